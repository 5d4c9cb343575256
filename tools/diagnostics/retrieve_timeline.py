"""When a lower-tier retrieve's reads and copies happen (a diagnostic, not a figure).

``PYTHONPATH=. python3 tools/diagnostics/retrieve_timeline.py [--tokens 32768] [--dir .]
[--io-plane processes|threads]``

Stores one prompt of Llama-3-8B-shaped KV (bf16, 256-token chunks of 32 MiB) into L2, then on
a fresh engine (L1 empty, the files in the page cache) times, per mode:
- ``read``: ``prefetch`` + ``wait`` (the tier read into L1 alone),
- ``copy``: ``retrieve`` with every chunk already in L1 (the copies alone),
- ``whole`` / ``layerwise``: ``retrieve`` (+ ``wait_all`` on the stream) from L2,
and for the last two prints when each chunk's read ended and when each scatter started and
returned, relative to the call: whether reads and copies overlap.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from typing import Any

import torch

from bench.ttft_model import LLAMA3_8B, PagedKV
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.threads import default_io_threads

GiB = 1 << 30


class Marks:
    def __init__(self) -> None:
        self.t0 = 0.0
        self.reads: list[float] = []
        self.scatters: list[tuple[float, float, int]] = []

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.reads.clear()
        self.scatters.clear()

    def ms(self, t: float) -> float:
        return 1e3 * (t - self.t0)


def instrument(engine: TieredKVEngine, marks: Marks) -> None:
    storage = engine.storage
    read_into = storage.read_into

    async def timed_read(tier_index: int, key: Any, obj: Any) -> bool:
        ok = await read_into(tier_index, key, obj)
        marks.reads.append(time.perf_counter())
        return ok

    storage.read_into = timed_read  # type: ignore[method-assign]
    mover = engine._running().mover
    scatter = mover.scatter

    async def timed_scatter(layout: Any, block_ids: Any, transfers: Any) -> None:
        start = time.perf_counter()
        await scatter(layout, block_ids, transfers)
        marks.scatters.append((start, time.perf_counter(), len(transfers)))

    mover.scatter = timed_scatter  # type: ignore[method-assign]


def summary(marks: Marks, end: float) -> str:
    reads = sorted(marks.reads)
    parts = []
    if reads:
        q = [reads[int(f * (len(reads) - 1))] for f in (0, 0.25, 0.5, 0.75, 1.0)]
        parts.append(
            f"{len(reads)} reads ended at " + " / ".join(f"{marks.ms(t):.1f}" for t in q) + " ms"
        )
    for start, stop, n in marks.scatters:
        parts.append(f"scatter {n} chunks {marks.ms(start):.1f}-{marks.ms(stop):.1f}")
    parts.append(f"returned {marks.ms(end):.1f} ms")
    return "; ".join(parts)


async def main(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    shape = LLAMA3_8B
    block_size, chunk = 16, 256
    tokens = args.tokens
    nbytes = tokens * shape.num_layers * 2 * shape.kv_heads * shape.head_dim * 2
    paged = PagedKV(shape, tokens // block_size + 1, block_size, device)
    for kv in paged.layers:
        kv.normal_()
    ids = list(range(1000, 1000 + tokens))
    blocks = list(range(tokens // block_size))
    with tempfile.TemporaryDirectory(dir=args.dir) as l2:
        config = dict(
            chunk_size=chunk,
            l1_size=nbytes + GiB,
            l2_path=l2,
            l2_size=2 * nbytes + GiB,
            l2_io_threads=default_io_threads(),
            prefetch_policy="wait_complete",
            prefetch_l1_fraction=0.95,
            load_policy="always",
            io_plane=args.io_plane,
            close_timeout_s=120.0,
        )
        hints = {"block_size": block_size, "kv_layout": "NHD"}
        async with TieredKVEngine(EngineConfig(**config)) as engine:  # type: ignore[arg-type]
            engine.register_kv_caches(paged.layers, model_name="m", layout_hints=hints)
            await engine.store(ids, blocks, model_name="m")
            await engine.flush()
        engine = TieredKVEngine(EngineConfig(**config))  # type: ignore[arg-type]
        engine.register_kv_caches(paged.layers, model_name="m", layout_hints=hints)
        await engine.open()
        try:
            marks = Marks()
            instrument(engine, marks)
            stream = torch.cuda.current_stream() if cuda else None
            times: dict[str, list[float]] = {m: [] for m in ("read", "copy", "whole", "layerwise")}
            for rep in range(args.reps):
                for mode in ("read", "copy", "whole", "layerwise"):
                    await engine.evict_l1()
                    if mode == "copy":
                        handle = await engine.prefetch(ids, model_name="m")
                        await handle.wait()
                        await engine.retrieve(ids, blocks, model_name="m", prefetch=handle)
                    sync()
                    marks.reset()
                    if mode == "read":
                        handle = await engine.prefetch(ids, model_name="m")
                        await handle.wait()
                        handle.close()
                    elif mode == "layerwise":
                        load = await engine.retrieve_layerwise(ids, blocks, model_name="m")
                        load.wait_all(stream)
                        sync()
                        assert load.result.valid_tokens == tokens, load.result
                    else:
                        got = await engine.retrieve(ids, blocks, model_name="m")
                        sync()
                        assert got.valid_tokens == tokens, got
                    end = time.perf_counter()
                    times[mode].append(1e3 * (end - marks.t0))
                    if rep == args.reps - 1:
                        print(f"{mode}: {summary(marks, end)}", flush=True)
            gbytes = nbytes / 1e9
            for mode, ms in times.items():
                med = statistics.median(ms)
                print(f"{mode:9s} median {med:7.1f} ms ({gbytes / med * 1e3:5.1f} GB/s) of {ms}")
        finally:
            await engine.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--dir", default=".")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--io-plane", default="processes")
    parser.add_argument("--device", default="cuda")
    asyncio.run(main(parser.parse_args()))
