"""`LowerTier`: the interface of tiers below L1 (disk, remote).

Contract for implementers:
- Called only from the engine's event loop; blocking I/O runs in threads (or on sockets), and a
  cancelled call waits for its thread to stop touching the caller's buffers before it returns.
- Buffers belong to the caller: `put` reads the object's bytes and `get_into` writes them while the
  caller holds a reference; neither keeps the object nor changes its reference count.
- Failures (disk full, corrupt data, remote down) are counted in stats and returned as False;
  they never raise into the serving path. `asyncio.CancelledError` always propagates, and a
  cancelled `put` leaves nothing visible to readers.
- `contains` answers from the tier's own index without I/O; it may be stale only in the direction
  of a later miss (a file removed behind our back), never of wrong data, since `get_into` verifies
  the key and the checksum.
- ``name`` keys the tier's write policy and its statistics: an engine refuses two tiers of one
  name, compared without case (L1's included).
- ``events``: None unless someone listens (`StorageManager.watch`). A tier that drops chunks on
  its own (its eviction, a corrupt copy, `remove`) emits ``removed`` for each there; stores are
  announced by the storage manager when a write succeeds, so a tier never announces them.
"""

from __future__ import annotations

import abc
import dataclasses
import threading
from collections import deque
from collections.abc import Sequence
from typing import Literal

from tiered_kv.io.plane import WorkerPlane
from tiered_kv.keys import ChunkKey
from tiered_kv.memory import MemoryObj


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    """A lower tier's statistics: occupancy where the tier knows it (None where it does not, as
    for a remote store other processes share); each tier subclasses it with its own counters.

    Fields are numbers, None, a nested `TierStats` (a wrapper's inner tier) or a name → number
    mapping (a client's counters); `tiered_kv.metrics` flattens them into ``engine.stats()``.
    """

    entries: int | None = None
    bytes_used: int | None = None
    capacity: int | None = None


DEFAULT_READ_PARALLELISM = 8
DEFAULT_WRITE_PARALLELISM = 2

TIER_OCCUPANCY = tuple(field.name for field in dataclasses.fields(TierStats))


TierEventKind = Literal["stored", "removed"]


@dataclasses.dataclass(frozen=True, slots=True)
class TierEvent:
    """A chunk entered (``stored``) or left (``removed``) the tier named ``tier``.

    ``num_tokens`` is the chunk's token count for a store, 0 for a removal (not known there)."""

    kind: TierEventKind
    tier: str
    key: ChunkKey
    num_tokens: int = 0


class TierEventLog:
    """Tier activity for one listener (a router's feed), in the order it happened.

    Emitted on the engine's loop, drained from any thread (`drain`). Bounded: past ``capacity``
    undrained events the oldest are dropped and counted in ``dropped``, so a listener that stops
    draining costs memory up to the bound, never more. Tiers hold None when nobody listens, so
    the cost then is one attribute test per store or removal.
    """

    __slots__ = ("_events", "_lock", "capacity", "dropped", "emitted")

    def __init__(self, capacity: int = 8192) -> None:
        if capacity < 1:
            raise ValueError(f"TierEventLog capacity: expected >= 1, got {capacity}")
        self.capacity = capacity
        self._events: deque[TierEvent] = deque()
        self._lock = threading.Lock()
        self.dropped = 0
        self.emitted = 0

    def emit(self, kind: TierEventKind, tier: str, key: ChunkKey, num_tokens: int = 0) -> None:
        event = TierEvent(kind, tier, key, num_tokens)
        with self._lock:
            if len(self._events) >= self.capacity:
                self._events.popleft()
                self.dropped += 1
            self._events.append(event)
            self.emitted += 1

    def drain(self) -> list[TierEvent]:
        """Every event not drained yet, oldest first."""
        with self._lock:
            events = list(self._events)
            self._events.clear()
        return events

    def __len__(self) -> int:
        return len(self._events)


class LowerTier(abc.ABC):
    name: str
    events: TierEventLog | None = None

    @property
    def read_parallelism(self) -> int:
        """Reads worth having in flight at once (prefetch's per-tier limit unless the config
        sets ``prefetch_concurrency``): a tier with its own I/O threads says how many."""
        return DEFAULT_READ_PARALLELISM

    @property
    def write_parallelism(self) -> int:
        """Background writes worth having in flight at once (the storage manager runs this many
        writers for the tier's queue): a tier with its own write threads says how many."""
        return DEFAULT_WRITE_PARALLELISM

    def use_plane(self, plane: WorkerPlane | None) -> bool:
        """The engine's I/O worker processes (``io_plane``), offered before `open`, not yet
        started: a tier whose reads are file I/O may move their bytes through them. True when
        it will (the engine starts the workers only then). Default: not used."""
        return False

    @abc.abstractmethod
    async def open(self) -> None:
        """Prepare the tier (e.g. rebuild the index); called once before any other method."""

    @abc.abstractmethod
    def contains(self, key: ChunkKey) -> bool:
        """Whether the tier holds ``key``, from its index (no I/O; a remote tier answers from
        what it has seen, so it may say False for a key another process stored)."""

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Which of ``keys`` the tier holds, in order; a remote tier asks in one round trip.

        Lookup uses this for the chunks L1 does not hold. A failure answers False (a miss).
        """
        return [self.contains(key) for key in keys]

    @abc.abstractmethod
    async def put(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Store ``obj`` under ``key``. True when stored (or already present), False on failure."""

    @abc.abstractmethod
    async def get_into(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Fill ``obj`` (allocated for the expected layout and token count) with ``key``'s bytes.

        False on a miss, a layout or token-count mismatch, or a corrupt copy (which is removed).
        On False the object's bytes are unspecified; the caller must not use them.
        """

    # A tier whose reads run at two speeds, its files in the OS page cache or not (L2): its
    # cost model keeps one estimate of each (`tiered_kv.cost.PageCachedTierCost`).
    page_cached_reads: bool = False

    def cached_share(self, keys: Sequence[ChunkKey]) -> float | None:
        """The share of ``keys`` (held by the tier) whose bytes are in the page cache now, from
        a cheap probe of a few of them; None when the tier cannot tell. Default: None."""
        return None

    def was_page_cached(self, key: ChunkKey) -> bool | None:
        """Whether the last successful `get_into` of ``key`` found its bytes in the page cache
        (asked once, right after that read; None when unknown). Default: None."""
        return None

    async def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark ``keys`` as recently used (they hit in a tier above), so that eviction keeps them.

        Batched and cheap: never a round trip per key, never an error (a failure is counted and
        ignored). Keys the tier does not hold are skipped. The default does nothing."""
        return None

    def use(self, keys: Sequence[ChunkKey]) -> None:
        """One request's chunk keys in prompt order, held here or not (`EvictionOrder.use`):
        the reuse an eviction policy counts. Never I/O. The default does nothing."""
        return None

    @abc.abstractmethod
    async def remove(self, key: ChunkKey) -> bool:
        """Drop ``key``; True when it was present."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """Counters and occupancy: a frozen `TierStats` (subclass) snapshot."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release every resource; safe to call twice."""
