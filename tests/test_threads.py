"""`BlockingPool`: bounded threads, cancellation that waits for the thread, close that joins."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tiered_kv.errors import ConfigError, EngineStateError
from tiered_kv.threads import Aborted, BlockingPool, check_abort, default_io_threads


def _pool_threads(name: str) -> list[threading.Thread]:
    """The pool's workers (named ``<pool>-<index>``)."""
    return [t for t in threading.enumerate() if t.name.removeprefix(f"{name}-").isdigit()]


async def test_jobs_run_in_parallel_on_at_most_size_threads() -> None:
    pool = BlockingPool("tkv-test-par", 3)
    barrier = threading.Barrier(3, timeout=10)
    running = 0
    peak = 0
    lock = threading.Lock()

    def job(i: int) -> int:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        if i < 3:
            barrier.wait()  # the first three meet: they run at once
        with lock:
            running -= 1
        return i * i

    results = await asyncio.gather(*(pool.run(lambda i=i: job(i)) for i in range(9)))
    assert results == [i * i for i in range(9)]
    assert peak == 3
    assert pool.stats().threads == 3
    assert await pool.aclose(timeout=10)
    assert _pool_threads("tkv-test-par") == []


async def test_an_error_in_a_job_reaches_its_caller() -> None:
    pool = BlockingPool("tkv-test-err", 1)

    def fail() -> None:
        raise OSError(5, "EIO")

    with pytest.raises(OSError, match="EIO"):
        await pool.run(fail)
    assert await pool.run(lambda: 7) == 7
    await pool.aclose()


async def test_cancelling_a_running_job_aborts_it_and_waits_for_its_thread() -> None:
    pool = BlockingPool("tkv-test-cancel", 1)
    started = threading.Event()
    finished = threading.Event()
    buffer = bytearray(8)

    def job(abort: threading.Event) -> None:
        started.set()
        try:
            while True:
                check_abort(abort)
                buffer[0] = 1  # writes into the caller's buffer until told to stop
                abort.wait(0.001)
        finally:
            finished.set()

    abort = threading.Event()
    task = asyncio.ensure_future(pool.run(lambda: job(abort), abort))
    await asyncio.get_running_loop().run_in_executor(None, started.wait)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # run returned only once the thread let go: the buffer is the caller's again.
    assert finished.is_set() and abort.is_set()
    buffer[0] = 0
    await asyncio.sleep(0.01)
    assert buffer[0] == 0
    await pool.aclose()


async def test_cancelling_a_queued_job_drops_it() -> None:
    pool = BlockingPool("tkv-test-queue", 1)
    gate = threading.Event()
    ran: list[str] = []
    first = asyncio.ensure_future(pool.run(lambda: gate.wait(10)))
    second = asyncio.ensure_future(pool.run(lambda: ran.append("second")))
    await asyncio.sleep(0.01)
    assert pool.stats().queued == 1
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    assert pool.stats().queued == 0
    gate.set()
    assert await first is True
    assert await pool.aclose(timeout=10)
    assert ran == []


async def test_run_all_runs_parts_at_once_and_returns_their_results_in_order() -> None:
    pool = BlockingPool("tkv-test-all", 4)
    barrier = threading.Barrier(4, timeout=10)  # breaks unless four parts run at once
    threads: set[str] = set()

    def part(i: int) -> int:
        threads.add(threading.current_thread().name)
        if i < 4:
            barrier.wait()
        return i * 10

    assert await pool.run_all([lambda i=i: part(i) for i in range(6)]) == [0, 10, 20, 30, 40, 50]
    assert len(threads) == 4
    assert await pool.run_all([]) == []
    await pool.aclose()


async def test_run_all_raises_the_first_error_after_every_started_part_ended() -> None:
    pool = BlockingPool("tkv-test-all-err", 2)
    release = threading.Event()
    ended: list[str] = []
    aborted: list[bool] = []

    def failing() -> None:
        release.wait(10)
        raise OSError(5, "EIO")

    def slow(abort: threading.Event) -> None:
        release.set()
        abort.wait(10)  # the error sets the job's abort event: this part stops early
        aborted.append(abort.is_set())
        ended.append("slow")

    def later(abort: threading.Event) -> None:
        check_abort(abort)  # started after the error: stops at its first check
        ended.append("later")

    abort = threading.Event()
    with pytest.raises(OSError, match="EIO"):
        await pool.run_all([failing, lambda: slow(abort), lambda: later(abort)], abort)
    assert ended == ["slow"] and aborted == [True]
    await pool.aclose()


async def test_cancelling_run_all_drops_queued_parts_and_waits_for_running_ones() -> None:
    pool = BlockingPool("tkv-test-all-cancel", 2)
    started = threading.Barrier(3, timeout=10)
    finished: list[int] = []
    ran: list[int] = []

    def part(i: int, abort: threading.Event) -> None:
        ran.append(i)
        if i < 2:
            started.wait()
            abort.wait(10)
            finished.append(i)

    abort = threading.Event()
    task = asyncio.ensure_future(
        pool.run_all([lambda i=i: part(i, abort) for i in range(5)], abort)
    )
    await asyncio.get_running_loop().run_in_executor(None, started.wait)
    assert pool.stats().queued == 3
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Returned only once both running parts let go; the queued three never run.
    assert sorted(finished) == [0, 1] and abort.is_set()
    assert pool.stats().queued == 0
    assert await pool.run(lambda: 1) == 1
    assert sorted(ran) == [0, 1]
    assert await pool.aclose(timeout=10)


async def test_a_closed_pool_refuses_jobs_and_close_is_idempotent() -> None:
    pool = BlockingPool("tkv-test-closed", 2)
    assert await pool.run(lambda: 1) == 1
    assert await pool.aclose(timeout=10)
    assert await pool.aclose(timeout=10)
    with pytest.raises(EngineStateError, match="closed"):
        await pool.run(lambda: 2)
    with pytest.raises(EngineStateError, match="closed"):
        await pool.run_all([lambda: 2])


def test_sizes_are_checked_and_sized_from_the_machine() -> None:
    assert 4 <= default_io_threads() <= 16
    for bad in (0, -1, True, 2.0, "4"):
        with pytest.raises(ConfigError, match="threads"):
            BlockingPool("tkv-test-bad", bad)  # type: ignore[arg-type]
    with pytest.raises(Aborted):
        aborted = threading.Event()
        aborted.set()
        check_abort(aborted)
