"""Where the time of ``bench/ttft.py``'s slow cases goes (a diagnostic, not a figure).

``PYTHONPATH=. python3 tools/diagnostics/ttft_profile.py [--tokens 32768] [--store-tokens 2048]
[--launch graphs|eager]``

1. The one-token prefill over a resident prefix: a torch.profiler table of its GPU kernels.
2. A fully cached layerwise load from L1 beside the model: per layer, when the model's thread
   got past ``wait_layer``, when the layer could start on the GPU (its load landed and the
   previous layer was done) and when it finished; then, with graphs, host marks only (the
   timing events above cost the model's thread time): retrieve's return, the model's first
   and last waits, the enqueue's end, the logits.
3. A short prefill with and without a layerwise store, alternating, and a profile of the
   store's kernels beside the model's.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import statistics
import sys
import threading
import time
import traceback
from typing import Any

import torch

import bench.ttft as tt
from bench.ttft_model import LLAMA3_8B, PagedKV, build_model
from tiered_kv.sync import new_event_loop


class TimedLoad:
    """A layerwise load whose waits leave timing events on the model's stream."""

    def __init__(self, load: Any, num_layers: int) -> None:
        self.load = load
        self.host = [0.0] * num_layers
        self.ready = [torch.cuda.Event(enable_timing=True) for _ in range(num_layers)]

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        self.load.wait_layer(layer, stream)
        self.host[layer] = time.perf_counter()
        self.ready[layer].record()


def profile_table(fn: Any, rows: int = 18) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows), flush=True)


