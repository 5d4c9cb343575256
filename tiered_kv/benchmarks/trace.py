"""A request trace through the engine beside LRU and the offline optimum at the same sizes (CPU).

TRACE (a JSON-lines file in Mooncake's format, or the name of a generated trace,
`trace_gen.TRACES`) is replayed in arrival order through a fresh engine per size and eviction
policy (`trace_replay.replay`: lookup, retrieve, store; hits are the tokens retrieve delivered),
and the same requests through `trace_sim`'s block caches: LRU and the offline optimum (Belady).
Their capacity is what the tiers hold together: L1's blocks with L1 alone; with L2 under it,
the larger of L1's and L2's, since the hierarchy is inclusive (write_through: every chunk L1
takes is written to L2 too, and replays flush their writes, so none is dropped). An exclusive
hierarchy of the same sizes could hold L1's plus L2's. "Gap closed" is (ours - LRU) /
(optimum - LRU): 0% is the LRU simulation's share, 100% the optimum's.

Usage: ``tiered-kv bench trace TRACE [--sweep [SIZES]] [--l2] [--policies lru,reuse] ...`` (or
``python bench/trace.py`` in a clone). Progress goes to stderr; the tables are printed last on
stdout, ``--json`` keeps every figure and the PNG (matplotlib) plots share served against
capacity. Independent replays of a sweep run in ``--jobs`` processes.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import multiprocessing
import multiprocessing.queues
import os
import queue
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from tiered_kv.benchmarks.common import DEFAULT_OUT, load_pyplot, save_figure
from tiered_kv.benchmarks.progress import Progress
from tiered_kv.benchmarks.trace_replay import (
    KV_BYTES_PER_TOKEN,
    ReplayResult,
    chunks_per_block,
    paged_cache_shape,
    replay,
)
from tiered_kv.benchmarks.trace_sim import (
    BLOCK_TOKENS,
    SimResult,
    TraceError,
    TraceRequest,
    load_trace,
    simulate_belady,
    simulate_lru,
)
from tiered_kv.config import EVICTIONS, IO_PLANES, Eviction, IoPlane, format_size

DEFAULT_SWEEP = (250, 500, 1000, 2000, 4000, 8000, 16000)
DEFAULT_L1_BLOCKS = 1000
DEFAULT_JOBS = min(os.cpu_count() or 1, 4)
REPORT_EVERY = 16  # requests a worker replays between progress reports


@dataclasses.dataclass(frozen=True, slots=True)
class ReplaySettings:
    """What every replay of one bench run shares."""

    block_tokens: int
    chunk_tokens: int
    kv_bytes_per_token: int
    time_scale: float | None
    io_plane: IoPlane


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """One replay: tier sizes in trace blocks and the eviction policy of both tiers."""

    l1_blocks: int
    l2_blocks: int
    policy: Eviction

    @property
    def label(self) -> str:
        lower = f" + L2 {self.l2_blocks}" if self.l2_blocks else ""
        return f"{self.policy}, L1 {self.l1_blocks}{lower}"


def held_blocks(l1_blocks: int, l2_blocks: int) -> int:
    """Distinct blocks the tiers hold together: inclusive (write_through), so the larger."""
    return max(l1_blocks, l2_blocks)


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One size: the engine's replay per policy and the two simulations at ``capacity``."""

    l1_blocks: int
    l2_blocks: int
    lru: SimResult
    optimum: SimResult
    engine: Mapping[str, ReplayResult]

    @property
    def capacity(self) -> int:
        return held_blocks(self.l1_blocks, self.l2_blocks)

    def gap_closed(self, policy: str) -> float | None:
        """Percent of the way from the LRU simulation to the optimum; None where they agree."""
        span = self.optimum.hit_tokens - self.lru.hit_tokens
        if span == 0:
            return None
        return 100 * (self.engine[policy].hit_tokens - self.lru.hit_tokens) / span


# -- the trace ----------------------------------------------------------------------------------
def generated_traces() -> Mapping[str, Callable[..., list[TraceRequest]]]:
    """`trace_gen.TRACES` (name -> ``fn(seed=...)``), or none where that module is absent."""
    try:
        from tiered_kv.benchmarks.trace_gen import TRACES
    except ModuleNotFoundError as exc:
        if exc.name != "tiered_kv.benchmarks.trace_gen":
            raise
        return {}
    return TRACES


