"""GPU ↔ host KV transfer benchmark: every CudaMover path against the machine's own ceilings.

Run on a CUDA machine: ``tiered-kv bench transfer [--quick]`` (or, in a clone,
``PYTHONPATH=. python3 bench/transfer.py [--quick]``). Without a CUDA device it says so and exits
with status 2: it has no CPU part (the CPU benchmarks are ``workload`` and ``remote``).

1. Ceilings, measured here: pinned cudaMemcpy D2H and H2D (1 GiB), both at once on two streams,
   and device-to-device (bytes read + written).
2. Caches: Llama-3-8B-like (32 layers, 8 KV heads x 128, bf16, block 16) as NHD and as an HND
   view, MLA (32 layers, 576-wide bf16), an int8 group with 132-byte rows (32 layers), and
   whole-block caches (format 'blocks', [NB, 8, 16, 256] bf16: vLLM's CPU-backend layout).
   Chunks of 256 tokens, block tables shuffled (a long-running server's blocks are not adjacent).
3. For ``auto`` (the engine's default: staging, or DMA for long runs, and small calls as mapped
   kernels of few CTAs) and each path: store (gather) and retrieve (scatter) GB/s as the engine
   sees them (awaited mover calls, enqueue and completion included) at 1 and 32 chunks per call;
   store and retrieve of 32 chunks at once; the slowdown of a concurrent bf16 matmul during
   retrieves.
4. Baselines: naive torch (index_select, then copy to pinned memory), and LMCache's
   ``multi_layer_kv_transfer`` on the NHD cache when the ``lmcache`` wheel imports.

Prints a table last; ``--json PATH`` writes every figure; ``DIR/transfer.png`` (``--out DIR``,
needs the ``bench`` extra: matplotlib) plots store, retrieve and both at once against the ceilings.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tiered_kv.benchmarks.common import (
    DEFAULT_OUT,
    bar_chart,
    load_pyplot,
    require_cuda,
    run_on_engine_loop,
)
from tiered_kv.benchmarks.progress import Progress, print_line
from tiered_kv.gpu.base import ChunkTransfer
from tiered_kv.gpu.kernels import check_driver
from tiered_kv.gpu.mover import PATHS, CudaMover, MoverOptions, choose_path
from tiered_kv.gpu.plan import PathChoice
from tiered_kv.layout import KVCacheLayout, build_layout
from tiered_kv.memory import HostArena, MemoryObj

GiB = 1 << 30
CHUNK = 256
BLOCK = 16
LAYERS = 32
SLOT_BYTES = MoverOptions().staging_slot_bytes  # --slot-mib


# -- ceilings -------------------------------------------------------------------------------------
def _time_ms(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of ``fn`` timed with CUDA events on the current stream."""
    times: list[float] = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def ceilings(nbytes: int, reps: int) -> dict[str, float]:
    host_a = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host_b = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dev_b = torch.empty_like(dev_a)
    host_b.copy_(dev_a)
    d2h = _time_ms(lambda: host_a.copy_(dev_a, non_blocking=True), reps)
    h2d = _time_ms(lambda: dev_b.copy_(host_b, non_blocking=True), reps)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        current = torch.cuda.current_stream()
        s1.wait_stream(current)
        s2.wait_stream(current)
        with torch.cuda.stream(s1):
            host_a.copy_(dev_a, non_blocking=True)
        with torch.cuda.stream(s2):
            dev_b.copy_(host_b, non_blocking=True)
        current.wait_stream(s1)
        current.wait_stream(s2)

    both_ms = _time_ms(both, reps)
    d2d = _time_ms(lambda: dev_b.copy_(dev_a), reps)
    out = {
        "d2h": nbytes / d2h / 1e6,
        "h2d": nbytes / h2d / 1e6,
        "both": 2 * nbytes / both_ms / 1e6,
        "d2d": 2 * nbytes / d2d / 1e6,
    }
    return out


