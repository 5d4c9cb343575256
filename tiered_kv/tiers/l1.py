"""`L1Tier`: committed chunks in the host arena, evicted in its order (`tiered_kv.eviction`:
LRU or reuse) among the unreferenced ones.

Owns the mapping key → `MemoryObj` and eviction. Staged objects (allocated, being filled) are
invisible until `commit`. The tier holds one reference to each committed object; readers and
in-flight transfers hold their own, and an object is only evicted when the tier's reference is the
last one. Loop-only, like `HostArena`. Must not do I/O or touch KV bytes.

Dirty entries (marked by the storage manager for write_back tiers that lack a copy) are evicted
only after every clean candidate, and only through the eviction hook, which may refuse (return
False): the entry then stays, so evicted data is never lost when its demotion cannot be queued.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from tiered_kv.eviction import EvictionOrder, make_order
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import MemoryLayoutDesc
from tiered_kv.memory import HostArena, MemoryObj
from tiered_kv.snapshot import snapshot
from tiered_kv.tiers.base import TierEventLog

# Called before an entry leaves the tier. Returning False refuses the eviction (the entry stays);
# None or True let it go. A hook that needs the bytes afterwards takes its own reference.
EvictHook = Callable[[ChunkKey, MemoryObj], "bool | None"]


@dataclasses.dataclass(frozen=True, slots=True)
class L1Stats:
    entries: int
    bytes_used: int
    hits: int
    misses: int
    evictions: int
    allocation_failures: int
    dirty: int  # waiting for a write_back demotion
    evictions_refused: int  # by the eviction hook (a full write_back queue)
    # The eviction order's counters (`EvictionStats`).
    keys_reused: int = 0
    keys_first: int = 0
    keys_partial: int = 0
    history_keys: int = 0
    promotions: int = 0
    returns: int = 0


class L1Tier:
    name = "L1"

    def __init__(
        self,
        arena: HostArena,
        *,
        on_evict: EvictHook | None = None,
        eviction: str = "lru",
    ) -> None:
        """``eviction``: the order's name (`tiered_kv.eviction.make_order`)."""
        self.arena = arena
        self.on_evict = on_evict
        self.events: TierEventLog | None = None  # set while someone listens (`TierEventLog`)
        self._entries: dict[ChunkKey, MemoryObj] = {}
        self.order: EvictionOrder[ChunkKey] = make_order(eviction)
        self._bytes = 0
        self._dirty: set[ChunkKey] = set()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.allocation_failures = 0
        self.evictions_refused = 0

    def allocate(self, layout: MemoryLayoutDesc, num_tokens: int) -> MemoryObj | None:
        """A staging object (one reference, the caller's), evicting entries to make room.

        None when even evicting every unreferenced entry leaves no run large enough.
        """
        obj = self.arena.allocate_obj(layout, num_tokens)
        while obj is None:
            if not self._evict_one():
                self.allocation_failures += 1
                return None
            obj = self.arena.allocate_obj(layout, num_tokens)
        return obj

    def commit(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Make ``obj`` visible under ``key``; the tier takes its own reference.

        False (and no reference taken) when ``key`` is already present: the first copy wins.
        """
        if key in self._entries:
            return False
        self._entries[key] = obj.ref()
        self._bytes += obj.nbytes
        # A prompt's shorter last chunk: its layout knows the full size.
        self.order.insert(key, partial=obj.num_tokens < obj.layout.chunk_size)
        if self.events is not None:
            self.events.emit("stored", self.name, key, obj.num_tokens)
        return True

    def get(self, key: ChunkKey) -> MemoryObj | None:
        """The object with a new reference for the caller (who must `unref` it), or None."""
        obj = self._entries.get(key)
        if obj is None:
            self.misses += 1
            return None
        self.order.touch(key)
        self.hits += 1
        return obj.ref()

    def contains(self, key: ChunkKey) -> bool:
        return key in self._entries

    def peek(self, key: ChunkKey) -> MemoryObj | None:
        """The committed object without a reference, hit counting or recency update."""
        return self._entries.get(key)

    def mark_dirty(self, key: ChunkKey) -> None:
        """``key`` still needs a copy in a write_back tier: evict it last, through the hook."""
        if key in self._entries:
            self._dirty.add(key)

    def mark_clean(self, key: ChunkKey) -> None:
        self._dirty.discard(key)

    def is_dirty(self, key: ChunkKey) -> bool:
        return key in self._dirty

    def dirty_keys(self) -> list[ChunkKey]:
        """Dirty keys, first to be evicted first."""
        return [key for key in self.order.victims() if key in self._dirty]

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def touch(self, key: ChunkKey) -> None:
        self.order.touch(key)

    def use(self, keys: Sequence[ChunkKey]) -> None:
        """One request's chunk keys in prompt order, held here or not (`EvictionOrder.use`)."""
        self.order.use(keys)

    def remove(self, key: ChunkKey) -> bool:
        """Drop the tier's reference; readers keep theirs until they are done."""
        obj = self._entries.pop(key, None)
        if obj is None:
            return False
        self._bytes -= obj.nbytes
        self._dirty.discard(key)
        self.order.remove(key)
        obj.unref()
        if self.events is not None:
            self.events.emit("removed", self.name, key)
        return True

    def evict_unreferenced(self, max_bytes: int | None = None) -> int:
        """Evict entries nobody else references, in order, up to ``max_bytes``; returns bytes
        freed."""
        freed = 0
        for key in self._candidates():
            if max_bytes is not None and freed >= max_bytes:
                break
            obj = self._entries.get(key)
            if obj is not None and obj.refcount == 1:
                freed += self._evict(key)
        return freed

    def clear(self) -> None:
        """Drop every entry without calling the eviction hook (shutdown)."""
        for key in list(self._entries):
            self.remove(key)

    def _candidates(self) -> list[ChunkKey]:
        """Unreferenced entries in eviction order: clean ones first, then dirty ones."""
        idle = [k for k in self.order.victims() if self._entries[k].refcount == 1]
        return [k for k in idle if k not in self._dirty] + [k for k in idle if k in self._dirty]

    def _evict_one(self) -> bool:
        # Clean entries first, then dirty ones; a refusal changes nothing, so iterating on is safe
        # (the hook must not change the tier), and a success returns at once.
        for want_dirty in (False, True):
            for key in self.order.victims():
                obj = self._entries[key]
                if obj.refcount == 1 and (key in self._dirty) is want_dirty and self._evict(key):
                    return True  # the order changed: stop walking it
        return False

    def _evict(self, key: ChunkKey) -> int:
        """Bytes the entry accounted for, or 0 when the hook refused the eviction."""
        obj = self._entries[key]
        if self.on_evict is not None and self.on_evict(key, obj) is False:
            self.evictions_refused += 1
            return 0
        nbytes = obj.nbytes
        self.remove(key)
        self.evictions += 1
        return nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> L1Stats:
        return snapshot(
            L1Stats,
            self,
            entries=len(self._entries),
            bytes_used=self._bytes,
            dirty=len(self._dirty),
            **dataclasses.asdict(self.order.stats()),
        )
