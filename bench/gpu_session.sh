#!/usr/bin/env bash
# The GPU checks owed by fastdp, in phases that each fit the device tool's 10-minute command limit.
#
#   bash bench/gpu_session.sh test       # build against the machine's torch, backend info, pytest -m cuda
#   bash bench/gpu_session.sh kernels    # bench_noise, bench_norms, bench_clip, bench_lipschitz
#   bash bench/gpu_session.sh steps      # bench_dpsgd, bench_clipless, bench_jl
#   bash bench/gpu_session.sh compare    # compare.py (growth to OOM) and the virtual-batch sweep
#
# Run from the repository root on the GPU machine, carrying `.whl` (opacus, dp-accounting and dm-tree wheels for
# Python 3.12: see README "GPU notes"). Every phase builds fastdp._C first if this machine has not (a fresh
# machine is bare), logs to $OUT (default bench/results/gpu-session) and packs the new results and logs into
# $OUT/<phase>.tgz, one file, as the device tool returns at most 8 files.
set -uo pipefail
phase=${1:?"usage: bash bench/gpu_session.sh test|kernels|steps|compare"}
OUT=${OUT:-bench/results/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
PY=${PYTHON:-python3}

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
if ! $PY -c "import fastdp._C" 2>/dev/null; then
  echo "building fastdp._C against $($PY -c 'import torch; print(torch.__version__)')"
  $PY -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
fi
$PY -c "import fastdp, torch; print(torch.cuda.get_device_name(), fastdp.backend_info())" | tee "$OUT/info.txt"

stamp=$(mktemp)
case "$phase" in
  test)
    $PY -m pytest tests -m cuda -q -rs -p no:cacheprovider --junitxml="$OUT/cuda-tests.xml" 2>&1 | tee "$OUT/cuda-tests.txt"
    ;;
  kernels)
    for b in bench_noise bench_norms bench_clip bench_lipschitz; do
      (cd bench && timeout 150 $PY $b.py) 2>&1 | tee "$OUT/$b.txt"
    done
    ;;
  steps)
    for b in bench_dpsgd bench_clipless bench_jl; do
      (cd bench && timeout 200 $PY $b.py) 2>&1 | tee "$OUT/$b.txt"
    done
    ;;
  compare)
    timeout 400 $PY bench/compare.py --job-timeout-s 120 2>&1 | tee "$OUT/compare.txt"
    timeout 150 $PY bench/compare.py --micro-batch 256 --max-batch 16384 --workloads mlp-256 cnn-256 \
      --providers nonprivate opacus-hooks opacus-ghost fastdp-dpsgd 2>&1 | tee "$OUT/compare-virtual.txt"
    ;;
  *)
    echo "unknown phase $phase: test, kernels, steps or compare" >&2
    exit 2
    ;;
esac
# the results this phase wrote (bench/results/*.csv, *.png newer than its start) and its logs, in one file
find bench/results -maxdepth 1 -newer "$stamp" \( -name '*.csv' -o -name '*.png' \) -print0 \
  | tar czf "$OUT/$phase.tgz" --null -T - "$OUT"/*.txt "$OUT"/*.xml "$OUT"/*.log 2>/dev/null
ls -la "$OUT"