# -- caches ---------------------------------------------------------------------------------------
def make_case(name: str, num_blocks: int) -> tuple[list[Any], dict[str, Any]]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raw = torch.randint(
            0,
            256,
            (*shape[:-1], shape[-1] * dtype.itemsize),
            dtype=torch.uint8,
            device="cuda",
            generator=gen,
        )
        return raw.view(dtype)

    hints: dict[str, Any] = {"block_size": BLOCK}
    if name == "llama_nhd":
        entries = [rand((2, num_blocks, BLOCK, 8, 128), torch.bfloat16) for _ in range(LAYERS)]
        return entries, {**hints, "kv_layout": "NHD"}
    if name == "llama_hnd":
        physical = [rand((2, num_blocks, 8, BLOCK, 128), torch.bfloat16) for _ in range(LAYERS)]
        return [p.permute(0, 1, 3, 2, 4) for p in physical], {**hints, "kv_layout": "HND"}
    if name == "mla":
        return [rand((num_blocks, BLOCK, 576), torch.bfloat16) for _ in range(LAYERS)], hints
    if name == "int8_132":
        return [rand((num_blocks, BLOCK, 132), torch.int8) for _ in range(LAYERS)], hints
    if name.startswith("blocks"):
        # Whole-block caches (vLLM's CPU-backend layout [NB, NH, BS, 2*HS], Llama-3-8B heads):
        # one contiguous run per block and layer: 64 KiB at block 16, 1 MiB at block 256
        # (case ``blocks_b256``).
        bs = block_size_of(name)
        entries = [rand((num_blocks, 8, bs, 256), torch.bfloat16) for _ in range(LAYERS)]
        return entries, {"block_size": bs, "format": "blocks"}
    raise ValueError(name)


def block_size_of(name: str) -> int:
    """Tokens per block: 16, or what a ``blocks_b<N>`` case names (longer whole-block runs)."""
    return int(name.removeprefix("blocks_b")) if name.startswith("blocks_b") else BLOCK


class Case:
    def __init__(self, name: str, max_chunks: int) -> None:
        self.block_size = block_size_of(name)
        per_chunk = CHUNK // self.block_size
        self.num_blocks = 2 * max_chunks * per_chunk + 8
        self.name = name
        self.entries, hints = make_case(name, self.num_blocks)
        self.layout: KVCacheLayout = build_layout(
            self.entries, chunk_size=CHUNK, layout_hints=hints
        )
        self.chunk_bytes = self.layout.layout_desc.nbytes(CHUNK)
        perm = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        half = max_chunks * per_chunk
        self.blocks_a, self.blocks_b = perm[:half], perm[half : 2 * half]
        self.arena = HostArena(2 * max_chunks * self.chunk_bytes + (1 << 20), pin=True)
        self.objs_a = self._objs(max_chunks)
        self.objs_b = self._objs(max_chunks)

    def _objs(self, n: int) -> list[MemoryObj]:
        out = []
        for _ in range(n):
            obj = self.arena.allocate_obj(self.layout.layout_desc, CHUNK)
            assert obj is not None
            out.append(obj)
        return out

    def transfers(self, objs: list[MemoryObj], n: int) -> list[ChunkTransfer]:
        return [ChunkTransfer(objs[i], i * CHUNK) for i in range(n)]

    def close(self) -> None:
        for obj in (*self.objs_a, *self.objs_b):
            obj.unref()
        self.arena.close()


async def _wall(fn: Callable[[], Awaitable[Any]], reps: int) -> float:
    """Median seconds of awaiting ``fn()`` (after one warm-up)."""
    await fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmul_ms(a: torch.Tensor, stream: torch.cuda.Stream, iters: int) -> Callable[[], float]:
    """Queue ``iters`` matmuls on ``stream``; the returned function waits and gives their ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        for _ in range(iters):
            torch.mm(a, a)
        end.record()

    def finish() -> float:
        end.synchronize()
        return float(start.elapsed_time(end))

    return finish


async def matmul_slowdown(run_retrieve: Callable[[], Awaitable[Any]], iters: int) -> float:
    """Percent by which a bf16 matmul loop slows while retrieves run on the mover's streams:
    the median over alternating (alone, with retrieves) pairs, so clock drift cancels."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_stream = torch.cuda.Stream()
    _matmul_ms(a, mm_stream, 5)()  # warm-up
    idle = torch.cuda.Stream()  # the "engine stream" the mover orders against: not the matmul's
    ratios = []
    for _ in range(5):
        alone = _matmul_ms(a, mm_stream, iters)()
        finish = _matmul_ms(a, mm_stream, iters)
        end_event = torch.cuda.Event()
        end_event.record(mm_stream)
        with torch.cuda.stream(idle):
            while not end_event.query():
                await run_retrieve()
        ratios.append(finish() / alone)
    return 100.0 * (statistics.median(ratios) - 1.0)


