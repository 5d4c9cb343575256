"""`TorchMover`: gather/scatter with plain torch indexing, on CPU or CUDA tensors.

The CPU path of the engine and the bit-exact oracle the GPU kernels are tested against. Copies
bytes (every dtype as uint8), so fp8 and int8 groups move exactly. Work runs on one worker thread
so the event loop never blocks on a copy.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from tiered_kv.errors import LayoutError, TieredKVError
from tiered_kv.gpu.base import ChunkTransfer, KVMover, LayerLoad, check_layers
from tiered_kv.layout import KVCacheLayout, LayerGroup
from tiered_kv.threads import BlockingPool


def _byte_view(view: torch.Tensor) -> torch.Tensor:
    """``[NB, BS, NH, HS]`` of any dtype → ``[NB, BS, NH, HS * itemsize]`` uint8 (zero-copy)."""
    return view if view.dtype == torch.uint8 else view.view(torch.uint8)


def block_runs(
    layout: KVCacheLayout, block_ids: torch.Tensor, token_start: int, num_tokens: int
) -> list[tuple[int, int, int, int]]:
    """The tokens ``[token_start, token_start + num_tokens)`` as runs within one block each:
    (block id, first slot in it, first row of the chunk, rows). One ``copy_`` a run moves a
    block's rows in one strided copy (advanced indexing of (block, slot) pairs was 3x slower
    on the CPU, on vLLM's CPU layout)."""
    size = layout.block_size
    first, last = token_start // size, (token_start + num_tokens - 1) // size
    ids = block_ids[first : last + 1].tolist()
    runs = []
    row = 0
    for index, block in enumerate(ids, start=first):
        start = max(token_start, index * size)
        end = min(token_start + num_tokens, (index + 1) * size)
        runs.append((int(block), start - index * size, row, end - start))
        row += end - start
    return runs


def gather_chunk(
    layout: KVCacheLayout,
    block_ids: torch.Tensor,
    transfer: ChunkTransfer,
    layers: Collection[int] | None = None,
) -> None:
    """Copy one chunk's tokens from every group (or only model ``layers``) into ``transfer.obj``
    (synchronous)."""
    obj = transfer.obj
    runs = block_runs(layout, block_ids, transfer.token_start, obj.num_tokens)
    for group in layout.groups:
        host = obj.group_bytes(group.index)
        pieces = contiguous_pieces(group, runs)
        if pieces is not None:
            _copy_pieces(group, host, 0, pieces, layers, to_host=True)
            continue
        for i, kv in enumerate(group.kv_views):
            if layers is not None and group.layer_indices[i] not in layers:
                continue
            for k, view in enumerate(kv):
                source, target = _byte_view(view), host[i, k]
                for block, slot, row, count in runs:
                    rows = source[block, slot : slot + count].reshape(count, -1)
                    target[row : row + count].copy_(rows, non_blocking=False)


def scatter_chunk(
    layout: KVCacheLayout,
    block_ids: torch.Tensor,
    transfer: ChunkTransfer,
    layers: Collection[int] | None = None,
) -> None:
    """Write one chunk's tokens, after its ``skip_tokens``, into every group (or only model
    ``layers``) (synchronous)."""
    obj = transfer.obj
    skip = transfer.skip_tokens
    count = obj.num_tokens - skip
    if count == 0:
        return
    runs = block_runs(layout, block_ids, transfer.token_start + skip, count)
    for group in layout.groups:
        host = obj.group_bytes(group.index)
        pieces = contiguous_pieces(group, runs)
        if pieces is not None:
            _copy_pieces(group, host, skip, pieces, layers, to_host=False)
            continue
        shape = _row_shape(group)
        for i, kv in enumerate(group.kv_views):
            if layers is not None and group.layer_indices[i] not in layers:
                continue
            for k, view in enumerate(kv):
                rows = host[i, k, skip:].to(view.device, non_blocking=False).view(count, *shape)
                target = _byte_view(view)
                for block, slot, row, run in runs:
                    target[block, slot : slot + run].copy_(rows[row : row + run])


