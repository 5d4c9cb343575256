"""Launches of the copy kernel for `CudaMover`: the mapped path's kernels and staging fills.

Owns `Launcher`: a call's block table (`block_table`: inline in the parameters when it fits),
packing a launch's parameter block (up to `MAX_JOBS` jobs) into one reused buffer, whole-block
rows, the grid, the launch counters; a call's mapped kernels
(`enqueue_mapped`) and its staging fills through a direction's ring (`queue_fill`,
`enqueue_staging`). Owns no call state: references, buffers and completion are calls.py's.
Called on the loop thread and on the thread that pulls a layerwise load (layerwise.py);
whatever touches the parameter buffer, a staging ring or the current context holds ``lock``,
the mover's.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import struct
import threading
import time
from collections.abc import Callable, Sequence

from tiered_kv.errors import LayoutError
from tiered_kv.gpu.base import ChunkTransfer
from tiered_kv.gpu.calls import Call
from tiered_kv.gpu.device import DeviceState, MoverOptions
from tiered_kv.gpu.events import INLINE_IDS, BlockTable
from tiered_kv.gpu.kernels import check_driver, cuda_driver
from tiered_kv.gpu.plan import (
    JOB_MAX_BYTES,
    MAX_JOBS,
    Fill,
    GroupPlan,
    LayoutPlan,
    batches,
    group_offset,
    layer_ranges,
    slot_fills,
)
from tiered_kv.gpu.staging import Direction, Job, enqueue_fill

_PARAMS_HEAD = struct.Struct("<QQqqqiiiiii")  # TkvParams up to jobs[]
_JOB = struct.Struct("<Qiiiiii")  # TkvJob
_IDS_OFFSET = _PARAMS_HEAD.size + MAX_JOBS * _JOB.size  # TkvParams.inline_ids
PARAMS_SIZE = _IDS_OFFSET + INLINE_IDS * 4
_THREADS = 256
_UNROLL = 4  # TKV_UNROLL
LEAD_SLOTS = 2  # staging enqueues this many slots' worth before yielding to the loop
EDGE_CTA_FACTOR = 4  # CTAs of the first (gather) or last (scatter) kernel, times staging_ctas

FillHook = Callable[[Direction, bool, Sequence[Job]], None]


class Launcher:
    """The copy kernel's launches for one mover (every device it serves).

    ``before_fill_launch(side, to_host, jobs)``, when set, runs before each staging fill's
    kernel is launched, on the thread launching it: a seam for tests (delays, faults)."""

    def __init__(self, options: MoverOptions, lock: threading.RLock) -> None:
        self.options = options
        self.lock = lock
        self.counters: dict[str, int | float] = {
            "kernel_launches": 0,
            "kernel_launches_block_rows": 0,
            "block_table_uploads": 0,
        }
        self.before_fill_launch: FillHook | None = None
        self._params = ctypes.create_string_buffer(PARAMS_SIZE)
        self._params_arg = (ctypes.c_void_p * 1)(ctypes.addressof(self._params))
        self._params_address = ctypes.addressof(self._params_arg)
        self._params_bytes = memoryview(self._params).cast("B")
        self._packed_ids: object = None  # the inline ids the parameter block holds now

    def block_table(
        self, call: Call, block_ids: Sequence[int], span: tuple[int, int], stream: object
    ) -> BlockTable:
        """``call``'s block table for its kernels: inline in each launch when the blocks it
        touches (``span``, `plan.block_span`) fit (`INLINE_IDS`), else uploaded on ``stream``
        (counted)."""
        table = call.buffers.block_table(block_ids, span, stream)
        if not table.inline:
            self.counters["block_table_uploads"] += 1
        return table

    def launch(
        self,
        state: DeviceState,
        group: GroupPlan,
        stream: object,
        to_host: bool,
        block_size: int,
        table: BlockTable,
        jobs: Sequence[Job],
        ctas: int,
    ) -> None:
        """One launch of the copy kernel over up to `MAX_JOBS` jobs of one group, on ``stream``
        (a ``CUstream``). The parameter block (with an inline table's ids) is packed into one
        reused buffer: the driver copies it at launch (under the lock: a layerwise load's
        waiter launches too)."""
        driver = cuda_driver()
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
        with self.lock:
            self.counters["kernel_launches"] += 1
            self.counters["kernel_launches_block_rows"] += rows is not None
            params = self._params
            _PARAMS_HEAD.pack_into(
                params,
                0,
                group.layer_ptrs.data_ptr(),
                table.device,
                group.block_stride,
                group.pos_stride,
                group.head_stride,
                group.kv_count,
                group.num_heads,
                group.head_bytes,
                block_size,
                len(jobs),
                table.base,
            )
            ids = table.ids
            if ids is not None and ids is not self._packed_ids:  # a fill after the first: kept
                self._params_bytes[_IDS_OFFSET : _IDS_OFFSET + 4 * len(ids)] = memoryview(ids).cast(
                    "B"
                )
                self._packed_ids = ids
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
            function = state.kernels.copy_function(to_host, group.width)
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
                    self._params_address,
                    0,
                ),
                "cuLaunchKernel(tkv copy)",
            )

    def launch_fill(
        self,
        state: DeviceState,
        group: GroupPlan,
        jobs: Sequence[Job],
        *,
        side: Direction,
        to_host: bool,
        block_size: int,
        table: BlockTable,
        ctas: int,
    ) -> None:
        """A staging fill's kernel on ``side``'s kernel stream (`enqueue_fill`'s ``launch``)."""
        if self.before_fill_launch is not None:
            self.before_fill_launch(side, to_host, jobs)
        self.launch(state, group, side.kernel_cu, to_host, block_size, table, jobs, ctas)

    def enqueue_mapped(
        self,
        state: DeviceState,
        plan: LayoutPlan,
        side: Direction,
        to_host: bool,
        table: BlockTable,
        transfers: Sequence[ChunkTransfer],
        layers: Sequence[int] | None,
        ctas: int = 0,
    ) -> None:
        """Kernels read or write the mapped host chunks: every layer (``layers`` None), or only
        those model layers; ``ctas`` per launch (0: the options' ``mapped_ctas``, or two per
        SM)."""
        ctas = ctas or self.options.mapped_ctas or 2 * state.sm_count
        block_size = plan.layout.block_size
        for group, ranges in layer_ranges(plan, layers):
            jobs = []
            for transfer in transfers:
                obj = transfer.obj
                host = state.device_address(obj.arena) + obj.offset
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
                self.launch(state, group, side.kernel_cu, to_host, block_size, table, batch, ctas)

    def queue_fill(
        self, call: Call, plan: LayoutPlan, fill: Fill, to_host: bool, table: BlockTable, edge: bool
    ) -> int:
        """Queue one staging fill of ``call`` through its side's ring, under the lock (a
        layerwise load's waiter may be queueing on the same ring). The one kernel nothing
        overlaps (``edge``: a gather's first, a scatter's last) gets more CTAs: a few
        microseconds of SMs to take that much off the call. Returns the fill's bytes."""
        ctas = self.options.staging_ctas
        launch = functools.partial(
            self.launch_fill,
            call.state,
            fill.group,
            side=call.side,
            to_host=to_host,
            block_size=plan.layout.block_size,
            table=table,
            ctas=ctas * EDGE_CTA_FACTOR if edge else ctas,
        )
        layer_done = None if call.load is None else call.load.record_layer
        with self.lock:
            return enqueue_fill(call.side, fill, to_host, launch, layer_done)

    async def enqueue_staging(
        self,
        plan: LayoutPlan,
        call: Call,
        to_host: bool,
        table: BlockTable,
        transfers: Sequence[ChunkTransfer],
    ) -> bool:
        """Queue every fill of ``call``, yielding to the loop between fills once `LEAD_SLOTS`
        slots' worth is queued, so a store and a retrieve started together both start at once.
        Returns whether the caller was cancelled at one of the yields (the call is enqueued
        whole regardless)."""
        state, side = call.state, call.side
        with self.lock:
            state.ensure_slots(side, plan)
        lead = LEAD_SLOTS * side.slot_bytes
        queued = 0
        cancelled = False
        fills = slot_fills(plan, transfers, side.slot_bytes, ramp_up=to_host, layers=call.layers)
        upcoming = next(fills, None)
        while upcoming is not None:
            fill = upcoming
            upcoming = next(fills, None)
            edge = not queued if to_host else upcoming is None
            nbytes = self.queue_fill(call, plan, fill, to_host, table, edge)
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
