"""CUDA events of `CudaMover`'s calls: what orders a call after its caller, times it, and
tells its completion, per call (`CallBuffers`) and per layer (`CudaLayerLoad`).

Owns the block table of a call (`BlockTable`: inline in its launches' parameters, or a pinned
and a device copy) and its ready/begun/done events (pooled per device), and a layerwise load's
per-layer events. Enqueues nothing but event records, waits and the block table's upload.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from tiered_kv.errors import LayoutError, TieredKVError
from tiered_kv.gpu.base import LayerLoad
from tiered_kv.gpu.kernels import check_driver, cuda_driver

INLINE_IDS = 640  # TKV_INLINE_IDS in cuda_src/tkv_copy.cu


@dataclasses.dataclass(frozen=True, slots=True)
class BlockTable:
    """Where a call's kernels read its block ids. ``device``: the address of an uploaded copy of
    the whole table; 0: ``ids`` (request blocks ``base`` onwards) travel in each launch's
    parameters, so nothing is uploaded and no kernel waits for a copy."""

    device: int
    base: int = 0
    ids: array.array[int] | None = None

    @property
    def inline(self) -> bool:
        return self.ids is not None


class CallBuffers:
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

    def block_table(
        self, block_ids: Sequence[int], blocks: tuple[int, int], stream: Any
    ) -> BlockTable:
        """The call's table, for kernels that read request blocks ``blocks`` = [first, end)
        (`plan.block_span`, checked against ``block_ids``):
        inline when they are at most `INLINE_IDS`, else the whole table's copy to the device
        queued on ``stream``. The pinned source stays untouched until the call completes (the
        buffers are the call's)."""
        first, end = blocks
        if end - first <= INLINE_IDS:
            return BlockTable(0, first, _int32s(block_ids[first:end]))
        driver = cuda_driver()

        ids = _int32s(block_ids)
        self.reserve(len(ids))
        nbytes = len(ids) * ids.itemsize
        ctypes.memmove(self.host_ids.data_ptr(), ids.buffer_info()[0], nbytes)
        check_driver(
            driver.cuMemcpyHtoDAsync(
                self.device_ids.data_ptr(), self.host_ids.data_ptr(), nbytes, stream
            ),
            "cuMemcpyHtoDAsync(block ids)",
        )
        return BlockTable(self.device_ids.data_ptr())


def _int32s(block_ids: Sequence[int]) -> array.array[int]:
    try:
        return array.array("i", block_ids)
    except OverflowError as exc:
        raise LayoutError(f"block ids must fit in int32: {exc}") from None


class LayerPull(Protocol):
    """What a staging layerwise load's waiters call (`layerwise.LoadPull`): ``pull(i)`` queues
    what layer ``i`` needs (None: everything); ``mark(stream)`` notes where the waiting stream
    is, once it waits for a layer."""

    def __call__(self, layer: int | None) -> None: ...

    def mark(self, stream: Any) -> None: ...


class CudaLayerLoad(LayerLoad):
    """A layerwise scatter on the load streams. ``events[i]`` is recorded once the last copy of
    model layer ``i`` is queued; ``result`` resolves when the whole call has finished.

    On the staging path the rest of the load is queued by its waiters: ``wait_layer(i)`` has
    ``pull`` queue what layer ``i`` lacks on the calling thread (the model's own: a second
    Python thread enqueueing beside it would trade the GIL with it, docs/layerwise.md), then
    orders the stream after layer ``i``'s event only. Other paths are enqueued whole by a task
    of the loop (``task``) before the load is returned.
    """

    def __init__(self, device: torch.device, num_layers: int) -> None:
        super().__init__(num_layers)
        self.device = device
        # Made as the layers are queued: a load's front (its first copies) makes one or two.
        self.events: dict[int, torch.cuda.Event] = {}
        self._has_event = [False] * num_layers
        self.task: asyncio.Task[None] | None = None  # the enqueue
        self.result: asyncio.Future[float] | None = None  # the GPU work
        self.error: BaseException | None = None
        self.call_owns_objects = False  # set once the enqueue's call holds the references
        # Staging loads are enqueued by their waiters: ``pull(i)`` queues what layer i lacks
        # (or maybe one fill of a lead beyond it) on the calling thread, ``pull(None)`` all;
        # ``pulled`` resolves on the loop once the whole load is queued and handed to the waiter.
        self.pull: LayerPull | None = None
        self.pulled: asyncio.Future[None] | None = None

    def record_layer(self, layer: int, stream: torch.cuda.Stream) -> None:
        """The enqueueing thread: layer ``layer``'s last copy is queued on ``stream``."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        self.events[layer] = event
        self._has_event[layer] = True

    def has_event(self, layer: int) -> bool:
        """Whether layer ``layer``'s copies are queued (its event recorded)."""
        return self._has_event[layer]

    def end_enqueue(self, error: BaseException | None) -> None:
        """Loop thread, once the enqueue ended: ``error`` is why it stopped short (None: whole)."""
        self.error = error

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        self._check(layer)
        if self.pull is not None:
            self.pull(layer)
        if not self.has_event(layer):
            raise TieredKVError(f"layerwise load failed before layer {layer}: {self.error}")
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.events[layer])
        if self.pull is not None:
            self.pull.mark(stream)

    def done(self) -> bool:
        if self.task is not None and not self.task.done():
            return False
        if self.pulled is not None and not self.pulled.done():
            return False
        if self.error is not None:
            return True  # the enqueue failed: what it had queued was waited for and released
        return self.result is None or self.result.done()

    async def enqueued(self) -> None:
        if self.pull is not None and self.pulled is not None:
            self.pull(None)
            await asyncio.shield(self.pulled)
        if self.task is not None:
            await asyncio.shield(self.task)
        if self.error is not None:
            raise TieredKVError(f"layerwise load failed: {self.error}") from self.error

    async def wait(self) -> None:
        await self.enqueued()
        if self.result is None:
            return
        try:
            await asyncio.shield(self.result)
        except asyncio.CancelledError:
            raise
        except TieredKVError:
            raise
        except Exception as exc:  # pragma: no cover - results carry TieredKVError
            raise TieredKVError(f"layerwise load failed: {exc}") from exc
