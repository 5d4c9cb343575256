#!/usr/bin/env bash
# One device call for the I/O plane (issue 40): the GPU tests and the plane's fault tests, then
# the write benches (a long prompt per durability; small chunks stored back to back, both
# planes) and the L2 prefetch against its ceiling (both planes, idle and beside a busy Python
# thread). Usage on the device: bash tools/diagnostics/issue40_device.sh [tests|benches|all]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-all}
echo "cores $(nproc); $(nvidia-smi --query-gpu=name --format=csv,noheader)"
if [[ $what == tests || $what == all ]]; then
    python3 -m pytest -q -x -p no:cacheprovider tests/gpu tests/faults/test_io_plane.py 2>&1 | tail -6
fi
if [[ $what == benches || $what == all ]]; then
    for plane in processes threads; do
        python3 bench/store_burst.py --dir . --io-plane $plane 2>&1 | tail -6 | tee -a "$OUT/store_burst.txt"
    done
    python3 bench/l2_write.py --tokens 32768 --l1-size 8GiB --dir . 2>&1 | tail -7 | tee "$OUT/l2_write.txt"
    for plane in processes threads; do
        for busy in "" --busy; do
            python3 -m tiered_kv.cli bench prefetch --tiers L2 --io-plane $plane $busy --dir . --no-plot 2>&1 \
                | tail -3 | tee -a "$OUT/prefetch.txt"
        done
    done
fi
