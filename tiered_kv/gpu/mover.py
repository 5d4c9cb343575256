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

import array
import asyncio
import ctypes
import dataclasses
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from tiered_kv.errors import LayoutError, TieredKVError
from tiered_kv.gpu.base import ChunkTransfer, KVMover
from tiered_kv.gpu.completion import CompletionWaiter, TransferClock
from tiered_kv.gpu.kernels import (
    COPY_WIDTHS,
    DeviceKernels,
    check_driver,
    load_kernels,
    release_kernels,
)
from tiered_kv.layout import KVCacheLayout, LayerGroup
from tiered_kv.memory import HostArena, MemoryObj

PATHS = ("staging", "mapped", "dma")
MAX_JOBS = 32  # TKV_MAX_JOBS in cuda_src/tkv_copy.cu
_PARAMS_HEAD = struct.Struct("<QQqqqiiiiii")  # TkvParams up to jobs[]
_JOB = struct.Struct("<Qiiiiii")  # TkvJob
_PARAMS_SIZE = _PARAMS_HEAD.size + MAX_JOBS * _JOB.size
_THREADS = 256
_UNROLL = 4  # TKV_UNROLL
JOB_MAX_BYTES = 1 << 30
RAMP_STEPS = 3  # staging fills ramp from (or down to) slot/8: see `_slot_fills`
LEAD_SLOTS = 2  # staging enqueues this many slots' worth before yielding to the loop
EDGE_CTA_FACTOR = 4  # CTAs of the first (gather) or last (scatter) kernel, times staging_ctas
# `auto` uses the DMA-only path when a chunk's contiguous runs average at least this many bytes:
# below it the copy engines spend their time on descriptors. Measured (bench/transfer.py, H100,
# 32-chunk calls, whole-block runs): DMA reached 58% / 79% / 90% of the PCIe ceiling with 64 KiB /
# 256 KiB / 1 MiB runs, while staging reached 97-98% for each, so DMA stays off up to there.
DMA_MIN_RUN_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class MoverOptions:
    """``path``: ``auto`` or one of `PATHS`. Staging uses ``staging_slots`` GPU buffers of
    ``staging_slot_bytes`` per direction (grown to one layer's slab when that is larger) and
    ``staging_ctas`` thread blocks per launch; ``mapped_ctas`` (0: two per SM) for the mapped
    path, which needs many loads in flight to cover PCIe latency."""

    path: str = "auto"
    staging_slot_bytes: int = 32 << 20
    staging_slots: int = 3
    staging_ctas: int = 32
    mapped_ctas: int = 0

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
        if self.staging_ctas < 1 or self.mapped_ctas < 0:
            raise ValueError(
                f"MoverOptions: staging_ctas must be >= 1 and mapped_ctas >= 0, got "
                f"{self.staging_ctas}, {self.mapped_ctas}"
            )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _GroupPlan:
    """How to move one layer group: strides in bytes, vector width, device pointer table."""

    group: LayerGroup
    width: int
    host_ptrs: tuple[int, ...]  # [L * K] paged base addresses, layer-major
    layer_ptrs: torch.Tensor  # the same, int64 on the device (the kernel's table)
    block_stride: int
    pos_stride: int
    head_stride: int
    head_bytes: int
    row_bytes: int
    num_heads: int
    kv_count: int
    num_layers: int
    # Where a block's rows are contiguous (NHD-like) and that allows a wider vector: the same
    # group seen with one row per block (block_size x row_bytes bytes), for jobs whose token
    # ranges fall on block boundaries. 132-byte int8 rows copy at 16 bytes instead of 4.
    block_rows: _GroupPlan | None = None

    def slab_bytes(self, num_layers: int, num_tokens: int) -> int:
        return num_layers * self.kv_count * num_tokens * self.row_bytes


