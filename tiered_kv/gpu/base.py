"""`KVMover`: the interface of everything that copies KV between paged caches and host chunks.

Contract: called from the engine's event loop. ``gather`` reads tokens
``[token_start, token_start + obj.num_tokens)`` of a request (block ``block_ids[i]`` holds tokens
``[i*BS, (i+1)*BS)``) from every layer group into each object; ``scatter`` writes them back,
except the first ``skip_tokens`` tokens of each transfer, whose slots are never written. A mover
holds its own reference to every object until its copies have finished, so a caller cancelled
mid-transfer may drop its references at once. Order with the engine's compute: a gather reads KV
the engine's current stream has written; after a scatter returns, work the engine queues on its
current stream sees the new KV.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence

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


class KVMover(abc.ABC):
    name: str

    @abc.abstractmethod
    async def gather(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        """Paged caches → host objects."""

    @abc.abstractmethod
    async def scatter(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        """Host objects → paged caches, skipping each transfer's first ``skip_tokens``."""

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