def contiguous_pieces(
    group: LayerGroup, runs: Sequence[tuple[int, int, int, int]]
) -> list[tuple[int, int, int]] | None:
    """For CPU caches whose token rows are contiguous within a block (NHD-like, or whole
    blocks): ``runs`` as (paged byte offset, host row, rows) pieces, each one contiguous range
    on both sides, runs over blocks adjacent in memory merged. None otherwise (strided rows:
    copied with torch). Block ids out of the group's range raise `LayoutError` (the pieces are
    raw addresses)."""
    s = group.strides
    if not group.kv_views or group.kv_views[0][0].device.type != "cpu":
        return None
    item = group.host.dtype.itemsize
    row_bytes = group.host.row_bytes
    if s.pos_stride * item != row_bytes or (s.num_heads > 1 and s.head_stride != s.head_size):
        return None
    block_bytes = s.block_stride * item
    pieces: list[tuple[int, int, int]] = []
    end = -1  # paged byte offset just past the last piece
    for block, slot, row, count in runs:
        if not 0 <= block < s.num_blocks:
            raise LayoutError(f"block id {block} out of range [0, {s.num_blocks})")
        start = block * block_bytes + slot * row_bytes
        if start == end:
            first, first_row, rows = pieces[-1]
            pieces[-1] = (first, first_row, rows + count)
        else:
            pieces.append((start, row, count))
        end = start + count * row_bytes
    return pieces


def _copy_pieces(
    group: LayerGroup,
    host: torch.Tensor,
    skip: int,
    pieces: Sequence[tuple[int, int, int]],
    layers: Collection[int] | None,
    *,
    to_host: bool,
) -> None:
    """Copy `contiguous_pieces` between every selected layer's paged cache and ``host`` (the group's
    ``[L, K, T, row_bytes]`` bytes, from row ``skip`` on): one memmove per piece, which
    releases the GIL and costs none of a tensor slice's dispatch."""
    row_bytes = group.host.row_bytes
    for i, kv in enumerate(group.kv_views):
        if layers is not None and group.layer_indices[i] not in layers:
            continue
        for k, view in enumerate(kv):
            paged = view.data_ptr()
            rows = host[i, k].data_ptr() + skip * row_bytes
            for offset, row, count in pieces:
                a, b = paged + offset, rows + row * row_bytes
                if to_host:
                    ctypes.memmove(b, a, count * row_bytes)
                else:
                    ctypes.memmove(a, b, count * row_bytes)


def _row_shape(group: LayerGroup) -> tuple[int, int]:
    itemsize = group.host.dtype.itemsize
    return group.strides.num_heads, group.strides.head_size * itemsize


