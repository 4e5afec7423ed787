"""``python -m fastdp.audit [--quick] [--cases ...] [--out FILE]``: see :mod:`fastdp.audit.report`."""

import sys

from fastdp.audit.report import main

sys.exit(main())
