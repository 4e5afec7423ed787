# fastdp: make demo (train private models, print accuracy and epsilon), make test (the suite), make docs (the site),
# make bench (every benchmark in bench/, results appended to bench/results/), make lint.
# The venv is created on first use; torch is pinned to the local CPU wheel
# (an unpinned torch pulls several GB of CUDA packages).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.fastdp-installed
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h csrc/include/fastdp/*.h)

.PHONY: install demo test docs lint bench clean

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

# The documentation site (Sphinx + MyST, docs/): HTML in docs/_build/html, every warning an error.
docs: install
	$(BIN)/python -m sphinx -W --keep-going -b html docs docs/_build/html

lint: install
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# compare.py: one process per library (torch, Opacus, fastdp variants, tf-privacy if `make bench-tf` was run);
# `$(BIN)/python bench/compare.py --full` for the long run; then the virtual-batch sweep (memory and throughput
# against the logical batch, micro-batches of 256).
bench: install
	cd bench && for b in bench_dpsgd bench_jl bench_clipless project_every_utility bench_noise bench_norms bench_clip bench_lipschitz; do \
		../$(BIN)/python $$b.py || exit 1; done
	$(BIN)/python bench/compare.py --tf-python $(TF_VENV)/bin/python
	$(BIN)/python bench/compare.py --micro-batch 256 --max-batch 8192 --workloads mlp-256 cnn-256 \
		--providers nonprivate opacus-hooks opacus-ghost fastdp-dpsgd

# tf-privacy's own venv (TensorFlow 2.14.1 and numpy 1.26, which fastdp's venv cannot hold), read by compare.py.
# Needs Python 3.11 and PyPI (about 600 MB of wheels).
TF_PYTHON ?= python3.11
TF_VENV   ?= $(VENV)/tf-privacy
.PHONY: bench-tf
bench-tf: $(TF_VENV)/.installed

$(TF_VENV)/.installed: bench/requirements-tf.txt
	$(TF_PYTHON) -m venv $(TF_VENV)
	$(TF_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TF_VENV)/bin/python -m pip install --quiet -r bench/requirements-tf.txt
	touch $@

# Paper tables (issue 7): papers/00, 01 and 02 reproduced beside the published numbers, written to
# bench/results/reproduction.md (+ reproduction_runs.csv, reproduction_plot.csv); <= 30 min on 2 CPU cores.
# make reproduce REPRODUCE_ARGS=--full: the larger, paper-protocol sweeps (hours).
REPRODUCE_ARGS ?=
.PHONY: reproduce
reproduce: install
	$(BIN)/python -m bench.reproduce $(REPRODUCE_ARGS)

# Empirical privacy audit (issue 9): noise, sensitivity and membership-inference audits of every variant, and the
# deliberately broken one, written to bench/results/audit.md; fails unless every variant passes and the broken one is
# caught. 4.5 min on 2 quiet CPU cores (13 when shared); AUDIT_ARGS=--quick: the test-sized run (2 min).
AUDIT_ARGS ?=
.PHONY: audit
audit: install
	$(BIN)/python -m fastdp.audit --out bench/results/audit.md $(AUDIT_ARGS)

clean:
	rm -rf build *.egg-info fastdp/*.so $(STAMP)