async def sweep(case: Case, reps: int, n: int) -> None:
    """Staging slot size x CTAs, and the mapped path's CTAs, at ``n`` chunks per call."""
    for slot_mib in (8, 16, 32):
        for ctas in (16, 32, 64):
            options = MoverOptions(
                path="staging", staging_slot_bytes=slot_mib << 20, staging_ctas=ctas
            )
            await _sweep_one(
                case, reps, n, CudaMover(options), f"staging slot={slot_mib}MiB ctas={ctas}"
            )
    for ctas in (16, 32, 66, 132, 264):
        options = MoverOptions(path="mapped", mapped_ctas=ctas)
        await _sweep_one(case, reps, n, CudaMover(options), f"mapped ctas={ctas}")


async def probe(case: Case, reps: int, profile: bool = False) -> None:
    """Where one call's time goes (enqueue, GPU, wake-up), and the copy kernel alone by CTAs."""
    mover = CudaMover(MoverOptions(path="staging", staging_slot_bytes=SLOT_BYTES))
    mover.trace = []
    for n in (1, 32):
        for label, fn in (
            (
                "store",
                lambda n=n: mover.gather(
                    case.layout, case.blocks_a, case.transfers(case.objs_a, n)
                ),
            ),
            (
                "retrieve",
                lambda n=n: mover.scatter(
                    case.layout, case.blocks_b, case.transfers(case.objs_b, n)
                ),
            ),
        ):
            mover.trace.clear()
            await _wall(fn, reps)
            polls = mover.stats()["completion_polls"]
            await _wall(fn, reps)
            polls = (mover.stats()["completion_polls"] - polls) / (reps + 1)
            med = {
                k: statistics.median(t[k] for t in mover.trace)
                for k in (
                    "call_s",
                    "ids_s",
                    "recorded_s",
                    "first_copy_s",
                    "enqueue_s",
                    "gpu_s",
                    "observed_s",
                    "finish_s",
                    "total_s",
                )
            }
            late = med["observed_s"] - med["recorded_s"] - med["gpu_s"]
            gpu_rate = n * case.chunk_bytes / med["gpu_s"] / 1e9
            print_line(
                f"probe {case.name} {label}@{n}: call {1e6 * med['call_s']:.0f}, recorded "
                f"{1e6 * med['recorded_s']:.0f}, ids {1e6 * med['ids_s']:.0f}, "
                f"first copy queued {1e6 * med['first_copy_s']:.0f} "
                f"us, seen {1e6 * late:.0f} us after the GPU; "
                f"enqueue {1e6 * med['enqueue_s']:.0f} us, gpu "
                f"{1e6 * med['gpu_s']:.0f} us ({gpu_rate:.1f} GB/s), "
                f"seen done {1e6 * med['observed_s']:.0f} us, on loop {1e6 * med['finish_s']:.0f} "
                f"us, total {1e6 * med['total_s']:.0f} us, "
                f"{polls:.0f} polls/call",
            )
    if profile:
        import cProfile
        import pstats

        mover.trace = None
        for n in (1, 32):
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(reps):
                await mover.gather(case.layout, case.blocks_a, case.transfers(case.objs_a, n))
            profiler.disable()
            print_line(f"probe profile: {reps} stores of {n} chunks, by own time")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    state = mover.device_state(case.layout.device)
    plan = state.plan(case.layout)
    group = plan.groups[0]
    staging = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    ids = torch.tensor(case.blocks_a, dtype=torch.int32, device="cuda")
    from cuda.bindings import driver

    from tiered_kv.gpu.events import BlockTable

    per_layer = group.slab_bytes(1, CHUNK)
    layers = min(group.num_layers, (32 << 20) // per_layer)
    job = [(staging.data_ptr(), 0, 0, CHUNK, 0, layers)]
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    for ctas in (16, 32, 64, 132, 264, 528):
        for to_host in (True, False):
            launch = functools.partial(
                mover.launcher.launch,
                state,
                group,
                stream,
                to_host,
                case.layout.block_size,
                BlockTable(ids.data_ptr()),
                job,
                ctas,
            )
            ms = _time_ms(launch, reps * 3)
            print_line(
                f"probe {case.name} kernel {'gather' if to_host else 'scatter'} ctas={ctas} "
                f"width={group.width}: {layers * per_layer / ms / 1e6:.0f} GB/s (D2D, one way)",
            )
    await mover.aclose()


def dma_sizes(reps: int) -> None:
    """The copy engines alone: 1 GiB between the GPU and a pinned arena as back-to-back copies
    of one size, to see what each DMA costs beyond its bytes."""
    from cuda.bindings import driver

    total = GiB
    arena = HostArena(total, pin=True)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    stream = driver.CUstream(torch.cuda.current_stream().cuda_stream)
    for size in (GiB, 128 << 20, 32 << 20, 8 << 20, 2 << 20):
        for to_host in (True, False):

            def run(size: int = size, to_host: bool = to_host) -> None:
                for off in range(0, total, size):
                    host, gpu = arena.base_ptr + off, dev.data_ptr() + off
                    src, dst = (gpu, host) if to_host else (host, gpu)
                    check_driver(driver.cuMemcpyAsync(dst, src, size, stream), "cuMemcpyAsync")

            ms = _time_ms(run, reps)
            print_line(
                f"probe dma {'D2H' if to_host else 'H2D'} {total // size} x {size >> 20} MiB: "
                f"{total / ms / 1e6:.1f} GB/s",
            )
    arena.close()


async def _sweep_one(case: Case, reps: int, n: int, mover: CudaMover, label: str) -> None:
    try:
        row = await bench_path(mover, case, reps, [1, n], 30)
    finally:
        await mover.aclose()
    print_line(
        f"sweep {case.name} {label}: store@1 {row['store_1']:.1f} retr@1 {row['retrieve_1']:.1f} "
        f"store@{n} {row[f'store_{n}']:.1f} retr@{n} {row[f'retrieve_{n}']:.1f} "
        f"both {row['both']:.1f} matmul {row['matmul_slowdown_pct']:.1f}%",
    )


# -- baselines ----------------------------------------------------------------------------------
def naive_store(case: Case, n: int, hosts: list[torch.Tensor]) -> None:
    """index_select the chunk's blocks per layer and K/V, then copy to pinned memory."""
    blocks = torch.tensor(case.blocks_a, device="cuda")
    per_chunk = CHUNK // case.block_size
    for c in range(n):
        ids = blocks[c * per_chunk : (c + 1) * per_chunk]
        for group in case.layout.groups:
            for i, kv in enumerate(group.kv_views):
                for k, view in enumerate(kv):
                    rows = view.index_select(0, ids).reshape(CHUNK, -1)
                    hosts[c][i, k].copy_(rows, non_blocking=True)
    torch.cuda.synchronize()


def lmcache_transfers(
    case: Case, n: int, hosts: list[torch.Tensor]
) -> dict[str, Callable[[], None]] | None:
    """LMCache's ``multi_layer_kv_transfer`` (kernel writing pinned memory directly) for a store
    and a retrieve of ``n`` chunks, or None when the wheel does not import."""
    try:
        from lmcache import c_ops as lmc_ops
    except Exception as exc:
        print_line(f"LMCache not importable ({exc.__class__.__name__}: {exc}); skipped")
        return None
    ptrs = torch.tensor([t.data_ptr() for t in case.entries], dtype=torch.int64, device="cuda")
    blocks = torch.tensor(case.blocks_a, dtype=torch.int64)
    offsets = torch.arange(CHUNK * n) % BLOCK
    slots = (blocks.repeat_interleave(BLOCK)[: CHUNK * n] * BLOCK + offsets).cuda()
    fmt = lmc_ops.EngineKVFormat.NL_X_TWO_NB_BS_NH_HS
    page = case.num_blocks * BLOCK

    def transfer(direction: Any) -> Callable[[], None]:
        def run() -> None:
            for c in range(n):
                lmc_ops.multi_layer_kv_transfer(
                    hosts[c],
                    ptrs,
                    slots[c * CHUNK : (c + 1) * CHUNK],
                    torch.device("cuda"),
                    page,
                    direction,
                    fmt,
                    block_size=BLOCK,
                    head_size=128,
                )
            torch.cuda.synchronize()

        return run

    return {
        "store": transfer(lmc_ops.TransferDirection.D2H),
        "retrieve": transfer(lmc_ops.TransferDirection.H2D),
    }


# -- main ---------------------------------------------------------------------------------------
async def bench_path(
    mover: CudaMover, case: Case, reps: int, counts: list[int], mm_iters: int
) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case.name, "path": mover.options.path}

    def store(n: int) -> Awaitable[None]:
        return mover.gather(case.layout, case.blocks_a, case.transfers(case.objs_a, n))

    def retrieve(n: int) -> Awaitable[None]:
        return mover.scatter(case.layout, case.blocks_b, case.transfers(case.objs_b, n))

    for n in counts:
        t_store = await _wall(functools.partial(store, n), reps)
        t_load = await _wall(functools.partial(retrieve, n), reps)
        row[f"store_{n}"] = n * case.chunk_bytes / t_store / 1e9
        row[f"retrieve_{n}"] = n * case.chunk_bytes / t_load / 1e9
    n = counts[-1]

    async def both() -> None:
        await asyncio.gather(store(n), retrieve(n))

    t_both = await _wall(both, reps)
    row["both"] = 2 * n * case.chunk_bytes / t_both / 1e9
    row["matmul_slowdown_pct"] = await matmul_slowdown(lambda: retrieve(4), mm_iters)
    return row


