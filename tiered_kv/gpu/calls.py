"""One `CudaMover` call from enqueue to release, and the tracker that finishes it on the loop.

Owns `Call` (a gather or scatter: the references to its objects, its pooled `CallBuffers`, its
order after the caller) and `CallTracker` (the calls on the GPU, the `CompletionWaiter` thread
that sees each end, the per-call counters). A call releases its references and buffers only
once the GPU is done with them (`CallTracker` on completion, or its enqueuer after a
synchronize when enqueueing failed), whatever happens to its caller. Enqueues no copies
(launch.py, dma.py and staging.py do). Calls are made, submitted and finished on the loop
thread; a layerwise load's call is also enqueued on the model's thread (layerwise.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import torch

from tiered_kv.errors import TieredKVError
from tiered_kv.gpu.base import ChunkTransfer
from tiered_kv.gpu.completion import CompletionWaiter
from tiered_kv.gpu.device import DeviceState
from tiered_kv.gpu.events import CallBuffers, CudaLayerLoad
from tiered_kv.gpu.plan import PATHS, CallDirection, MoverPath
from tiered_kv.gpu.staging import Direction
from tiered_kv.memory import MemoryObj

# A caller awaiting its call (`CallTracker.wait`) is woken this long before the call's predicted
# end (a call predicted to end sooner is never handed to the waiter thread), then watches the
# call's last event on the loop thread alone until this long after that end at most
# (`SPIN_GRACE_S`); past the grace the waiter thread takes the call back.
SPIN_LEAD_S = 100e-6
SPIN_GRACE_S = 100e-6


@dataclasses.dataclass(eq=False, slots=True)
class Call:
    """One gather or scatter from enqueue to release."""

    direction: CallDirection
    state: DeviceState
    side: Direction
    buffers: CallBuffers
    held: list[MemoryObj]
    nbytes: int
    result: asyncio.Future[float]
    path: MoverPath
    start: float
    trace: dict[str, Any] | None = None
    layers: tuple[int, ...] | None = None  # model layers moved (None: all, chunk-major)
    after: Any = None  # event the paged-cache side waits for, instead of the caller's stream
    load: CudaLayerLoad | None = None  # a layerwise scatter's, with its per-layer events
    learn: bool = True  # teach the clock this call's rate (not for gathers with gaps)
    predicted_end: float = 0.0  # perf_counter seconds, set when submitted
    finished: bool = False  # `CallTracker._finish` has run (it runs once)
    watch: object = None  # the waiter's handle of the submission (None: not with the waiter)
    # (predicted start, seconds, loop), kept for `CallTracker.hand_over`.
    prediction: tuple[float, float, asyncio.AbstractEventLoop] | None = None
    near: asyncio.Future[None] | None = None  # resolves shortly before the predicted end

    def open(self, caller: torch.cuda.Stream, to_host: bool) -> None:
        """Order the call after the caller's queued work and record its ``begun`` event."""
        side, buffers, path = self.side, self.buffers, self.path
        ready = self.after
        if ready is None:
            ready = buffers.ready
            ready.record(caller)
        # Whatever first touches the paged cache waits for the caller's queued work (or the
        # producer's event): the kernels, or the copies on the DMA-only path. (Staging DMAs are
        # ordered through the slot events.)
        first = side.dma_stream if path == "dma" else side.kernel_stream
        first.wait_event(ready)
        # `begun` precedes all of the call's GPU work (a staging scatter starts with DMAs that
        # need not wait for the caller), so the clock never learns a rate faster than the link.
        opening = side.dma_stream if path == "staging" and not to_host else first
        buffers.begun.record(opening)

    def layer_steps(self) -> list[tuple[int, ...] | None]:
        """How the mapped and DMA paths enqueue the call: whole (None), one step of all its
        layers, or one step per layer when a layerwise load needs an event after each."""
        if self.load is not None and self.layers is not None:
            return [(layer,) for layer in self.layers]
        return [self.layers]

    def record_layers(self, layers: tuple[int, ...] | None, stream: torch.cuda.Stream) -> None:
        """A layerwise load's step of ``layers`` is queued on ``stream``: record their events."""
        if self.load is not None and layers is not None:
            for layer in layers:
                self.load.record_layer(layer, stream)

    def release(self) -> None:
        """Drop the references and return the buffers (only once the GPU is done with them)."""
        for obj in self.held:
            obj.unref()
        self.held = []
        self.state.buffers.append(self.buffers)


