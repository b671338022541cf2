#!/usr/bin/env bash
# The CUDA paths in one command: the GPU test suite (tests/gpu) and `tiercache bench gpu`.
#
#   scripts/gpu-check.sh --fetch-wheels   on a machine with package-registry access: puts the wheels the
#                                         GPU machine lacks into .whl/ (Python 3.12, x86-64)
#   scripts/gpu-check.sh [--quick]        on the GPU machine, from the repository root: installs .whl/ into
#                                         a private directory, runs the suite and the bench
#
# The GPU machine is expected to have Python 3.12 with torch (CUDA), numpy, xxhash, CuPy and pytest, and
# no vLLM: nothing here imports vLLM. Logs and the bench's JSON go to $OUT (the device tool's folder) or
# artifacts/gpu-check. Exit status: 0 when the suite passed and the bench ran; 3 without a CUDA device
# (nothing ran); 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
WHEELS=.whl
SITE=${TIERCACHE_GPU_SITE:-/tmp/tiercache-gpu-site}

# What the store's modules import beyond torch/numpy/xxhash (records: cbor2; disk index: lmdb; configs:
# pydantic and its parts), and kvikio for GDS with its own parts (CuPy and the CUDA toolkit's cuFile are
# already on such machines). Versions as in this project's dev environment, 2026-11.
WHEEL_PINS=(
  cbor2==6.3.0 lmdb==3.0.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 "rapids-logger==0.3.*"
)

fetch_wheels() {
  mkdir -p "$WHEELS"
  for pin in "${WHEEL_PINS[@]}"; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" "$pin" \
      || { echo "gpu-check: could not download $pin" >&2; return 1; }
  done
  echo "gpu-check: wheels in $WHEELS/ ($(du -sh "$WHEELS" | cut -f1)); carry that folder to the GPU machine"
}

if [ "${1:-}" = "--fetch-wheels" ]; then
  fetch_wheels
  exit $?
fi
QUICK=()
[ "${1:-}" = "--quick" ] && QUICK=(--quick)
RESULTS=${OUT:-artifacts/gpu-check}
mkdir -p "$RESULTS"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-check: no CUDA device here (in $PY, torch is missing or torch.cuda.is_available() is False);" \
       "nothing ran. Run this on a machine with an NVIDIA GPU (PYTHON=... picks the interpreter)." >&2
  exit 3
fi
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl \
    || { echo "gpu-check: installing $WHEELS/*.whl into $SITE failed" >&2; exit 1; }
else
  echo "gpu-check: no $WHEELS/ here; using what $PY already has (scripts/gpu-check.sh --fetch-wheels makes it)"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch; print('gpu-check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)"

"$PY" -m pytest -q -p no:cacheprovider --confcutdir=tests/gpu tests/gpu 2>&1 | tee "$RESULTS/test-gpu.log"
suite=${PIPESTATUS[0]}
"$PY" -m vllm_tiercache.tools.cli bench gpu "${QUICK[@]}" --json > "$RESULTS/bench-gpu.json"
bench=$?
if [ $bench -eq 0 ]; then
  "$PY" -c "import json, sys; from vllm_tiercache.tools.bench.gpu.command import format_report; \
print(format_report(json.load(open(sys.argv[1]))))" "$RESULTS/bench-gpu.json" | tee "$RESULTS/bench-gpu.txt"
fi
echo "gpu-check: suite exit $suite, bench exit $bench; logs in $RESULTS/"
[ $suite -eq 0 ] && [ $bench -eq 0 ] && exit 0
exit 1
