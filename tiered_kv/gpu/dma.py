"""The DMA-only path of `CudaMover`: one ``cuMemcpyBatchAsync`` of a call's contiguous runs.

Owns turning a call's chunks and layers into (destination, source, bytes) runs contiguous on
both sides (`plan.runs`) and enqueueing them as one batched copy on a direction's DMA stream.
No kernels, no staging memory; the caller orders the DMA stream and records the call's events.
Called on the loop thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiered_kv.gpu.base import ChunkTransfer
from tiered_kv.gpu.kernels import check_driver
from tiered_kv.gpu.plan import LayoutPlan, group_offset, layer_ranges, runs
from tiered_kv.gpu.staging import Direction


def enqueue_dma(
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
        for group, ranges in layer_ranges(plan, layers):
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
