"""`TorchMover`: gather/scatter with plain torch indexing, on CPU or CUDA tensors.

The CPU path of the engine and the bit-exact oracle the GPU kernels are tested against. Copies
bytes (every dtype as uint8), so fp8 and int8 groups move exactly. Work runs on one worker thread
so the event loop never blocks on a copy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Sequence

import torch

from tiered_kv.gpu.base import ChunkTransfer, KVMover
from tiered_kv.layout import KVCacheLayout, LayerGroup


def _byte_view(view: torch.Tensor) -> torch.Tensor:
    """``[NB, BS, NH, HS]`` of any dtype → ``[NB, BS, NH, HS * itemsize]`` uint8 (zero-copy)."""
    return view if view.dtype == torch.uint8 else view.view(torch.uint8)


def _slots(
    layout: KVCacheLayout, block_ids: torch.Tensor, token_start: int, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(token_start, token_start + num_tokens, device=block_ids.device)
    return block_ids[positions // layout.block_size], positions % layout.block_size


def gather_chunk(layout: KVCacheLayout, block_ids: torch.Tensor, transfer: ChunkTransfer) -> None:
    """Copy one chunk's tokens from every group into ``transfer.obj`` (synchronous)."""
    obj = transfer.obj
    blocks, offsets = _slots(layout, block_ids, transfer.token_start, obj.num_tokens)
    for group in layout.groups:
        host = obj.group_bytes(group.index)
        for i, kv in enumerate(group.kv_views):
            for k, view in enumerate(kv):
                rows = _byte_view(view)[blocks, offsets]
                host[i, k].copy_(rows.reshape(obj.num_tokens, -1), non_blocking=False)


def scatter_chunk(layout: KVCacheLayout, block_ids: torch.Tensor, transfer: ChunkTransfer) -> None:
    """Write one chunk's tokens, after its ``skip_tokens``, into every group (synchronous)."""
    obj = transfer.obj
    skip = transfer.skip_tokens
    count = obj.num_tokens - skip
    if count == 0:
        return
    blocks, offsets = _slots(layout, block_ids, transfer.token_start + skip, count)
    for group in layout.groups:
        host = obj.group_bytes(group.index)
        shape = _row_shape(group)
        for i, kv in enumerate(group.kv_views):
            for k, view in enumerate(kv):
                rows = host[i, k, skip:].to(view.device, non_blocking=False)
                _byte_view(view).index_put_((blocks, offsets), rows.view(count, *shape))


def _row_shape(group: LayerGroup) -> tuple[int, int]:
    itemsize = group.host.dtype.itemsize
    return group.strides.num_heads, group.strides.head_size * itemsize


class TorchMover(KVMover):
    """Reference mover. On CUDA it orders itself after the caller's stream and syncs its own."""

    name = "torch"

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tkv-mover")
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # used by the worker only
        self.bytes_gathered = 0
        self.bytes_scattered = 0
        self.gather_seconds = 0.0
        self.scatter_seconds = 0.0

    async def gather(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        seconds = await self._run(layout, block_ids, transfers, gather_chunk)
        self.gather_seconds += seconds
        self.bytes_gathered += sum(t.obj.nbytes for t in transfers)

    async def scatter(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        seconds = await self._run(layout, block_ids, transfers, scatter_chunk)
        self.scatter_seconds += seconds
        self.bytes_scattered += sum(
            t.obj.nbytes * (t.obj.num_tokens - t.skip_tokens) // t.obj.num_tokens for t in transfers
        )

    async def _run(
        self,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        copy_one: Callable[[KVCacheLayout, torch.Tensor, ChunkTransfer], None],
    ) -> float:
        if not transfers:
            return 0.0
        loop = asyncio.get_running_loop()
        ready: torch.cuda.Event | None = None
        if layout.device.type == "cuda":
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record(torch.cuda.current_stream(layout.device))

        def work() -> float:
            start = time.perf_counter()
            ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=layout.device)
            if ready is None:
                for transfer in transfers:
                    copy_one(layout, ids, transfer)
            else:
                stream = self._stream(layout.device)
                stream.wait_event(ready)
                with torch.cuda.stream(stream):
                    for transfer in transfers:
                        copy_one(layout, ids, transfer)
                stream.synchronize()
            return time.perf_counter() - start

        held = [t.obj.ref() for t in transfers]
        future = loop.run_in_executor(self._executor, work)

        def release(done: asyncio.Future[float]) -> None:
            for obj in held:
                obj.unref()
            if not done.cancelled():
                done.exception()  # mark retrieved: the awaiting task may be gone

        future.add_done_callback(release)
        # Shielded: a cancelled caller must not cancel the future, whose callback releases the
        # objects only once the worker thread has stopped touching them.
        return await asyncio.shield(future)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        """This mover's side stream on ``device``, created once (worker thread only)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._streams[device] = stream
        return stream

    def stats(self) -> dict[str, int | float]:
        return {
            "bytes_gathered": self.bytes_gathered,
            "bytes_scattered": self.bytes_scattered,
            "gather_seconds": self.gather_seconds,
            "scatter_seconds": self.scatter_seconds,
        }

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
