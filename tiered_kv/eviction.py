"""Which chunk a tier lets go first: `LRU` and `Reuse` (docs/eviction.md).

A tier (L1 by bytes, L2 by bytes on disk) keeps its entries and asks its order which keys to
evict, first to go first; it skips what it may not evict (a reader's reference, a dirty chunk)
and asks again. The order hears what happens to the keys:

- ``insert(key, partial=)``: a key became resident (``partial``: a prompt's last, shorter chunk);
- ``touch(key)``: it was read or is about to be (recency only);
- ``use(keys)``: one request's chunk keys, in prompt order, once per request
  (`TieredKVEngine.store` reports them, resident or not): the reuse the policy counts;
- ``remove(key)``: it left.

`LRU` is least recently used first, as tiers always did (``use`` is a no-op: inserts and
touches already ordered the keys).

`Reuse` ranks by age scaled by how likely a chunk is to be used again. Traces of production
traffic (Mooncake's FAST'25 release) show that a chunk seen by one request is used again far
less often than one two requests have used (45% against 85% in the synthetic trace), and a
prompt's last, shorter chunk almost never is (2%: the next turn of a conversation has a full
chunk there, with another hash). So each key is in one of three classes, each an LRU list:

- reused: two or more requests used it (counted through ``use``, resident or not: counts of
  keys the tier does not hold are remembered, up to `HISTORY_FACTOR` times as many as it holds,
  so a chunk that comes back after an eviction, or whose write lands after its use, is known);
- first: fewer than two so far;
- partial: the same, for a prompt's last, shorter chunk.

A key's age is the number of events (inserts, touches, uses of any key) since its last; the
victim is the head of the list with the largest age times the class weight (`WEIGHTS`: a
first-seen chunk ages four times as fast as a reused one, a partial one sixteen times).
Within one request, ``use`` renews the keys from the last chunk to the first, so a prompt's
head is younger than its tail and the tail goes first: a chunk is worth nothing without the
chunks before it.

Pure Python with no I/O; loop-only like the tiers. `tiered_kv.benchmarks.trace_sim` replays
traces through the same classes.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Hashable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from tiered_kv.errors import ConfigError
from tiered_kv.snapshot import snapshot

K = TypeVar("K", bound=Hashable)

REUSED, FIRST, PARTIAL = 0, 1, 2
WEIGHTS = (1, 4, 16)  # age multipliers of the classes above
HISTORY_FACTOR = 4  # use counts kept for up to this many times the resident keys
HISTORY_MIN = 4096


@dataclasses.dataclass(frozen=True, slots=True)
class EvictionStats:
    """An order's counters, as tiers report them (fields of `L1Stats` and `DiskStats`)."""

    keys_reused: int = 0  # resident keys per class (all in "reused" for LRU)
    keys_first: int = 0
    keys_partial: int = 0
    history_keys: int = 0  # use counts remembered for keys no longer resident
    promotions: int = 0  # keys that moved to "reused" on their second use
    returns: int = 0  # keys inserted again whose earlier uses the history remembered


class EvictionOrder(Protocol[K]):
    name: str

    def insert(self, key: K, *, partial: bool = False) -> None: ...
    def touch(self, key: K) -> None: ...
    def use(self, keys: Sequence[K]) -> None: ...
    def remove(self, key: K) -> None: ...
    def victims(self) -> Iterator[K]: ...
    def __contains__(self, key: object) -> bool: ...
    def __len__(self) -> int: ...
    def stats(self) -> EvictionStats: ...


class LRU(Generic[K]):
    """Least recently used first: inserts and touches make a key the most recent."""

    name = "lru"

    def __init__(self) -> None:
        self._keys: collections.OrderedDict[K, None] = collections.OrderedDict()

    def insert(self, key: K, *, partial: bool = False) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)

    def touch(self, key: K) -> None:
        if key in self._keys:
            self._keys.move_to_end(key)

    def use(self, keys: Sequence[K]) -> None:
        pass

    def remove(self, key: K) -> None:
        self._keys.pop(key, None)

    def victims(self) -> Iterator[K]:
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def stats(self) -> EvictionStats:
        return EvictionStats(keys_reused=len(self._keys))


