"""Lower-tier prefetch into L1 against the machine's own ceilings, in one run (CPU).

A prompt of ``--chunks`` chunks (``--chunk-mib`` MiB each) is stored, flushed to the lower tiers
and evicted from L1; then `engine.prefetch(tokens)` is timed until every chunk is in L1:
1. L2 warm (the chunk files in the page cache) against parallel ``readinto`` of the same files
   by as many threads as L2 has (`ceilings.page_cache_read_gbps`);
2. L2 cold (cached pages dropped with ``posix_fadvise``) against ``O_DIRECT`` reads of the same
   files by as many threads, where the filesystem allows it (`ceilings.direct_read_gbps`);
3. L3 (``tiered-kv serve`` in its own process) against loopback TCP with as many streams as the
   tier has connections, a process per end (`ceilings.loopback_tcp_gbps`).

Usage: ``tiered-kv bench prefetch [--quick] [--chunks N] [--chunk-mib M] [--dir DIR]`` (or
``python bench/prefetch.py`` in a clone). Progress goes to stderr; the table of ratios is
printed last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from tiered_kv.benchmarks import ceilings
from tiered_kv.benchmarks.common import free_port, process, run_on_engine_loop
from tiered_kv.config import IO_PLANES, EngineConfig
from tiered_kv.engine import TieredKVEngine
from tiered_kv.threads import default_io_threads
from tiered_kv.tiers.base import LowerTier
from tiered_kv.tiers.factory import remote_tier
from tiered_kv.tiers.l2 import DiskTier

CHUNK_TOKENS = 256
BLOCK_SIZE = 16
HEADS, HEAD_SIZE = 8, 128  # bf16 K and V: 1 MiB per layer of a 256-token chunk


THREAD_SWEEP = (1, 4, 8, 16)
STREAM_SWEEP = (1, 4, 8)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    path: str
    ours_gbps: float
    ceiling_gbps: float | None
    ceiling: str

    @property
    def ratio(self) -> float | None:
        return None if not self.ceiling_gbps else self.ours_gbps / self.ceiling_gbps


def _caches(num_layers: int, num_blocks: int) -> list[torch.Tensor]:
    """vLLM NHD caches of random bf16 bits (never zeros: they hide unwritten bytes)."""
    gen = torch.Generator().manual_seed(0)
    shape = (2, num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE)
    return [
        torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen).view(
            torch.bfloat16
        )
        for _ in range(num_layers)
    ]


@contextlib.contextmanager
def _busy_python(busy: bool) -> Iterator[None]:
    """With ``busy``, a Python thread spinning beside the engine meanwhile, as the model runner
    or the scheduler of a serving process does: what the interpreter lock costs a data plane."""
    if not busy:
        yield
        return
    stop = threading.Event()

    def spin() -> None:
        count = 0
        while not stop.is_set():
            count += 1

    thread = threading.Thread(target=spin, name="bench-busy", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


async def _time_prefetch(engine: TieredKVEngine, tokens: list[int], reps: int) -> list[float]:
    """Seconds from `prefetch` to every chunk in L1, L1 emptied before each rep."""
    times = []
    for _ in range(reps):
        await engine.evict_l1()
        started = time.perf_counter()
        handle = await engine.prefetch(tokens)
        ready = await handle.wait()
        times.append(time.perf_counter() - started)
        handle.close()
        if ready != len(tokens):
            raise RuntimeError(f"prefetch loaded {ready} of {len(tokens)} tokens")
    await engine.evict_l1()
    return times


async def _filled_engine(
    config: EngineConfig, tier: LowerTier, caches: list[torch.Tensor], tokens: list[int]
) -> TieredKVEngine:
    engine = TieredKVEngine(config, lower_tiers=[tier])
    await engine.open()
    engine.register_kv_caches(caches, model_name="bench", layout_hints={"block_size": BLOCK_SIZE})
    blocks = list(range(len(tokens) // BLOCK_SIZE))
    if await engine.store(tokens, blocks) != len(tokens):
        raise RuntimeError("the store did not take every chunk")
    await engine.flush()
    return engine


async def run(args: argparse.Namespace) -> list[Row]:
    workdir = Path(tempfile.mkdtemp(prefix="tkv-bench-prefetch-", dir=args.dir))
    try:
        return await _measure(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _measure(args: argparse.Namespace, workdir: Path) -> list[Row]:
    chunk_bytes = args.chunk_mib << 20
    num_layers = max(1, chunk_bytes // (2 * CHUNK_TOKENS * HEADS * HEAD_SIZE * 2))
    tokens = list(range(args.chunks * CHUNK_TOKENS))
    total = args.chunks * num_layers * 2 * CHUNK_TOKENS * HEADS * HEAD_SIZE * 2
    caches = _caches(num_layers, len(tokens) // BLOCK_SIZE)
    l1_size = 2 * total + (64 << 20)
    rows: list[Row] = []
    log(f"{args.chunks} chunks of {total / args.chunks / 2**20:.0f} MiB ({total / 1e9:.2f} GB)")

    config = EngineConfig(
        chunk_size=CHUNK_TOKENS,
        l1_size=l1_size,
        io_plane=args.io_plane,
        io_workers=args.l2_threads or default_io_threads(),  # as many as L2's read threads
    )
    if "L2" in args.tiers:
        rows += await _l2_rows(args, workdir, config, caches, tokens, total)
    if "L3" in args.tiers:
        rows.append(await _l3_row(args, config, caches, tokens, total, chunk_bytes))
    return rows


async def _l2_rows(
    args: argparse.Namespace,
    workdir: Path,
    config: EngineConfig,
    caches: list[torch.Tensor],
    tokens: list[int],
    total: int,
) -> list[Row]:
    rows: list[Row] = []
    l2 = DiskTier(workdir / "l2", 2 * total, io_threads=args.l2_threads)
    engine = await _filled_engine(config, l2, caches, tokens)
    try:
        # The reads' real parallelism: L2's threads, or as many worker processes.
        threads = args.l2_threads or default_io_threads()
        paths = sorted(p for p in (workdir / "l2").glob("??/*") if p.is_file())
        sweep = {n: ceilings.page_cache_read_gbps(paths, n) for n in THREAD_SWEEP}
        log("page cache -> memory, readinto: " + ceilings.sweep_text(sweep, "threads"))
        # The ceiling at our thread count, before and after ours (the better of the two).
        before = ceilings.page_cache_read_gbps(paths, threads)
        stats_before = l2.stats()
        with _busy_python(args.busy):
            warm = await _time_prefetch(engine, tokens, args.reps)
        stats_after = l2.stats()
        reads = stats_after.hits - stats_before.hits
        read_s = stats_after.read_seconds - stats_before.read_seconds
        ceiling = max(before, ceilings.page_cache_read_gbps(paths, threads))
        ours = total / statistics.median(warm) / 1e9
        log(
            f"L2 warm: ours {ours:.2f} GB/s (median {1e3 * statistics.median(warm):.1f} ms, "
            f"best {1e3 * min(warm):.1f} ms), readinto x{threads} {ceiling:.2f} GB/s; "
            f"a chunk's read took {1e3 * read_s / max(reads, 1):.1f} ms on its thread "
            f"({total / args.chunks / 1e6 / max(read_s / max(reads, 1), 1e-9) / 1e3:.2f} GB/s)"
        )
        extra = "" if args.io_plane == "threads" else f", {args.io_plane}"
        label = f"L2 warm (page cache{extra}{', busy thread' if args.busy else ''})"
        rows.append(Row(label, ours, ceiling, f"readinto, {threads} threads"))
        cold: list[float] = []
        for _ in range(args.reps):
            for path in paths:
                ceilings.drop_cached_pages(path)
            cold += await _time_prefetch(engine, tokens, 1)
        direct = {n: ceilings.direct_read_gbps(paths, n) for n in (*THREAD_SWEEP, threads)}
        if direct[threads] is not None:
            log("disk (fadvise-dropped), O_DIRECT: " + ceilings.sweep_text(direct, "in flight"))
        ours = total / statistics.median(cold) / 1e9
        rows.append(
            Row("L2 cold (fadvise-dropped)", ours, direct[threads], f"O_DIRECT, {threads} threads")
        )
    finally:
        await engine.aclose()
    return rows


async def _l3_row(
    args: argparse.Namespace,
    config: EngineConfig,
    caches: list[torch.Tensor],
    tokens: list[int],
    total: int,
    chunk_bytes: int,
) -> Row:
    port = free_port()
    serve = [sys.executable, "-m", "tiered_kv.cli", "serve", "--port", str(port)]
    with process([*serve, "--capacity", str(2 * total)], port):
        l3 = remote_tier(dataclasses.replace(config, l3_url=f"tkv://127.0.0.1:{port}"))
        engine = await _filled_engine(config, l3, caches, tokens)
        try:
            streams = l3.connector.connections
            times = await _time_prefetch(engine, tokens, args.reps)
        finally:
            await engine.aclose()
    ours = total / statistics.median(times) / 1e9
    tcp_sweep = {
        n: await asyncio.to_thread(
            ceilings.loopback_tcp_gbps, n, message_bytes=chunk_bytes, total_bytes=total
        )
        for n in sorted({*STREAM_SWEEP, streams})
    }
    log("loopback TCP, a process per end: " + ceilings.sweep_text(tcp_sweep, "streams"))
    tcp = tcp_sweep[streams]
    log(f"L3: ours {ours:.2f} GB/s, loopback TCP x{streams} {tcp:.2f} GB/s")
    return Row("L3 (tiered-kv serve, loopback)", ours, tcp, f"TCP, {streams} streams")


def print_table(rows: Sequence[Row]) -> None:
    print(f"\n{'path':34} {'ours GB/s':>10} {'ceiling GB/s':>13} {'ratio':>6}  ceiling")
    for row in rows:
        ceiling = "-" if row.ceiling_gbps is None else f"{row.ceiling_gbps:.2f}"
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}"
        print(f"{row.path:34} {row.ours_gbps:10.2f} {ceiling:>13} {ratio:>6}  {row.ceiling}")


def build_parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 chunks of 8 MiB, 3 reps")
    parser.add_argument("--chunks", type=int, default=64, help="chunks in the prompt (64)")
    parser.add_argument("--chunk-mib", type=int, default=32, help="MiB per chunk (32)")
    parser.add_argument("--reps", type=int, default=5, help="timed prefetches per path (5)")
    parser.add_argument("--tiers", default="L2,L3", help="which of L2, L3 to measure (both)")
    parser.add_argument(
        "--l2-threads", type=int, default=None, help="L2's I/O threads (sized from the machine)"
    )
    parser.add_argument("--dir", default=None, help="where L2 files go (default: a temp dir)")
    parser.add_argument(
        "--io-plane",
        choices=IO_PLANES,
        default="threads",
        help="where L2 reads move their bytes (%(default)s)",
    )
    parser.add_argument(
        "--busy", action="store_true", help="a busy Python thread beside the timed L2 prefetches"
    )
    parser.add_argument("--no-plot", action="store_true", help="accepted; this prints a table")
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    args.tiers = {t.strip().upper() for t in args.tiers.split(",") if t.strip()}
    if not args.tiers or not args.tiers <= {"L2", "L3"}:
        raise SystemExit(f"--tiers: expected L2, L3 or both, got {sorted(args.tiers)}")
    if args.quick:
        args.chunks, args.chunk_mib, args.reps = 16, 8, 3
    print_table(run_on_engine_loop(run(args)))
    return 0