class TorchMover(KVMover):
    """Reference mover. On CUDA it orders itself after the caller's stream and syncs its own."""

    name = "torch"

    def __init__(self) -> None:
        # Its own thread, not concurrent.futures: a close from an atexit hook still runs.
        self._worker = BlockingPool("tkv-mover", 1)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}  # used by the worker only
        self.bytes_gathered = 0
        self.bytes_scattered = 0
        self.gather_seconds = 0.0
        self.scatter_seconds = 0.0

    async def gather(
        self,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        *,
        layers: Sequence[int] | None = None,
        after: Any = None,
    ) -> None:
        selected = None if layers is None else frozenset(check_layers(layout, layers))

        def copy(layout: KVCacheLayout, ids: torch.Tensor, transfer: ChunkTransfer) -> None:
            gather_chunk(layout, ids, transfer, selected)

        seconds = await self._run(layout, block_ids, transfers, copy, after=after)
        self.gather_seconds += seconds
        share = 1.0 if selected is None else len(selected) / layout.num_layers
        self.bytes_gathered += int(sum(t.obj.nbytes for t in transfers) * share)

    async def scatter(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        """Copies on the worker thread; on CUDA caches its stream waits for the caller's."""
        seconds = await self._run(layout, block_ids, transfers, scatter_chunk)
        self.scatter_seconds += seconds
        self.bytes_scattered += sum(
            t.obj.nbytes * (t.obj.num_tokens - t.skip_tokens) // t.obj.num_tokens for t in transfers
        )

    async def scatter_layerwise(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> LayerLoad:
        """Runs on the worker thread layer by layer; each layer's completion is a host flag
        (CPU caches) or a CUDA event recorded on the worker's stream (CUDA caches)."""
        load = _ThreadLayerLoad(layout)

        def copy_layers(ids: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
            for layer in range(layout.num_layers):
                self.scatter_layer(layout, ids, transfers, layer)
                load.layer_copied(layer, stream)

        load.future = asyncio.ensure_future(
            self._run(layout, block_ids, transfers, None, layerwise=copy_layers, on_exit=load.end)
        )
        self.bytes_scattered += sum(
            t.obj.nbytes * (t.obj.num_tokens - t.skip_tokens) // t.obj.num_tokens for t in transfers
        )
        if not transfers:
            load.end(None)
        await asyncio.sleep(0)  # the worker has the job: the caller may wait per layer now
        return load

    def scatter_layer(
        self,
        layout: KVCacheLayout,
        block_ids: torch.Tensor,
        transfers: Sequence[ChunkTransfer],
        layer: int,
    ) -> None:
        """Worker thread: model layer ``layer`` of every transfer (a subclass may wrap it to
        observe or hold back a layerwise load layer by layer, as tests do)."""
        only = frozenset((layer,))
        for transfer in transfers:
            scatter_chunk(layout, block_ids, transfer, only)

    async def _run(
        self,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        copy_one: Callable[[KVCacheLayout, torch.Tensor, ChunkTransfer], None] | None,
        *,
        after: Any = None,
        layerwise: Callable[[torch.Tensor, torch.cuda.Stream | None], None] | None = None,
        on_exit: Callable[[BaseException | None], None] | None = None,
    ) -> float:
        if not transfers:
            return 0.0
        ready: torch.cuda.Event | None = None
        if layout.device.type == "cuda":
            if after is not None:
                ready = after
            else:
                ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
                ready.record(torch.cuda.current_stream(layout.device))

        def copy_all(ids: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
            if layerwise is not None:
                layerwise(ids, stream)
                return
            assert copy_one is not None
            for transfer in transfers:
                copy_one(layout, ids, transfer)

        def work() -> float:
            start = time.perf_counter()
            error: BaseException | None = None
            try:
                ids = torch.as_tensor(list(block_ids), dtype=torch.long)  # host: runs are ints
                if ready is None:
                    copy_all(ids, None)
                else:
                    stream = self._stream(layout.device)
                    stream.wait_event(ready)
                    with torch.cuda.stream(stream):
                        copy_all(ids, stream)
                    stream.synchronize()
            except BaseException as exc:
                error = exc
                raise
            finally:
                if on_exit is not None:
                    on_exit(error)
            return time.perf_counter() - start

        held = [t.obj.ref() for t in transfers]
        future = self._worker.submit(work)

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
        await self._worker.aclose()


class _ThreadLayerLoad(LayerLoad):
    """`TorchMover`'s layerwise load: the worker thread marks each layer as it finishes it
    (CPU caches) or records that layer's CUDA event on its stream (CUDA caches)."""

    def __init__(self, layout: KVCacheLayout) -> None:
        super().__init__(layout.num_layers)
        self._cuda = layout.device.type == "cuda"
        self._device = layout.device
        self._marked = [threading.Event() for _ in range(layout.num_layers)]
        self._events: list[torch.cuda.Event | None] = [None] * layout.num_layers
        self._error: BaseException | None = None
        self.future: asyncio.Future[float] | None = None

    def layer_copied(self, layer: int, stream: torch.cuda.Stream | None) -> None:
        """Worker thread: layer ``layer`` is copied (CPU) or enqueued on ``stream`` (CUDA)."""
        if stream is not None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
            self._events[layer] = event
        self._marked[layer].set()

    def end(self, error: BaseException | None) -> None:
        """Worker thread, last: releases every waiter, failed or not."""
        self._error = error
        for marked in self._marked:
            marked.set()

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        self._check(layer)
        self._marked[layer].wait()
        event = self._events[layer]
        if event is None:
            if self._error is not None:
                raise TieredKVError(f"layerwise load failed before layer {layer}: {self._error}")
            return
        if stream is None:
            stream = torch.cuda.current_stream(self._device)
        stream.wait_event(event)

    def done(self) -> bool:
        return self.future is None or self.future.done()

    async def wait(self) -> None:
        if self.future is None:
            return
        try:
            await asyncio.shield(self.future)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise TieredKVError(f"layerwise load failed: {exc}") from exc
