"""How fast a long prompt's KV reaches L2, against the disk's own write ceiling in the same run.

A prompt of ``--tokens`` tokens (32k by default) of Llama-3-8B-shaped KV (32 layers, 8 KV heads
x 128, bf16: 128 KiB per token, 4 GiB at 32k, 32 MiB chunks of 256 tokens) in vLLM-shaped paged
caches on the device (CUDA when there, else the CPU), stored by a fresh engine with L2 on
``--dir``, once per L2 durability:
- ``none``: from ``store`` until ``flush`` returned (every chunk written into the page cache);
- ``batched`` (the default) and ``per_write``: until the engine closed (``aclose`` syncs what
  batched durability had not synced yet): every chunk on the disk itself.
Ceilings, the same bytes as files of the same size written with ``pwrite`` by as many threads as
L2 keeps writes in flight: into the page cache, and then one ``syncfs`` (the disk); the best of
three passes each.

Usage: ``PYTHONPATH=. python3 bench/l2_write.py [--tokens N] [--dir DIR] [--l1-size SIZE]
[--io-plane auto|threads|processes]``.
The table is printed last: seconds, GB/s and the ratio to the matching ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.threads import default_io_threads, write_threads
from tiered_kv.tiers.l2.files import DEFAULT_FILE_OPS

LAYERS, HEADS, HEAD_SIZE, BLOCK, CHUNK = 32, 8, 128, 16, 256
WRITES_IN_FLIGHT = write_threads(default_io_threads())  # L2's write parallelism, by default
REPS = 3  # passes of each raw ceiling


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_caches(tokens: int, device: str) -> list[torch.Tensor]:
    blocks = tokens // BLOCK + 1
    gen = torch.Generator(device=device).manual_seed(0)
    return [
        torch.randint(
            -(2**15),
            2**15,
            (2, blocks, BLOCK, HEADS, HEAD_SIZE),
            dtype=torch.int16,
            generator=gen,
            device=device,
        ).view(torch.bfloat16)
        for _ in range(LAYERS)
    ]


async def engine_write(
    caches: list[torch.Tensor],
    tokens: int,
    root: Path,
    durability: str,
    l1_size: str,
    io_plane: str = "auto",
) -> tuple[float, int]:
    """Seconds from ``store`` until the chunks are on L2 as ``durability`` means it, and the
    bytes L2 wrote."""
    config = EngineConfig(
        chunk_size=CHUNK,
        l1_size=l1_size,
        l2_path=str(root),
        l2_size="512GiB",
        l2_durability=durability,  # type: ignore[arg-type]
        io_plane=io_plane,  # type: ignore[arg-type]
    )
    engine = TieredKVEngine(config)
    await engine.open()
    try:
        engine.register_kv_caches(
            caches, model_name="m", layout_hints={"block_size": BLOCK, "kv_layout": "NHD"}
        )
        token_ids = list(range(1000, 1000 + tokens))
        block_ids = list(range(1, tokens // BLOCK + 1))
        if caches[0].is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        stored = await engine.store(token_ids, block_ids)
        if stored != tokens:
            raise RuntimeError(f"{durability}: stored {stored} of {tokens} tokens")
        if await engine.flush(timeout=600):
            raise RuntimeError(f"{durability}: writes still pending after 600 s")
        written = engine.stats().storage.tiers[0].writes
        assert written is not None
        if durability == "none":
            return time.perf_counter() - started, written.bytes_written
    finally:
        await engine.aclose()
    return time.perf_counter() - started, written.bytes_written


def raw_write(root: Path, files: int, file_bytes: int, threads: int, sync: bool) -> float:
    """Seconds to write ``files`` files of ``file_bytes`` with ``pwrite`` on ``threads``
    threads (then one ``syncfs`` when ``sync``)."""
    root.mkdir(parents=True)
    data = memoryview(os.urandom(file_bytes))

    def write(index: int) -> None:
        fd = os.open(root / f"f{index}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view, offset = data, 0
            while view:
                count = os.pwrite(fd, view, offset)
                view, offset = view[count:], offset + count
        finally:
            os.close(fd)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(files)))
    if sync:
        DEFAULT_FILE_OPS.sync_filesystem(root)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--dir", type=Path, help="where L2 goes (default: a temp dir)")
    parser.add_argument("--l1-size", default="8GiB", help="the engine's L1 (%(default)s)")
    parser.add_argument(
        "--io-plane", default="auto", choices=("auto", "threads", "processes"), help="%(default)s"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    parent = Path(tempfile.mkdtemp(prefix="tkv-l2-write-", dir=args.dir))
    caches = make_caches(args.tokens, device)
    kv_bytes = args.tokens * LAYERS * 2 * HEADS * HEAD_SIZE * 2
    log(f"{device}; {args.tokens} tokens, {kv_bytes / 2**30:.2f} GiB of KV; L2 under {parent}")
    rows: list[tuple[str, float, int, str]] = []
    try:
        raw: dict[bool, float] = {}
        files = -(-args.tokens // CHUNK)
        for sync in (False, True):
            passes = []
            for rep in range(REPS):  # the best pass: the first one also pays cold allocations
                target = parent / f"raw-{int(sync)}-{rep}"
                passes.append(raw_write(target, files, kv_bytes // files, WRITES_IN_FLIGHT, sync))
                shutil.rmtree(target)
                DEFAULT_FILE_OPS.sync_filesystem(parent)  # the deletes, before the next run
            raw[sync] = min(passes)
            label = "raw pwrite + syncfs" if sync else "raw pwrite (page cache)"
            log(f"{label}: {raw[sync]:.2f} s")
            rows.append((label, raw[sync], kv_bytes, "1.00"))
        for durability in ("none", "batched", "per_write"):
            target = parent / durability
            seconds, written = asyncio.run(
                engine_write(caches, args.tokens, target, durability, args.l1_size, args.io_plane)
            )
            ceiling = raw[durability != "none"]
            log(f"engine, durability {durability}: {seconds:.2f} s, {written} bytes")
            rows.append((f"engine, {durability}", seconds, written, f"{seconds / ceiling:.2f}"))
            shutil.rmtree(target)
            DEFAULT_FILE_OPS.sync_filesystem(parent)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    print(
        f"\n{args.tokens} tokens ({kv_bytes / 1e9:.2f} GB), {WRITES_IN_FLIGHT} raw writers, "
        f"io_plane {args.io_plane}"
    )
    print(f"{'path':<28}{'seconds':>9}{'GB/s':>8}{'x ceiling':>11}")
    for label, seconds, nbytes, ratio in rows:
        print(f"{label:<28}{seconds:>9.2f}{nbytes / seconds / 1e9:>8.2f}{ratio:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
