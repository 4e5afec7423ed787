import sys

from bench.reproduce.cli import main

sys.exit(main())
