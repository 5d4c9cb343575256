"""`CudaMover`: the mover for CUDA KV caches: NVRTC copy kernels and DMA on its own streams.

Owns the mover's public verbs and what they share: per device a `DeviceState` (device.py), the
lock that serializes enqueues on a staging ring, the launch parameters and the current context
(`Launcher`, launch.py), the calls on the GPU (`CallTracker`, calls.py), the staging layerwise
loads not yet queued (`LayerwiseLoads`, layerwise.py) and the tasks that enqueue other
layerwise loads. A whole call is enqueued here in the caller's task, on one of three paths
(docs/architecture.md, "GPU mover"): ``staging`` (launch.py, staging.py), ``mapped``
(launch.py) or ``dma`` (dma.py); ``auto`` picks per layout (`choose_path`). It packs no
launch and builds no copy itself, and releases no call before the GPU is done with it.

Ordering: a gather waits (on the GPU) for an event recorded on the caller's current stream;
after a scatter the caller's current stream waits on the load's event. The mover holds
references to every object until the GPU is done with it, so callers may be cancelled at any
time. The verbs belong to one event loop; only a layerwise load's ``wait_layer`` runs on other
threads (layerwise.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from tiered_kv.errors import LayoutError
from tiered_kv.gpu.base import (
    ChunkTransfer,
    KVMover,
    LayerLoad,
    LayerSave,
    check_layers,
)
from tiered_kv.gpu.calls import Call, CallTracker, hold, new_call, retrieved
from tiered_kv.gpu.device import DeviceState, MoverOptions
from tiered_kv.gpu.dma import enqueue_dma
from tiered_kv.gpu.events import CallBuffers, CudaLayerLoad
from tiered_kv.gpu.kernels import load_kernels, release_kernels
from tiered_kv.gpu.launch import Launcher
from tiered_kv.gpu.layerwise import CudaLayerSave, LayerwiseLoads
from tiered_kv.gpu.plan import (
    PATHS,
    CallDirection,
    LayoutPlan,
    MoverPath,
    block_span,
    choose_path,
    moved_bytes,
    moves_at_most,
)
from tiered_kv.layout import KVCacheLayout
from tiered_kv.memory import MemoryObj

__all__ = ["PATHS", "CudaMover", "MoverOptions", "choose_path"]


class CudaMover(KVMover):
    """Kernels and DMA for CUDA caches. One instance serves every device it is handed.

    ``launcher`` launches its copy kernels (its ``before_fill_launch`` is a seam for tests)."""

    name = "cuda"

    def __init__(self, options: MoverOptions | None = None) -> None:
        self.options = options or MoverOptions()
        self._devices: dict[int, DeviceState] = {}
        self._calls = CallTracker()
        # Set to a list to record, per call, enqueue time, GPU time and total (benchmarks only:
        # it adds events on the caller's stream).
        self.trace: list[dict[str, Any]] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # layerwise loads still enqueueing
        # The staging rings, the launch parameters and the current context: the loop enqueues,
        # and so does the thread that waits for a layerwise load (`LoadPull`).
        self.launcher = Launcher(self.options, threading.RLock())
        self._loads = LayerwiseLoads(self.launcher, self._calls)

    # -- public --------------------------------------------------------------------------------
    def prepare(self, layout: KVCacheLayout) -> None:
        """Load (or compile) the kernels, create the streams, plan the layout and allocate the
        staging slots and two calls' block-table buffers, so the first transfer pays none of it."""
        state = self.device_state(layout.device)
        plan = state.plan(layout)
        if plan.path == "staging":
            with self.launcher.lock:  # a layerwise load's waiter may be queueing on the load ring
                for side in (state.store, state.load):
                    state.ensure_slots(side, plan)
        while len(state.buffers) < 2:
            state.buffers.append(CallBuffers(state.device))
        for buffers in state.buffers:
            buffers.reserve(layout.num_blocks)

    def forget(self, layout: KVCacheLayout) -> None:
        """Drop ``layout``'s plan (which holds the layout and so its KV tensors)."""
        for state in self._devices.values():
            state.forget(layout)

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
        queued by whoever waits for them (`LayerwiseLoads`): the model's thread in
        ``wait_layer``, the loop in ``enqueued``/``wait``, or the loop once the copies should
        have ended. The other paths queue everything here. The references to the objects are
        taken here."""
        state = self.device_state(layout.device)
        load = CudaLayerLoad(state.device, layout.num_layers)
        if not transfers:
            load.end_enqueue(None)
            return load
        plan = state.plan(layout)
        if plan.path == "staging":
            return self._loads.begin(state, plan, list(block_ids), list(transfers), load)
        held = hold(transfers)
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

    def begin_gather(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> LayerSave:
        """One call for the whole layerwise gather: each `save` enqueues that layer's fills at
        once (no completion per layer), and `finish` waits for the last copy."""
        return CudaLayerSave(
            self,
            layout,
            block_ids,
            transfers,
            device_state=self.device_state,
            launcher=self.launcher,
            calls=self._calls,
        )

    def stats(self) -> dict[str, int | float]:
        return {
            **self._calls.counters,
            **self.launcher.counters,
            "completion_polls": self._calls.waiter.polls,
            "completion_pokes": self._calls.waiter.pokes,
        }

    async def aclose(self) -> None:
        """Wait for calls still on the GPU (their callers may be gone), then stop the thread."""
        await self._loads.aclose()  # layerwise loads nobody waited for: queue the rest
        while self._tasks:
            await asyncio.wait(list(self._tasks))
        await self._calls.drain()
        self._calls.close()
        devices, self._devices = self._devices, {}
        for index, state in devices.items():
            state.plans.clear()
            release_kernels(index)

    def device_state(self, device: torch.device) -> DeviceState:
        """``device``'s state, made on first use (kernels loaded, streams created)."""
        if device.type != "cuda":
            raise LayoutError(f"CudaMover moves CUDA caches only; these live on {device}")
        index = device.index if device.index is not None else torch.cuda.current_device()
        state = self._devices.get(index)
        if state is None:
            kernels = load_kernels(index)
            state = DeviceState(torch.device("cuda", index), kernels, self.options)
            self._devices[index] = state
        return state

    # -- one call ------------------------------------------------------------------------------
    def _call_path(
        self,
        plan: LayoutPlan,
        transfers: Sequence[ChunkTransfer],
        to_host: bool,
        *,
        whole: bool,
    ) -> MoverPath:
        """The layout's path, but under ``auto`` a whole call of at most ``small_call_bytes`` on
        a staging layout, its objects pinned, runs as mapped kernels (`MoverOptions`)."""
        options = self.options
        if (
            whole
            and options.path == "auto"
            and plan.path == "staging"
            and moves_at_most(transfers, to_host, options.small_call_bytes)
            and all(t.obj.arena.pinned for t in transfers)
        ):
            return "mapped"
        return plan.path

    async def _move(
        self,
        direction: CallDirection,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        *,
        layers: tuple[int, ...] | None = None,
        after: Any = None,
        load: CudaLayerLoad | None = None,
        held: list[MemoryObj] | None = None,
    ) -> None:
        """Enqueue the call in the caller's task, hand it to the tracker and await the result
        (a layerwise ``load`` gets the result instead, and the caller returns once the call is
        enqueued). The call owns references to its objects and its buffers until the GPU is
        done, whatever happens to the caller: cancelled while enqueueing, the call is still
        enqueued whole; cancelled while awaiting, the caller returns at once."""
        if not transfers:
            return
        start = time.perf_counter()
        state = self.device_state(layout.device)
        plan = state.plan(layout)
        span = block_span(layout.block_size, transfers, len(block_ids))
        to_host = direction == "gather"
        side = state.store if to_host else state.load
        loop = asyncio.get_running_loop()
        call = new_call(
            state,
            side,
            direction,
            hold(transfers) if held is None else held,
            self._call_path(plan, transfers, to_host, whole=layers is None and load is None),
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
        caller = state.current_stream()
        try:
            cancelled = await self._enqueue(call, plan, caller, to_host, block_ids, span, transfers)
        except BaseException:
            # Part of the call may be queued and still touch the objects: let it finish.
            torch.cuda.synchronize(state.device)
            call.release()
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
        self._calls.submit(call, predicted_start, predicted, loop, awaited=load is None)
        if load is not None:
            load.result = call.result
            call.result.add_done_callback(retrieved)
        if cancelled:
            self._calls.hand_over(call)  # its caller will not watch it
            raise asyncio.CancelledError
        if load is not None:
            return
        seen = await self._calls.wait(call)
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

    async def _enqueue(
        self,
        call: Call,
        plan: LayoutPlan,
        caller: torch.cuda.Stream,
        to_host: bool,
        block_ids: Sequence[int],
        span: tuple[int, int],
        transfers: Sequence[ChunkTransfer],
    ) -> bool:
        """Queue the whole call on the GPU, ending with ``call.buffers.done``. Staging yields to
        the loop between fills once a lead is queued; each fill is atomic, and the slot events
        keep the ring ordered across calls. Returns whether the caller was cancelled meanwhile
        (the call is enqueued whole regardless)."""
        state, side, buffers = call.state, call.side, call.buffers
        state.kernels.make_current()
        if call.trace is not None:
            call.trace["gpu_start"] = begin = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            begin.record(caller)
            call.trace["recorded"] = time.perf_counter()
        call.open(caller, to_host)
        if call.path == "dma":
            for layers in call.layer_steps():
                enqueue_dma(plan, side, to_host, block_ids, transfers, layers)
                call.record_layers(layers, side.dma_stream)
            buffers.done.record(side.dma_stream)
            return False
        table = self.launcher.block_table(call, block_ids, span, side.kernel_cu)
        if call.trace is not None:
            call.trace["ids"] = time.perf_counter()
        if call.path == "mapped":
            ctas = self.options.small_call_ctas if plan.path != "mapped" else 0
            for layers in call.layer_steps():
                self.launcher.enqueue_mapped(
                    state, plan, side, to_host, table, transfers, layers, ctas
                )
                call.record_layers(layers, side.kernel_stream)
            buffers.done.record(side.kernel_stream)
            return False
        cancelled = await self.launcher.enqueue_staging(plan, call, to_host, table, transfers)
        # Gathers end with a DMA, scatters with a kernel; each waited for the other.
        buffers.done.record(side.dma_stream if to_host else side.kernel_stream)
        return cancelled