def group_plan(group: LayerGroup, device: torch.device) -> _GroupPlan:
    """Byte strides, copy width and pointer table of one layer group."""
    s = group.strides
    item = group.host.dtype.itemsize
    ptrs = tuple(p for layer in group.kv_pointers() for p in layer)
    head_bytes = s.head_size * item
    row_bytes = group.host.row_bytes
    strides = (s.block_stride * item, s.pos_stride * item, s.head_stride * item)
    plan = _GroupPlan(
        group=group,
        width=copy_width(head_bytes, *strides, *ptrs),
        host_ptrs=ptrs,
        layer_ptrs=torch.tensor(ptrs, dtype=torch.int64, device=device),
        block_stride=strides[0],
        pos_stride=strides[1],
        head_stride=strides[2],
        head_bytes=head_bytes,
        row_bytes=row_bytes,
        num_heads=s.num_heads,
        kv_count=group.host.kv_count,
        num_layers=group.host.num_layers,
    )
    block_row = s.block_size * row_bytes
    if (s.num_heads == 1 or strides[2] == head_bytes) and strides[1] == row_bytes:
        width = copy_width(block_row, strides[0], *ptrs)
        if width > plan.width:
            block_rows = dataclasses.replace(
                plan,
                width=width,
                pos_stride=strides[0],
                head_stride=block_row,
                head_bytes=block_row,
                row_bytes=block_row,
                num_heads=1,
            )
            plan = dataclasses.replace(plan, block_rows=block_rows)
    return plan


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _LayoutPlan:
    layout: KVCacheLayout  # keeps the layout (and its tensors) alive while the plan is cached
    groups: tuple[_GroupPlan, ...]
    path: str
    # Bytes of the largest one-layer slab of a chunk: no staging slot may be smaller.
    largest_layer: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        chunk = self.layout.layout_desc.chunk_size
        object.__setattr__(self, "largest_layer", max(g.slab_bytes(1, chunk) for g in self.groups))


def copy_width(*values: int) -> int:
    """The widest copy width in `COPY_WIDTHS` dividing every value (sizes, strides, addresses)."""
    for width in COPY_WIDTHS:
        if all(value % width == 0 for value in values):
            return width
    return 1


def choose_path(layout: KVCacheLayout, requested: str = "auto") -> str:
    """``auto``: DMA only when every group's rows are contiguous over a whole block (NHD-like), so
    a chunk is a few long runs; otherwise staging, which reaches the DMA ceiling for any layout
    while using few SMs. The mapped path is never the default: it competes with the model for
    SMs for the whole transfer (bench/transfer.py measures the matmul slowdown)."""
    if requested != "auto":
        return requested
    for group in layout.groups:
        s = group.strides
        item = group.host.dtype.itemsize
        row = s.num_heads * s.head_size * item
        block_run = s.block_size * row
        contiguous = s.head_stride == s.head_size and s.pos_stride * item == row
        if not contiguous or block_run < DMA_MIN_RUN_BYTES:
            return "staging"
    return "dma"


class _Direction:
    """One direction's streams (kernel + DMA), staging ring and its events, and the clock that
    predicts when its queued calls finish."""

    def __init__(self, device: torch.device, priority: int, slots: int) -> None:
        from cuda.bindings import driver

        self.kernel_stream = torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]
        self.dma_stream = torch.cuda.Stream(device, priority=priority)  # type: ignore[no-untyped-call]
        self.kernel_cu = driver.CUstream(self.kernel_stream.cuda_stream)
        self.dma_cu = driver.CUstream(self.dma_stream.cuda_stream)
        self.slots: list[torch.Tensor] = []
        self.slot_bytes = 0
        self.filled = [torch.cuda.Event() for _ in range(slots)]  # type: ignore[no-untyped-call]
        self.freed = [torch.cuda.Event() for _ in range(slots)]  # type: ignore[no-untyped-call]
        self.used = [False] * slots
        self.next_slot = 0
        self.device = device
        self.slot_count = slots
        self.clock = TransferClock()

    def ensure_slots(self, nbytes: int) -> None:
        """Staging slots of at least ``nbytes`` each; reallocating waits for the old ones' use."""
        if nbytes <= self.slot_bytes:
            return
        if self.slots:
            torch.cuda.synchronize(self.device)
        self.slots = [
            torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            for _ in range(self.slot_count)
        ]
        self.slot_bytes = nbytes
        self.used = [False] * self.slot_count


