# fastdp: make demo (train private models, print accuracy and epsilon), make test (the suite),
# make bench (every benchmark in bench/, results appended to bench/results/), make lint.
# The venv is created on first use; torch is pinned to the local CPU wheel
# (an unpinned torch pulls several GB of CUDA packages).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.fastdp-installed
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h csrc/include/fastdp/*.h)

.PHONY: install demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python $(SOURCES)
	$(BIN)/python -m pip install --quiet "$(TORCH)" setuptools wheel ninja
	MAX_JOBS=$${MAX_JOBS:-2} $(BIN)/python -m pip install --quiet --no-build-isolation -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/fastdp demo

# pytest's non-zero exits (5: no tests ran) fail the target as they should.
test: install
	FASTDP_REQUIRE_EXT=1 $(BIN)/python -m pytest tests

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

bench: install
	cd bench && for b in bench_dpsgd bench_jl bench_clipless bench_noise bench_norms bench_clip bench_lipschitz; do \
		../$(BIN)/python $$b.py || exit 1; done

clean:
	rm -rf build *.egg-info fastdp/*.so $(STAMP)
