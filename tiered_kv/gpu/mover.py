"""`CudaMover`: the mover for CUDA KV caches: NVRTC copy kernels and DMA on its own streams.

Owns, per device: a store stream and a higher-priority load stream (each with a DMA companion
stream), a ring of GPU staging slots per direction, the events that order them, and a pool of
per-call buffers (block table, timing events); per mover, a `CompletionWaiter` thread that turns
"the GPU finished" into an asyncio result. Per registered layout: each group's
copy plan (vector width, byte strides, a device table of layer pointers). Three paths:

- ``staging``: a kernel gathers a slice of a chunk (some layers of one group) into a GPU staging
  slot, then one DMA moves the slot to pinned host memory; slices rotate through the ring so the
  kernel of slice i+1 overlaps the DMA of slice i. Loads run the reverse. Kernels use a few SMs
  for a small share of the transfer: the DMA is the bottleneck.
- ``mapped``: the kernel reads or writes the pinned host chunk directly through its mapped
  device address. No staging memory, but it occupies SMs for the whole PCIe transfer.
- ``dma``: no kernels: one batched async copy (``cuMemcpyBatchAsync``) of the contiguous runs
  of each chunk. No SMs; only fast when runs are long (NHD rows in contiguous blocks).

``auto`` (the default) picks per layout: see `choose_path`. Ordering: a gather waits (on the GPU)
for an event recorded on the caller's current stream; after a scatter the caller's current
stream waits on the load's event. The mover holds references to every object until the GPU is
done with it, so callers may be cancelled at any time. Staging enqueues may interleave between
fills (concurrent calls share the ring); each fill is enqueued atomically and the slot events
order every use of a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from tiered_kv.errors import LayoutError, TieredKVError
from tiered_kv.gpu.base import (
    ChunkTransfer,
    KVMover,
    LayerLoad,
    LayerSave,
    check_layers,
)
from tiered_kv.gpu.completion import CompletionWaiter
from tiered_kv.gpu.events import CallBuffers, CudaLayerLoad
from tiered_kv.gpu.kernels import DeviceKernels, check_driver, load_kernels, release_kernels
from tiered_kv.gpu.plan import (
    JOB_MAX_BYTES,
    MAX_JOBS,
    PATHS,
    Fill,
    GroupPlan,
    LayoutPlan,
    batches,
    choose_path,
    group_offset,
    group_plan,
    moved_bytes,
    runs,
    slot_fills,
)
from tiered_kv.gpu.staging import Direction, Job, enqueue_fill
from tiered_kv.layout import KVCacheLayout
from tiered_kv.memory import HostArena, MemoryObj

__all__ = ["PATHS", "CudaMover", "MoverOptions", "choose_path"]

_PARAMS_HEAD = struct.Struct("<QQqqqiiiiii")  # TkvParams up to jobs[]
_JOB = struct.Struct("<Qiiiiii")  # TkvJob
_PARAMS_SIZE = _PARAMS_HEAD.size + MAX_JOBS * _JOB.size
_THREADS = 256
_UNROLL = 4  # TKV_UNROLL
LEAD_SLOTS = 2  # staging enqueues this many slots' worth before yielding to the loop
MIN_LEAD_LAYERS = 2  # a layerwise wait queues a fill if fewer layers beyond its own are queued
# A staging layerwise load whose layers copy in this much or less launches its first layers as
# mapped kernels (`MoverOptions.mapped_front_layers`).
MAPPED_FRONT_LAYER_BYTES = 16 << 20
FALLBACK_S = 1.0  # a pulled load's rest is queued by the loop after twice its copies' time + this
EDGE_CTA_FACTOR = 4  # CTAs of the first (gather) or last (scatter) kernel, times staging_ctas


@dataclasses.dataclass(frozen=True, slots=True)
class MoverOptions:
    """``path``: ``auto`` or one of `PATHS`. Staging uses ``staging_slots`` GPU buffers of
    ``staging_slot_bytes`` per direction (grown to one layer's slab when that is larger) and
    ``staging_ctas`` thread blocks per launch; ``mapped_ctas`` (0: two per SM) for the mapped
    path, which needs many loads in flight to cover PCIe latency. A staging layerwise load of
    small layers (each copied in `MAPPED_FRONT_LAYER_BYTES` or less) launches its first
    ``mapped_front_layers`` layers (at most all but one) as mapped kernels, one per layer, before
    it returns: a launch is a quarter of a staging fill's Python, and the GPU, idle until the
    model starts, has the SMs to spare (0: staging fills only)."""

    path: str = "auto"
    staging_slot_bytes: int = 32 << 20
    staging_slots: int = 3
    staging_ctas: int = 32
    mapped_ctas: int = 0
    mapped_front_layers: int = 4

    def __post_init__(self) -> None:
        if self.path not in ("auto", *PATHS):
            raise ValueError(
                f"MoverOptions.path: expected 'auto' or one of {PATHS}, got {self.path!r}"
            )
        if self.staging_slots < 2:
            raise ValueError(f"MoverOptions.staging_slots must be >= 2, got {self.staging_slots}")
        if self.staging_slot_bytes < 4096:
            raise ValueError(
                f"MoverOptions.staging_slot_bytes must be >= 4096, got {self.staging_slot_bytes}"
            )
        if self.staging_ctas < 1 or self.mapped_ctas < 0 or self.mapped_front_layers < 0:
            raise ValueError(
                f"MoverOptions: staging_ctas must be >= 1, mapped_ctas and mapped_front_layers "
                f">= 0, got {self.staging_ctas}, {self.mapped_ctas}, {self.mapped_front_layers}"
            )


class _DeviceState:
    def __init__(self, device: torch.device, kernels: DeviceKernels, options: MoverOptions) -> None:
        self.device = device
        self.kernels = kernels
        _, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        self.store = Direction(device, 0, options.staging_slots)
        self.load = Direction(device, high, options.staging_slots)
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self.host_delta: dict[int, int] = {}  # arena base → device address minus host address
        self.plans: dict[int, LayoutPlan] = {}
        self.buffers: list[CallBuffers] = []  # free ones

    def take_buffers(self) -> CallBuffers:
        return self.buffers.pop() if self.buffers else CallBuffers(self.device)


@dataclasses.dataclass(eq=False, slots=True)
class _Call:
    """One gather or scatter from enqueue to release."""

    direction: str
    state: _DeviceState
    side: Direction
    buffers: CallBuffers
    held: list[MemoryObj]
    nbytes: int
    result: asyncio.Future[float]
    path: str
    start: float
    trace: dict[str, Any] | None = None
    layers: tuple[int, ...] | None = None  # model layers moved (None: all, chunk-major)
    after: Any = None  # event the paged-cache side waits for, instead of the caller's stream
    load: CudaLayerLoad | None = None  # a layerwise scatter's, with its per-layer events
    learn: bool = True  # teach the clock this call's rate (not for gathers with gaps)


class CudaMover(KVMover):
    """Kernels and DMA for CUDA caches. One instance serves every device it is handed."""

    name = "cuda"

    def __init__(self, options: MoverOptions | None = None) -> None:
        self.options = options or MoverOptions()
        self._devices: dict[int, _DeviceState] = {}
        # Completion is seen by this thread (sleep, then poll near the predicted end).
        self._waiter = CompletionWaiter()
        self._counters: dict[str, int | float] = {
            f"{direction}_{path}_{what}": 0
            for direction in ("gather", "scatter")
            for path in PATHS
            for what in ("bytes", "calls")
        }
        self._counters.update(
            bytes_gathered=0,
            bytes_scattered=0,
            gather_seconds=0.0,
            scatter_seconds=0.0,
            kernel_launches=0,
            kernel_launches_block_rows=0,
        )
        # Set to a list to record, per call, enqueue time, GPU time and total (benchmarks only:
        # it adds events on the caller's stream).
        self.trace: list[dict[str, Any]] | None = None
        self._inflight: set[_Call] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # layerwise loads still enqueueing
        self._idle: asyncio.Future[None] | None = None
        # The staging rings, the launch parameters and the current context: the loop enqueues,
        # and so does the thread that waits for a layerwise load (`_LoadPull`).
        self._lock = threading.RLock()
        self._pulls: set[_LoadPull] = set()  # layerwise loads not fully queued and submitted
        self._params = ctypes.create_string_buffer(_PARAMS_SIZE)
        self._params_arg = (ctypes.c_void_p * 1)(ctypes.addressof(self._params))

    # -- public --------------------------------------------------------------------------------
    def prepare(self, layout: KVCacheLayout) -> None:
        """Load (or compile) the kernels, create the streams, plan the layout and allocate the
        staging slots and two calls' block-table buffers, so the first transfer pays none of it."""
        state = self._state(layout.device)
        plan = self._plan(state, layout)
        if plan.path == "staging":
            with self._lock:  # a layerwise load's waiter may be queueing on the load ring
                for side in (state.store, state.load):
                    side.ensure_slots(max(self.options.staging_slot_bytes, plan.largest_layer))
        while len(state.buffers) < 2:
            state.buffers.append(CallBuffers(state.device))
        for buffers in state.buffers:
            buffers.reserve(layout.num_blocks)

    def forget(self, layout: KVCacheLayout) -> None:
        """Drop ``layout``'s plan (which holds the layout and so its KV tensors)."""
        for state in self._devices.values():
            plan = state.plans.get(id(layout))
            if plan is not None and plan.layout is layout:
                del state.plans[id(layout)]

    async def gather(
        self,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        *,
        layers: Sequence[int] | None = None,
        after: Any = None,
    ) -> None:
        chosen = None if layers is None else check_layers(layout, layers)
        await self._move("gather", layout, block_ids, transfers, layers=chosen, after=after)

    async def scatter(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        await self._move("scatter", layout, block_ids, transfers)

    async def scatter_layerwise(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> LayerLoad:
        """Returns once the first layers' copies are queued. On the staging path the rest are
        queued by whoever waits for them (`_LoadPull`): the model's thread in ``wait_layer``,
        the loop in ``enqueued``/``wait``, or the loop once the copies should have ended. The
        other paths queue everything here. The references to the objects are taken here."""
        state = self._state(layout.device)
        load = CudaLayerLoad(state.device, layout.num_layers)
        if not transfers:
            load.end_enqueue(None)
            return load
        if self._plan(state, layout).path == "staging":
            return self._begin_pull(state, layout, list(block_ids), list(transfers), load)
        held = _hold(transfers)
        task = asyncio.get_running_loop().create_task(
            self._move(
                "scatter",
                layout,
                list(block_ids),
                list(transfers),
                layers=check_layers(layout, None),
                load=load,
                held=held,
            )
        )
        load.task = task
        self._tasks.add(task)

        def enqueued(task: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            error = None if task.cancelled() else task.exception()
            if not load.call_owns_objects:  # the task ended before a call took the references
                for obj in held:
                    obj.unref()
                error = error or asyncio.CancelledError()
            load.end_enqueue(error)

        task.add_done_callback(enqueued)
        await asyncio.wait([task])  # cancelling this wait leaves the task to enqueue the whole load
        return load

    def _begin_pull(
        self,
        state: _DeviceState,
        layout: KVCacheLayout,
        block_ids: list[int],
        transfers: list[ChunkTransfer],
        load: CudaLayerLoad,
    ) -> CudaLayerLoad:
        """Set up a staging layerwise load (ordered after the caller's stream, its block table
        uploaded), queue its first layers (as mapped kernels: `_mapped_front`), and leave the
        rest to `_LoadPull`."""
        plan = self._plan(state, layout)
        loop = asyncio.get_running_loop()
        layers = check_layers(layout, None)
        front = self._mapped_front(plan, transfers, layers)
        side = state.load
        call = _new_call(
            state,
            side,
            "scatter",
            _hold(transfers),
            plan.path,
            nbytes=moved_bytes(plan, transfers, False, layers),
            layers=layers,
            load=load,
        )
        load.call_owns_objects = True
        try:
            with self._lock:
                state.kernels.make_current()
                side.ensure_slots(max(self.options.staging_slot_bytes, plan.largest_layer))
                self._open(call, plan, torch.cuda.current_stream(state.device), False)
                device_ids = call.buffers.upload_ids(block_ids, side.kernel_cu)
                for layer in front:
                    self._enqueue_mapped(state, plan, side, False, device_ids, transfers, (layer,))
                    load.record_layer(layer, side.kernel_stream)
        except BaseException:
            torch.cuda.synchronize(state.device)
            self._release(call)
            raise
        pull = _LoadPull(self, call, plan, device_ids, transfers, loop, layers[len(front) :])
        self._pulls.add(pull)
        load.pull, load.pulled = pull, pull.submitted
        # The copies start now: predict their end now, for the waiter and the fallback.
        pull.predicted = side.clock.schedule(call.nbytes, call.start)
        # Through layer `MIN_LEAD_LAYERS` (unless the front has): the copies keep going while
        # the model's thread gets to its first waits, which then need not queue a fill
        # (docs/decisions/layerwise-loads-on-the-gpu.md).
        pull.queue(min(MIN_LEAD_LAYERS, pull.last))
        task = loop.create_task(pull.fallback(2 * pull.predicted[1] + FALLBACK_S))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return load

    def _mapped_front(
        self, plan: LayoutPlan, transfers: Sequence[ChunkTransfer], layers: Sequence[int]
    ) -> Sequence[int]:
        """The first layers of a staging layerwise load to launch as mapped kernels: up to
        ``mapped_front_layers`` (all but the last at most, so the pull has fills to end with),
        when every layer of them copies in `MAPPED_FRONT_LAYER_BYTES` or less and every chunk
        is in pinned memory: there a staging fill's enqueue outlasts its copy, and before the
        model starts it is all latency; larger layers keep staging, where mapped kernels would
        hold SMs beside the model for longer (docs/decisions/layerwise-loads-on-the-gpu.md)."""
        count = min(self.options.mapped_front_layers, len(layers) - 1)
        if count <= 0 or not all(transfer.obj.arena.pinned for transfer in transfers):
            return []
        front = layers[:count]
        largest = max(moved_bytes(plan, transfers, False, (layer,)) for layer in front)
        return front if largest <= MAPPED_FRONT_LAYER_BYTES else []

    def _pull_ended(self, pull: _LoadPull, error: BaseException | None) -> None:
        """On the loop, once a pulled load is wholly queued (or its enqueue failed): hand its
        completion to the waiter (or wait for what was queued, release, report)."""
        call = pull.call
        load = call.load
        if load is None:  # unreachable: pulls are layerwise loads
            raise TieredKVError("layerwise pull without a load")
        self._pulls.discard(pull)
        load.result = call.result
        call.result.add_done_callback(_retrieved)
        if error is not None:
            try:
                torch.cuda.synchronize(call.state.device)  # what was queued may touch the objects
            finally:
                self._release(call)
                call.result.set_exception(
                    TieredKVError(f"CudaMover: layerwise load failed while enqueueing: {error}")
                )
                load.end_enqueue(error)
                pull.submitted.set_result(None)
            return
        predicted_start, predicted = pull.predicted
        self._inflight.add(call)
        self._waiter.submit(
            call.buffers.done,
            predicted_start,
            predicted,
            pull.loop,
            lambda seen, failed: self._finish(call, seen, failed),
        )
        load.end_enqueue(None)
        pull.submitted.set_result(None)

    def begin_gather(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> LayerSave:
        """One call for the whole layerwise gather: each `save` enqueues that layer's fills at
        once (no completion per layer), and `finish` waits for the last copy."""
        return _CudaLayerSave(self, layout, block_ids, transfers)

    def stats(self) -> dict[str, int | float]:
        return {
            **self._counters,
            "completion_polls": self._waiter.polls,
            "completion_pokes": self._waiter.pokes,
        }

    async def aclose(self) -> None:
        """Wait for calls still on the GPU (their callers may be gone), then stop the thread."""
        for pull in list(self._pulls):  # layerwise loads nobody waited for: queue the rest
            pull(None)
            await asyncio.shield(pull.submitted)
        while self._tasks:
            await asyncio.wait(list(self._tasks))
        while self._inflight:
            self._idle = asyncio.get_running_loop().create_future()
            await self._idle
        self._waiter.close()
        devices, self._devices = self._devices, {}
        for index, state in devices.items():
            state.plans.clear()
            release_kernels(index)

    # -- planning ----------------------------------------------------------------------------
    def _state(self, device: torch.device) -> _DeviceState:
        if device.type != "cuda":
            raise LayoutError(f"CudaMover moves CUDA caches only; these live on {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        state = self._devices.get(index)
        if state is None:
            kernels = load_kernels(index)
            state = _DeviceState(torch.device("cuda", index), kernels, self.options)
            self._devices[index] = state
        return state

    def _plan(self, state: _DeviceState, layout: KVCacheLayout) -> LayoutPlan:
        plan = state.plans.get(id(layout))
        if plan is not None and plan.layout is layout:
            return plan
        groups = tuple(group_plan(group, state.device) for group in layout.groups)
        plan = LayoutPlan(layout, groups, choose_path(layout, self.options.path))
        state.plans[id(layout)] = plan
        return plan

    def _device_address(self, state: _DeviceState, arena: HostArena) -> int:
        """Mapped device address of the arena's first byte (equal to it under UVA)."""
        delta = state.host_delta.get(arena.base_ptr)
        if delta is None:
            if not arena.pinned:
                raise TieredKVError(
                    "CudaMover: the mapped path needs a pinned host arena (EngineConfig.pin_memory)"
                )
            from cuda.bindings import driver

            dptr = check_driver(
                driver.cuMemHostGetDevicePointer(arena.base_ptr, 0), "cuMemHostGetDevicePointer"
            )
            delta = int(dptr) - arena.base_ptr
            state.host_delta[arena.base_ptr] = delta
        return arena.base_ptr + delta

    # -- one call ------------------------------------------------------------------------------
    async def _move(
        self,
        direction: str,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        *,
        layers: tuple[int, ...] | None = None,
        after: Any = None,
        load: CudaLayerLoad | None = None,
        held: list[MemoryObj] | None = None,
    ) -> None:
        """Enqueue the call in the caller's task, hand its completion event to the waiter and
        await the result (a layerwise ``load`` gets the result instead, and the caller returns
        once the call is enqueued). The call owns references to its objects and its buffers
        until the waiter has seen the GPU finish (`_finish`), whatever happens to the caller:
        cancelled while enqueueing, the call is still enqueued whole; cancelled while awaiting,
        the caller returns at once."""
        if not transfers:
            return
        start = time.perf_counter()
        state = self._state(layout.device)
        plan = self._plan(state, layout)
        to_host = direction == "gather"
        side = state.store if to_host else state.load
        loop = asyncio.get_running_loop()
        call = _new_call(
            state,
            side,
            direction,
            _hold(transfers) if held is None else held,
            plan.path,
            start=start,
            trace={} if self.trace is not None else None,
            layers=layers,
            after=after,
            load=load,
        )  # nbytes is counted once the call is queued: the first DMA should not wait
        if load is not None:
            load.call_owns_objects = True
        if call.trace is not None:
            call.trace["call"] = time.perf_counter()
        caller = torch.cuda.current_stream(state.device)
        try:
            cancelled = await self._enqueue(call, plan, caller, to_host, block_ids, transfers)
        except BaseException:
            # Part of the call may be queued and still touch the objects: let it finish.
            torch.cuda.synchronize(state.device)
            self._release(call)
            raise
        call.nbytes = moved_bytes(plan, transfers, to_host, layers)
        if not to_host and load is None:
            caller.wait_event(call.buffers.done)  # the engine's next kernels see the loaded KV
        if call.trace is not None:
            call.trace["enqueued"] = time.perf_counter()
            call.trace["gpu_end"] = end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            caller.wait_event(call.buffers.done)
            end.record(caller)
        predicted_start, predicted = side.clock.schedule(call.nbytes, start)
        self._inflight.add(call)
        self._waiter.submit(
            call.buffers.done,
            predicted_start,
            predicted,
            loop,
            lambda seen, error: self._finish(call, seen, error),
        )
        if load is not None:
            load.result = call.result
            call.result.add_done_callback(_retrieved)
        if cancelled:
            raise asyncio.CancelledError
        if load is not None:
            return
        seen = await call.result
        if self.trace is not None and call.trace is not None:
            trace = call.trace
            self.trace.append(
                {
                    "direction": direction,
                    "bytes": call.nbytes,
                    "enqueue_s": trace["enqueued"] - start,
                    "call_s": trace["call"] - start,
                    "ids_s": trace.get("ids", trace["recorded"]) - start,
                    "recorded_s": trace["recorded"] - start,
                    "first_copy_s": trace.get("first_copy", trace["enqueued"]) - start,
                    "gpu_s": trace["gpu_start"].elapsed_time(trace["gpu_end"]) / 1e3,
                    "observed_s": seen - start,
                    "finish_s": trace["finish"] - start,
                    "total_s": time.perf_counter() - start,
                }
            )

    def _finish(self, call: _Call, seen: float, error: BaseException | None) -> None:
        """On the call's loop, once the waiter saw its last event (or a CUDA error polling it):
        learn the rate, count, release, hand the caller its result."""
        buffers = call.buffers
        if call.trace is not None:
            call.trace["finish"] = time.perf_counter()
        if error is None:
            if call.learn:  # a layerwise store's GPU time includes waits for its producer
                seconds = buffers.begun.elapsed_time(buffers.done) / 1e3
                call.side.clock.observe(call.nbytes, seconds)
            direction = call.direction
            self._counters[f"{direction}_{call.path}_bytes"] += call.nbytes
            self._counters[f"{direction}_{call.path}_calls"] += 1
            self._counters[f"{direction}_seconds"] += time.perf_counter() - call.start
            self._counters["bytes_gathered" if direction == "gather" else "bytes_scattered"] += (
                call.nbytes
            )
        # After a fault the context is unusable: nothing on the GPU touches the objects again.
        self._release(call)
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

    def _save_layer(self, save: _CudaLayerSave, layer: int, after: Any) -> None:
        """Enqueue one layer of a layerwise gather on the store side, ordered after ``after``
        (or the current stream): the session's first layer takes the objects, the buffers and
        the block table."""
        layout, transfers = save.layout, save.transfers
        call = save.call
        if call is None:
            state = self._state(layout.device)
            plan = self._plan(state, layout)
            side = state.store
            call = _new_call(state, side, "gather", _hold(transfers), plan.path, learn=False)
            save.call, save.plan = call, plan
            state.kernels.make_current()
            if plan.path == "staging":
                side.ensure_slots(max(self.options.staging_slot_bytes, plan.largest_layer))
            first = side.dma_stream if plan.path == "dma" else side.kernel_stream
            call.buffers.begun.record(first)
            if plan.path != "dma":
                save.device_ids = call.buffers.upload_ids(save.block_ids, side.kernel_cu)
        state, side, saved_plan = call.state, call.side, save.plan
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
            self._enqueue_dma(plan, side, True, save.block_ids, transfers, layers)
        elif plan.path == "mapped":
            self._enqueue_mapped(state, plan, side, True, save.device_ids, transfers, layers)
        else:
            launch = functools.partial(
                self._launch_jobs,
                state,
                side=side,
                to_host=True,
                block_size=plan.layout.block_size,
                device_ids=save.device_ids,
                ctas=self.options.staging_ctas,
            )
            # Only the session's first layer ramps up (nothing precedes its first DMA); later
            # layers go in full fills: fewer launches and copies per layer on the loop thread.
            ramp_up = save.last_bytes == 0
            for fill in slot_fills(
                plan, transfers, side.slot_bytes, ramp_up=ramp_up, layers=layers
            ):
                enqueue_fill(side, fill, True, functools.partial(launch, fill.group))
        save.last_bytes = moved_bytes(plan, transfers, True, layers)
        call.nbytes += save.last_bytes

    async def _finish_save(self, save: _CudaLayerSave) -> None:
        """Record the session's end after its last queued copy and wait for it."""
        call, plan = save.call, save.plan
        if call is None or plan is None:  # unreachable: finish checks
            raise TieredKVError("layerwise gather finished before it began")
        if not save.submitted:
            save.submitted = True
            side = call.side
            call.state.kernels.make_current()
            call.buffers.done.record(
                side.kernel_stream if plan.path == "mapped" else side.dma_stream
            )
            start, predicted = side.clock.schedule(save.last_bytes, time.perf_counter())
            self._inflight.add(call)
            self._waiter.submit(
                call.buffers.done,
                start,
                predicted,
                asyncio.get_running_loop(),
                lambda seen, error: self._finish(call, seen, error),
            )
        await asyncio.shield(call.result)

    def _release(self, call: _Call) -> None:
        for obj in call.held:
            obj.unref()
        call.held = []
        call.state.buffers.append(call.buffers)

    async def _enqueue(
        self,
        call: _Call,
        plan: LayoutPlan,
        caller: torch.cuda.Stream,
        to_host: bool,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
    ) -> bool:
        """Queue the whole call on the GPU, ending with ``call.buffers.done``. Staging yields to
        the loop between fills once a lead is queued, so a store and a retrieve started together
        both start at once; each fill is atomic, and the slot events keep the ring ordered across
        calls. Returns whether the caller was cancelled meanwhile (the call is enqueued whole
        regardless)."""
        state, side, buffers = call.state, call.side, call.buffers
        state.kernels.make_current()
        if call.trace is not None:
            call.trace["gpu_start"] = begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record(caller)
            call.trace["recorded"] = time.perf_counter()
        self._open(call, plan, caller, to_host)
        if plan.path == "dma":
            for layers in _layer_steps(call):
                self._enqueue_dma(plan, side, to_host, block_ids, transfers, layers)
                _record_layers(call, layers, side.dma_stream)
            buffers.done.record(side.dma_stream)
            return False
        device_ids = buffers.upload_ids(block_ids, side.kernel_cu)
        if call.trace is not None:
            call.trace["ids"] = time.perf_counter()
        if plan.path == "mapped":
            for layers in _layer_steps(call):
                self._enqueue_mapped(state, plan, side, to_host, device_ids, transfers, layers)
                _record_layers(call, layers, side.kernel_stream)
            buffers.done.record(side.kernel_stream)
            return False
        cancelled = await self._enqueue_staging(state, plan, call, to_host, device_ids, transfers)
        # Gathers end with a DMA, scatters with a kernel; each waited for the other.
        buffers.done.record(side.dma_stream if to_host else side.kernel_stream)
        return cancelled

    def _open(
        self, call: _Call, plan: LayoutPlan, caller: torch.cuda.Stream, to_host: bool
    ) -> None:
        """Order the call after the caller's queued work and record its ``begun`` event."""
        side, buffers = call.side, call.buffers
        ready = call.after
        if ready is None:
            ready = buffers.ready
            ready.record(caller)
        # Whatever first touches the paged cache waits for the caller's queued work (or the
        # producer's event): the kernels, or the copies on the DMA-only path. (Staging DMAs are
        # ordered through the slot events.)
        first = side.dma_stream if plan.path == "dma" else side.kernel_stream
        first.wait_event(ready)
        # `begun` precedes all of the call's GPU work (a staging scatter starts with DMAs that
        # need not wait for the caller), so the clock never learns a rate faster than the link.
        opening = side.dma_stream if plan.path == "staging" and not to_host else first
        buffers.begun.record(opening)

    def _queue_fill(
        self, call: _Call, plan: LayoutPlan, fill: Fill, to_host: bool, device_ids: int, edge: bool
    ) -> int:
        """Queue one staging fill of ``call`` through its side's ring, under the lock (a
        layerwise load's waiter may be queueing on the same ring). The one kernel nothing
        overlaps (``edge``: a gather's first, a scatter's last) gets more CTAs: a few
        microseconds of SMs to take that much off the call. Returns the fill's bytes."""
        ctas = self.options.staging_ctas
        launch = functools.partial(
            self._launch_jobs,
            call.state,
            fill.group,
            side=call.side,
            to_host=to_host,
            block_size=plan.layout.block_size,
            device_ids=device_ids,
            ctas=ctas * EDGE_CTA_FACTOR if edge else ctas,
        )
        layer_done = None if call.load is None else call.load.record_layer
        with self._lock:
            return enqueue_fill(call.side, fill, to_host, launch, layer_done)

    # -- paths ---------------------------------------------------------------------------------
    def _launch_jobs(
        self,
        state: _DeviceState,
        group: GroupPlan,
        jobs: Sequence[Job],
        *,
        side: Direction,
        to_host: bool,
        block_size: int,
        device_ids: int,
        ctas: int,
    ) -> None:
        self._launch(state, group, side.kernel_cu, to_host, block_size, device_ids, jobs, ctas)

    def _launch(
        self,
        state: _DeviceState,
        group: GroupPlan,
        stream: Any,
        to_host: bool,
        block_size: int,
        device_ids: int,
        jobs: Sequence[tuple[int, int, int, int, int, int]],
        ctas: int,
    ) -> None:
        """One launch of the copy kernel over up to `MAX_JOBS` jobs of one group, on ``stream``
        (a ``CUstream``). The parameter block is packed into one reused buffer: the driver copies
        it at launch (under the mover's lock: a layerwise load's waiter launches too)."""
        from cuda.bindings import driver

        rows = group.block_rows
        if rows is not None:
            for _, start, t0, n, _, _ in jobs:
                if start % block_size or t0 % block_size or n % block_size:
                    rows = None
                    break
        if rows is not None:
            # Whole blocks only: copy them as one wide row each (tokens become blocks).
            group = rows
            jobs = [
                (host, start // block_size, t0 // block_size, n // block_size, l0, l1)
                for host, start, t0, n, l0, l1 in jobs
            ]
            block_size = 1
        with self._lock:
            self._counters["kernel_launches"] += 1
            self._counters["kernel_launches_block_rows"] += rows is not None
            params = self._params
            _PARAMS_HEAD.pack_into(
                params,
                0,
                group.layer_ptrs.data_ptr(),
                device_ids,
                group.block_stride,
                group.pos_stride,
                group.head_stride,
                group.kv_count,
                group.num_heads,
                group.head_bytes,
                block_size,
                len(jobs),
                0,
            )
            # Vectors of the largest job (the grid covers it); each job below 2^31 vectors.
            layer_vectors = group.kv_count * group.row_bytes // group.width
            max_vectors = 1
            offset = _PARAMS_HEAD.size
            pack = _JOB.pack_into
            for host, token_start, t_begin, num_tokens, l0, l1 in jobs:
                pack(params, offset, host, token_start, t_begin, num_tokens, l0, l1, 0)
                offset += _JOB.size
                vectors = (l1 - l0) * (num_tokens - t_begin) * layer_vectors
                if vectors > max_vectors:
                    max_vectors = vectors
            if max_vectors >= 1 << 31:
                raise LayoutError(f"copy job of {max_vectors} vectors exceeds the kernel's 2^31")
            per_cta = _THREADS * _UNROLL
            grid_x = max(1, min(-(-ctas // len(jobs)), -(-max_vectors // per_cta)))
            function = state.kernels.function("gather" if to_host else "scatter", group.width)
            check_driver(
                driver.cuLaunchKernel(
                    function,
                    grid_x,
                    len(jobs),
                    1,
                    _THREADS,
                    1,
                    1,
                    0,
                    stream,
                    ctypes.addressof(self._params_arg),
                    0,
                ),
                "cuLaunchKernel(tkv copy)",
            )

    def _enqueue_mapped(
        self,
        state: _DeviceState,
        plan: LayoutPlan,
        side: Direction,
        to_host: bool,
        device_ids: int,
        transfers: Sequence[ChunkTransfer],
        layers: Sequence[int] | None,
    ) -> None:
        """Kernels read or write the mapped host chunks: every layer (``layers`` None), or only
        those model layers."""
        ctas = self.options.mapped_ctas or 2 * state.sm_count
        block_size = plan.layout.block_size
        for group, ranges in _layer_ranges(plan, layers):
            jobs = []
            for transfer in transfers:
                obj = transfer.obj
                host = self._device_address(state, obj.arena) + obj.offset
                host += group_offset(obj, group)
                t_begin = 0 if to_host else transfer.skip_tokens
                # Jobs of at most 1 GiB keep the kernel's 32-bit vector indices in range.
                per_layer = group.slab_bytes(1, obj.num_tokens)
                step = max(1, JOB_MAX_BYTES // per_layer)
                for first, end in ranges:
                    for l0 in range(first, end, step):
                        l1 = min(end, l0 + step)
                        start = host + group.slab_bytes(l0, obj.num_tokens)
                        jobs.append((start, transfer.token_start, t_begin, obj.num_tokens, l0, l1))
            for batch in batches(jobs, MAX_JOBS):
                self._launch(
                    state, group, side.kernel_cu, to_host, block_size, device_ids, batch, ctas
                )

    async def _enqueue_staging(
        self,
        state: _DeviceState,
        plan: LayoutPlan,
        call: _Call,
        to_host: bool,
        device_ids: int,
        transfers: Sequence[ChunkTransfer],
    ) -> bool:
        """Returns whether the caller was cancelled at one of the yields (see `_enqueue`)."""
        side = call.side
        with self._lock:
            side.ensure_slots(max(self.options.staging_slot_bytes, plan.largest_layer))
        lead = LEAD_SLOTS * side.slot_bytes
        queued = 0
        cancelled = False
        fills = slot_fills(plan, transfers, side.slot_bytes, ramp_up=to_host, layers=call.layers)
        upcoming = next(fills, None)
        while upcoming is not None:
            fill = upcoming
            upcoming = next(fills, None)
            edge = not queued if to_host else upcoming is None
            nbytes = self._queue_fill(call, plan, fill, to_host, device_ids, edge)
            if call.trace is not None and not queued:
                call.trace["first_copy"] = time.perf_counter()
            queued += nbytes
            if queued >= lead and not cancelled:
                # A lead is queued: let a concurrent call of the other direction enqueue too.
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    cancelled = True  # finish enqueueing without yielding; the caller re-raises
                state.kernels.make_current()
        return cancelled

    def _enqueue_dma(
        self,
        plan: LayoutPlan,
        side: Direction,
        to_host: bool,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        layers: Sequence[int] | None,
    ) -> None:
        """One batched copy of the contiguous runs of every layer (or only model ``layers``)."""
        from cuda.bindings import driver

        dsts: list[Any] = []
        srcs: list[Any] = []
        sizes: list[int] = []
        for transfer in transfers:
            obj = transfer.obj
            host_base = obj.arena.base_ptr + obj.offset
            t_begin = 0 if to_host else transfer.skip_tokens
            for group, ranges in _layer_ranges(plan, layers):
                chunk_runs = runs(group, plan.layout.block_size, block_ids, transfer, t_begin)
                slab = group.slab_bytes(1, obj.num_tokens) // group.kv_count
                host_group = host_base + group_offset(obj, group)
                # host_ptrs is layer-major over (layer, K/V), like the host slabs.
                for first, end in ranges:
                    for lk in range(first * group.kv_count, end * group.kv_count):
                        paged = group.host_ptrs[lk]
                        host = host_group + lk * slab
                        for paged_off, host_off, nbytes in chunk_runs:
                            src, dst = paged + paged_off, host + host_off
                            if not to_host:
                                src, dst = dst, src
                            dsts.append(driver.CUdeviceptr(dst))
                            srcs.append(driver.CUdeviceptr(src))
                            sizes.append(nbytes)
        if not sizes:
            return
        attrs = driver.CUmemcpyAttributes()
        attrs.srcAccessOrder = driver.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        attrs.flags = driver.CUmemcpyFlags.CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        stream = driver.CUstream(side.dma_stream.cuda_stream)
        check_driver(
            driver.cuMemcpyBatchAsync(dsts, srcs, sizes, len(sizes), [attrs], [0], 1, stream),
            "cuMemcpyBatchAsync",
        )


class _LoadPull:
    """The staging enqueue of one layerwise load, pulled by whoever needs its next layer.

    `CudaMover._begin_pull` queues layers 0 to `MIN_LEAD_LAYERS` (or more, as mapped kernels)
    before the load is returned; the pull fills the ``layers`` it is given. Then ``pull(i)``
    queues, under the mover's lock, what layer ``i`` still lacks or else, when the lead is short
    or the GPU has model work to cover it, one fill toward layer ``i + ahead`` (``ahead``: the
    layers of `LEAD_SLOTS` slots, so the copy engine keeps a lead on the model); ``pull(None)``
    queues the rest. The model's thread pulls in ``wait_layer``, so while the model runs no
    other Python thread is busy enqueueing
    (`CudaLayerLoad` says why that matters); the loop pulls in ``enqueued``, in
    `CudaMover.aclose`, and in `fallback` once the copies should have ended, so a load nobody
    waits for still completes and releases its objects. Whichever pull queues the last fill
    records the call's end; `CudaMover._pull_ended` then hands it to the completion waiter on
    the loop."""

    def __init__(
        self,
        mover: CudaMover,
        call: _Call,
        plan: LayoutPlan,
        device_ids: int,
        transfers: Sequence[ChunkTransfer],
        loop: asyncio.AbstractEventLoop,
        layers: Sequence[int],
    ) -> None:
        side = call.side
        self.mover = mover
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
        self._device_ids = device_ids

    def __call__(self, layer: int | None) -> None:
        """Queue through ``layer`` (None: everything), and from the second wait on, when the
        GPU can spare the time, one fill of the lead beyond it. The first wait queues through
        its own layer only: until it returns the model has nothing on the GPU, so more would
        only delay its start. A later wait whose layer is queued already adds one fill toward
        ``layer + ahead`` only if the copies are short (fewer than `MIN_LEAD_LAYERS` layers
        queued beyond it) or the model's stream still has the previous layer ahead of it (the
        `mark` of the last wait not reached): a fill queued while the GPU is on the last layer
        launched leaves it idle until the next launch (docs/decisions/layerwise-loads-on-the-
        gpu.md). A wait whose layer is not queued yet queues just that layer."""
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
        with self.mover._lock:
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
                    self.mover._queue_fill(call, self._plan, fill, False, self._device_ids, edge)
                    self._upcoming = next(self._fills, None)
                call.buffers.done.record(call.side.kernel_stream)
            except BaseException as exc:  # what was queued finishes; the rest never runs
                error = exc
                load.error = exc
            self.ended = True
        if threading.get_ident() == self.loop_thread:
            self.mover._pull_ended(self, error)
        else:
            # A closed loop was closed after `CudaMover.aclose`, which ends every pull first.
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.mover._pull_ended, self, error)

    async def fallback(self, delay_s: float) -> None:
        """Queue whatever nobody pulled once the copies should have ended."""
        done, _ = await asyncio.wait([self.submitted], timeout=delay_s)
        if not done:
            self(None)


class _CudaLayerSave(LayerSave):
    """`CudaMover`'s layerwise gather: one `_Call` from the first `save` to `finish`."""

    def __init__(
        self,
        mover: CudaMover,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
    ) -> None:
        super().__init__(mover, layout, block_ids, transfers)
        self.cuda = mover
        self.layout = layout
        self.block_ids = list(block_ids)
        self.transfers = list(transfers)
        self.call: _Call | None = None
        self.plan: LayoutPlan | None = None
        self.device_ids = 0
        self.last_bytes = 0
        self.submitted = False

    def save(self, layer: int, after: Any = None) -> None:
        if self.transfers:
            self.cuda._save_layer(self, layer, after)

    async def finish(self) -> None:
        if self.call is not None:
            await self.cuda._finish_save(self)


def _layer_steps(call: _Call) -> list[tuple[int, ...] | None]:
    """How the mapped and DMA paths enqueue a call: whole (None), one step of all its layers, or
    one step per layer when a layerwise load needs an event after each."""
    if call.load is not None and call.layers is not None:
        return [(layer,) for layer in call.layers]
    return [call.layers]


def _record_layers(call: _Call, layers: tuple[int, ...] | None, stream: torch.cuda.Stream) -> None:
    if call.load is not None and layers is not None:
        for layer in layers:
            call.load.record_layer(layer, stream)


def _layer_ranges(
    plan: LayoutPlan, layers: Sequence[int] | None
) -> list[tuple[GroupPlan, list[tuple[int, int]]]]:
    """Per group, the [first, end) ranges of its local layers to move: all, or those of model
    ``layers`` (groups without any are left out)."""
    if layers is None:
        return [(group, [(0, group.num_layers)]) for group in plan.groups]
    places = plan.places
    local: dict[int, list[int]] = {}
    for layer in layers:
        index, position = places[layer]
        local.setdefault(index, []).append(position)
    out = []
    for index, positions in sorted(local.items()):
        ranges: list[tuple[int, int]] = []
        for position in sorted(positions):
            if ranges and ranges[-1][1] == position:
                ranges[-1] = (ranges[-1][0], position + 1)
            else:
                ranges.append((position, position + 1))
        out.append((plan.groups[index], ranges))
    return out


def _retrieved(result: asyncio.Future[float]) -> None:
    """A layerwise load's result may never be awaited: mark its exception as seen."""
    if not result.cancelled():
        result.exception()


def _new_call(
    state: _DeviceState,
    side: Direction,
    direction: str,
    held: list[MemoryObj],
    path: str,
    *,
    nbytes: int = 0,
    start: float | None = None,
    **fields: Any,
) -> _Call:
    """A call on ``side`` holding ``held`` and the pool's next buffers. The references come in
    taken (`_hold`) before the buffers are: a freed object fails the call before it costs the
    pool a buffer set."""
    return _Call(
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


def _hold(transfers: Sequence[ChunkTransfer]) -> list[MemoryObj]:
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
