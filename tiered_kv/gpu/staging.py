"""The staging path of `CudaMover`: per direction, a kernel stream, a DMA stream and a ring of
GPU staging slots whose events order every use of a slot across calls.

A gather fill is a kernel (paged cache → slot) then DMAs (slot → pinned host); a scatter fill
is DMAs (host → slot) then a kernel (slot → paged cache). Fills of consecutive slots overlap:
the kernel of one with the DMA of the previous. Called on the loop thread only (the ring's
state is unlocked).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tiered_kv.gpu.completion import TransferClock
from tiered_kv.gpu.kernels import check_driver
from tiered_kv.gpu.plan import Fill, group_offset

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


def copy_runs(runs: Sequence[tuple[int, int, int]], stream: object) -> None:
    """Enqueue (destination, source, bytes) copies on ``stream``, one `cuMemcpyAsync` each.
    (One `cuMemcpyBatchAsync` per fill was tried: on an H100 with driver 13 it held the host
    until the stream's earlier work was done, which serialized a layerwise load with the
    model's reads of its first layers.)"""
    from cuda.bindings import driver

    for dst, src, nbytes in runs:
        check_driver(driver.cuMemcpyAsync(dst, src, nbytes, stream), "cuMemcpyAsync")


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
    group = fill.group
    slot = side.next_slot
    side.next_slot = (slot + 1) % side.slot_count
    base = side.slots[slot].data_ptr()
    jobs: list[Job] = []
    copies: list[tuple[int, int, int]] = []  # (host, slot address, bytes)
    offset = 0
    for transfer, l0, l1 in fill.pieces:
        obj = transfer.obj
        nbytes = group.slab_bytes(l1 - l0, obj.num_tokens)
        host = obj.arena.base_ptr + obj.offset + group_offset(obj, group)
        host += group.slab_bytes(l0, obj.num_tokens)
        t_begin = 0 if to_host else transfer.skip_tokens
        # The job's slab starts at layer l0 inside the slot.
        jobs.append((base + offset, transfer.token_start, t_begin, obj.num_tokens, l0, l1))
        if copies and copies[-1][0] + copies[-1][2] == host:
            # Adjacent on the host too (consecutive layers, or neighbouring objects): one DMA.
            copies[-1] = (copies[-1][0], copies[-1][1], copies[-1][2] + nbytes)
        else:
            copies.append((host, base + offset, nbytes))
        offset += nbytes
    if to_host:
        if side.used[slot]:
            side.kernel_stream.wait_event(side.freed[slot])
        launch(jobs)
        side.filled[slot].record(side.kernel_stream)
        side.dma_stream.wait_event(side.filled[slot])
        copy_runs([(host, dev, n) for host, dev, n in copies], side.dma_cu)
        side.freed[slot].record(side.dma_stream)
    else:
        if side.used[slot]:
            side.dma_stream.wait_event(side.freed[slot])
        copy_runs([(dev, host, n) for host, dev, n in copies], side.dma_cu)
        side.filled[slot].record(side.dma_stream)
        side.kernel_stream.wait_event(side.filled[slot])
        launch(jobs)
        side.freed[slot].record(side.kernel_stream)
        if layer_done is not None:
            for layer in fill.completes:
                layer_done(layer, side.kernel_stream)
    side.used[slot] = True
    return offset
