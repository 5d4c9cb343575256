"""Sustained stores of small chunks: how many lower-tier writes keep up, and how many drop.

``--prompts`` new prompts (3000 by default) of ``--chunks`` chunks (24) of 16 KiB each (32 tokens
of 512 bytes of KV: 2 layers, 1 KV head x 64, bf16), stored back to back by one engine with L2
on ``--dir`` (write_through, the default policy), as a serving engine stores the prompts of a
busy trace: each ``store`` right after the last, never waiting for L2. Reported: chunks stored,
L2 writes done and dropped (``dropped_full``), the store rate and the rate L2 wrote at, and, in
the same run, the ceiling for files this small: the same number of files of the same size
written whole (a temp file, ``pwrite``, rename into place, as L2 does) by as many threads as
L2 keeps writes in flight, with no engine at all.

Usage: ``PYTHONPATH=. python3 bench/store_burst.py [--prompts N] [--chunks N] [--dir DIR]
[--l1-size SIZE] [--io-plane auto|threads|processes]``. The table is printed last.
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

LAYERS, HEADS, HEAD_SIZE, BLOCK, CHUNK = 2, 1, 64, 16, 32
CHUNK_BYTES = CHUNK * LAYERS * 2 * HEADS * HEAD_SIZE * 2  # 16 KiB
WRITES_IN_FLIGHT = write_threads(default_io_threads())  # L2's write parallelism, by default


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def engine_burst(
    prompts: int, chunks: int, root: Path, l1_size: str, io_plane: str
) -> dict[str, float]:
    tokens = chunks * CHUNK
    blocks = tokens // BLOCK
    gen = torch.Generator().manual_seed(0)
    caches = [
        torch.randint(-(2**15), 2**15, (2, blocks + 1, BLOCK, HEADS, HEAD_SIZE), generator=gen)
        .to(torch.int16)
        .view(torch.bfloat16)
        for _ in range(LAYERS)
    ]
    config = EngineConfig(
        chunk_size=CHUNK,
        l1_size=l1_size,
        l2_path=str(root),
        l2_size="64GiB",
        io_plane=io_plane,  # type: ignore[arg-type]
    )
    engine = TieredKVEngine(config)
    await engine.open()
    try:
        engine.register_kv_caches(
            caches, model_name="m", layout_hints={"block_size": BLOCK, "kv_layout": "NHD"}
        )
        block_ids = list(range(1, blocks + 1))
        stored = 0
        started = time.perf_counter()
        for prompt in range(prompts):
            first = 1000 + prompt * tokens  # new tokens: every chunk of every prompt is new
            stored += await engine.store(list(range(first, first + tokens)), block_ids)
        stores_done = time.perf_counter() - started
        if await engine.flush(timeout=600):
            raise RuntimeError("writes still pending after 600 s")
        all_written = time.perf_counter() - started
        writes = engine.stats().storage.tiers[0].writes
        assert writes is not None
    finally:
        await engine.aclose()
    return {
        "chunks": prompts * chunks,
        "stored_chunks": stored // CHUNK,
        "done": writes.done,
        "dropped": writes.dropped_full,
        "stores_s": stores_done,
        "written_s": all_written,
    }


def raw_small_files(root: Path, files: int, threads: int) -> float:
    """Seconds to write ``files`` files of `CHUNK_BYTES` whole (temp name, ``pwrite``, rename)
    on ``threads`` threads into 256 directories, as L2 lays them out."""
    for shard in range(256):
        (root / f"{shard:02x}").mkdir(parents=True)
    data = memoryview(os.urandom(CHUNK_BYTES))

    def write(index: int) -> None:
        directory = root / f"{index % 256:02x}"
        temp = directory / f".f{index}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.pwrite(fd, data, 0)
        finally:
            os.close(fd)
        os.replace(temp, directory / f"f{index}")

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(files)))
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--chunks", type=int, default=24, help="chunks per prompt")
    parser.add_argument("--dir", type=Path, help="where L2 goes (default: a temp dir)")
    parser.add_argument("--l1-size", default="256MiB", help="the engine's L1 (%(default)s)")
    parser.add_argument("--io-plane", default="auto", choices=("auto", "threads", "processes"))
    args = parser.parse_args()
    parent = Path(tempfile.mkdtemp(prefix="tkv-store-burst-", dir=args.dir))
    files = args.prompts * args.chunks
    log(
        f"{args.prompts} prompts x {args.chunks} chunks of {CHUNK_BYTES // 1024} KiB; "
        f"L2 under {parent}"
    )
    try:
        raw = raw_small_files(parent / "raw", files, WRITES_IN_FLIGHT)
        shutil.rmtree(parent / "raw")
        DEFAULT_FILE_OPS.sync_filesystem(parent)
        log(f"raw: {files} files in {raw:.2f} s")
        result = asyncio.run(
            engine_burst(args.prompts, args.chunks, parent / "l2", args.l1_size, args.io_plane)
        )
        log(f"engine: {result}")
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    chunks = result["chunks"]
    dropped = result["dropped"]
    print(
        f"\n{args.prompts} prompts x {args.chunks} chunks of {CHUNK_BYTES // 1024} KiB, "
        f"L1 {args.l1_size}, io_plane {args.io_plane}, {WRITES_IN_FLIGHT} raw writers"
    )
    print(f"{'':<34}{'chunks':>9}{'seconds':>9}{'chunks/s':>10}{'x raw':>7}")
    print(f"{'raw whole-file writes':<34}{files:>9}{raw:>9.2f}{files / raw:>10.0f}{1:>7.2f}")
    stores_s, written_s = result["stores_s"], result["written_s"]
    print(
        f"{'engine stores (L1)':<34}{result['stored_chunks']:>9.0f}{stores_s:>9.2f}"
        f"{result['stored_chunks'] / stores_s:>10.0f}{'':>7}"
    )
    print(
        f"{'engine L2 writes done':<34}{result['done']:>9.0f}{written_s:>9.2f}"
        f"{result['done'] / written_s:>10.0f}{written_s / raw:>7.2f}"
    )
    print(f"L2 writes dropped: {dropped:.0f} of {chunks:.0f} ({100 * dropped / chunks:.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