async def main(args: argparse.Namespace) -> None:
    device = torch.device("cuda")
    opts = tt.Options(lengths=(args.store_tokens, args.tokens), reps=args.reps)
    shape = LLAMA3_8B
    model = build_model(shape, device)
    paged = PagedKV(shape, -(-args.tokens // opts.block_size) + 8, opts.block_size, device)
    runner = tt.ModelRunner(model, paged, device, graphs=args.launch == "graphs")
    n = args.tokens
    requests = tt.make_requests(opts, paged, n, device)
    stored = requests[100]
    prefix = stored.compute_from
    short = tt.make_requests(opts, paged, args.store_tokens, device)[100]
    t = time.perf_counter()
    for request, prefix_tokens in ((stored, 0), (stored, prefix), (short, 0)):
        await runner.prepare(request, prefix_tokens)
    print(f"launch: {args.launch} (prepared in {time.perf_counter() - t:.1f} s)", flush=True)

    def one(prefix_tokens: int, **kw: Any) -> torch.Tensor:
        return tt.prefill(model, paged, stored.device_ids, stored.slots, prefix_tokens, **kw)

    t = time.perf_counter()
    await runner.prefill(stored, 0)
    torch.cuda.synchronize()
    print(f"recompute {n}: {1e3 * (time.perf_counter() - t):.1f} ms (first)", flush=True)

    times = []
    for _ in range(args.reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        await runner.prefill(stored, prefix)
        times.append(time.perf_counter() - t)
    print(f"1-token prefill over {prefix}: {[round(1e3 * x, 1) for x in times[1:]]} ms", flush=True)
    profile_table(lambda: one(prefix), rows=8)
    flat = paged.layers[0].view(2, -1, shape.kv_heads, shape.head_dim)
    for name, gather in (
        ("transposed index_select", lambda: flat[0].transpose(0, 1).index_select(1, stored.slots)),
        ("row index_select", lambda: flat[0].index_select(0, stored.slots)),
    ):
        gather()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            gather()
        torch.cuda.synchronize()
        print(f"  gather K of one layer, {name}: {1e2 * (time.perf_counter() - t):.3f} ms")

    async with tt.open_engine(opts, paged) as engine:
        assert await engine.store(stored.host_ids, stored.block_ids) == n
        for mode in ("whole", "layerwise"):
            totals = []
            for rep in range(args.reps + 1):
                paged.poison(stored.block_ids)
                torch.cuda.synchronize()
                start_ev = torch.cuda.Event(enable_timing=True)
                start_ev.record()
                t0 = time.perf_counter()
                await engine.lookup(stored.host_ids)  # as a request arrives
                t_lookup = time.perf_counter()
                timed = None
                if mode == "layerwise":
                    load = await engine.retrieve_layerwise(stored.host_ids, stored.block_ids)
                    t_ret = time.perf_counter()
                    timed = TimedLoad(load, shape.num_layers)
                    done_ev = [
                        torch.cuda.Event(enable_timing=True) for _ in range(shape.num_layers)
                    ]
                    logits = await runner.prefill(
                        stored,
                        prefix,
                        load=timed,
                        on_layer_written=lambda i, d=done_ev: d[i].record(),
                    )
                    await load.wait()
                else:
                    await engine.retrieve(stored.host_ids, stored.block_ids)
                    t_ret = time.perf_counter()
                    logits = await runner.prefill(stored, prefix)
                total = time.perf_counter() - t0
                totals.append(total)
                assert torch.isfinite(logits).all()
                line = (
                    f"{mode} rep {rep}: TTFT {1e3 * total:.1f} ms, lookup "
                    f"{1e3 * (t_lookup - t0):.1f} ms, retrieve returned {1e3 * (t_ret - t0):.1f} ms"
                )
                print(line, flush=True)
                if timed is not None and rep == args.reps:
                    torch.cuda.synchronize()
                    for i in range(shape.num_layers):
                        print(
                            f"  layer {i:2d}: host past wait {1e3 * (timed.host[i] - t0):6.1f}"
                            f"  gpu ready {start_ev.elapsed_time(timed.ready[i]):6.1f}"
                            f"  kv written {start_ev.elapsed_time(done_ev[i]):6.1f} ms"
                        )
            print(f"{mode}: median {1e3 * statistics.median(totals[1:]):.1f} ms", flush=True)
        if runner.graphs:
            await model_marks(engine, runner, stored, prefix, shape.num_layers, args.reps)
        if args.no_store:
            runner.close()
            return

        plain, saving = [], []
        for rep in range(2 * args.reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            await runner.prefill(short, 0)
            a = time.perf_counter() - t
            saver = await engine.store_layerwise(short.host_ids, short.block_ids)
            torch.cuda.synchronize()
            t = time.perf_counter()
            await runner.prefill(short, 0, on_layer_written=saver.save_layer)
            b = time.perf_counter() - t
            await saver.commit()
            await engine.evict_l1()
            if rep:
                plain.append(a)
                saving.append(b)
        ratio = statistics.median(b / a for a, b in zip(plain, saving, strict=True))
        print(
            f"{args.store_tokens} prefill {1e3 * statistics.median(plain):.1f} ms, with store "
            f"{1e3 * statistics.median(saving):.1f} ms, median ratio {ratio:.4f}",
            flush=True,
        )
        print("plain", [round(1e3 * x, 1) for x in plain])
        print("saving", [round(1e3 * x, 1) for x in saving])
        await store_timeline(engine, runner, short, shape.num_layers)
        saver = await engine.store_layerwise(short.host_ids, short.block_ids)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            await runner.prefill(short, 0, on_layer_written=saver.save_layer)
            await saver.commit()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
    runner.close()


async def model_marks(
    engine: Any, runner: Any, request: Any, prefix: int, num_layers: int, reps: int
) -> None:
    """Host clock marks of a fully cached layerwise load with the graphs' model (no events on
    the model's stream): when retrieve returned, when the model's thread got past the waits of
    layers 0 and ``num_layers - 1``, when the enqueue ended, when the logits reached the host."""
    from bench.ttft_model import logits_to_host
    from tiered_kv.gpu.events import CudaLayerLoad

    graphs = runner._captured[runner._key(request, prefix)]
    marks: dict[str, float] = {}
    end_enqueue = CudaLayerLoad.end_enqueue

    def ended(self: CudaLayerLoad, error: BaseException | None) -> None:
        marks.setdefault("enqueue ended", time.perf_counter())
        end_enqueue(self, error)

    def run(load: Any) -> torch.Tensor:
        with torch.inference_mode():
            graphs.ids.copy_(request.device_ids[graphs.prefix_tokens :].unsqueeze(0))
            graphs.graphs[0].replay()
            for layer in range(num_layers):
                load.wait_layer(layer)
                if layer in (0, num_layers - 1):
                    marks[f"past wait {layer}"] = time.perf_counter()
                graphs.graphs[1 + layer].replay()
            graphs.graphs[-1].replay()
            return logits_to_host(graphs.logits[0, -1])

    CudaLayerLoad.end_enqueue = ended  # type: ignore[method-assign]
    try:
        for rep in range(reps + 1):
            marks.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            await engine.lookup(request.host_ids)
            load = await engine.retrieve_layerwise(request.host_ids, request.block_ids)
            marks["retrieve returned"] = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(runner._executor, run, load)
            marks["logits on the host"] = time.perf_counter()
            await load.wait()
            if rep:
                order = sorted(marks.items(), key=lambda kv: kv[1])
                print("  marks (ms): " + ", ".join(f"{k} {1e3 * (v - t0):.2f}" for k, v in order))
    finally:
        CudaLayerLoad.end_enqueue = end_enqueue  # type: ignore[method-assign]


async def store_timeline(engine: Any, runner: Any, request: Any, num_layers: int) -> None:
    """One prefill with a layerwise store, per layer: when the model's thread called
    ``save_layer``, when the loop queued that layer's copies, when the layer's compute ended on
    the GPU; then when the logits reached the host and the chunks were committed."""
    saver = await engine.store_layerwise(request.host_ids, request.block_ids)
    called = [0.0] * num_layers
    began = [0.0] * num_layers
    queued = [0.0] * num_layers
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_layers)]
    queue = saver._queue

    def timed_queue(layer: int, after: Any) -> None:
        began[layer] = time.perf_counter()
        queue(layer, after)
        queued[layer] = time.perf_counter()

    saver._queue = timed_queue

    def written(layer: int) -> None:
        ends[layer].record()
        saver.save_layer(layer)
        called[layer] = time.perf_counter()

    ticks: list[float] = []

    async def watchdog() -> None:  # the loop's own stalls show as gaps between ticks
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.0005)

    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    dog = asyncio.get_running_loop().create_task(watchdog())
    samples: collections.Counter[str] = collections.Counter()
    sampling = threading.Event()
    loop_thread = threading.get_ident()

    def sample() -> None:  # where the loop's thread is, every 2 ms
        while not sampling.wait(0.002):
            frame = sys._current_frames().get(loop_thread)
            if frame is not None:
                stack = traceback.extract_stack(frame)[-4:]
                samples[" < ".join(f"{f.name}:{f.lineno}" for f in reversed(stack))] += 1

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    await runner.prefill(request, 0, on_layer_written=written)
    t_logits = time.perf_counter()
    sampling.set()
    sampler.join()
    dog.cancel()
    for where, count in samples.most_common(3):
        print(f"  the loop's thread, {count} samples: {where}")
    gaps = sorted(((b - a, a - t0) for a, b in itertools.pairwise(ticks)), reverse=True)[:4]
    print(
        "  the loop's longest stalls (ms, from ms):",
        [(round(1e3 * d, 1), round(1e3 * a, 1)) for d, a in gaps],
    )
    await saver.commit()
    t_commit = time.perf_counter()
    for layer in range(num_layers):
        print(
            f"  layer {layer:2d}: save_layer called {1e3 * (called[layer] - t0):7.2f}  the loop "
            f"from {1e3 * (began[layer] - t0):7.2f} to {1e3 * (queued[layer] - t0):7.2f}  gpu end "
            f"{start.elapsed_time(ends[layer]):7.2f} ms"
        )
    print(
        f"  logits on the host {1e3 * (t_logits - t0):.2f} ms, committed "
        f"{1e3 * (t_commit - t0):.2f} ms",
        flush=True,
    )
    await engine.evict_l1()


async def enqueue_profile(args: argparse.Namespace) -> None:
    """No model: how long the loop thread spends enqueueing a layerwise load and store, and on
    what (cProfile of the loop thread)."""
    import cProfile
    import pstats

    device = torch.device("cuda")
    opts = tt.Options(lengths=(args.store_tokens, args.tokens), reps=args.reps)
    shape = LLAMA3_8B
    paged = PagedKV(shape, -(-args.tokens // opts.block_size) + 8, opts.block_size, device)
    stored = tt.make_requests(opts, paged, args.tokens, device)[100]
    short = tt.make_requests(opts, paged, args.store_tokens, device)[100]
    async with tt.open_engine(opts, paged) as engine:
        assert await engine.store(stored.host_ids, stored.block_ids) == args.tokens
        for rep in range(args.reps + 1):
            prof = cProfile.Profile() if rep == args.reps else None
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            load = await engine.retrieve_layerwise(stored.host_ids, stored.block_ids)
            t1 = time.perf_counter()
            await load.enqueued()
            t2 = time.perf_counter()
            await load.wait()
            t3 = time.perf_counter()
            if prof:
                prof.disable()
            print(
                f"layerwise load {args.tokens}: returned {1e3 * (t1 - t0):.1f} ms, enqueued "
                f"{1e3 * (t2 - t0):.1f} ms, done {1e3 * (t3 - t0):.1f} ms"
                + (" (profiled)" if prof else ""),
                flush=True,
            )
        assert prof is not None
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(22)
        stats.sort_stats("cumulative").print_stats(30)
        stats.print_callers("acquire")
        for rep in range(args.reps + 1):
            prof = cProfile.Profile() if rep == args.reps else None
            saver = await engine.store_layerwise(short.host_ids, short.block_ids)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            for layer in range(shape.num_layers):
                saver.save_layer(layer)
            t1 = time.perf_counter()
            await saver.commit()
            t2 = time.perf_counter()
            if prof:
                prof.disable()
            await engine.evict_l1()
            print(
                f"layerwise store {args.store_tokens}: 32 save_layer calls {1e3 * (t1 - t0):.2f}"
                f" ms, committed {1e3 * (t2 - t0):.1f} ms" + (" (profiled)" if prof else ""),
                flush=True,
            )
        assert prof is not None
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--store-tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--enqueue", action="store_true", help="no model: the enqueue's cost")
    parser.add_argument("--launch", choices=("graphs", "eager"), default="graphs")
    parser.add_argument("--no-store", action="store_true", help="loads only")
    parser.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval")
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(enqueue_profile(args) if args.enqueue else main(args))
