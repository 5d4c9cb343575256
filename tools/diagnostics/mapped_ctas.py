"""How many CTAs should a small call's mapped kernels have? (CUDA)

For each case, one-chunk stores and retrieves (medians of 40 awaited calls) on the staging path
and on the mapped path with 16, 32, 64 and the default (two per SM) CTAs, with the slowdown of
a concurrent bf16 matmul while one-chunk and four-chunk retrieves loop beside it. Staging runs
first and last, so drift shows.

    PYTHONPATH=. python3 tools/diagnostics/mapped_ctas.py int8_132 mla
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Awaitable

from tiered_kv.benchmarks.common import run_on_engine_loop
from tiered_kv.benchmarks.transfer import Case, _wall, matmul_slowdown
from tiered_kv.gpu.mover import CudaMover, MoverOptions


async def measure(case: Case, label: str, options: MoverOptions) -> None:
    mover = CudaMover(options)

    def store(n: int) -> Awaitable[None]:
        return mover.gather(case.layout, case.blocks_a, case.transfers(case.objs_a, n))

    def retrieve(n: int) -> Awaitable[None]:
        return mover.scatter(case.layout, case.blocks_b, case.transfers(case.objs_b, n))

    t_store = await _wall(functools.partial(store, 1), 40)
    t_retrieve = await _wall(functools.partial(retrieve, 1), 40)
    one = await matmul_slowdown(lambda: retrieve(1), 20)
    four = await matmul_slowdown(lambda: retrieve(4), 20)
    print(
        f"{case.name:9s} {label:12s} store@1 {case.chunk_bytes / t_store / 1e9:5.1f} "
        f"retr@1 {case.chunk_bytes / t_retrieve / 1e9:5.1f} GB/s  "
        f"matmul (1-chunk retrieves) {one:5.1f}%  (4-chunk) {four:5.1f}%",
        flush=True,
    )
    await mover.aclose()


def main() -> None:
    staging = MoverOptions(path="staging")
    variants = [("staging", staging)]
    variants += [(f"mapped {n}", MoverOptions(path="mapped", mapped_ctas=n)) for n in (16, 32, 64)]
    variants += [("mapped 2/SM", MoverOptions(path="mapped")), ("staging", staging)]
    for name in sys.argv[1:] or ["int8_132", "mla"]:
        case = Case(name, 4)
        for label, options in variants:
            run_on_engine_loop(measure(case, label, options))
        case.close()


if __name__ == "__main__":
    main()