def hold(transfers: Sequence[ChunkTransfer]) -> list[MemoryObj]:
    """A reference to every transfer's object; none if one of them is already freed."""
    held: list[MemoryObj] = []
    try:
        for transfer in transfers:
            held.append(transfer.obj.ref())
    except BaseException:
        for obj in held:
            obj.unref()
        raise
    return held


def new_call(
    state: DeviceState,
    side: Direction,
    direction: CallDirection,
    held: list[MemoryObj],
    path: MoverPath,
    *,
    nbytes: int = 0,
    start: float | None = None,
    **fields: Any,
) -> Call:
    """A call on ``side`` holding ``held`` and the pool's next buffers. The references come in
    taken (`hold`) before the buffers are: a freed object fails the call before it costs the
    pool a buffer set."""
    return Call(
        direction=direction,
        state=state,
        side=side,
        buffers=state.take_buffers(),
        held=held,
        nbytes=nbytes,
        result=asyncio.get_running_loop().create_future(),
        path=path,
        start=time.perf_counter() if start is None else start,
        **fields,
    )


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def retrieved(result: asyncio.Future[float]) -> None:
    """A layerwise load's result may never be awaited: mark its exception as seen."""
    if not result.cancelled():
        result.exception()


class CallTracker:
    """The calls of one mover on the GPU: each is handed to the completion waiter and finished
    on its loop (learn the rate, count, release, resolve); `drain` waits for all of them."""

    def __init__(self) -> None:
        # Completion is seen by this thread (sleep, then poll near the predicted end).
        self.waiter = CompletionWaiter()
        self.counters: dict[str, int | float] = {
            f"{direction}_{path}_{what}": 0
            for direction in ("gather", "scatter")
            for path in PATHS
            for what in ("bytes", "calls")
        }
        self.counters.update(
            bytes_gathered=0, bytes_scattered=0, gather_seconds=0.0, scatter_seconds=0.0
        )
        self._inflight: set[Call] = set()
        self._idle: asyncio.Future[None] | None = None

    def submit(
        self,
        call: Call,
        predicted_start: float,
        predicted: float,
        loop: asyncio.AbstractEventLoop,
        *,
        awaited: bool = False,
    ) -> None:
        """``call`` is wholly queued, ending with ``call.buffers.done``: finish it on ``loop``
        once the waiter sees that event (polling from ``predicted`` seconds after
        ``predicted_start``). ``awaited``: its caller will `wait` for it, so the waiter also
        wakes that caller shortly before the predicted end; a call predicted to end sooner than
        that is left to its caller's watch alone until the caller hands it over (`wait`, or
        `hand_over` when the caller leaves first): no thread wakes for it, and none takes the
        GIL from the loop while the caller enqueues its next call."""
        self._inflight.add(call)
        call.predicted_end = predicted_start + predicted
        call.prediction = (predicted_start, predicted, loop)
        if awaited and call.predicted_end - time.perf_counter() <= SPIN_LEAD_S:
            return
        self._to_waiter(call, predicted_start, predicted, loop, awaited)

    def hand_over(self, call: Call) -> None:
        """The caller stops watching ``call`` (its watch gave up, or it was cancelled before
        waiting): the waiter thread finishes it, unless it already has it or it is done."""
        if call.watch is None and not call.finished and call.prediction is not None:
            self._to_waiter(call, *call.prediction, awaited=False)

    def _to_waiter(
        self,
        call: Call,
        predicted_start: float,
        predicted: float,
        loop: asyncio.AbstractEventLoop,
        awaited: bool,
    ) -> None:
        early = None
        if awaited:
            call.near = loop.create_future()
            early = functools.partial(_resolve, call.near)
        call.watch = self.waiter.submit(
            call.buffers.done,
            predicted_start,
            predicted,
            loop,
            lambda seen, error: self._finish(call, seen, error),
            early=early,
            early_at=call.predicted_end - SPIN_LEAD_S,
        )

    async def wait(self, call: Call) -> float:
        """The caller's wait for a submitted ``call``: asleep until shortly before its predicted
        end (woken by the waiter thread), then watching its last event on the loop thread alone
        (`SPIN_LEAD_S`, `SPIN_GRACE_S`): the call is withdrawn from the waiter meanwhile, so no
        thread takes the GIL from the loop; it goes back if the watch gives up. Returns when
        the call was seen done."""
        if call.watch is not None:
            near = call.near
            far = call.predicted_end - time.perf_counter() > SPIN_LEAD_S
            if near is not None and far and not near.done():
                await near
            if call.finished or not self.waiter.withdraw(call.watch):
                return await call.result  # seen, or being delivered by the thread
            call.watch = None
        self._watch(call)
        self.hand_over(call)  # the watch gave up (a call behind others, or late)
        return await call.result

    def _watch(self, call: Call) -> None:
        """Poll ``call``'s last event on this (the loop's) thread until it completes or the
        grace after the predicted end runs out. Not for a call the GPU has not begun (it waits
        behind the caller's work, which the prediction knows nothing of)."""
        buffers = call.buffers
        try:
            if not buffers.begun.query():  # type: ignore[no-untyped-call]
                return
            deadline = max(call.predicted_end, time.perf_counter()) + SPIN_GRACE_S
            while not buffers.done.query():  # type: ignore[no-untyped-call]
                if time.perf_counter() > deadline:
                    return
        except Exception:  # a GPU fault: the waiter thread delivers it
            return
        self._finish(call, time.perf_counter(), None)

    def _finish(self, call: Call, seen: float, error: BaseException | None) -> None:
        """On the call's loop, once its last event was seen (by the waiter thread, or by the
        caller in `wait`), or a CUDA error polling it: learn the rate, count, release, hand the
        caller its result. Runs once per call."""
        if call.finished:
            return
        call.finished = True
        if call.near is not None and not call.near.done():
            call.near.set_result(None)
        buffers = call.buffers
        if call.trace is not None:
            call.trace["finish"] = time.perf_counter()
        if error is None:
            if call.learn:  # a layerwise store's GPU time includes waits for its producer
                seconds = buffers.begun.elapsed_time(buffers.done) / 1e3
                call.side.clock.observe(call.nbytes, seconds)
            direction = call.direction
            self.counters[f"{direction}_{call.path}_bytes"] += call.nbytes
            self.counters[f"{direction}_{call.path}_calls"] += 1
            self.counters[f"{direction}_seconds"] += time.perf_counter() - call.start
            self.counters["bytes_gathered" if direction == "gather" else "bytes_scattered"] += (
                call.nbytes
            )
        # After a fault the context is unusable: nothing on the GPU touches the objects again.
        call.release()
        self._inflight.discard(call)
        if not call.result.done():  # the caller may have been cancelled
            if error is None:
                call.result.set_result(seen)
            else:
                call.result.set_exception(
                    TieredKVError(f"CudaMover: {call.direction} failed on the GPU: {error}")
                )
        if not self._inflight and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    async def drain(self) -> None:
        """Until no call is on the GPU (their callers may be gone)."""
        while self._inflight:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle

    def close(self) -> None:
        """Stop the waiter's thread (after `drain`)."""
        self.waiter.close()
