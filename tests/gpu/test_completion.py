"""`TransferClock` and `CompletionWaiter` on the CPU, with events that complete at set times
(the GPU tests use real CUDA events through `CudaMover`)."""

from __future__ import annotations

import asyncio
import threading
import time
import types
from typing import Any

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
    """Completes at ``at`` (perf_counter seconds); records when, and on which thread, it was
    queried."""

    def __init__(self, at: float) -> None:
        self.at = at
        self.queries: list[float] = []
        self.threads: list[int] = []

    def query(self) -> bool:
        now = time.perf_counter()
        self.queries.append(now)
        self.threads.append(threading.get_ident())
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


async def test_waiter_posts_the_early_callback_once_and_a_withdrawn_call_is_never_delivered() -> (
    None
):
    loop = asyncio.get_running_loop()
    waiter = CompletionWaiter()
    try:
        now = time.perf_counter()
        event = TimedEvent(now + 0.030)
        early: asyncio.Future[tuple[float, int]] = loop.create_future()
        delivered: list[float] = []
        handle = waiter.submit(
            event,
            now,
            0.030,
            loop,
            lambda seen, _: delivered.append(seen),
            early=lambda: early.set_result((time.perf_counter(), threading.get_ident())),
            early_at=now + 0.010,
        )
        at, thread = await asyncio.wait_for(early, 5)
        assert thread == threading.get_ident()  # on the loop's thread
        assert now + 0.010 <= at < event.at  # at its time, before the event completed
        assert not event.queries or min(event.queries) >= now + EARLY_FRACTION * 0.030
        assert waiter.withdraw(handle)  # the submitter saw the event itself
        assert not waiter.withdraw(handle)  # already gone
        assert waiter.pending == 0
        await asyncio.sleep(0.050)  # past the event's completion
        assert delivered == []  # a withdrawn call is not delivered
        assert waiter.pokes == 0  # the early callback woke the loop: no pokes besides
    finally:
        waiter.close()


class _Clock:
    def __init__(self) -> None:
        self.observed: list[tuple[int, float]] = []

    def observe(self, nbytes: int, seconds: float) -> None:
        self.observed.append((nbytes, seconds))


class _Buffers:
    """A call's begun and done events, completing at set times."""

    def __init__(self, begun_at: float, done_at: float) -> None:
        self.begun, self.done = TimedEvent(begun_at), TimedEvent(done_at)
        self.begun.elapsed_time = lambda end: 1e3 * (end.at - self.begun.at)  # type: ignore[attr-defined]


def _tracked_call(begun_at: float, done_at: float) -> Any:
    from tiered_kv.gpu.calls import Call

    loop = asyncio.get_running_loop()
    state = types.SimpleNamespace(buffers=[])
    side = types.SimpleNamespace(clock=_Clock())
    return Call(
        direction="scatter",
        state=state,  # type: ignore[arg-type]
        side=side,  # type: ignore[arg-type]
        buffers=_Buffers(begun_at, done_at),  # type: ignore[arg-type]
        held=[],
        nbytes=1 << 20,
        result=loop.create_future(),
        path="staging",
        start=time.perf_counter(),
    )


async def test_a_caller_sees_its_call_end_on_the_loop_without_the_waiter_threads_sighting() -> None:
    from tiered_kv.gpu.calls import SPIN_GRACE_S, CallTracker

    tracker = CallTracker()
    try:
        now = time.perf_counter()
        call = _tracked_call(now, now + 0.020)
        tracker.submit(call, now, 0.020, asyncio.get_running_loop(), awaited=True)
        seen = await asyncio.wait_for(tracker.wait(call), 5)
        assert call.buffers.done.at <= seen < call.buffers.done.at + SPIN_GRACE_S + 0.005
        assert call.finished and call.result.result() == seen
        assert tracker.waiter.pending == 0  # withdrawn: the thread does not see it again
        assert call.side.clock.observed == [(1 << 20, pytest.approx(0.020))]
        assert call.state.buffers == [call.buffers]  # released once
        assert tracker.counters["scatter_staging_calls"] == 1
        await asyncio.sleep(0.010)
        assert tracker.counters["scatter_staging_calls"] == 1  # and finished once
    finally:
        await tracker.drain()
        tracker.close()


async def test_a_call_not_begun_or_far_behind_its_prediction_is_left_to_the_waiter() -> None:
    """The caller watches only a call the GPU has begun, and only until the grace after its
    predicted end; beyond that the waiter thread's sighting ends the wait (no loop spinning
    for the length of someone else's work)."""
    from tiered_kv.gpu.calls import SPIN_GRACE_S, CallTracker

    tracker = CallTracker()
    try:
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        behind = _tracked_call(now + 0.050, now + 0.060)  # waits on the caller's stream
        slow = _tracked_call(now, now + 0.060)  # begun, but far slower than predicted
        tracker.submit(behind, now, 0.005, loop, awaited=True)
        tracker.submit(slow, now, 0.005, loop, awaited=True)
        seen = await asyncio.wait_for(asyncio.gather(tracker.wait(behind), tracker.wait(slow)), 5)
        for call, at in zip((behind, slow), seen, strict=True):
            assert at >= call.buffers.done.at
            assert call.finished
        loop_thread = threading.get_ident()

        def on_loop(event: TimedEvent) -> list[float]:
            return [
                q for q, t in zip(event.queries, event.threads, strict=True) if t == loop_thread
            ]

        assert on_loop(behind.buffers.done) == []  # not begun: never watched on the loop
        # Begun: watched on the loop until the grace past its predicted end, not until its end
        # (the bound leaves 40 ms for a slow machine; watching to the end would reach 60).
        assert on_loop(slow.buffers.done)
        assert max(on_loop(slow.buffers.done)) < now + 0.005 + SPIN_GRACE_S + 0.040
    finally:
        await tracker.drain()
        tracker.close()


async def test_a_short_awaited_call_is_watched_by_its_caller_alone_unless_it_is_handed_over() -> (
    None
):
    """A call predicted to end within `SPIN_LEAD_S` never reaches the waiter thread when its
    caller sees it end; one that outlasts the caller's watch, or whose caller leaves without
    waiting (cancelled), is handed over and still finished once."""
    from tiered_kv.gpu.calls import SPIN_LEAD_S, CallTracker

    tracker = CallTracker()
    try:
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        quick = _tracked_call(now, now + 50e-6)
        tracker.submit(quick, now, 50e-6, loop, awaited=True)
        assert tracker.waiter.pending == 0  # deferred: no submission, no thread woken
        seen = await asyncio.wait_for(tracker.wait(quick), 5)
        assert seen >= quick.buffers.done.at and quick.finished
        assert tracker.waiter.polls == 0 and tracker.waiter.pending == 0

        now = time.perf_counter()
        late = _tracked_call(now, now + 0.030)  # predicted 50 µs: the watch gives up
        tracker.submit(late, now, 50e-6, loop, awaited=True)
        seen = await asyncio.wait_for(tracker.wait(late), 5)
        assert seen >= late.buffers.done.at and late.finished
        assert tracker.waiter.polls > 0  # the thread saw it end

        now = time.perf_counter()
        left = _tracked_call(now, now + 0.010)
        tracker.submit(left, now, SPIN_LEAD_S / 2, loop, awaited=True)
        tracker.hand_over(left)  # the caller was cancelled before waiting
        assert tracker.waiter.pending == 1
        await asyncio.wait_for(tracker.drain(), 5)
        assert left.finished and left.result.result() >= left.buffers.done.at
        assert tracker.counters["scatter_staging_calls"] == 3
    finally:
        await tracker.drain()
        tracker.close()
