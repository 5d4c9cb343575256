"""The benchmarks that ship with the package (`tiered-kv bench NAME`, or `python bench/NAME.py`
in a clone): each measures the machine's own ceiling in the same run, prints a table last and
writes PNG plots (matplotlib: the ``bench`` extra). Imports nothing heavy until one is run."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

BENCHMARKS = {
    "workload": "multi-turn conversations on L1 + L2 (+ L3): hit rate, TTFT proxy, prefetch (CPU)",
    "transfer": "GPU <-> host KV transfers of every mover path against cudaMemcpy (needs CUDA)",
    "remote": "the L3 server and Redis on loopback against a raw socket (CPU)",
    "prefetch": "L2 (warm, cold) and L3 prefetch into L1 against readinto, O_DIRECT and TCP (CPU)",
    "trace": "a request trace through the engine beside LRU and the offline optimum (CPU)",
}


def run_benchmark(name: str, argv: Sequence[str], prog: str) -> int:
    """Run benchmark ``name`` with command-line ``argv``; its exit status. A benchmark that
    cannot run here (no CUDA device, no matplotlib for the plots) says why on stderr: 2."""
    if name not in BENCHMARKS:
        known = ", ".join(BENCHMARKS)
        print(f"{prog}: no benchmark {name!r}; choose from {known}", file=sys.stderr)
        return 2
    from tiered_kv.benchmarks.common import BenchmarkUnavailable

    module = importlib.import_module(f"tiered_kv.benchmarks.{name}")
    try:
        status: int = module.main(list(argv), prog=prog)
    except BenchmarkUnavailable as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return status
