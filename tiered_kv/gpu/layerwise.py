"""Layerwise calls of `CudaMover`: staging loads pulled layer by layer by their waiters, and
gathers saved layer by layer.

Owns `LayerwiseLoads` (a mover's staging layerwise loads until each is wholly queued: its
front, its `LoadPull`, the fallback that queues what nobody pulled, handing it to the
`CallTracker`), `LoadPull` (one load's remaining fills) and `CudaLayerSave` (one gather call
from the first `save` to `finish`). Loads on the other paths are enqueued whole by the mover.
A load is begun, ended and closed on the loop thread; its fills are queued by whichever thread
waits for a layer (the model's thread in ``wait_layer``, or the loop), under the launcher's
lock. Saves run on the loop thread. Why the rules below: docs/layerwise.md and
docs/decisions/layerwise-loads-on-the-gpu.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tiered_kv.errors import TieredKVError
from tiered_kv.gpu.base import ChunkTransfer, KVMover, LayerSave, check_layers
from tiered_kv.gpu.calls import Call, CallTracker, hold, new_call, retrieved
from tiered_kv.gpu.device import DeviceState
from tiered_kv.gpu.dma import enqueue_dma
from tiered_kv.gpu.events import BlockTable, CudaLayerLoad
from tiered_kv.gpu.launch import LEAD_SLOTS, Launcher
from tiered_kv.gpu.plan import LayoutPlan, block_span, moved_bytes, slot_fills
from tiered_kv.gpu.staging import enqueue_fill
from tiered_kv.layout import KVCacheLayout

MIN_LEAD_LAYERS = 2  # a layerwise wait queues a fill if fewer layers beyond its own are queued
# A staging layerwise load whose layers copy in this much or less launches its first layers as
# mapped kernels (`MoverOptions.mapped_front_layers`).
MAPPED_FRONT_LAYER_BYTES = 16 << 20
FALLBACK_S = 1.0  # a pulled load's rest is queued by the loop after twice its copies' time + this


class LayerwiseLoads:
    """A mover's staging layerwise loads that are not yet wholly queued and submitted."""

    def __init__(self, launcher: Launcher, calls: CallTracker) -> None:
        self._launcher = launcher
        self._calls = calls
        self._pulls: set[LoadPull] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # each pull's fallback

    def begin(
        self,
        state: DeviceState,
        plan: LayoutPlan,
        block_ids: list[int],
        transfers: list[ChunkTransfer],
        load: CudaLayerLoad,
    ) -> CudaLayerLoad:
        """Set up a staging layerwise load (ordered after the caller's stream, its block table
        uploaded), queue its first layers (as mapped kernels: `_mapped_front`), and leave the
        rest to a `LoadPull`. Takes the references to the objects."""
        launcher = self._launcher
        loop = asyncio.get_running_loop()
        layers = check_layers(plan.layout, None)
        front = self._mapped_front(plan, transfers, layers)
        span = block_span(plan.layout.block_size, transfers, len(block_ids))
        side = state.load
        call = new_call(
            state,
            side,
            "scatter",
            hold(transfers),
            plan.path,
            nbytes=moved_bytes(plan, transfers, False, layers),
            layers=layers,
            load=load,
        )
        load.call_owns_objects = True
        try:
            with launcher.lock:
                state.kernels.make_current()
                state.ensure_slots(side, plan)
                call.open(torch.cuda.current_stream(state.device), False)
                table = launcher.block_table(call, block_ids, span, side.kernel_cu)
                for layer in front:
                    launcher.enqueue_mapped(state, plan, side, False, table, transfers, (layer,))
                    load.record_layer(layer, side.kernel_stream)
        except BaseException:
            torch.cuda.synchronize(state.device)
            call.release()
            raise
        pull = LoadPull(
            call, plan, table, transfers, loop, layers[len(front) :], launcher, self._ended
        )
        self._pulls.add(pull)
        load.pull, load.pulled = pull, pull.submitted
        # The copies start now: predict their end now, for the waiter and the fallback.
        pull.predicted = side.clock.schedule(call.nbytes, call.start)
        # Through layer `MIN_LEAD_LAYERS` (unless the front has): the copies keep going while
        # the model's thread gets to its first waits, which then need not queue a fill.
        pull.queue(min(MIN_LEAD_LAYERS, pull.last))
        task = loop.create_task(pull.fallback(2 * pull.predicted[1] + FALLBACK_S))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return load

    def _mapped_front(
        self, plan: LayoutPlan, transfers: Sequence[ChunkTransfer], layers: Sequence[int]
    ) -> Sequence[int]:
        """The first layers to launch as mapped kernels: up to ``mapped_front_layers`` (all but
        the last at most, so the pull has fills to end with), when each copies in
        `MAPPED_FRONT_LAYER_BYTES` or less and every chunk is pinned; none otherwise."""
        count = min(self._launcher.options.mapped_front_layers, len(layers) - 1)
        if count <= 0 or not all(transfer.obj.arena.pinned for transfer in transfers):
            return []
        front = layers[:count]
        largest = max(moved_bytes(plan, transfers, False, (layer,)) for layer in front)
        return front if largest <= MAPPED_FRONT_LAYER_BYTES else []

    def _ended(self, pull: LoadPull, error: BaseException | None) -> None:
        """On the loop, once a pulled load is wholly queued (or its enqueue failed): hand its
        completion to the tracker (or wait for what was queued, release, report)."""
        call = pull.call
        load = call.load
        if load is None:  # unreachable: pulls are layerwise loads
            raise TieredKVError("layerwise pull without a load")
        self._pulls.discard(pull)
        load.result = call.result
        call.result.add_done_callback(retrieved)
        if error is not None:
            try:
                torch.cuda.synchronize(call.state.device)  # what was queued may touch the objects
            finally:
                call.release()
                call.result.set_exception(
                    TieredKVError(f"CudaMover: layerwise load failed while enqueueing: {error}")
                )
                load.end_enqueue(error)
                pull.submitted.set_result(None)
            return
        predicted_start, predicted = pull.predicted
        self._calls.submit(call, predicted_start, predicted, pull.loop)
        load.end_enqueue(None)
        pull.submitted.set_result(None)

    async def aclose(self) -> None:
        """Queue and submit the rest of every load nobody waited for, and end the fallbacks."""
        for pull in list(self._pulls):
            pull(None)
            await asyncio.shield(pull.submitted)
        while self._tasks:
            await asyncio.wait(list(self._tasks))


