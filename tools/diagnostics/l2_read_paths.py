"""Where an L2 warm load's time goes: page-cache reads by N threads, read alone or hashed in
slices of several sizes, with and without a Python thread busy beside them (the model's launch
thread in a TTFT run), and the engine's own prefetch at each slice size.

    PYTHONPATH=. python3 tools/diagnostics/l2_read_paths.py [--chunks 128] [--chunk-mib 32]

Prints GB/s per (threads, slice) and how much a busy Python thread slowed down beside the
readers (its loop rate against alone). A diagnostic, not a benchmark: no ratios, no targets.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import xxhash

from tiered_kv.benchmarks import ceilings

MIB = 1 << 20


def _buffers(count: int, size: int) -> list[memoryview]:
    try:
        import torch

        if torch.cuda.is_available():
            return [
                memoryview(torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy())
                for _ in range(count)
            ]
    except ImportError:
        pass
    return [memoryview(bytearray(size)) for _ in range(count)]


def _read(path: Path, buffer: memoryview, slice_bytes: int, hashed: bool) -> None:
    with open(path, "rb", buffering=0) as file:
        state = xxhash.xxh3_64() if hashed else None
        for start in range(0, len(buffer), slice_bytes):
            piece = buffer[start : start + slice_bytes]
            got = file.readinto(piece)
            if got != len(piece):
                raise RuntimeError(f"short read of {path}")
            if state is not None:
                state.update(piece)


def _preadv(path: Path, buffer: memoryview, hashed: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.preadv(fd, [buffer], 0) != len(buffer):
            raise RuntimeError(f"short read of {path}")
    finally:
        os.close(fd)
    if hashed:
        xxhash.xxh3_64(buffer).intdigest()


def _spin_rate(stop: threading.Event, out: list[float]) -> None:
    count = 0
    started = time.perf_counter()
    while not stop.is_set():
        for _ in range(1000):
            count += 1
    out.append(count / (time.perf_counter() - started))


def _measure(paths, buffers, threads, job, busy: bool) -> tuple[float, float | None]:
    jobs = [(lambda i, p=p: job(p, buffers[i])) for p in paths]
    stop = threading.Event()
    rates: list[float] = []
    spinner = threading.Thread(target=_spin_rate, args=(stop, rates)) if busy else None
    if spinner:
        spinner.start()
    elapsed = ceilings._parallel(jobs, threads)
    stop.set()
    if spinner:
        spinner.join()
    total = sum(len(buffers[0]) for _ in paths)
    return total / elapsed / 1e9, (rates[0] if rates else None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=128)
    parser.add_argument("--chunk-mib", type=int, default=32)
    parser.add_argument("--threads", default="4,8,16")
    parser.add_argument("--slices-mib", default="1,4,16,0")
    parser.add_argument("--engine", action="store_true", help="also the engine's prefetch")
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (seconds; Python's default is 0.005)",
    )
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    print(f"GIL switch interval {sys.getswitchinterval() * 1e3:.2f} ms", flush=True)
    size = args.chunk_mib * MIB
    thread_counts = [int(n) for n in args.threads.split(",")]
    slice_sizes = [int(s) * MIB or size for s in args.slices_mib.split(",")]
    workdir = Path(tempfile.mkdtemp(prefix="tkv-l2-paths-"))
    paths = []
    data = os.urandom(size)
    for i in range(args.chunks):
        path = workdir / f"{i:04d}"
        path.write_bytes(data)
        paths.append(path)
    for path in paths:  # into the page cache
        _read(path, memoryview(bytearray(size)), size, False)
    buffers = _buffers(max(thread_counts), size)
    spin_alone: list[float] = []
    stop = threading.Event()
    spinner = threading.Thread(target=_spin_rate, args=(stop, spin_alone))
    spinner.start()
    time.sleep(1.0)
    stop.set()
    spinner.join()
    print(
        f"{args.chunks} files of {args.chunk_mib} MiB; a busy Python thread alone: "
        f"{spin_alone[0] / 1e6:.1f} M/s",
        flush=True,
    )
    for threads in thread_counts:
        for busy in (False, True):
            cells = []
            gbps, rate = _measure(
                paths, buffers, threads, lambda p, b: _read(p, b, size, False), busy
            )
            cells.append(
                f"read {gbps:.1f}" + (f" (busy {rate / spin_alone[0]:.2f})" if rate else "")
            )
            for slice_bytes in slice_sizes:
                gbps, rate = _measure(
                    paths, buffers, threads, lambda p, b, s=slice_bytes: _read(p, b, s, True), busy
                )
                cells.append(
                    f"{slice_bytes // MIB}M+hash {gbps:.1f}"
                    + (f" (busy {rate / spin_alone[0]:.2f})" if rate else "")
                )
            gbps, rate = _measure(paths, buffers, threads, lambda p, b: _preadv(p, b, True), busy)
            cells.append(
                f"preadv+hash {gbps:.1f}" + (f" (busy {rate / spin_alone[0]:.2f})" if rate else "")
            )
            print(
                f"{threads:2d} threads{' +busy' if busy else '      '}: " + ", ".join(cells),
                flush=True,
            )
    if args.engine:
        asyncio.run(_engine(args, slice_sizes))
    return 0


async def _engine(args: argparse.Namespace, slice_sizes: list[int]) -> None:
    """The engine's L2 warm prefetch of 64 chunks into L1 at each slice size and thread count."""
    import shutil
    import statistics

    from tiered_kv.benchmarks import prefetch
    from tiered_kv.config import EngineConfig
    from tiered_kv.tiers.l2 import DiskTier, files

    chunks = min(args.chunks, 64)
    ns = prefetch.build_parser(None).parse_args(["--chunks", str(chunks)])
    chunk_bytes = ns.chunk_mib * MIB
    heads_bytes = prefetch.HEADS * prefetch.HEAD_SIZE * 2
    num_layers = max(1, chunk_bytes // (2 * prefetch.CHUNK_TOKENS * heads_bytes))
    tokens = list(range(chunks * prefetch.CHUNK_TOKENS))
    total = chunks * num_layers * 2 * prefetch.CHUNK_TOKENS * heads_bytes
    caches = prefetch._caches(num_layers, len(tokens) // prefetch.BLOCK_SIZE)
    config = EngineConfig(chunk_size=prefetch.CHUNK_TOKENS, l1_size=2 * total + (64 << 20))
    from tiered_kv.tiers.l2 import tier as tier_module

    spans: list[tuple[float, float]] = []
    original = tier_module.ChunkRead.parts

    def timed(part):  # type: ignore[no-untyped-def]
        def run():  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            try:
                return part()
            finally:
                spans.append((started, time.perf_counter()))

        return run

    def timed_parts(self):  # type: ignore[no-untyped-def]
        return [timed(part) for part in original(self)]

    tier_module.ChunkRead.parts = timed_parts  # type: ignore[method-assign]
    for threads in (8, 16):
        workdir = Path(tempfile.mkdtemp(prefix="tkv-l2-engine-"))
        l2 = DiskTier(workdir / "l2", 2 * total, io_threads=threads)
        engine = await prefetch._filled_engine(config, l2, caches, tokens)
        try:
            for slice_bytes in slice_sizes:
                files.FileOps.read_slice_bytes = slice_bytes
                spans.clear()
                began = time.perf_counter()
                times = await prefetch._time_prefetch(engine, tokens, 7)
                busy = sum(end - start for start, end in spans)
                first = min(start for start, _ in spans) - began
                runs = 7  # the rounds timed above
                print(
                    f"  on the read threads: {len(spans) / runs / chunks:.1f} parts a chunk, "
                    f"{1e3 * busy / len(spans):.2f} ms a part, "
                    f"{chunk_bytes * chunks * runs / busy / 1e9:.2f} GB/s a thread, "
                    f"{busy / (time.perf_counter() - began):.1f} threads busy on average, "
                    f"first read started {1e3 * first:.2f} ms after the prefetch",
                    flush=True,
                )
                print(
                    f"engine prefetch {chunks} chunks, {threads} threads, "
                    f"{slice_bytes // MIB} MiB slices: {total / statistics.median(times) / 1e9:.1f}"
                    f" GB/s (best {total / min(times) / 1e9:.1f})",
                    flush=True,
                )
        finally:
            await engine.aclose()
            shutil.rmtree(workdir, ignore_errors=True)
    files.FileOps.read_slice_bytes = files.READ_SLICE_BYTES
    tier_module.ChunkRead.parts = original  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.exit(main())