class Reuse(Generic[K]):
    """Age scaled by reuse class; see the module docstring."""

    name = "reuse"

    def __init__(self) -> None:
        # Per class: key -> its entry, oldest first. An entry is one list, [clock at the key's
        # last event, uses, class], shared with `_entries`: an event hashes the key at most
        # twice (a ChunkKey's hash is a Python call).
        self._lists: tuple[collections.OrderedDict[K, list[int]], ...] = tuple(
            collections.OrderedDict() for _ in WEIGHTS
        )
        self._entries: dict[K, list[int]] = {}
        self._history: collections.OrderedDict[K, int] = collections.OrderedDict()
        self._clock = 0
        self.promotions = 0
        self.returns = 0

    def insert(self, key: K, *, partial: bool = False) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._lists[entry[2]].move_to_end(key)
            self._clock += 1
            entry[0] = self._clock
            return
        uses = self._history.pop(key, 0) if self._history else 0
        if uses:
            self.returns += 1
        cls = REUSED if uses >= 2 else PARTIAL if partial else FIRST
        self._clock += 1
        entry = [self._clock, uses, cls]
        self._entries[key] = entry
        self._lists[cls][key] = entry

    def touch(self, key: K) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._lists[entry[2]].move_to_end(key)
            self._clock += 1
            entry[0] = self._clock

    def use(self, keys: Sequence[K]) -> None:
        entries, lists = self._entries, self._lists
        clock = self._clock
        for key in reversed(keys):  # the tail first: the head ends youngest
            entry = entries.get(key)
            if entry is None:  # not (yet) resident: a write still on its way, or not taken
                self._remember(key, self._history.pop(key, 0) + 1)
                continue
            clock += 1
            entry[0] = clock
            entry[1] += 1
            cls = entry[2]
            if cls != REUSED and entry[1] >= 2:  # a second use: reused from now on
                self.promotions += 1
                del lists[cls][key]
                entry[2] = REUSED
                lists[REUSED][key] = entry
            else:
                lists[cls].move_to_end(key)
        self._clock = clock

    def remove(self, key: K) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        del self._lists[entry[2]][key]
        self._remember(key, entry[1])

    def victims(self) -> Iterator[K]:
        """Keys by scaled age, oldest first: a merge of the class lists, each oldest first,
        by hand (the heads compared per key: the first victim costs no set-up). Do not change
        the order while iterating."""
        now = self._clock
        heads: list[list[Any]] = []  # [scaled age, key, the list's iterator, weight]
        for entries, weight in zip(self._lists, WEIGHTS, strict=True):
            if entries:
                rest = iter(entries.items())
                key, entry = next(rest)
                heads.append([(now - entry[0]) * weight, key, rest, weight])
        while heads:
            best = heads[0] if len(heads) == 1 else max(heads, key=_scaled_age)
            yield best[1]
            following = next(best[2], None)
            if following is None:
                heads.remove(best)
            else:
                best[0] = (now - following[1][0]) * best[3]
                best[1] = following[0]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> EvictionStats:
        return snapshot(
            EvictionStats,
            self,
            keys_reused=len(self._lists[REUSED]),
            keys_first=len(self._lists[FIRST]),
            keys_partial=len(self._lists[PARTIAL]),
            history_keys=len(self._history),
        )

    def _remember(self, key: K, uses: int) -> None:
        if not uses:
            return
        self._history[key] = uses
        self._history.move_to_end(key)
        limit = max(HISTORY_MIN, HISTORY_FACTOR * len(self._entries))
        while len(self._history) > limit:
            self._history.popitem(last=False)


def _scaled_age(head: list[Any]) -> int:
    return int(head[0])


def make_order(name: str) -> LRU[K] | Reuse[K]:
    """The eviction order ``name`` ("lru" or "reuse"; `config.EVICTIONS`)."""
    if name == "lru":
        return LRU()
    if name == "reuse":
        return Reuse()
    raise ConfigError(f"eviction: expected one of ('lru', 'reuse'), got {name!r}")