class LoadPull:
    """The staging enqueue of one layerwise load, pulled by whoever needs its next layer.

    ``pull(i)`` queues, under the launcher's lock, what layer ``i`` still lacks or else, when
    the lead is short or the GPU has model work to cover it, one fill toward layer
    ``i + ahead`` (``ahead``: the layers of `LEAD_SLOTS` slots); ``pull(None)`` queues the rest.
    The model's thread pulls in ``wait_layer``; the loop in ``enqueued``, in
    `LayerwiseLoads.aclose` and in `fallback`, so a load nobody waits for still completes.
    Whichever pull queues the last fill records the call's end, and ``ended`` hands it over on
    the loop."""

    def __init__(
        self,
        call: Call,
        plan: LayoutPlan,
        table: BlockTable,
        transfers: Sequence[ChunkTransfer],
        loop: asyncio.AbstractEventLoop,
        layers: Sequence[int],
        launcher: Launcher,
        ended: Callable[[LoadPull, BaseException | None], None],
    ) -> None:
        side = call.side
        self.call = call
        self.loop = loop
        self.loop_thread = threading.get_ident()
        self.submitted: asyncio.Future[None] = loop.create_future()
        self.predicted = (call.start, 0.0)  # (start, seconds) of the copies, from the clock
        self.last = plan.layout.num_layers - 1
        lead = LEAD_SLOTS * side.slot_bytes
        self.ahead = max(1, -(-lead * plan.layout.num_layers // max(1, call.nbytes)))
        self.ended = False
        self.waited = False  # a wait has queued (the model may have work on the GPU since)
        self.marker: torch.cuda.Event | None = None  # where the last wait left the model's stream
        self._fills = slot_fills(plan, transfers, side.slot_bytes, ramp_up=False, layers=layers)
        self._upcoming = next(self._fills, None)
        self._plan = plan
        self._table = table
        self._launcher = launcher
        self._on_end = ended

    def __call__(self, layer: int | None) -> None:
        """Queue through ``layer`` (None: everything). The first wait queues its own layer only
        (nothing more should delay the model's start); a later wait whose layer is queued adds
        one fill of the lead only if fewer than `MIN_LEAD_LAYERS` layers beyond it are queued or
        the model's stream has not reached the last wait's `mark`. A wait whose layer is not
        queued yet queues just that layer."""
        load = self.call.load
        if layer is None:
            self.queue(self.last)
        elif self.waited and load is not None and load.has_event(layer):
            short = not load.has_event(min(self.last, layer + MIN_LEAD_LAYERS))
            if short or self._stream_has_work():
                self.queue(min(self.last, layer + self.ahead), fills=1)
        else:
            self.waited = True
            self.queue(layer)

    def _stream_has_work(self) -> bool:
        """Whether the waiting stream has not reached the last wait's mark yet: the GPU still
        has the model's work before it queued (the layer that wait released, at least)."""
        marker = self.marker
        return marker is not None and not marker.query()  # type: ignore[no-untyped-call]

    def mark(self, stream: Any) -> None:
        """Record, on ``stream`` right after its wait for a layer, the mark the next wait
        queries: reached, the GPU has started that layer; not reached, the layer is still ahead
        of it."""
        if self.ended:
            return
        if self.marker is None:
            self.marker = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.marker.record(stream)

    def queue(self, target: int, fills: int | None = None) -> None:
        """Queue fills until model layer ``target``'s copies are all queued (or all of them,
        for the last layer), at most ``fills`` of them, on the calling thread."""
        load = self.call.load
        if self.ended or load is None or load.has_event(target):
            return
        error: BaseException | None = None
        with self._launcher.lock:
            if self.ended:
                return
            call = self.call
            try:
                call.state.kernels.make_current()
                while self._upcoming is not None:
                    if target < self.last and load.has_event(target):
                        return
                    if fills is not None:
                        if fills <= 0:
                            return
                        fills -= 1
                    # Queued before the next fill is planned (its copies start sooner). The
                    # fill that completes the last layer is the last one (layer-major).
                    fill = self._upcoming
                    edge = self.last in fill.completes
                    self._launcher.queue_fill(call, self._plan, fill, False, self._table, edge)
                    self._upcoming = next(self._fills, None)
                call.buffers.done.record(call.side.kernel_stream)
            except BaseException as exc:  # what was queued finishes; the rest never runs
                error = exc
                load.error = exc
            self.ended = True
        if threading.get_ident() == self.loop_thread:
            self._on_end(self, error)
        else:
            # A closed loop was closed after `CudaMover.aclose`, which ends every pull first.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self._on_end, self, error)

    async def fallback(self, delay_s: float) -> None:
        """Queue whatever nobody pulled once the copies should have ended."""
        done, _ = await asyncio.wait([self.submitted], timeout=delay_s)
        if not done:
            self(None)


class CudaLayerSave(LayerSave):
    """`CudaMover`'s layerwise gather: one `Call` from the first `save` to `finish`. Each
    `save` enqueues that layer's copies at once (no completion per layer); `finish` waits for
    the last one."""

    def __init__(
        self,
        mover: KVMover,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        *,
        device_state: Callable[[torch.device], DeviceState],
        launcher: Launcher,
        calls: CallTracker,
    ) -> None:
        super().__init__(mover, layout, block_ids, transfers)
        self.layout = layout
        self.block_ids = list(block_ids)
        self.transfers = list(transfers)
        self.call: Call | None = None
        self.plan: LayoutPlan | None = None
        self.table = BlockTable(0)  # set with the call
        self.last_bytes = 0
        self.submitted = False
        self._device_state = device_state
        self._launcher = launcher
        self._calls = calls

    def save(self, layer: int, after: Any = None) -> None:
        if self.transfers:
            self._save_layer(layer, after)

    async def finish(self) -> None:
        if self.call is not None:
            await self._finish()

    def _save_layer(self, layer: int, after: Any) -> None:
        """Enqueue one layer on the store side, ordered after ``after`` (or the current
        stream): the first layer takes the objects, the buffers and the block table."""
        transfers, launcher = self.transfers, self._launcher
        call = self.call
        if call is None:
            state = self._device_state(self.layout.device)
            plan = state.plan(self.layout)
            side = state.store
            span = block_span(self.layout.block_size, transfers, len(self.block_ids))
            call = new_call(state, side, "gather", hold(transfers), plan.path, learn=False)
            self.call, self.plan = call, plan
            state.kernels.make_current()
            if plan.path == "staging":
                state.ensure_slots(side, plan)
            first = side.dma_stream if plan.path == "dma" else side.kernel_stream
            call.buffers.begun.record(first)
            if plan.path != "dma":
                self.table = launcher.block_table(call, self.block_ids, span, side.kernel_cu)
        state, side, saved_plan = call.state, call.side, self.plan
        if saved_plan is None:  # unreachable: set with the call
            raise TieredKVError("layerwise gather without a plan")
        plan = saved_plan
        state.kernels.make_current()
        if after is None:
            after = call.buffers.ready
            after.record(torch.cuda.current_stream(state.device))
        first = side.dma_stream if plan.path == "dma" else side.kernel_stream
        first.wait_event(after)
        layers = (layer,)
        if plan.path == "dma":
            enqueue_dma(plan, side, True, self.block_ids, transfers, layers)
        elif plan.path == "mapped":
            launcher.enqueue_mapped(state, plan, side, True, self.table, transfers, layers)
        else:
            launch = functools.partial(
                launcher.launch_fill,
                state,
                side=side,
                to_host=True,
                block_size=plan.layout.block_size,
                table=self.table,
                ctas=launcher.options.staging_ctas,
            )
            # Only the first layer ramps up (nothing precedes its first DMA); later layers go
            # in full fills: fewer launches and copies per layer on the loop thread.
            ramp_up = self.last_bytes == 0
            for fill in slot_fills(
                plan, transfers, side.slot_bytes, ramp_up=ramp_up, layers=layers
            ):
                enqueue_fill(side, fill, True, functools.partial(launch, fill.group))
        self.last_bytes = moved_bytes(plan, transfers, True, layers)
        call.nbytes += self.last_bytes

    async def _finish(self) -> None:
        """Record the call's end after its last queued copy and wait for it."""
        call, plan = self.call, self.plan
        if call is None or plan is None:  # unreachable: finish checks
            raise TieredKVError("layerwise gather finished before it began")
        if not self.submitted:
            self.submitted = True
            side = call.side
            call.state.kernels.make_current()
            call.buffers.done.record(
                side.kernel_stream if plan.path == "mapped" else side.dma_stream
            )
            start, predicted = side.clock.schedule(self.last_bytes, time.perf_counter())
            self._calls.submit(call, start, predicted, asyncio.get_running_loop())
        await asyncio.shield(call.result)
