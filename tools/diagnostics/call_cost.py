"""What does each host-side step of a small `CudaMover` call cost? (CUDA)

Times, on the loop thread of a warm process, the primitives one call is made of (torch and
cuda-bindings event records and waits, launches, copies, a future's round trip) and a whole
awaited one-chunk store and retrieve per case, split by the mover's trace, with the caller
watching its call's end on the loop (the default) and with the waiter thread's sighting alone.
Prints one line per primitive: median microseconds per call over many repetitions.

    PYTHONPATH=. python3 tools/diagnostics/call_cost.py [--cases int8_132,mla]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable

import torch


def per_call_us(fn: Callable[[], object], reps: int = 2000) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - start) / reps * 1e6)
    return statistics.median(samples)


def primitives() -> None:
    from cuda.bindings import driver

    torch.cuda.init()
    stream = torch.cuda.Stream()
    cu_stream = driver.CUstream(stream.cuda_stream)
    event = torch.cuda.Event()
    timed = torch.cuda.Event(enable_timing=True)
    cu_event = driver.CUevent(event.cuda_event)
    dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    rows = {
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "torch Event.record(stream)": lambda: event.record(stream),
        "torch timed Event.record(stream)": lambda: timed.record(stream),
        "torch stream.wait_event(event)": lambda: stream.wait_event(event),
        "torch event.query()": lambda: event.query(),
        "driver.CUstream(int)": lambda: driver.CUstream(stream.cuda_stream),
        "cuEventRecord (cached handles)": lambda: driver.cuEventRecord(cu_event, cu_stream),
        "cuStreamWaitEvent (cached)": lambda: driver.cuStreamWaitEvent(cu_stream, cu_event, 0),
        "cuEventQuery (cached)": lambda: driver.cuEventQuery(cu_event),
        "cuMemcpyAsync 4 KiB D2H": lambda: driver.cuMemcpyAsync(
            host.data_ptr(), dev.data_ptr(), 4096, cu_stream
        ),
        "cuMemcpyHtoDAsync 4 KiB": lambda: driver.cuMemcpyHtoDAsync(
            dev.data_ptr(), host.data_ptr(), 4096, cu_stream
        ),
        "CUDA_MEMCPY2D() construct": lambda: driver.CUDA_MEMCPY2D(),
        "cuCtxGetCurrent": lambda: driver.cuCtxGetCurrent(),
    }
    params = driver.CUDA_MEMCPY2D()
    params.srcMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    params.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_HOST
    params.srcDevice = dev.data_ptr()
    params.dstHost = host.data_ptr()
    params.srcPitch = params.dstPitch = 8192
    params.WidthInBytes = 4096
    params.Height = 4

    def set_and_copy_2d() -> None:
        params.srcDevice = dev.data_ptr()
        params.dstHost = host.data_ptr()
        driver.cuMemcpy2DAsync(params, cu_stream)

    rows["cuMemcpy2DAsync (reused struct, 2 fields set)"] = set_and_copy_2d
    for name, fn in rows.items():
        print(f"{name:48s} {per_call_us(fn):7.2f} us", flush=True)
    stream.synchronize()

    async def futures() -> None:
        loop = asyncio.get_running_loop()

        async def round_trip() -> None:
            fut = loop.create_future()
            fut.set_result(None)
            await fut

        for _ in range(50):
            await round_trip()
        start = time.perf_counter()
        for _ in range(5000):
            await round_trip()
        print(
            f"{'future create+set+await (done)':48s} "
            f"{(time.perf_counter() - start) / 5000 * 1e6:7.2f} us"
        )

    asyncio.run(futures())


def whole_calls(
    cases: list[str],
    reps: int,
    paths: tuple[str, ...] = ("staging", "mapped"),
    modes: tuple[bool, ...] = (False, True),
) -> None:
    from tiered_kv.benchmarks.common import run_on_engine_loop
    from tiered_kv.benchmarks.transfer import Case
    from tiered_kv.gpu.mover import CudaMover, MoverOptions

    async def run(case: Case, path: str, watch: bool) -> None:
        mover = CudaMover(MoverOptions(path=path))
        if not watch:  # the waiter thread's sighting alone ends each wait
            mover._calls.wait = lambda call: call.result  # type: ignore[method-assign]
        mover.trace = []
        for label, fn in (
            (
                "store",
                lambda: mover.gather(case.layout, case.blocks_a, case.transfers(case.objs_a, 1)),
            ),
            (
                "retrieve",
                lambda: mover.scatter(case.layout, case.blocks_b, case.transfers(case.objs_b, 1)),
            ),
        ):
            for _ in range(5):
                await fn()
            mover.trace.clear()
            walls = []
            for _ in range(reps):
                start = time.perf_counter()
                await fn()
                walls.append(time.perf_counter() - start)
            med = {
                k: 1e6 * statistics.median(t[k] for t in mover.trace)
                for k in mover.trace[0]
                if k.endswith("_s")
            }
            wall = statistics.median(walls)
            print(
                f"{case.name} {path} {'watch' if watch else 'waiter'} {label}@1 "
                f"{case.chunk_bytes / wall / 1e9:5.1f} GB/s wall "
                f"{1e6 * wall:6.0f} us: " + ", ".join(f"{k[:-2]} {v:.0f}" for k, v in med.items()),
                flush=True,
            )
        await mover.aclose()

    for name in cases:
        case = Case(name, 1)
        for path in paths:
            for _ in range(2):  # alternating, so drift shows
                for watch in modes:
                    run_on_engine_loop(run(case, path, watch))
        case.close()


def profile(case_name: str, calls: int) -> None:
    """cProfile of ``calls`` one-chunk staging stores and retrieves: own time per call, in µs."""
    import cProfile
    import pstats

    from tiered_kv.benchmarks.common import run_on_engine_loop
    from tiered_kv.benchmarks.transfer import Case
    from tiered_kv.gpu.mover import CudaMover, MoverOptions

    case = Case(case_name, 1)

    async def run() -> None:
        mover = CudaMover(MoverOptions(path="staging"))
        for direction in ("gather", "scatter"):
            blocks, objs = (
                (case.blocks_a, case.objs_a)
                if direction == "gather"
                else (case.blocks_b, case.objs_b)
            )
            move = getattr(mover, direction)
            for _ in range(20):
                await move(case.layout, blocks, case.transfers(objs, 1))
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(calls):
                await move(case.layout, blocks, case.transfers(objs, 1))
            profiler.disable()
            stats = pstats.Stats(profiler)
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:30]  # type: ignore[attr-defined]
            print(f"profile {case_name} {direction}@1: own µs per call (cProfile inflates them)")
            for (file, line, name), (_, ncalls, tottime, cumtime, _) in rows:
                where = f"{file.rsplit('/', 1)[-1]}:{line}({name})"
                print(
                    f"  {1e6 * tottime / calls:7.2f} own {1e6 * cumtime / calls:7.2f} cum "
                    f"{ncalls / calls:5.1f}x  {where}"
                )
        await mover.aclose()

    run_on_engine_loop(run())
    case.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="int8_132,mla,llama_nhd")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--paths", default="staging,mapped")
    parser.add_argument("--watch-only", action="store_true", help="skip the waiter-alone rows")
    parser.add_argument("--no-primitives", action="store_true")
    parser.add_argument("--profile", help="only cProfile one-chunk staging calls of this case")
    args = parser.parse_args()
    if args.profile:
        profile(args.profile, 500)
        return
    if not args.no_primitives:
        primitives()
    modes = (True,) if args.watch_only else (False, True)
    whole_calls(args.cases.split(","), args.reps, tuple(args.paths.split(",")), modes)


if __name__ == "__main__":
    main()
