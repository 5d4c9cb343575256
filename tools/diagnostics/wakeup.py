"""How fast can another thread wake an idle asyncio loop? (What `CompletionWaiter` pays per call.)

Run anywhere: ``PYTHONPATH=. python3 tools/diagnostics/wakeup.py``. For each way of waking, a
loop sleeps in its selector for 20 ms while a thread (or a timer) fires; the figure is the
median delay from the firing (the thread's call, or the timer's deadline) to the awaiting
coroutine running.

- ``thread``: a thread sleeps until T, then ``call_soon_threadsafe`` (what the mover does).
- ``thread+prewake``: the same, but the thread also pokes the loop with a no-op every
  ``--prewake-us`` during the last millisecond before T (keeps the loop's CPU from sleeping
  deeply).
- ``timerfd``: the loop waits on a Linux timerfd armed for T (no second thread at all).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tiered_kv.benchmarks.progress import Progress
from tiered_kv.sync import new_event_loop

IDLE_S = 0.020


def _sleep_until(t: float) -> None:
    while True:
        left = t - time.perf_counter()
        if left <= 0:
            return
        time.sleep(min(left, 50e-6) if left < 1e-3 else left - 1e-3)


async def via_thread(prewake_s: float) -> float:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[float] = loop.create_future()
    target = time.perf_counter() + IDLE_S

    def fire() -> None:
        if prewake_s > 0:
            t = target - 1e-3
            while t < target:
                _sleep_until(t)
                loop.call_soon_threadsafe(lambda: None)
                t += prewake_s
        _sleep_until(target)
        loop.call_soon_threadsafe(fut.set_result, time.perf_counter())

    threading.Thread(target=fire, daemon=True).start()
    fired = await fut
    return time.perf_counter() - fired


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


async def via_timerfd(fd: int) -> float:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    target = time.perf_counter() + IDLE_S
    mono = time.clock_gettime(time.CLOCK_MONOTONIC) + IDLE_S
    spec = _Itimerspec()
    spec.it_value.tv_sec = int(mono)
    spec.it_value.tv_nsec = int((mono % 1) * 1e9)
    if _libc.timerfd_settime(fd, 1, ctypes.byref(spec), None) != 0:  # TFD_TIMER_ABSTIME
        raise OSError(ctypes.get_errno(), "timerfd_settime")

    def ready() -> None:
        os.read(fd, 8)
        loop.remove_reader(fd)
        fut.set_result(None)

    loop.add_reader(fd, ready)
    await fut
    return time.perf_counter() - target


def workload() -> float:
    """A fixed bit of interpreter work (about what enqueueing a call costs); its seconds."""
    start = time.perf_counter()
    items = [object() for _ in range(64)]
    total = 0
    for _ in range(20):
        total += sum(id(x) & 1 for x in items)
    return time.perf_counter() - start


async def main(rounds: int, prewake_us: float) -> None:
    results: dict[str, list[float]] = {"thread": [], "thread+prewake": [], "timerfd": []}
    work: dict[str, list[float]] = {"warm": [], "after thread+prewake wake": []}
    fd = _libc.timerfd_create(time.CLOCK_MONOTONIC, 0)
    progress = Progress(rounds, "wakeup")
    for _ in range(rounds):
        results["thread"].append(await via_thread(0.0))
        results["thread+prewake"].append(await via_thread(prewake_us * 1e-6))
        work["after thread+prewake wake"].append(workload())
        workload()
        work["warm"].append(workload())
        if fd >= 0:
            results["timerfd"].append(await via_timerfd(fd))
        progress.advance()
    for name, values in work.items():
        print(f"workload {name:<26} median {1e6 * statistics.median(values):6.0f} us", flush=True)
    for name, values in results.items():
        if values:
            values.sort()
            print(
                f"wakeup {name:<15} median {1e6 * statistics.median(values):6.0f} us, "
                f"p90 {1e6 * values[int(0.9 * len(values))]:6.0f} us",
                flush=True,
            )
    if fd >= 0:
        os.close(fd)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--prewake-us", type=float, default=100.0)
    args = parser.parse_args()
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main(args.rounds, args.prewake_us))
