"""`KVMover`: the interface of everything that copies KV between paged caches and host chunks.

Contract: called from the engine's event loop. ``gather`` reads tokens
``[token_start, token_start + obj.num_tokens)`` of a request (block ``block_ids[i]`` holds tokens
``[i*BS, (i+1)*BS)``) from every layer group into each object; ``scatter`` writes them back,
except the first ``skip_tokens`` tokens of each transfer, whose slots are never written. A mover
holds its own reference to every object until its copies have finished, so a caller cancelled
mid-transfer may drop its references at once. Order with the engine's compute: a gather reads KV
the engine's current stream has written; after a scatter returns, work the engine queues on its
current stream sees the new KV.

Layerwise: ``gather(..., layers=..., after=event)`` copies only the given model layers (indexes
into the registration order, `KVCacheLayout.layer_names`), ordered after ``event`` (recorded on
the stream that wrote them) instead of the current stream. `scatter_layerwise` enqueues a
scatter ordered layer by layer across all its chunks and returns a `LayerLoad` at once: the
caller waits per layer (`LayerLoad.wait_layer`) instead of for the whole call.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from tiered_kv.layout import KVCacheLayout
from tiered_kv.memory import MemoryObj


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkTransfer:
    obj: MemoryObj
    token_start: int
    skip_tokens: int = 0

    def __post_init__(self) -> None:
        if self.token_start < 0 or not 0 <= self.skip_tokens <= self.obj.num_tokens:
            raise ValueError(
                f"ChunkTransfer: token_start {self.token_start} must be >= 0 and skip_tokens "
                f"{self.skip_tokens} in [0, {self.obj.num_tokens}]"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class MoverStats:
    """What every mover reports: bytes and seconds each way (``*_seconds``: the sum of per-call
    times), plus its own counters by name (``extra``: per path, completion polls, ...)."""

    bytes_gathered: int = 0
    bytes_scattered: int = 0
    gather_seconds: float = 0.0
    scatter_seconds: float = 0.0
    extra: Mapping[str, int | float] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_counters(cls, counters: Mapping[str, int | float]) -> MoverStats:
        """From a mover's flat `KVMover.stats` (the four common names, the rest as ``extra``)."""
        common = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(
            bytes_gathered=int(counters.get("bytes_gathered", 0)),
            bytes_scattered=int(counters.get("bytes_scattered", 0)),
            gather_seconds=float(counters.get("gather_seconds", 0.0)),
            scatter_seconds=float(counters.get("scatter_seconds", 0.0)),
            extra={k: v for k, v in counters.items() if k not in common},
        )


class LayerLoad(abc.ABC):
    """A layerwise scatter in flight: one completion point per model layer.

    Created by `KVMover.scatter_layerwise`, its copies enqueued or being enqueued. `wait_layer`
    may be called from any thread (it only orders a stream, or blocks the calling thread on CPU
    caches); `wait` belongs to the loop that started the load. The mover holds its own
    references to the objects until every copy has finished.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")

    @abc.abstractmethod
    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Order ``stream`` (default: the current stream of the caches' device) after layer
        ``layer``'s copies: a GPU-side wait, no host sync. On CPU caches the calling thread
        blocks until that layer is copied."""

    def wait_all(self, stream: Any = None) -> None:
        """`wait_layer` for every layer."""
        for layer in range(self.num_layers):
            self.wait_layer(layer, stream)

    async def enqueued(self) -> None:
        """Until every layer's copies are queued; raises `TieredKVError` when enqueueing
        failed. Movers that enqueue before returning the load are always there."""
        return None

    @abc.abstractmethod
    def done(self) -> bool:
        """Every copy finished (or failed) and the mover's references are dropped."""

    @abc.abstractmethod
    async def wait(self) -> None:
        """Until `done`; raises `TieredKVError` when a copy failed. Cancelling the waiter leaves
        the load running to its end."""


