#!/usr/bin/env bash
# One device call: install the wheels the GPU image lacks, run the GPU tests of the mover and the
# layerwise paths, then a quick transfer benchmark. Usage on the device: bash tools/diagnostics/gpu_check.sh
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|matplotlib|numpy|cuda|accelerate|safetensors|tokenizers) " | tr '\n' ';'; echo
python3 -m pytest -q -x -p no:cacheprovider tests/test_layerwise_gpu.py tests/test_cuda_mover.py tests/test_gpu_planning.py tests/test_layerwise.py "$@" 2>&1 | tail -25
