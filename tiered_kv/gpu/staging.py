"""The staging path of `CudaMover`: per direction, a kernel stream, a DMA stream and a ring of
GPU staging slots whose events order every use of a slot across calls.

A gather fill is a kernel (paged cache → slot) then DMAs (slot → pinned host); a scatter fill
is DMAs (host → slot) then a kernel (slot → paged cache). Fills of consecutive slots overlap:
the kernel of one with the DMA of the previous. The ring's state is unlocked: its callers
serialize each ring (launch.py enqueues under the mover's lock, from the loop or a thread
pulling a layerwise load; a layerwise gather enqueues on the loop, the store ring's only thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from tiered_kv.gpu.completion import TransferClock
from tiered_kv.gpu.kernels import check_driver, cuda_driver
from tiered_kv.gpu.plan import Fill

Job = tuple[int, int, int, int, int, int]  # (address, token_start, t_begin, tokens, l0, l1)


class Direction:
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


MAX_PITCH = 1 << 30  # well inside what cuMemcpy2D accepts for a host or device pitch


class StridedCopy(NamedTuple):
    """``rows`` copies of ``width`` bytes: row k from ``src + k * src_pitch`` to
    ``dst + k * dst_pitch`` (one row: a plain copy). A tuple: one is made per fill."""

    dst: int
    src: int
    width: int
    rows: int = 1
    dst_pitch: int = 0
    src_pitch: int = 0


def strided_copies(runs: Sequence[tuple[int, int, int]]) -> list[StridedCopy]:
    """(destination, source, bytes) runs, in order, as few strided copies: consecutive runs of
    one size whose destinations and sources each step by a constant pitch become one 2-D copy
    (a layer-major fill's pieces: one layer of consecutive chunk objects, which the arena
    usually lays out evenly, land side by side in the staging slot). Runs on the loop thread
    for every fill: plain ints until a copy is complete."""
    out: list[StridedCopy] = []
    # The copy being grown: first run, width, rows, pitches (0 while it has one row).
    dst0 = src0 = width = rows = dst_pitch = src_pitch = 0
    for dst, src, nbytes in runs:
        if rows and nbytes == width:
            if rows == 1:
                dp, sp = dst - dst0, src - src0
                if nbytes <= dp <= MAX_PITCH and nbytes <= sp <= MAX_PITCH:
                    rows, dst_pitch, src_pitch = 2, dp, sp
                    continue
            elif dst == dst0 + rows * dst_pitch and src == src0 + rows * src_pitch:
                rows += 1
                continue
        if rows:
            out.append(StridedCopy(dst0, src0, width, rows, dst_pitch, src_pitch))
        dst0, src0, width, rows, dst_pitch, src_pitch = dst, src, nbytes, 1, 0, 0
    if rows:
        out.append(StridedCopy(dst0, src0, width, rows, dst_pitch, src_pitch))
    return out


def copy_runs(runs: Sequence[tuple[int, int, int]], stream: object, *, to_host: bool) -> None:
    """Enqueue (destination, source, bytes) copies on ``stream``: runs that step evenly go as
    one `cuMemcpy2DAsync` (a 32-chunk layer-major fill: one call instead of 32), the rest one
    `cuMemcpyAsync` each."""
    driver = cuda_driver()
    if len(runs) == 1:  # a one-chunk fill: nothing to stride
        dst, src, nbytes = runs[0]
        check_driver(driver.cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")
        return
    for copy in strided_copies(runs):
        if copy.rows == 1:
            check_driver(
                driver.cuMemcpyAsync(copy.dst, copy.src, copy.width, stream), "cuMemcpyAsync"
            )
            continue
        params = driver.CUDA_MEMCPY2D()
        host_type = driver.CUmemorytype.CU_MEMORYTYPE_HOST
        device_type = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        params.srcMemoryType = device_type if to_host else host_type
        params.dstMemoryType = host_type if to_host else device_type
        if to_host:
            params.srcDevice = copy.src
            params.dstHost = copy.dst
        else:
            params.srcHost = copy.src
            params.dstDevice = copy.dst
        params.srcPitch = copy.src_pitch
        params.dstPitch = copy.dst_pitch
        params.WidthInBytes = copy.width
        params.Height = copy.rows
        check_driver(driver.cuMemcpy2DAsync(params, stream), "cuMemcpy2DAsync")


def fill_parts(
    fill: Fill, base: int, to_host: bool
) -> tuple[list[Job], list[tuple[int, int, int]]]:
    """A fill's kernel jobs (each piece's slab at its place in the slot at ``base``) and its
    (destination, source, bytes) copies (host and slot addresses, in ``to_host``'s order),
    pieces adjacent on the host merged. Pure arithmetic, on the loop thread for every fill (a
    32k-token layerwise load has 4096 pieces): kept flat."""
    group = fill.group
    row_bytes = group.kv_count * group.row_bytes  # one token row of one layer, K and V
    index = group.group.index
    jobs: list[Job] = []
    copies: list[tuple[int, int, int]] = []  # (host, slot, bytes) until the end
    offset = 0
    last_end = -1  # host address just past the last copy
    for transfer, l0, l1 in fill.pieces:
        obj = transfer.obj
        tokens = obj.num_tokens
        layer_bytes = row_bytes * tokens
        nbytes = (l1 - l0) * layer_bytes
        host = (
            obj.arena.base_ptr
            + obj.offset
            + obj.layout.group_offsets(tokens)[index]
            + l0 * layer_bytes
        )
        # The job's slab starts at layer l0 inside the slot.
        t_begin = 0 if to_host else transfer.skip_tokens
        jobs.append((base + offset, transfer.token_start, t_begin, tokens, l0, l1))
        if host == last_end:
            # Adjacent on the host too (consecutive layers, or neighbouring objects): one DMA.
            first_host, first_slot, run = copies[-1]
            copies[-1] = (first_host, first_slot, run + nbytes)
        else:
            copies.append((host, base + offset, nbytes))
        last_end = host + nbytes
        offset += nbytes
    if not to_host:
        copies = [(slot, host, nbytes) for host, slot, nbytes in copies]
    return jobs, copies


def enqueue_fill(
    side: Direction,
    fill: Fill,
    to_host: bool,
    launch: Callable[[Sequence[Job]], None],
    layer_done: Callable[[int, torch.cuda.Stream], None] | None = None,
) -> int:
    """Enqueue one fill through the next slot of ``side``'s ring: its kernel (``launch`` of the
    fill's jobs on ``side.kernel_stream``) and DMAs, ordered by the slot's events. A scatter
    calls ``layer_done(i, stream)`` for each layer the fill completes, after its last copy is
    queued on ``stream``. Returns the fill's bytes."""
    slot = side.next_slot
    side.next_slot = (slot + 1) % side.slot_count
    jobs, copies = fill_parts(fill, side.slots[slot].data_ptr(), to_host)
    if to_host:
        if side.used[slot]:
            side.kernel_stream.wait_event(side.freed[slot])
        launch(jobs)
        side.filled[slot].record(side.kernel_stream)
        side.dma_stream.wait_event(side.filled[slot])
        copy_runs(copies, side.dma_cu, to_host=True)
        side.freed[slot].record(side.dma_stream)
    else:
        if side.used[slot]:
            side.dma_stream.wait_event(side.freed[slot])
        copy_runs(copies, side.dma_cu, to_host=False)
        side.filled[slot].record(side.dma_stream)
        side.kernel_stream.wait_event(side.filled[slot])
        launch(jobs)
        side.freed[slot].record(side.kernel_stream)
        if layer_done is not None:
            for layer in fill.completes:
                layer_done(layer, side.kernel_stream)
    side.used[slot] = True
    return fill.nbytes