async def bench_case(
    case: Case, reps: int, counts: list[int], mm_iters: int
) -> list[dict[str, Any]]:
    rows = []
    paths: tuple[PathChoice, ...] = ("auto", *PATHS)  # auto: what the engine does by default
    for path in paths:
        mover = CudaMover(MoverOptions(path=path, staging_slot_bytes=SLOT_BYTES))
        try:
            row = await bench_path(mover, case, reps, counts, mm_iters)
        except Exception as exc:
            row = {"case": case.name, "path": path, "error": f"{exc.__class__.__name__}: {exc}"}
        finally:
            await mover.aclose()
        rows.append(row)
        print_line(json.dumps(row))
    n = counts[-1]
    hosts = [
        torch.empty(case.layout.layout_desc.nbytes(CHUNK), dtype=torch.uint8, pin_memory=True)
        for _ in range(n)
    ]
    group0 = case.layout.groups[0].host
    views = [h[: group0.nbytes(CHUNK)].view(group0.dtype).view(group0.shape(CHUNK)) for h in hosts]
    start = time.perf_counter()
    for _ in range(reps):
        naive_store(case, n, views)
    rows.append(
        {
            "case": case.name,
            "path": "naive torch",
            f"store_{n}": reps * n * case.chunk_bytes / (time.perf_counter() - start) / 1e9,
        }
    )
    if case.name == "llama_nhd":
        lm_hosts = [
            torch.empty((2, LAYERS, CHUNK, 1024), dtype=torch.bfloat16, pin_memory=True)
            for _ in range(n)
        ]
        runs = lmcache_transfers(case, n, lm_hosts)
        if runs is not None:
            lm: dict[str, Any] = {"case": case.name, "path": "lmcache 0.5.2"}
            try:
                for label, fn in runs.items():
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    lm[f"{label}_{n}"] = (
                        reps * n * case.chunk_bytes / (time.perf_counter() - t0) / 1e9
                    )
            except Exception as exc:
                lm["error"] = f"{exc.__class__.__name__}: {exc}"
            rows.append(lm)
    print_line(json.dumps(rows[-1]))
    return rows


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and cases")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where the plot goes (%(default)s)"
    )
    parser.add_argument("--no-plot", action="store_true", help="the table alone (no matplotlib)")
    parser.add_argument("--cases", default="llama_nhd,llama_hnd,mla,int8_132,blocks")
    parser.add_argument("--sweep", action="store_true", help="tune staging slots and CTAs")
    parser.add_argument("--probe", action="store_true", help="time a call's parts and the kernel")
    parser.add_argument("--profile", action="store_true", help="with --probe: cProfile stores")
    parser.add_argument("--slot-mib", type=int, help="staging slot size (default: the mover's)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    require_cuda()
    tables = not (args.sweep or args.probe)
    plt = None if args.no_plot or not tables else load_pyplot()
    if args.slot_mib:
        global SLOT_BYTES
        SLOT_BYTES = args.slot_mib << 20
    reps = 3 if args.quick else 10
    counts = [1, 32]
    names = args.cases.split(",")
    progress = Progress(1 + len(names), "transfer", plain_lines=1 + len(names))
    ceil = ceilings(GiB, 5 if args.quick else 10)
    print_line("ceilings GB/s: " + json.dumps({k: round(v, 1) for k, v in ceil.items()}))
    progress.advance("ceilings measured")
    rows: list[dict[str, Any]] = []
    for name in names:
        case = Case(name, counts[-1])
        if args.probe:
            if name == names[0]:
                dma_sizes(reps)
            run_on_engine_loop(probe(case, reps, args.profile))
        if args.sweep:
            run_on_engine_loop(sweep(case, reps, counts[-1]))
        if tables:
            print_line(
                f"{name}: chunk {case.chunk_bytes / 2**20:.1f} MiB, auto path "
                f"{choose_path(case.layout)}"
            )
            rows += run_on_engine_loop(bench_case(case, reps, counts, 30 if args.quick else 60))
        case.close()
        del case
        torch.cuda.empty_cache()
        progress.advance(f"{name} done")
    progress.close()
    if not tables:
        return 0
    if args.json:
        args.json.write_text(json.dumps({"ceilings": ceil, "rows": rows}, indent=1))
    if plt is not None:
        png = args.out / "transfer.png"
        plot(plt, ceil, rows, counts[-1], png)
        print(f"plot: {png}")
    print_table(ceil, rows, counts)
    return 0


def plot(plt: Any, ceil: dict[str, float], rows: list[dict[str, Any]], n: int, path: Path) -> None:
    """Store, retrieve and both at once (``n`` chunks per call) as % of their ceilings."""
    measured = [row for row in rows if "error" not in row]
    bar_chart(
        plt,
        path,
        f"GPU <-> host, {n} chunks of {CHUNK} tokens per call; % of the ceilings measured in the "
        f"same run (D2H {ceil['d2h']:.1f}, H2D {ceil['h2d']:.1f}, both {ceil['both']:.1f} GB/s)",
        [f"{row['case']} {row['path']}" for row in measured],
        {
            label: [None if key not in row else 100 * row[key] / ceil[ceiling] for row in measured]
            for label, key, ceiling in (
                ("store", f"store_{n}", "d2h"),
                ("retrieve", f"retrieve_{n}", "h2d"),
                ("both at once", "both", "both"),
            )
        },
        "% of ceiling",
        reference=(100.0, "ceiling (cudaMemcpy, pinned)"),
    )


def print_table(ceil: dict[str, float], rows: list[dict[str, Any]], counts: list[int]) -> None:
    print()
    print(
        f"ceilings: D2H {ceil['d2h']:.1f} GB/s, H2D {ceil['h2d']:.1f}, both {ceil['both']:.1f}, "
        f"D2D {ceil['d2d']:.0f} (read+write)"
    )
    header = f"{'case':<10} {'path':<14}"
    for n in counts:
        header += f" {'store@' + str(n):>14} {'retr@' + str(n):>14}"
    header += f" {'both@' + str(counts[-1]):>14} {'matmul':>7}"
    print(header)

    def cell(value: float | None, ceiling: float) -> str:
        if value is None:
            return f"{'-':>14}"
        return f"{value:6.1f} ({100 * value / ceiling:3.0f}%)".rjust(14)

    for row in rows:
        line = f"{row['case']:<10} {row['path']:<14}"
        for n in counts:
            line += cell(row.get(f"store_{n}"), ceil["d2h"]) + cell(
                row.get(f"retrieve_{n}"), ceil["h2d"]
            )
        line += cell(row.get("both"), ceil["both"])
        slow = row.get("matmul_slowdown_pct")
        line += f" {slow:6.1f}%" if slow is not None else f" {'-':>7}"
        if "error" in row:
            line += f"  ERROR {row['error'][:60]}"
        print(line)
