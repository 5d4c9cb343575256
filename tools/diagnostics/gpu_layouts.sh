#!/usr/bin/env bash
# GPU check for the layout work (device machine): the GPU tests of layouts and movers, then the
# transfer benchmark's NHD, HND-view and whole-block cases. Run from the repository root with
# the wheels of ../shared/tools/device-wheels.sh in .whl/. Logs go to $OUT when set.
set -uo pipefail
OUT="${OUT:-/tmp/tkv-out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:.:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pytest -q -p no:cacheprovider -m gpu --hypothesis-show-statistics "$@" \
    tests/test_layout_readings.py tests/test_cuda_mover.py tests/test_cuda_reference.py \
    tests/test_kernels.py tests/test_roundtrip.py > "$OUT/pytest-gpu.log" 2>&1
grep -E "passing|%|FAILED|Error|passed|failed" "$OUT/pytest-gpu.log" | tail -30
# --no-plot: the device machine may lack matplotlib (the 'bench' extra); the JSON has every figure.
python3 bench/transfer.py --quick --no-plot --cases llama_nhd,llama_hnd,blocks \
    --json "$OUT/transfer-layouts.json" 2>&1 | tee "$OUT/transfer.log" | tail -14
