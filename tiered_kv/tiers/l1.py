"""`L1Tier`: committed chunks in the host arena, LRU over the unreferenced ones.

Owns the mapping key → `MemoryObj` and eviction. Staged objects (allocated, being filled) are
invisible until `commit`. The tier holds one reference to each committed object; readers and
in-flight transfers hold their own, and an object is only evicted when the tier's reference is the
last one. Loop-only, like `HostArena`. Must not do I/O or touch KV bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from tiered_kv.keys import ChunkKey
from tiered_kv.layout import MemoryLayoutDesc
from tiered_kv.memory import HostArena, MemoryObj

EvictHook = Callable[[ChunkKey, MemoryObj], None]


class L1Tier:
    name = "L1"

    def __init__(self, arena: HostArena, *, on_evict: EvictHook | None = None) -> None:
        self.arena = arena
        self.on_evict = on_evict
        self._entries: OrderedDict[ChunkKey, MemoryObj] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.allocation_failures = 0

    def allocate(self, layout: MemoryLayoutDesc, num_tokens: int) -> MemoryObj | None:
        """A staging object (one reference, the caller's), evicting LRU entries to make room.

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
        return True

    def get(self, key: ChunkKey) -> MemoryObj | None:
        """The object with a new reference for the caller (who must `unref` it), or None."""
        obj = self._entries.get(key)
        if obj is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return obj.ref()

    def contains(self, key: ChunkKey) -> bool:
        return key in self._entries

    def touch(self, key: ChunkKey) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def remove(self, key: ChunkKey) -> bool:
        """Drop the tier's reference; readers keep theirs until they are done."""
        obj = self._entries.pop(key, None)
        if obj is None:
            return False
        self._bytes -= obj.nbytes
        obj.unref()
        return True

    def evict_unreferenced(self, max_bytes: int | None = None) -> int:
        """Evict LRU entries nobody else references, up to ``max_bytes``; returns bytes freed."""
        freed = 0
        for key in [k for k, o in self._entries.items() if o.refcount == 1]:
            if max_bytes is not None and freed >= max_bytes:
                break
            freed += self._evict(key)
        return freed

    def clear(self) -> None:
        """Drop every entry without calling the eviction hook (shutdown)."""
        for key in list(self._entries):
            self.remove(key)

    def _evict_one(self) -> bool:
        for key, obj in self._entries.items():
            if obj.refcount == 1:
                self._evict(key)
                return True
        return False

    def _evict(self, key: ChunkKey) -> int:
        obj = self._entries[key]
        if self.on_evict is not None:
            self.on_evict(key, obj)
        nbytes = obj.nbytes
        self.remove(key)
        self.evictions += 1
        return nbytes

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self._entries),
            "bytes_used": self._bytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "allocation_failures": self.allocation_failures,
        }