def load_requests(name: str, block_tokens: int, seed: int) -> list[TraceRequest]:
    """The requests of trace file ``name``, else of the generated trace of that name;
    `TraceError` naming the choices otherwise."""
    if Path(name).is_file():
        return load_trace(name, block_tokens)
    generated = generated_traces()
    if name not in generated:
        names = ", ".join(generated) or "none: tiered_kv.benchmarks.trace_gen is not here"
        raise TraceError(f"TRACE: {name!r} is no file and no generated trace (generated: {names})")
    requests = generated[name](seed=seed)
    for number, request in enumerate(requests):
        if len(request.hash_ids) != -(-request.input_length // block_tokens):
            raise TraceError(
                f"generated trace {name!r}, request {number}: {len(request.hash_ids)} blocks for "
                f"{request.input_length} tokens are not blocks of {block_tokens} tokens; pass the "
                "trace's block size as --block-tokens"
            )
    return requests


# -- the replays --------------------------------------------------------------------------------
def replay_job(
    requests: Sequence[TraceRequest],
    settings: ReplaySettings,
    job: Job,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """``job``'s replay on a loop of its own (in this process or a worker's)."""
    return asyncio.run(
        replay(
            requests,
            l1_blocks=job.l1_blocks,
            l2_blocks=job.l2_blocks,
            block_tokens=settings.block_tokens,
            chunk_tokens=settings.chunk_tokens,
            kv_bytes_per_token=settings.kv_bytes_per_token,
            l1_eviction=job.policy,
            l2_eviction=job.policy,
            time_scale=settings.time_scale,
            io_plane=settings.io_plane,
            progress=progress,
        )
    )


# A worker's trace, settings and progress queue, set once by `_start_worker` (pool initializer).
_worker: tuple[list[TraceRequest], ReplaySettings, multiprocessing.queues.Queue[int]] | None = None


def _start_worker(
    requests: list[TraceRequest],
    settings: ReplaySettings,
    reports: multiprocessing.queues.Queue[int],
    torch_threads: int,
) -> None:
    global _worker
    torch.set_num_threads(torch_threads)  # the workers share the machine's cores
    _worker = (requests, settings, reports)


def _replay_in_worker(job: Job) -> ReplayResult:
    if _worker is None:
        raise RuntimeError("_replay_in_worker runs in a pool started with _start_worker")
    requests, settings, reports = _worker
    sent = 0

    def report(done: int) -> None:
        nonlocal sent
        if done - sent >= REPORT_EVERY or done == len(requests):
            reports.put(done - sent)
            sent = done

    return replay_job(requests, settings, job, report)


def _advance(progress: Progress, note: str, done: int) -> None:
    progress.advance(note)


def _drain(reports: multiprocessing.queues.Queue[int], progress: Progress) -> None:
    while True:
        try:
            done = reports.get_nowait()
        except queue.Empty:
            return
        for _ in range(done):
            progress.advance()


def run_jobs(
    requests: list[TraceRequest],
    settings: ReplaySettings,
    jobs: Sequence[Job],
    workers: int,
    progress: Progress,
) -> list[ReplayResult]:
    """Every job's result, in order: in this process for one worker (or one job), else in a
    pool of ``workers`` spawned processes, each replay on its own `asyncio.run`."""
    if workers <= 1 or len(jobs) <= 1:
        return [
            replay_job(requests, settings, job, functools.partial(_advance, progress, job.label))
            for job in jobs
        ]
    context = multiprocessing.get_context("spawn")
    reports: multiprocessing.queues.Queue[int] = context.Queue()
    workers = min(workers, len(jobs))
    torch_threads = max(1, (os.cpu_count() or 1) // workers)
    try:
        with concurrent.futures.ProcessPoolExecutor(
            max_workers=workers,
            mp_context=context,
            initializer=_start_worker,
            initargs=(requests, settings, reports, torch_threads),
        ) as pool:
            futures = [pool.submit(_replay_in_worker, job) for job in jobs]
            try:
                pending = set(futures)
                while pending:
                    done, pending = concurrent.futures.wait(pending, timeout=0.1)
                    _drain(reports, progress)
                    for future in done:
                        future.result()  # a failed replay ends the run now, with its error
                return [future.result() for future in futures]
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    finally:
        _drain(reports, progress)
        reports.close()
        reports.join_thread()


# -- the output ---------------------------------------------------------------------------------
def _percent(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{round(value, 1) or 0.0:.1f}%"  # no "-0.0%" for a hair below zero


def _aligned(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=True)]
    return [
        "  ".join(cell.rjust(width) for cell, width in zip(line, widths, strict=True))
        for line in (headers, *rows)
    ]


def format_tables(rows: Sequence[Row], policies: Sequence[str]) -> str:
    """Share of prompt tokens served per size (engine per policy and tier, the simulations,
    gap closed), then the bytes each policy moved."""
    headers = ["capacity", "L1", "L2"]
    for policy in policies:
        headers += [policy, f"{policy} L1", f"{policy} L2"]
    headers += ["LRU (sim)", "optimum (sim)", *(f"{policy} gap closed" for policy in policies)]
    shares = []
    for row in rows:
        cells = [str(row.capacity), str(row.l1_blocks), str(row.l2_blocks)]
        for policy in policies:
            ours = row.engine[policy]
            cells += [_percent(100 * r) for r in (ours.ratio, ours.l1_ratio, ours.l2_ratio)]
        cells += [_percent(100 * row.lru.ratio), _percent(100 * row.optimum.ratio)]
        cells += [_percent(row.gap_closed(policy)) for policy in policies]
        shares.append(cells)
    moved = [
        [
            policy,
            str(row.capacity),
            format_size(ours.l1_bytes_delivered),
            format_size(ours.l2_bytes_read),
            format_size(ours.l2_bytes_written),
            str(ours.l2_writes_dropped),
        ]
        for policy in policies
        for row in rows
        for ours in (row.engine[policy],)
    ]
    byte_headers = ["policy", "capacity", "L1 delivered", "L2 read", "L2 written", "writes dropped"]
    return "\n".join(
        [
            "share of prompt tokens served from cache (capacity, L1, L2: trace blocks)",
            *_aligned(headers, shares),
            "",
            "bytes moved by the engine (KV bytes; writes dropped: full L2 write queue)",
            *_aligned(byte_headers, moved),
        ]
    )


def figures(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Every figure of every row, for ``--json``."""
    out = []
    for row in rows:
        engine: dict[str, Any] = {}
        for policy, ours in row.engine.items():
            engine[policy] = {
                **dataclasses.asdict(ours),
                "share": ours.ratio,
                "share_l1": ours.l1_ratio,
                "share_l2": ours.l2_ratio,
                "gap_closed_pct": row.gap_closed(policy),
            }
        out.append(
            {
                "l1_blocks": row.l1_blocks,
                "l2_blocks": row.l2_blocks,
                "capacity": row.capacity,
                "prompt_tokens": row.lru.prompt_tokens,
                "lru_sim": {"hit_tokens": row.lru.hit_tokens, "share": row.lru.ratio},
                "optimum_sim": {"hit_tokens": row.optimum.hit_tokens, "share": row.optimum.ratio},
                "engine": engine,
            }
        )
    return out


def plot(plt: Any, rows: Sequence[Row], policies: Sequence[str], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    capacities = [row.capacity for row in rows]
    for policy in policies:
        shares = [100 * row.engine[policy].ratio for row in rows]
        ax.plot(capacities, shares, "o-", label=f"engine, {policy}")
    ax.plot(capacities, [100 * r.lru.ratio for r in rows], "s--", color="grey", label="LRU (sim)")
    optimum = [100 * row.optimum.ratio for row in rows]
    ax.plot(capacities, optimum, "^:", color="black", label="optimum, Belady (sim)")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (trace blocks the tiers hold together)")
    ax.set_ylabel("prompt tokens served from cache (%)")
    ax.set_title(title, fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)


# -- the command line ---------------------------------------------------------------------------
def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"expected block counts >= 1 separated by commas (e.g. 250,1000), got {text!r}; "
            "give TRACE before a --sweep without SIZES"
        )
    return sizes


def _policies(text: str) -> tuple[Eviction, ...]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in EVICTIONS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected eviction policies from {', '.join(EVICTIONS)} separated by commas, "
            f"got {text!r}"
        )
    return tuple(name for name in EVICTIONS if name in names)


def build_parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        epilog=(
            "References: LRU and the offline optimum (Belady) simulated over trace blocks at "
            "capacity = what the tiers hold together: L1's blocks (L1 alone), or the larger "
            "of L1's and L2's (with L2: the hierarchy is inclusive, write_through). Gap "
            "closed = (ours - LRU) / (optimum - LRU)."
        ),
    )
    names = ", ".join(generated_traces()) or "none here yet"
    parser.add_argument(
        "trace", metavar="TRACE", help=f"a JSON-lines trace file, or a generated trace ({names})"
    )
    parser.add_argument(
        "--block-tokens", type=int, default=BLOCK_TOKENS, help="tokens per trace block (512)"
    )
    parser.add_argument(
        "--chunk-tokens", type=int, help="engine chunk size; must divide the block (a block)"
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=KV_BYTES_PER_TOKEN,
        help="KV bytes per token, even and >= 4 (%(default)s)",
    )
    parser.add_argument(
        "--l1-blocks", type=int, help=f"L1's size in trace blocks, one run ({DEFAULT_L1_BLOCKS})"
    )
    parser.add_argument(
        "--l2-blocks", type=int, help="L2's size in trace blocks, one run (0: L1 alone)"
    )
    parser.add_argument(
        "--sweep",
        nargs="?",
        type=_sizes,
        const=DEFAULT_SWEEP,
        metavar="SIZES",
        help="a run per size, comma-separated (without SIZES: "
        f"{','.join(map(str, DEFAULT_SWEEP))}); each size is L1's, or with --l2 L2's",
    )
    parser.add_argument(
        "--l2", action="store_true", help="sweep L1 + L2: each size is L2's, L1 a quarter of it"
    )
    parser.add_argument(
        "--policies",
        type=_policies,
        default=EVICTIONS,
        help=f"engine eviction policies to run, both tiers set to each ({','.join(EVICTIONS)})",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        metavar="S",
        help="start each request S x its arrival time after the first's (default: back to back)",
    )
    parser.add_argument("--requests", type=int, metavar="N", help="the first N requests only")
    parser.add_argument("--seed", type=int, default=0, help="seed of a generated trace (0)")
    parser.add_argument(
        "--io-plane",
        choices=IO_PLANES,
        default="threads",
        help="where L2 moves its bytes (%(default)s: no worker processes per run)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        help=f"replays run in parallel, a process each (min(CPUs, 4): {DEFAULT_JOBS} here)",
    )
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    parser.add_argument(
        "--png", type=Path, default=DEFAULT_OUT / "trace.png", help="the plot (%(default)s)"
    )
    parser.add_argument("--no-plot", action="store_true", help="the table alone (no matplotlib)")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ReplaySettings:
    """The settings of every replay, or the parser's error (exit 2) naming the bad option."""
    if args.block_tokens < 1:
        parser.error(f"--block-tokens: must be >= 1, got {args.block_tokens}")
    chunk_tokens = args.block_tokens if args.chunk_tokens is None else args.chunk_tokens
    try:
        chunks_per_block(args.block_tokens, chunk_tokens)
        paged_cache_shape(args.kv_bytes_per_token)
    except ValueError as exc:
        parser.error(str(exc))
    if args.sweep is None and args.l2:
        parser.error("--l2 sizes a sweep; add --sweep [SIZES], or give --l2-blocks for one run")
    if args.sweep is not None and (args.l1_blocks is not None or args.l2_blocks is not None):
        parser.error("--l1-blocks and --l2-blocks size one run; a --sweep sizes each from SIZES")
    if args.sweep is not None and args.l2 and min(args.sweep) < 4:
        parser.error("--sweep with --l2: L1 is a quarter of each size, so sizes must be >= 4")
    if args.l1_blocks is not None and args.l1_blocks < 1:
        parser.error(f"--l1-blocks: must be >= 1, got {args.l1_blocks}")
    if args.l2_blocks is not None and args.l2_blocks < 0:
        parser.error(f"--l2-blocks: must be >= 0, got {args.l2_blocks}")
    if args.time_scale is not None and not args.time_scale >= 0:
        parser.error(f"--time-scale: must be >= 0, got {args.time_scale}")
    if args.requests is not None and args.requests < 1:
        parser.error(f"--requests: must be >= 1, got {args.requests}")
    if args.jobs < 1:
        parser.error(f"--jobs: must be >= 1, got {args.jobs}")
    return ReplaySettings(
        args.block_tokens,
        chunk_tokens,
        args.kv_bytes_per_token,
        args.time_scale or None,
        args.io_plane,
    )


def _sizes_of(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(L1 blocks, L2 blocks) of each row."""
    if args.sweep is None:
        l1 = DEFAULT_L1_BLOCKS if args.l1_blocks is None else args.l1_blocks
        return [(l1, args.l2_blocks or 0)]
    if args.l2:
        return [(size // 4, size) for size in args.sweep]
    return [(size, 0) for size in args.sweep]


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    settings = _check(parser, args)
    plt = None if args.no_plot else load_pyplot()
    try:
        requests = load_requests(args.trace, args.block_tokens, args.seed)
    except (OSError, TraceError) as exc:
        parser.error(str(exc))
    requests = requests[: args.requests]
    if not requests:
        parser.error(f"TRACE: {args.trace!r} has no requests")
    sizes = _sizes_of(args)
    jobs = [Job(l1, l2, policy) for l1, l2 in sizes for policy in args.policies]
    started = time.perf_counter()
    references = {
        capacity: (
            simulate_lru(requests, capacity, args.block_tokens),
            simulate_belady(requests, capacity, args.block_tokens),
        )
        for capacity in {held_blocks(l1, l2) for l1, l2 in sizes}
    }
    progress = Progress(len(jobs) * len(requests), "trace replay")
    try:
        results = run_jobs(requests, settings, jobs, args.jobs, progress)
    finally:
        progress.close()
    wall_s = time.perf_counter() - started
    by_job = dict(zip(jobs, results, strict=True))
    rows = [
        Row(
            l1,
            l2,
            *references[held_blocks(l1, l2)],
            {policy: by_job[Job(l1, l2, policy)] for policy in args.policies},
        )
        for l1, l2 in sizes
    ]
    shape = paged_cache_shape(settings.kv_bytes_per_token)
    hierarchy = "L1 alone"
    if args.l2:
        hierarchy = "L1 + L2 (L1 a quarter of L2)"
    elif rows[0].l2_blocks:
        hierarchy = "L1 + L2"
    pacing = f"time scale {settings.time_scale:g}" if settings.time_scale else "back to back"
    notes = [
        f"trace: {args.trace}, {len(requests)} requests, {rows[0].lru.prompt_tokens:,} prompt "
        f"tokens in blocks of {settings.block_tokens}; {hierarchy}",
        f"engine: chunks of {settings.chunk_tokens} tokens, KV {settings.kv_bytes_per_token} "
        f"B/token ({shape.heads} x {shape.head_size} {str(shape.dtype).removeprefix('torch.')}), "
        f"load policy always, write_through, io plane {settings.io_plane}, {pacing}",
        "references: LRU and the optimum (Belady) over trace blocks at capacity = what the "
        "tiers hold together (L1 alone: L1; with L2: max(L1, L2), an inclusive hierarchy)",
        f"wall: {wall_s:.1f} s for {len(jobs)} replays, {min(args.jobs, len(jobs))} at a time",
    ]
    if plt is not None:
        title = f"{Path(args.trace).name}: {len(requests)} requests, {hierarchy}"
        plot(plt, rows, args.policies, args.png, title)
        notes.append(f"plot: {args.png}")
    if args.json:
        arguments = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.json.write_text(
            json.dumps(
                {
                    "arguments": arguments,
                    "requests": len(requests),
                    "paged_cache": {
                        "dtype": str(shape.dtype).removeprefix("torch."),
                        "heads": shape.heads,
                        "head_size": shape.head_size,
                    },
                    "wall_s": wall_s,
                    "rows": figures(rows),
                },
                indent=1,
            )
        )
    for note in notes:
        print(note)
    print()
    print(format_tables(rows, args.policies))
    return 0
