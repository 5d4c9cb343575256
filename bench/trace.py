"""Entry point kept for clones: the benchmark lives in tiered_kv/benchmarks/trace.py and runs
from an installed package as `tiered-kv bench trace` (same options; `--help` lists them)."""

import sys
from pathlib import Path

# The clone's tiered_kv, also without an install (PYTHONPATH=. on the GPU machine).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiered_kv.benchmarks import run_benchmark

if __name__ == "__main__":
    sys.exit(run_benchmark("trace", sys.argv[1:], prog="bench/trace.py"))
