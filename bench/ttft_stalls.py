"""Whether a torch op on the host just before a timed run slows that run (a diagnostic).

``PYTHONPATH=. python3 bench/ttft_stalls.py [--lengths 2048,8192] [--reps 30]``
(``--tiny`` for a CPU smoke run)

It follows ``bench/ttft.py``'s flow: the model, an L1 engine, and the prefill phase, which
leaves the stored prompt in L1. The L1 load cases are replaced by one test, run twice: with a
pool of one intra-op thread per core, then with one thread. Each time it runs fully cached
prefills over the resident prefix ("compute-only") and fully cached layerwise loads from L1,
interleaved: each run either plain or right after the bench's own logit check (`compare` and an
``isfinite`` over a vocabulary of floats, on the host). It prints each variant's median and how
many runs took over 1.15x the fastest of both. The table in docs/benchmarks.md ("the bench's
own checks slowed the next timed run") came from this script on an H100.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

import bench.ttft as tt
from tiered_kv.engine import TieredKVEngine
from tiered_kv.sync import new_event_loop

STALLED = 1.15  # a run over this times the fastest of its comparison counts as stalled


class StallBench(tt.Bench):
    reps = 30

    async def load_cases(
        self, engine: TieredKVEngine, tier: str, n: int, requests: dict[int, tt.Request], **_: Any
    ) -> None:
        if tier != "L1":
            return
        request = requests[100]
        await self.runner.prepare(request, request.compute_from)
        vocab = self.opts.shape.vocab
        reference = torch.randn(vocab, generator=torch.Generator().manual_seed(n))
        other = reference + 0.01 * torch.randn(vocab, generator=torch.Generator().manual_seed(1))
        threads_before = torch.get_num_threads()
        try:
            for threads in (os.cpu_count() or 1, 1):
                torch.set_num_threads(threads)
                for layerwise in (None, engine):
                    times = await self.variants(request, layerwise, reference, other)
                    report(n, threads, "compute-only" if layerwise is None else "layerwise", times)
        finally:
            torch.set_num_threads(threads_before)

    async def variants(
        self,
        request: tt.Request,
        engine: TieredKVEngine | None,
        reference: torch.Tensor,
        other: torch.Tensor,
    ) -> dict[str, list[float]]:
        """`one` run ``reps`` times plain and right after a logit check, interleaved (after a
        warm-up of each); the seconds of each variant's runs."""
        times: dict[str, list[float]] = {"plain": [], "check": []}
        for i in range(self.reps + 1):
            for variant, runs in times.items():
                if variant == "check":
                    tt.compare(reference, other)
                    bool(torch.isfinite(other).all())
                elapsed = await self.one(request, engine)
                if i:
                    runs.append(elapsed)
        return times

    async def one(self, request: tt.Request, engine: TieredKVEngine | None) -> float:
        """One fully cached run (a layerwise load from L1 with ``engine``); its seconds."""
        self.paged.poison(request.block_ids)
        self.runner.sync()
        start = time.perf_counter()
        load = None
        if engine is not None:
            if await engine.lookup(request.host_ids) != request.cached_tokens:
                raise RuntimeError(f"{request.name}: not wholly in L1")
            load = await engine.retrieve_layerwise(request.host_ids, request.block_ids)
        await self.runner.prefill(request, request.compute_from, load=load)
        elapsed = time.perf_counter() - start
        if load is not None:
            await load.wait()
        return elapsed


def report(n: int, threads: int, what: str, times: dict[str, list[float]]) -> None:
    fastest = min(min(runs) for runs in times.values())
    for variant, runs in times.items():
        stalled = sum(t > STALLED * fastest for t in runs)
        print(
            f"[{n}] {threads:3d} threads, {what:12s} {variant:5s}: median "
            f"{1e3 * statistics.median(runs):.2f} ms, fastest {1e3 * min(runs):.2f} ms; "
            f"{stalled}/{len(runs)} over {STALLED}x the fastest",
            flush=True,
        )


def parse_args(argv: Sequence[str] | None = None) -> tuple[tt.Options, int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192", help="prompt lengths, comma-separated")
    parser.add_argument("--reps", type=int, default=30, help="runs per variant")
    parser.add_argument("--tiny", action="store_true", help="tiny model and prompts (CPU runs)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    lengths = tuple(int(x) for x in args.lengths.split(","))
    base = tt.tiny_options() if args.tiny else tt.Options()
    opts = dataclasses.replace(base, lengths=lengths, tiers=("L1",), reps=2, max_reps=2)
    return opts, args.reps


def main(argv: Sequence[str] | None = None) -> None:
    opts, reps = parse_args(argv)
    StallBench.reps = reps
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(tt.run_bench(opts, StallBench))


if __name__ == "__main__":
    sys.exit(main())
