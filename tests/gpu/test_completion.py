"""`TransferClock` and `CompletionWaiter` on the CPU, with events that complete at set times
(the GPU tests use real CUDA events through `CudaMover`)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tiered_kv.gpu.completion import (
    EARLY_FRACTION,
    POLL_MAX_S,
    PREWAKE_LEAD_S,
    PREWAKE_S,
    CompletionWaiter,
    TransferClock,
)


class TimedEvent:
    """Completes at ``at`` (perf_counter seconds); records when it was queried."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.queries: list[float] = []

    def query(self) -> bool:
        now = time.perf_counter()
        self.queries.append(now)
        return now >= self.at


def test_clock_queues_calls_behind_each_other() -> None:
    clock = TransferClock(initial_rate=1e9)
    assert clock.schedule(10**9, now=100.0) == pytest.approx((100.0, 1.0))
    # Queued at 100.5 behind the first call: starts when that one is predicted to end.
    assert clock.schedule(5 * 10**8, now=100.5) == pytest.approx((101.0, 0.5))
    # Queued after everything predicted has ended: starts now.
    assert clock.schedule(10**9, now=200.0) == pytest.approx((200.0, 1.0))


def test_clock_learns_the_fastest_rate_seen() -> None:
    clock = TransferClock(initial_rate=100e9, decay=0.5)
    clock.observe(10**9, 0.0)  # no timing: ignored, the initial guess stays
    assert clock.rate == pytest.approx(100e9)
    clock.observe(40 * 10**9, 1.0)  # the first observation replaces the guess
    assert clock.rate == pytest.approx(40e9)
    clock.observe(60 * 10**9, 1.0)  # faster: taken at once
    assert clock.rate == pytest.approx(60e9)
    clock.observe(10 * 10**9, 1.0)  # slower: the estimate only decays
    assert clock.rate == pytest.approx(30e9)
    with pytest.raises(ValueError, match="rate"):
        TransferClock(initial_rate=0)
    with pytest.raises(ValueError, match="decay"):
        TransferClock(decay=1.5)


async def test_waiter_polls_near_the_predicted_end_and_delivers_on_the_loop_thread() -> None:
    loop = asyncio.get_running_loop()
    waiter = CompletionWaiter()
    try:
        now = time.perf_counter()
        event = TimedEvent(now + 0.050)
        done: asyncio.Future[tuple[float, int]] = loop.create_future()
        waiter.submit(
            event, now, 0.040, loop, lambda seen, _: done.set_result((seen, threading.get_ident()))
        )
        seen, thread = await asyncio.wait_for(done, 5)
        assert thread == threading.get_ident()  # the callback ran on the loop's thread
        assert seen >= event.at
        assert min(event.queries) >= now + EARLY_FRACTION * 0.040  # slept until then
        assert waiter.polls == len(event.queries)
        # The loop was poked from PREWAKE_LEAD_S before the predicted end until the event was
        # seen: about (10 ms + lead) / PREWAKE_S pokes, and none long before.
        assert 3 <= waiter.pokes <= (0.010 + PREWAKE_LEAD_S) / PREWAKE_S + 5
        assert waiter.pending == 0
    finally:
        waiter.close()


async def test_waiter_serves_several_calls_each_on_its_own_schedule() -> None:
    loop = asyncio.get_running_loop()
    waiter = CompletionWaiter()
    try:
        now = time.perf_counter()
        slow, fast = TimedEvent(now + 0.060), TimedEvent(now + 0.010)
        order: list[str] = []
        finished = asyncio.Event()

        def on_done(name: str) -> None:
            order.append(name)
            if len(order) == 2:
                finished.set()

        waiter.submit(slow, now, 0.060, loop, lambda *_: on_done("slow"))
        waiter.submit(fast, now, 0.010, loop, lambda *_: on_done("fast"))
        await asyncio.wait_for(finished.wait(), 5)
        assert order == ["fast", "slow"]
        # The fast call's polling did not poll the slow one.
        assert min(slow.queries) >= now + EARLY_FRACTION * 0.060
    finally:
        waiter.close()


async def test_waiter_backs_off_on_calls_far_behind_their_prediction() -> None:
    """A call stuck behind a busy caller stream: polls thin out to POLL_MAX_S apart."""
    loop = asyncio.get_running_loop()
    waiter = CompletionWaiter()
    try:
        now = time.perf_counter()
        event = TimedEvent(now + 0.300)
        done: asyncio.Future[float] = loop.create_future()
        waiter.submit(event, now, 0.001, loop, lambda seen, _: done.set_result(seen))
        await asyncio.wait_for(done, 5)
        # At POLL_S (20 µs) throughout it would take ~15,000 polls; late ones are >= 0.5 ms.
        assert len(event.queries) < 0.300 / POLL_MAX_S + 200
        gaps = [b - a for a, b in zip(event.queries, event.queries[1:], strict=False)]
        assert max(gaps) >= POLL_MAX_S * 0.9
        # Pokes stopped once the call was found late (~2.5 ms in), not 300 ms of them.
        assert waiter.pokes < 0.010 / PREWAKE_S
    finally:
        waiter.close()


def test_closed_loop_gets_its_callback_run_by_the_waiter() -> None:
    """If the loop is gone, references must still be released: the waiter runs the callback."""
    loop = asyncio.new_event_loop()
    loop.close()
    waiter = CompletionWaiter()
    ran = threading.Event()
    threads: list[int] = []

    def callback(seen: float, error: BaseException | None) -> None:
        threads.append(threading.get_ident())
        ran.set()

    waiter.submit(TimedEvent(0.0), 0.0, 0.0, loop, callback)
    assert ran.wait(5)
    assert threads != [threading.get_ident()]
    waiter.close()


def test_close_waits_for_pending_calls_and_refuses_new_ones() -> None:
    loop = asyncio.new_event_loop()
    waiter = CompletionWaiter()
    try:
        results: list[float] = []
        event = TimedEvent(time.perf_counter() + 0.02)
        waiter.submit(event, 0.0, 0.02, loop, lambda seen, _: results.append(seen))
        waiter.close()  # returns once the pending event completed and was handed to the loop
        assert waiter.pending == 0
        loop.run_until_complete(asyncio.sleep(0))
        assert len(results) == 1 and results[0] >= event.at
        with pytest.raises(RuntimeError, match="closed"):
            waiter.submit(event, 0.0, 0.0, loop, lambda seen, _: results.append(seen))
    finally:
        loop.close()


class FaultyEvent:
    """Fault injection: polling raises, as a CUDA event query does after a GPU fault."""

    def query(self) -> bool:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


async def test_a_failing_poll_reaches_its_callback_and_the_waiter_keeps_serving() -> None:
    loop = asyncio.get_running_loop()
    waiter = CompletionWaiter()
    try:
        now = time.perf_counter()
        failed: asyncio.Future[BaseException | None] = loop.create_future()
        fine: asyncio.Future[BaseException | None] = loop.create_future()
        waiter.submit(FaultyEvent(), now, 0.0, loop, lambda _, e: failed.set_result(e))
        waiter.submit(TimedEvent(now + 0.01), now, 0.01, loop, lambda _, e: fine.set_result(e))
        error = await asyncio.wait_for(failed, 5)
        assert isinstance(error, RuntimeError) and "illegal memory access" in str(error)
        assert await asyncio.wait_for(fine, 5) is None
    finally:
        waiter.close()