class LayerSave:
    """A layerwise gather being filled: `save` queues one model layer's copy-out, ordered after
    an event of its producer; `finish` waits for every queued copy (its bytes are in the host
    objects when it returns). Called on the loop that began it. The mover holds its own
    references to the objects until `finish` has seen every copy end.

    This default queues each layer as its own `KVMover.gather` call, one after another; movers
    with cheaper per-layer enqueues override `KVMover.begin_gather`."""

    def __init__(
        self,
        mover: KVMover,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
    ) -> None:
        self._mover = mover
        self._layout = layout
        self._block_ids = list(block_ids)
        self._transfers = list(transfers)
        self._pending: list[tuple[int, Any]] = []
        self._worker: asyncio.Task[None] | None = None
        self._error: BaseException | None = None

    def save(self, layer: int, after: Any = None) -> None:
        self._pending.append((layer, after))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.get_running_loop().create_task(self._copy_pending())

    async def _copy_pending(self) -> None:
        while self._pending and self._error is None:
            layer, after = self._pending.pop(0)
            try:
                await self._mover.gather(
                    self._layout, self._block_ids, self._transfers, layers=(layer,), after=after
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._error = exc

    async def finish(self) -> None:
        """Until every saved layer is copied; raises `TieredKVError` if a copy failed (the
        copies still running are waited for first)."""
        while self._worker is not None and not self._worker.done():
            await asyncio.shield(self._worker)
        if self._error is not None:
            from tiered_kv.errors import TieredKVError

            raise TieredKVError(f"layerwise gather failed: {self._error}") from self._error


class FinishedLayerLoad(LayerLoad):
    """A load whose copies have all finished, and ordered the caller's stream after them."""

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        self._check(layer)

    def done(self) -> bool:
        return True

    async def wait(self) -> None:
        return None


class KVMover(abc.ABC):
    name: str

    @abc.abstractmethod
    async def gather(
        self,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        *,
        layers: Sequence[int] | None = None,
        after: Any = None,
    ) -> None:
        """Paged caches → host objects: every layer, or only ``layers`` (model layer indexes),
        ordered after the event ``after`` when given (CUDA), else after the current stream."""

    @abc.abstractmethod
    async def scatter(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        """Host objects → paged caches, skipping each transfer's first ``skip_tokens``."""

    async def scatter_layerwise(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> LayerLoad:
        """`scatter`, ordered layer by layer across all ``transfers`` (layer 0 of every chunk,
        then layer 1, ...) and after the current stream. May return before every copy is
        enqueued (the load holds its own references to the objects from the start). Nothing
        orders the caller's stream after the copies: `LayerLoad.wait_layer` does, per layer.
        This default (for movers without per-layer completion) scatters whole and returns a
        load whose layers are all ready."""
        await self.scatter(layout, block_ids, transfers)
        return FinishedLayerLoad(layout.num_layers)

    def begin_gather(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> LayerSave:
        """A layerwise gather into ``transfers``' objects, filled one `LayerSave.save` per layer
        as the producer makes them."""
        return LayerSave(self, layout, block_ids, transfers)

    def prepare(self, layout: KVCacheLayout) -> None:  # noqa: B027 - optional hook
        """Called when caches are registered: do here what would otherwise stall the first
        transfer (compiling kernels, creating streams, allocating buffers). Errors surface at
        registration."""

    def forget(self, layout: KVCacheLayout) -> None:  # noqa: B027 - optional hook
        """Drop what `prepare` and earlier calls keep for ``layout`` (plans, and with them the
        references to its KV tensors). Called when a registration is replaced and at close; calls
        already running keep what they use until they end."""

    def stats(self) -> Mapping[str, int | float]:
        """Counters, flat name → number (bytes moved, seconds spent, per path where it has
        several)."""
        return {}

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release streams, threads and buffers."""


def layer_places(layout: KVCacheLayout) -> tuple[tuple[int, int], ...]:
    """Model layer index → (group index, the layer's index inside its group)."""
    places: dict[int, tuple[int, int]] = {}
    for group in layout.groups:
        for local, layer in enumerate(group.layer_indices):
            places[layer] = (group.index, local)
    return tuple(places[layer] for layer in range(layout.num_layers))


def check_layers(layout: KVCacheLayout, layers: Sequence[int] | None) -> tuple[int, ...]:
    """``layers`` (or every layer) as a tuple of distinct, in-range model layer indexes."""
    if layers is None:
        return tuple(range(layout.num_layers))
    out = tuple(layers)
    if len(set(out)) != len(out) or any(
        isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < layout.num_layers
        for layer in out
    ):
        raise ValueError(
            f"layers: expected distinct ints in [0, {layout.num_layers}), got {list(out)[:8]}"
        )
    return out