class _CallBuffers:
    """What one call owns until the GPU is done with it: its block table (pinned host copy and
    device copy) and its timing events. Pooled per device, so a call allocates nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capacity = 0
        self.host_ids = torch.empty(0, dtype=torch.int32)
        self.device_ids = torch.empty(0, dtype=torch.int32, device=device)
        self.ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.begun = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self.done = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def reserve(self, count: int) -> None:
        """Room for ``count`` block ids (only while the buffers are not in a call's use)."""
        if count > self.capacity:
            self.capacity = max(count, 2 * self.capacity, 1024)
            self.host_ids = torch.empty(self.capacity, dtype=torch.int32, pin_memory=True)
            self.device_ids = torch.empty(self.capacity, dtype=torch.int32, device=self.device)

    def upload_ids(self, block_ids: Sequence[int], stream: Any) -> int:
        """Queue the block table's copy to the device on ``stream``; returns its device address.
        The pinned source stays untouched until the call completes (the buffers are the call's)."""
        from cuda.bindings import driver

        try:
            ids = array.array("i", block_ids)
        except OverflowError as exc:
            raise LayoutError(f"block ids must fit in int32: {exc}") from None
        self.reserve(len(ids))
        nbytes = len(ids) * ids.itemsize
        ctypes.memmove(self.host_ids.data_ptr(), ids.buffer_info()[0], nbytes)
        check_driver(
            driver.cuMemcpyHtoDAsync(
                self.device_ids.data_ptr(), self.host_ids.data_ptr(), nbytes, stream
            ),
            "cuMemcpyHtoDAsync(block ids)",
        )
        return self.device_ids.data_ptr()


class _DeviceState:
    def __init__(self, device: torch.device, kernels: DeviceKernels, options: MoverOptions) -> None:
        self.device = device
        self.kernels = kernels
        _, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        self.store = _Direction(device, 0, options.staging_slots)
        self.load = _Direction(device, high, options.staging_slots)
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self.host_delta: dict[int, int] = {}  # arena base → device address minus host address
        self.plans: dict[int, _LayoutPlan] = {}
        self.buffers: list[_CallBuffers] = []  # free ones

    def take_buffers(self) -> _CallBuffers:
        return self.buffers.pop() if self.buffers else _CallBuffers(self.device)


@dataclasses.dataclass(eq=False, slots=True)
class _Call:
    """One gather or scatter from enqueue to release."""

    direction: str
    state: _DeviceState
    side: _Direction
    buffers: _CallBuffers
    held: list[MemoryObj]
    nbytes: int
    result: asyncio.Future[float]
    trace: dict[str, Any] | None = None


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
        self._idle: asyncio.Future[None] | None = None
        self._params = ctypes.create_string_buffer(_PARAMS_SIZE)
        self._params_arg = (ctypes.c_void_p * 1)(ctypes.addressof(self._params))

    # -- public --------------------------------------------------------------------------------
    def prepare(self, layout: KVCacheLayout) -> None:
        """Load (or compile) the kernels, create the streams, plan the layout and allocate the
        staging slots and two calls' block-table buffers, so the first transfer pays none of it."""
        state = self._state(layout.device)
        plan = self._plan(state, layout)
        if plan.path == "staging":
            for side in (state.store, state.load):
                side.ensure_slots(max(self.options.staging_slot_bytes, plan.largest_layer))
        while len(state.buffers) < 2:
            state.buffers.append(_CallBuffers(state.device))
        for buffers in state.buffers:
            buffers.reserve(layout.num_blocks)

    def forget(self, layout: KVCacheLayout) -> None:
        """Drop ``layout``'s plan (which holds the layout and so its KV tensors)."""
        for state in self._devices.values():
            plan = state.plans.get(id(layout))
            if plan is not None and plan.layout is layout:
                del state.plans[id(layout)]

    async def gather(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        await self._move("gather", layout, block_ids, transfers)

    async def scatter(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        await self._move("scatter", layout, block_ids, transfers)

    def stats(self) -> dict[str, int | float]:
        return {
            **self._counters,
            "completion_polls": self._waiter.polls,
            "completion_pokes": self._waiter.pokes,
        }

    async def aclose(self) -> None:
        """Wait for calls still on the GPU (their callers may be gone), then stop the thread."""
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

    def _plan(self, state: _DeviceState, layout: KVCacheLayout) -> _LayoutPlan:
        plan = state.plans.get(id(layout))
        if plan is not None and plan.layout is layout:
            return plan
        groups = tuple(group_plan(group, state.device) for group in layout.groups)
        plan = _LayoutPlan(layout, groups, choose_path(layout, self.options.path))
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
    ) -> None:
        """Enqueue the call in the caller's task, hand its completion event to the waiter and
        await the result. The call owns references to its objects and its buffers until the
        waiter has seen the GPU finish (`_finish`), whatever happens to the caller: cancelled
        while enqueueing, the call is still enqueued whole; cancelled while awaiting, the caller
        returns at once."""
        if not transfers:
            return
        start = time.perf_counter()
        state = self._state(layout.device)
        plan = self._plan(state, layout)
        to_host = direction == "gather"
        side = state.store if to_host else state.load
        loop = asyncio.get_running_loop()
        held = _hold(transfers)
        call = _Call(
            direction=direction,
            state=state,
            side=side,
            buffers=state.take_buffers(),
            held=held,
            nbytes=0,  # counted once the call is queued: the first DMA should not wait
            result=loop.create_future(),
            trace={} if self.trace is not None else None,
        )
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
        call.nbytes = sum(_moved_bytes(t, to_host) for t in transfers)
        if not to_host:
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
        if cancelled:
            raise asyncio.CancelledError
        seen = await call.result
        self._counters[f"{direction}_{plan.path}_bytes"] += call.nbytes
        self._counters[f"{direction}_{plan.path}_calls"] += 1
        self._counters[f"{direction}_seconds"] += time.perf_counter() - start
        self._counters["bytes_gathered" if to_host else "bytes_scattered"] += call.nbytes
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
        learn the rate, release, hand the caller its result."""
        buffers = call.buffers
        if call.trace is not None:
            call.trace["finish"] = time.perf_counter()
        if error is None:
            call.side.clock.observe(call.nbytes, buffers.begun.elapsed_time(buffers.done) / 1e3)
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

    def _release(self, call: _Call) -> None:
        for obj in call.held:
            obj.unref()
        call.held = []
        call.state.buffers.append(call.buffers)

    async def _enqueue(
        self,
        call: _Call,
        plan: _LayoutPlan,
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
        ready = buffers.ready
        ready.record(caller)
        # Whatever first touches the paged cache waits for the caller's queued work: the kernels,
        # or the copies on the DMA-only path. (Staging DMAs are ordered through the slot events.)
        first = side.dma_stream if plan.path == "dma" else side.kernel_stream
        first.wait_event(ready)
        # `begun` precedes all of the call's GPU work (a staging scatter starts with DMAs that
        # need not wait for the caller), so the clock never learns a rate faster than the link.
        opening = side.dma_stream if plan.path == "staging" and not to_host else first
        buffers.begun.record(opening)
        if plan.path == "dma":
            self._enqueue_dma(state, plan, side, to_host, block_ids, transfers)
            buffers.done.record(side.dma_stream)
            return False
        device_ids = buffers.upload_ids(block_ids, side.kernel_cu)
        if call.trace is not None:
            call.trace["ids"] = time.perf_counter()
        if plan.path == "mapped":
            self._enqueue_mapped(state, plan, side, to_host, device_ids, transfers)
            buffers.done.record(side.kernel_stream)
            return False
        cancelled = await self._enqueue_staging(
            state, plan, side, to_host, device_ids, transfers, call.trace
        )
        # Gathers end with a DMA, scatters with a kernel; each waited for the other.
        buffers.done.record(side.dma_stream if to_host else side.kernel_stream)
        return cancelled

    # -- paths ---------------------------------------------------------------------------------
    def _launch(
        self,
        state: _DeviceState,
        group: _GroupPlan,
        stream: Any,
        to_host: bool,
        block_size: int,
        device_ids: int,
        jobs: Sequence[tuple[int, int, int, int, int, int]],
        ctas: int,
    ) -> None:
        """One launch of the copy kernel over up to `MAX_JOBS` jobs of one group, on ``stream``
        (a ``CUstream``). The parameter block is packed into one reused buffer: the driver copies
        it at launch."""
        from cuda.bindings import driver

        if group.block_rows is not None and all(
            job[1] % block_size == 0 and job[2] % block_size == 0 and job[3] % block_size == 0
            for job in jobs
        ):
            # Whole blocks only: copy them as one wide row each (tokens become blocks).
            group = group.block_rows
            jobs = [
                (host, start // block_size, t0 // block_size, n // block_size, l0, l1)
                for host, start, t0, n, l0, l1 in jobs
            ]
            block_size = 1
            self._counters["kernel_launches_block_rows"] += 1
        self._counters["kernel_launches"] += 1
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
        max_vectors = 1
        for i, (host, token_start, t_begin, num_tokens, l0, l1) in enumerate(jobs):
            _JOB.pack_into(
                params,
                _PARAMS_HEAD.size + i * _JOB.size,
                host,
                token_start,
                t_begin,
                num_tokens,
                l0,
                l1,
                0,
            )
            vectors = (l1 - l0) * group.kv_count * (num_tokens - t_begin) * group.row_bytes
            vectors //= group.width
            if vectors >= 1 << 31:
                raise LayoutError(f"copy job of {vectors} vectors exceeds the kernel's 2^31")
            max_vectors = max(max_vectors, vectors)
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
        plan: _LayoutPlan,
        side: _Direction,
        to_host: bool,
        device_ids: int,
        transfers: Sequence[ChunkTransfer],
    ) -> None:
        ctas = self.options.mapped_ctas or 2 * state.sm_count
        block_size = plan.layout.block_size
        for group in plan.groups:
            jobs = []
            for transfer in transfers:
                obj = transfer.obj
                host = self._device_address(state, obj.arena) + obj.offset
                host += _group_offset(obj, group)
                t_begin = 0 if to_host else transfer.skip_tokens
                # Jobs of at most 1 GiB keep the kernel's 32-bit vector indices in range.
                per_layer = group.slab_bytes(1, obj.num_tokens)
                step = max(1, JOB_MAX_BYTES // per_layer)
                for l0 in range(0, group.num_layers, step):
                    l1 = min(group.num_layers, l0 + step)
                    start = host + group.slab_bytes(l0, obj.num_tokens)
                    jobs.append((start, transfer.token_start, t_begin, obj.num_tokens, l0, l1))
            for batch in _batches(jobs, MAX_JOBS):
                self._launch(
                    state, group, side.kernel_cu, to_host, block_size, device_ids, batch, ctas
                )

    async def _enqueue_staging(
        self,
        state: _DeviceState,
        plan: _LayoutPlan,
        side: _Direction,
        to_host: bool,
        device_ids: int,
        transfers: Sequence[ChunkTransfer],
        trace: dict[str, Any] | None = None,
    ) -> bool:
        """Returns whether the caller was cancelled at one of the yields (see `_enqueue`)."""
        from cuda.bindings import driver

        block_size = plan.layout.block_size
        ctas = self.options.staging_ctas
        side.ensure_slots(max(self.options.staging_slot_bytes, plan.largest_layer))
        dma = side.dma_cu
        lead = LEAD_SLOTS * side.slot_bytes
        queued = 0
        cancelled = False
        fills = _slot_fills(plan, transfers, side.slot_bytes, ramp_up=to_host)
        upcoming = next(fills, None)
        while upcoming is not None:
            group, pieces = upcoming
            upcoming = next(fills, None)
            # The one kernel nothing overlaps (a gather's first, a scatter's last) gets more
            # CTAs: a few microseconds of SMs to take that much off the call.
            edge = not queued if to_host else upcoming is None
            fill_ctas = ctas * EDGE_CTA_FACTOR if edge else ctas
            slot = side.next_slot
            side.next_slot = (slot + 1) % side.slot_count
            base = side.slots[slot].data_ptr()
            jobs = []
            copies: list[tuple[int, int, int]] = []  # (host, slot address, bytes)
            offset = 0
            for transfer, l0, l1 in pieces:
                obj = transfer.obj
                nbytes = group.slab_bytes(l1 - l0, obj.num_tokens)
                host = obj.arena.base_ptr + obj.offset + _group_offset(obj, group)
                host += group.slab_bytes(l0, obj.num_tokens)
                t_begin = 0 if to_host else transfer.skip_tokens
                # The job's slab starts at layer l0 inside the slot.
                jobs.append((base + offset, transfer.token_start, t_begin, obj.num_tokens, l0, l1))
                if copies and copies[-1][0] + copies[-1][2] == host:
                    # Adjacent on the host too (consecutive layers, or neighbouring objects):
                    # one DMA.
                    copies[-1] = (copies[-1][0], copies[-1][1], copies[-1][2] + nbytes)
                else:
                    copies.append((host, base + offset, nbytes))
                offset += nbytes
            if to_host:
                if side.used[slot]:
                    side.kernel_stream.wait_event(side.freed[slot])
                self._launch(
                    state, group, side.kernel_cu, True, block_size, device_ids, jobs, fill_ctas
                )
                side.filled[slot].record(side.kernel_stream)
                side.dma_stream.wait_event(side.filled[slot])
                for host, dev, nbytes in copies:
                    check_driver(driver.cuMemcpyAsync(host, dev, nbytes, dma), "cuMemcpyAsync")
                side.freed[slot].record(side.dma_stream)
            else:
                if side.used[slot]:
                    side.dma_stream.wait_event(side.freed[slot])
                for host, dev, nbytes in copies:
                    check_driver(driver.cuMemcpyAsync(dev, host, nbytes, dma), "cuMemcpyAsync")
                side.filled[slot].record(side.dma_stream)
                side.kernel_stream.wait_event(side.filled[slot])
                self._launch(
                    state, group, side.kernel_cu, False, block_size, device_ids, jobs, fill_ctas
                )
                side.freed[slot].record(side.kernel_stream)
            side.used[slot] = True
            if trace is not None and not queued:
                trace["first_copy"] = time.perf_counter()
            queued += offset
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
        state: _DeviceState,
        plan: _LayoutPlan,
        side: _Direction,
        to_host: bool,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
    ) -> None:
        from cuda.bindings import driver

        dsts: list[Any] = []
        srcs: list[Any] = []
        sizes: list[int] = []
        for transfer in transfers:
            obj = transfer.obj
            host_base = obj.arena.base_ptr + obj.offset
            t_begin = 0 if to_host else transfer.skip_tokens
            for group in plan.groups:
                runs = _runs(group, plan.layout.block_size, block_ids, transfer, t_begin)
                slab = group.slab_bytes(1, obj.num_tokens) // group.kv_count
                host_group = host_base + _group_offset(obj, group)
                # host_ptrs is layer-major over (layer, K/V), like the host slabs.
                for lk, paged in enumerate(group.host_ptrs):
                    host = host_group + lk * slab
                    for paged_off, host_off, nbytes in runs:
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


def _moved_bytes(transfer: ChunkTransfer, to_host: bool) -> int:
    obj = transfer.obj
    if to_host or not transfer.skip_tokens:
        return obj.nbytes
    return obj.nbytes * (obj.num_tokens - transfer.skip_tokens) // obj.num_tokens


def _group_offset(obj: MemoryObj, group: _GroupPlan) -> int:
    return obj.layout.group_offsets(obj.num_tokens)[group.group.index]


def _batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _slot_fills(
    plan: _LayoutPlan, transfers: Sequence[ChunkTransfer], slot_bytes: int, *, ramp_up: bool
) -> Iterator[tuple[_GroupPlan, list[tuple[ChunkTransfer, int, int]]]]:
    """Pack (chunk, layer range) pieces of one group at a time into staging slots: each fill is
    at most ``slot_bytes`` and `MAX_JOBS` pieces, and becomes one launch plus its DMAs. The part
    of a call that nothing overlaps is kept short: a gather (kernel, then DMA) ramps up, its first
    fills 1/8, 1/4 and 1/2 of a slot, so the first DMA starts early; a scatter (DMA, then kernel)
    ramps down, each fill of the last slot's worth taking half of what is left (down to 1/8 of a
    slot), so the last kernel is short."""
    fills = 0
    remaining = 0
    if not ramp_up:
        remaining = sum(
            g.slab_bytes(g.num_layers, t.obj.num_tokens) for g in plan.groups for t in transfers
        )
    cap = 0

    def capacity() -> int:
        if ramp_up:
            return slot_bytes >> max(0, RAMP_STEPS - fills)
        if remaining > slot_bytes:
            return slot_bytes
        return max(slot_bytes >> RAMP_STEPS, remaining // 2)

    for group in plan.groups:
        fill: list[tuple[ChunkTransfer, int, int]] = []
        used = 0
        for transfer in transfers:
            per_layer = group.slab_bytes(1, transfer.obj.num_tokens)
            if per_layer > slot_bytes:
                raise ValueError(f"staging slot of {slot_bytes} bytes < one layer's {per_layer}")
            layer = 0
            while layer < group.num_layers:
                if not fill:
                    cap = capacity()
                room = (max(cap, per_layer) - used) // per_layer
                if room <= 0 or len(fill) == MAX_JOBS:
                    yield group, fill
                    fills += 1
                    remaining -= used
                    fill, used = [], 0
                    continue
                end = min(group.num_layers, layer + room)
                fill.append((transfer, layer, end))
                used += (end - layer) * per_layer
                layer = end
        if fill:
            yield group, fill
            fills += 1
            remaining -= used


def _runs(
    group: _GroupPlan,
    block_size: int,
    block_ids: Sequence[int],
    transfer: ChunkTransfer,
    t_begin: int,
) -> list[tuple[int, int, int]]:
    """Maximal (paged offset, host offset, bytes) runs contiguous on both sides, for one
    (layer, K/V) of one chunk; the same for every layer of the group. Walks block segments, so
    NHD costs one step per block, not per token."""
    head_bytes, row = group.head_bytes, group.row_bytes
    rows_contiguous = group.head_stride == head_bytes
    tokens_contiguous = rows_contiguous and group.pos_stride == row
    runs: list[list[int]] = []

    def add(paged: int, host: int, nbytes: int) -> None:
        if runs:
            last = runs[-1]
            if last[0] + last[2] == paged and last[1] + last[2] == host:
                last[2] += nbytes
                return
        runs.append([paged, host, nbytes])

    t = t_begin
    end = transfer.obj.num_tokens
    while t < end:
        pos = transfer.token_start + t
        in_block = pos % block_size
        count = min(block_size - in_block, end - t)
        base = int(block_ids[pos // block_size]) * group.block_stride
        if tokens_contiguous:
            add(base + in_block * group.pos_stride, t * row, count * row)
        else:
            for i in range(count):
                paged = base + (in_block + i) * group.pos_stride
                if rows_contiguous:
                    add(paged, (t + i) * row, row)
                else:
                    for h in range(group.num_heads):
                        add(
                            paged + h * group.head_stride,
                            (t + i) * row + h * head_bytes,
                            head_bytes,
                        )
        t += count
    return [(run[0], run[1], run[2]) for run in runs]
