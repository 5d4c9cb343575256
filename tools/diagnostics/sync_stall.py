"""Does a synchronous device-to-host copy on one thread stall another thread's CUDA calls?

``PYTHONPATH=. python3 tools/diagnostics/sync_stall.py`` (a CUDA machine). One thread keeps
recording an event and waiting on another on its own stream (what the engine's loop thread does
when it enqueues copies); the main thread queues about half a second of GEMMs and then waits for
them in four ways. Prints, per way, the side thread's slowest call: with a plain ``.cpu()`` (a
copy to pageable memory) the driver holds the side thread's calls until the GEMMs are done.
"""

from __future__ import annotations

import threading
import time

import torch


def main() -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    gate = torch.cuda.Event()  # type: ignore[no-untyped-call]
    small = torch.ones(16, device="cuda")
    pinned = torch.empty(16, pin_memory=True)

    def long_queue() -> None:
        for _ in range(400):
            a @ a

    def side_calls(calls: list[tuple[float, float]], stop: threading.Event) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            torch.cuda.Event().record(side)  # type: ignore[no-untyped-call]
            side.wait_event(gate)
            calls.append((start, time.perf_counter() - start))
            time.sleep(0.0005)

    def pageable() -> None:
        small.cpu()

    def event_first() -> None:
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        done.synchronize()
        small.cpu()

    def pinned_copy() -> None:
        pinned.copy_(small, non_blocking=True)
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record()
        done.synchronize()

    def stream_first() -> None:
        torch.cuda.current_stream().synchronize()
        small.cpu()

    long_queue()
    torch.cuda.synchronize()
    for name, wait in (
        ("pageable .cpu()", pageable),
        ("event.synchronize() then .cpu()", event_first),
        ("pinned non_blocking copy + event", pinned_copy),
        ("stream.synchronize() then .cpu()", stream_first),
    ):
        torch.cuda.synchronize()
        calls: list[tuple[float, float]] = []
        stop = threading.Event()
        thread = threading.Thread(target=side_calls, args=(calls, stop))
        thread.start()
        time.sleep(0.02)
        t0 = time.perf_counter()
        long_queue()
        gate.record()
        t1 = time.perf_counter()
        wait()
        t2 = time.perf_counter()
        stop.set()
        thread.join()
        at, slowest = max(calls, key=lambda call: call[1])
        print(
            f"{name}: queued {1e3 * (t1 - t0):.1f} ms, waited {1e3 * (t2 - t1):.1f} ms; the "
            f"side thread's slowest record + wait {1e3 * slowest:.1f} ms (at {1e3 * (at - t0):.1f}"
            f" ms), {len(calls)} calls"
        )


if __name__ == "__main__":
    main()
