"""`StorageManager`: L1 in front of the lower tiers (L2 disk, L3 remote, custom tiers).

Owns which tier holds what, the per-tier write policies (write_through, write_back on L1
eviction, selective after N hits) on bounded background queues, batched longest-prefix location
across tiers, and reads of lower-tier chunks into L1 objects. Never touches KV bytes itself
(tiers and movers do), never imports CUDA, and never blocks on a lower tier: a store asks
`write_room` first and waits (`wait_for_room`) while the tiers' writes make progress; a write
that meets a full queue anyway makes room by dropping the oldest waiting write whose chunk is
still in L1 (its bytes are still cached there), else is dropped itself (write_through,
selective), or refuses the eviction (write_back: the chunk stays in L1, so it is never lost);
every drop is counted. Loop-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Final

from tiered_kv.config import WRITE_POLICIES, WritePolicy
from tiered_kv.cost import Claim, PageCachedTierCost, TierCost
from tiered_kv.errors import ConfigError
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import MemoryLayoutDesc
from tiered_kv.memory import MemoryObj
from tiered_kv.snapshot import snapshot
from tiered_kv.tiers.base import LowerTier, TierEventLog
from tiered_kv.tiers.l1 import L1Tier

logger = logging.getLogger(__name__)

# Recency of chunks that hit in L1 is passed down to the lower tiers in batches: at this many
# keys, or after this long, whichever comes first (and on flush and close).
TOUCH_BATCH = 256
TOUCH_INTERVAL_S = 0.5
SELECTIVE_TRACKED_KEYS = 1 << 16  # hit counters kept for "selective" admission (LRU beyond)
# A wait for a lower-tier write to end that sees none end for this long marks the writes
# stalled: stores stop waiting for write room (and drop instead) until a write ends again.
WRITE_STALL_S = 1.0
# Waiting writes a full queue looks through, oldest first, for one whose chunk is still in L1.
DROP_SCAN = 64

WRITE_THROUGH, WRITE_BACK, SELECTIVE = WRITE_POLICIES
# `StorageManager.locate`'s location of a chunk in L1; a lower tier's is its index in ``lower``.
IN_L1: Final = -1


class BusyClock:
    """Seconds during which at least one operation of a path was running: the denominator of
    a path's throughput (summing per-operation latencies would count overlapping writes twice)."""

    __slots__ = ("_active", "_since", "seconds")

    def __init__(self) -> None:
        self._active = 0
        self._since = 0.0
        self.seconds = 0.0

    def start(self) -> None:
        if self._active == 0:
            self._since = time.perf_counter()
        self._active += 1

    def stop(self) -> None:
        self._active -= 1
        if self._active == 0:
            self.seconds += time.perf_counter() - self._since


class _WriteLine:
    """Writes waiting for a lower tier's writers, oldest first, bounded in chunks and in bytes
    (a full line still takes one chunk, however large, when nothing waits)."""

    def __init__(self, max_chunks: int, max_bytes: int | None) -> None:
        self.max_chunks = max_chunks
        self.max_bytes = max_bytes
        self.waiting: OrderedDict[ChunkKey, MemoryObj] = OrderedDict()
        self.bytes = 0  # of the waiting chunks
        self.unfinished = 0  # waiting or being written
        self._nonempty = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def takes(self, count: int, nbytes: int) -> bool:
        """Whether ``count`` more chunks of ``nbytes`` in all fit now."""
        if len(self.waiting) + count > self.max_chunks:
            return False
        if self.max_bytes is None or self.bytes + nbytes <= self.max_bytes:
            return True
        return not self.waiting and count == 1

    def put(self, key: ChunkKey, obj: MemoryObj) -> None:
        self.waiting[key] = obj
        self.bytes += obj.nbytes
        self.unfinished += 1
        self._nonempty.set()
        self._idle.clear()

    def remove(self, key: ChunkKey) -> MemoryObj:
        """Take a waiting write out unwritten (its reference goes to the caller)."""
        obj = self.waiting.pop(key)
        self.bytes -= obj.nbytes
        self.task_done()
        return obj

    async def get(self) -> tuple[ChunkKey, MemoryObj]:
        """The oldest waiting write; the caller calls `task_done` when it has ended."""
        while not self.waiting:
            self._nonempty.clear()
            await self._nonempty.wait()
        key, obj = self.waiting.popitem(last=False)
        self.bytes -= obj.nbytes
        return key, obj

    def task_done(self) -> None:
        self.unfinished -= 1
        if self.unfinished == 0:
            self._idle.set()

    async def join(self) -> None:
        await self._idle.wait()


@dataclasses.dataclass(slots=True)
class _WriteQueue:
    tier: LowerTier
    policy: WritePolicy
    line: _WriteLine
    pending: set[ChunkKey]
    workers: list[asyncio.Task[None]]
    dropped_full: int = 0
    dropped_in_l1: int = 0
    dropped_close: int = 0
    done: int = 0
    failed: int = 0
    skipped_present: int = 0
    demoted: int = 0
    demotions_refused: int = 0
    admitted: int = 0
    bytes_written: int = 0
    write_seconds: float = 0.0  # sum of per-write latencies
    busy: BusyClock = dataclasses.field(default_factory=BusyClock)


@dataclasses.dataclass(slots=True)
class _TierReads:
    hits: int = 0
    located: int = 0
    failures: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # sum of per-read latencies
    declined: int = 0
    declined_saved_seconds: float = 0.0
    in_flight: int = 0
    busy: BusyClock = dataclasses.field(default_factory=BusyClock)


@dataclasses.dataclass(frozen=True, slots=True)
class TierReadStats:
    """Reads of one lower tier into L1 (lookups that found chunks there, loads)."""

    located: int  # chunks lookups found first in this tier
    hits: int  # chunks read into L1
    failures: int  # reads (and batched lookups) that failed: misses
    bytes_read: int
    read_seconds: float  # sum of per-read latencies
    # Chunks lookups found here and left unclaimed, loading them being slower than recomputing
    # (load_policy "cost"), and the time that saved by the cost model's estimate.
    declined: int
    declined_saved_seconds: float
    busy_seconds: float  # time at least one read was running (throughput's denominator)


@dataclasses.dataclass(frozen=True, slots=True)
class WriteQueueStats:
    """One lower tier's bounded write queue and what became of its writes."""

    policy: WritePolicy
    queue_depth: int
    queue_capacity: int
    queue_bytes: int  # of the writes waiting
    queue_bytes_capacity: int | None  # None: bounded in chunks only
    pending: int  # queued or being written
    done: int
    failed: int
    dropped_full: int  # writes dropped for a full queue: the new one or a waiting one
    dropped_in_l1: int  # of those, chunks still in L1 when dropped (still cached there)
    dropped_close: int
    skipped_present: int
    demoted: int  # write_back: queued at L1 eviction (or at close)
    demotions_refused: int  # write_back: eviction refused, the queue was full
    admitted: int  # selective: queued once a chunk reached its hits
    bytes_written: int
    write_seconds: float  # sum of per-write latencies
    busy_seconds: float  # time at least one write was running


@dataclasses.dataclass(frozen=True, slots=True)
class LowerTierTraffic:
    """Storage's books on one lower tier: reads, and writes once the queue exists (open)."""

    name: str
    reads: TierReadStats
    writes: WriteQueueStats | None


@dataclasses.dataclass(frozen=True, slots=True)
class StorageStats:
    l1_hits: int  # chunks delivered from L1
    misses: int  # reads that found no usable copy in any tier holding the key
    promotions: int
    promotion_failures: int
    located_l1: int
    located_misses: int  # lookups whose prefix ended before the request's end
    demoting: int  # write_back chunks evicted from L1, still waiting for their write
    touches_sent: int
    touch_failures: int
    tiers: tuple[LowerTierTraffic, ...]  # top first

    def tier(self, name: str) -> LowerTierTraffic:
        """The books on the lower tier ``name`` (names compared without case)."""
        for tier in self.tiers:
            if tier.name.lower() == name.lower():
                return tier
        raise KeyError(f"no lower tier named {name!r}; tiers: {[t.name for t in self.tiers]}")


def _check_tier_names(l1_name: str, lower: Sequence[LowerTier]) -> None:
    """A tier's name keys its write policy and its statistics (compared without case, as
    ``write_policies`` are): two tiers of one name would share both, so refuse them."""
    seen = {l1_name.lower(): l1_name}
    for tier in lower:
        name = tier.name
        if not isinstance(name, str) or not name:
            raise ConfigError(f"lower tier {tier!r}: its name must be a non-empty string")
        other = seen.get(name.lower())
        seen[name.lower()] = name
        if other is not None:
            raise ConfigError(
                f"two tiers are named {name!r} and {other!r}: a tier's name keys its write "
                "policy and its statistics, and names are compared without case; give each "
                "custom lower tier a name of its own"
            )


class StorageManager:
    """Chains L1 and the lower tiers.

    Object ownership: `allocate` hands the caller a staging object with one reference; `commit`
    makes L1 and every write queue take their own, so the caller always drops its reference after
    committing. `get_l1` returns an object with a reference for the caller; `promote` publishes a
    chunk read up from a lower tier (the prefetch controller reads, storage owns the books).

    Write policies (``write_policies``: tier name → policy as `EngineConfig.write_policy_for`
    resolved it, checked there; a tier it leaves out is write_through):
    write_through queues the write at commit; write_back marks the L1 entry dirty and queues the
    write when L1 evicts it (the queue holds a reference, so the bytes stay until written, and
    the chunk stays readable meanwhile); selective queues the write once a chunk has been
    delivered ``selective_min_hits`` times.
    """

    def __init__(
        self,
        l1: L1Tier,
        lower: Sequence[LowerTier],
        *,
        write_queue: int = 256,
        write_queue_bytes: int | None = None,
        write_policies: Mapping[str, WritePolicy] | None = None,
        selective_min_hits: int = 2,
    ) -> None:
        self.l1 = l1
        self.lower = tuple(lower)
        _check_tier_names(l1.name, self.lower)
        policies = write_policies or {}
        self._policies = [policies.get(tier.name, WRITE_THROUGH) for tier in self.lower]
        self._selective = SELECTIVE in self._policies  # `record_hit` has work to do
        self._write_queue_size = write_queue
        self._write_queue_bytes = write_queue_bytes
        # A wait for a write to end saw none end for `WRITE_STALL_S`; cleared when one ends.
        self.writes_stalled = False
        self.write_stalls = 0
        self._selective_min_hits = selective_min_hits
        self._queues: list[_WriteQueue] = []
        self._opened = False
        self._demoting: dict[ChunkKey, MemoryObj] = {}
        self._hit_counts: OrderedDict[ChunkKey, int] = OrderedDict()
        self._touched: dict[ChunkKey, None] = {}  # L1 hits not yet passed down, oldest first
        self._touch_wanted = asyncio.Event()
        self._write_ended = asyncio.Event()  # set by each lower-tier write that ends
        self._toucher: asyncio.Task[None] | None = None
        self.touches_sent = 0
        self.touch_failures = 0
        self.l1_hits = 0
        self.reads = [_TierReads() for _ in self.lower]
        # Each lower tier's read cost, learned from the reads below (`tiered_kv.cost`).
        self.costs = [
            (PageCachedTierCost if tier.page_cached_reads else TierCost)(
                tier.name, tier.read_parallelism
            )
            for tier in self.lower
        ]
        self.misses = 0
        self.located_l1 = 0
        self.located_misses = 0
        self.promotions = 0
        self.promotion_failures = 0
        self.lower_read_seconds = 0.0
        if any(policy == WRITE_BACK for policy in self._policies):
            l1.on_evict = self._on_l1_evict
        self.events: TierEventLog | None = None

    def watch(self, events: TierEventLog | None) -> None:
        """Record chunks entering and leaving every tier in ``events`` from now on (None: stop):
        L1 commits and removals, lower-tier writes that succeed, and what lower tiers drop on
        their own. Chunks already in a tier are not announced."""
        self.events = events
        self.l1.events = events
        for tier in self.lower:
            tier.events = events

    async def open(self) -> None:
        for index, (tier, policy) in enumerate(zip(self.lower, self._policies, strict=True)):
            await tier.open()
            self.costs[index].parallelism = tier.read_parallelism  # known once it is open
            line = _WriteLine(self._write_queue_size, self._write_queue_bytes)
            wq = _WriteQueue(tier, policy, line, set(), [])
            wq.workers = [
                asyncio.create_task(self._writer(wq), name=f"tkv-{tier.name}-writer{i}")
                for i in range(max(1, tier.write_parallelism))
            ]
            self._queues.append(wq)
        if self.lower:
            self._toucher = asyncio.create_task(self._touch_loop(), name="tkv-touch")
        self._opened = True

    def write_policy(self, tier_name: str) -> WritePolicy | None:
        for tier, policy in zip(self.lower, self._policies, strict=True):
            if tier.name == tier_name:
                return policy
        return None

    # -- bookkeeping ------------------------------------------------------------------------
    def in_l1(self, key: ChunkKey) -> bool:
        """In L1, or evicted and still waiting for its write_back demotion (still readable)."""
        return self.l1.contains(key) or key in self._demoting

    def tier_of(self, key: ChunkKey) -> str | None:
        """Name of the highest tier holding ``key`` (from indexes, no I/O), or None."""
        if self.in_l1(key):
            return self.l1.name
        for tier in self.lower:
            if tier.contains(key):
                return tier.name
        return None

    def lower_holding(self, key: ChunkKey) -> list[int]:
        """Indexes of the lower tiers whose index holds ``key``, top first (no I/O)."""
        return [i for i, tier in enumerate(self.lower) if tier.contains(key)]

    def prefix_hits(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys some tier holds (indexes only); a miss ends the prefix."""
        for index, key in enumerate(keys):
            if self.tier_of(key) is None:
                return index
        return len(keys)

    async def locate(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Where each key of the longest cached prefix is: `IN_L1`, or ``i`` for ``lower[i]``
        (the highest tier holding it).

        The list stops at the first key no tier holds (a gap ends the prefix). Lower tiers are
        asked with one batched `contains_many` each, only about the keys no higher tier holds.
        """
        where: list[int | None] = [IN_L1 if self.in_l1(key) else None for key in keys]
        for index, tier in enumerate(self.lower):
            unknown = [i for i, w in enumerate(where) if w is None]
            if not unknown:
                break
            try:
                found = await tier.contains_many([keys[i] for i in unknown])
            except asyncio.CancelledError:
                raise
            except Exception:  # tier boundary: a broken index is a miss
                logger.warning("%s contains_many failed", tier.name, exc_info=True)
                self.reads[index].failures += 1
                continue
            for i, present in zip(unknown, found, strict=False):
                if present:
                    where[i] = index
        prefix: list[int] = []
        for key, w in zip(keys, where, strict=True):
            if w is None:  # a gap ends the prefix
                self.located_misses += 1
                break
            if w == IN_L1:
                self.located_l1 += 1
                self._note_l1_hit(key)
            else:
                self.reads[w].located += 1
            prefix.append(w)
        return prefix

    # -- store ------------------------------------------------------------------------------
    def allocate(self, layout: MemoryLayoutDesc, num_tokens: int) -> MemoryObj | None:
        return self.l1.allocate(layout, num_tokens)

    def commit(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Publish a filled staging object in L1 and apply each lower tier's write policy."""
        if not self.l1.commit(key, obj):
            return False
        for wq in self._queues:
            if wq.policy == WRITE_THROUGH:
                self._enqueue(wq, key, obj)
            elif wq.policy == WRITE_BACK:
                if not wq.tier.contains(key):
                    self.l1.mark_dirty(key)
            elif self._hit_counts.get(key, 0) >= self._selective_min_hits:
                self._enqueue(wq, key, obj)
        return True

    def note_use(self, keys: Sequence[ChunkKey]) -> None:
        """One request's chunk keys in prompt order (its store ended): the reuse the tiers'
        eviction orders count (`tiered_kv.eviction`), held or not."""
        self.l1.use(keys)
        for tier in self.lower:
            tier.use(keys)

    def write_room(self, sizes: Sequence[int]) -> int:
        """How many of the next chunks to commit, of ``sizes`` bytes each, every write_through
        queue takes now without dropping a write."""
        fits = len(sizes)
        for wq in self._queues:
            if wq.policy != WRITE_THROUGH:
                continue
            total = 0
            for count, size in enumerate(sizes[:fits], start=1):
                total += size
                if not wq.line.takes(count, total):
                    fits = count - 1
                    break
        return fits

    async def wait_for_room(self, timeout: float) -> bool:
        """Wait until a lower-tier write ends: its chunk may then leave L1 (a write_through
        copy is now below; a write_back demotion lets its bytes go) and its queue slot is free.
        False at once when no write is pending (nothing below will free room), or at
        ``timeout``; a wait that saw no write end for `WRITE_STALL_S` returns False then and
        marks the writes stalled (``writes_stalled``) until one ends."""
        if not any(wq.pending for wq in self._queues):
            return False
        self._write_ended.clear()
        try:
            async with asyncio.timeout(min(timeout, WRITE_STALL_S)):
                await self._write_ended.wait()
        except TimeoutError:
            if timeout > WRITE_STALL_S:
                self.writes_stalled = True
                self.write_stalls += 1
                logger.info(
                    "no lower-tier write ended for %.1fs: stores stop waiting for them",
                    WRITE_STALL_S,
                )
            return False
        return True

    def record_hit(self, key: ChunkKey, obj: MemoryObj) -> None:
        """A chunk was delivered to a request: count it, admit it to selective tiers at N."""
        if not self._selective:
            return
        count = self._hit_counts.pop(key, 0) + 1
        self._hit_counts[key] = count
        if len(self._hit_counts) > SELECTIVE_TRACKED_KEYS:
            self._hit_counts.popitem(last=False)
        if count < self._selective_min_hits:
            return
        for wq in self._queues:
            if wq.policy == SELECTIVE and self._enqueue(wq, key, obj):
                wq.admitted += 1

    def _enqueue(self, wq: _WriteQueue, key: ChunkKey, obj: MemoryObj) -> bool:
        """Queue a write of ``obj`` (the queue takes a reference); never blocks. A full queue
        drops its oldest waiting write whose chunk is still in L1 to make room (not for
        write_back, whose waiting chunks live nowhere else), else this write."""
        if key in wq.pending or wq.tier.contains(key):
            return False
        while not wq.line.takes(1, obj.nbytes):
            victim = self._droppable(wq)
            if victim is None:
                wq.dropped_full += 1
                if self.l1.contains(key):
                    wq.dropped_in_l1 += 1
                return False
            wq.line.remove(victim).unref()
            wq.pending.discard(victim)
            wq.dropped_full += 1
            wq.dropped_in_l1 += 1
        wq.line.put(key, obj.ref())
        wq.pending.add(key)
        return True

    def _droppable(self, wq: _WriteQueue) -> ChunkKey | None:
        """The oldest waiting write, of the first `DROP_SCAN`, whose chunk is still in L1."""
        if wq.policy == WRITE_BACK:
            return None
        for index, key in enumerate(wq.line.waiting):
            if index == DROP_SCAN:
                break
            if self.l1.contains(key):
                return key
        return None

    def _on_l1_evict(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """L1 eviction hook: queue write_back demotions, or refuse when a queue is full."""
        if not self.l1.is_dirty(key):
            return True
        targets = [
            wq
            for wq in self._queues
            if wq.policy == WRITE_BACK and key not in wq.pending and not wq.tier.contains(key)
        ]
        if any(not wq.line.takes(1, obj.nbytes) for wq in targets):
            for wq in targets:
                wq.demotions_refused += 1
            return False  # stays in L1 (dirty); the next eviction candidate is tried instead
        for wq in targets:
            self._enqueue(wq, key, obj)
            wq.demoted += 1
        if any(key in wq.pending for wq in self._queues if wq.policy == WRITE_BACK):
            self._demoting[key] = obj.ref()  # readable until written
        return True

    def _settle(self, key: ChunkKey) -> None:
        """After a write of ``key`` ended: release a finished demotion, clean the L1 entry."""
        if any(key in wq.pending for wq in self._queues if wq.policy == WRITE_BACK):
            return
        obj = self._demoting.pop(key, None)
        if obj is not None:
            obj.unref()
        if all(wq.tier.contains(key) for wq in self._queues if wq.policy == WRITE_BACK):
            self.l1.mark_clean(key)

    async def _writer(self, wq: _WriteQueue) -> None:
        while True:
            key, obj = await wq.line.get()
            try:
                if wq.tier.contains(key):
                    wq.skipped_present += 1
                    continue
                start = time.perf_counter()
                wq.busy.start()
                try:
                    stored = await wq.tier.put(key, obj)
                finally:
                    wq.busy.stop()
                if stored:
                    wq.done += 1
                    wq.bytes_written += obj.nbytes
                    wq.write_seconds += time.perf_counter() - start
                    if self.events is not None:
                        self.events.emit("stored", wq.tier.name, key, obj.num_tokens)
                else:
                    wq.failed += 1
            except asyncio.CancelledError:
                wq.dropped_close += 1  # only aclose cancels writers
                raise
            except Exception:  # tier boundary: a broken tier must not kill the writer
                logger.warning("%s write of %s failed", wq.tier.name, key.hex, exc_info=True)
                wq.failed += 1
            finally:
                wq.pending.discard(key)
                obj.unref()
                wq.line.task_done()
                self._write_ended.set()
                self.writes_stalled = False
                if wq.policy == WRITE_BACK:
                    self._settle(key)

    # -- read -------------------------------------------------------------------------------
    def get_l1(self, key: ChunkKey) -> MemoryObj | None:
        """The chunk if L1 holds it (caller's reference), without awaiting.

        A chunk evicted but still waiting for its write_back demotion is put back into L1.
        """
        obj = self.l1.get(key)
        if obj is None:
            demoting = self._demoting.get(key)
            if demoting is None:
                return None
            if self.l1.commit(key, demoting):
                self.l1.mark_dirty(key)  # its write is still pending; `_settle` cleans it
            obj = demoting.ref()
        self.l1_hits += 1
        self._note_l1_hit(key)
        return obj

    # -- recency ----------------------------------------------------------------------------
    def _note_l1_hit(self, key: ChunkKey) -> None:
        """A chunk hit in L1: its copies below must not age out while it is hot (a system
        prompt served from L1 would otherwise be the first thing L2 evicts)."""
        if not self.lower:
            return
        self._touched.pop(key, None)
        self._touched[key] = None
        if len(self._touched) >= TOUCH_BATCH:
            self._touch_wanted.set()

    async def _touch_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TOUCH_INTERVAL_S):  # no helper task, unlike wait_for
                    await self._touch_wanted.wait()
            self._touch_wanted.clear()
            await self.pass_down_recency()

    async def pass_down_recency(self) -> None:
        """Tell each lower tier which of its chunks hit in L1 since the last call (one batched
        `touch` per tier, least recent first). A failure is counted, never raised."""
        if not self._touched:
            return
        keys = list(self._touched)
        self._touched.clear()
        for tier in self.lower:
            held = [key for key in keys if tier.contains(key)]
            if not held:
                continue
            try:
                await tier.touch(held)
            except asyncio.CancelledError:
                raise
            except Exception:  # tier boundary: recency is a hint, never an error
                logger.warning("%s touch failed", tier.name, exc_info=True)
                self.touch_failures += 1
                continue
            self.touches_sent += len(held)

    async def read_into(self, tier_index: int, key: ChunkKey, obj: MemoryObj) -> bool:
        """Fill ``obj`` from ``lower[tier_index]``; a failure or exception is a miss (False)."""
        tier = self.lower[tier_index]
        reads = self.reads[tier_index]
        start = time.perf_counter()
        reads.busy.start()
        reads.in_flight += 1
        concurrency = reads.in_flight  # the reads this one shares the tier with, itself included
        try:
            found = await tier.get_into(key, obj)
        except asyncio.CancelledError:
            raise
        except Exception:  # tier boundary
            logger.warning("%s read of %s failed", tier.name, key.hex, exc_info=True)
            found = False
        finally:
            reads.in_flight -= 1
            reads.busy.stop()
        elapsed = time.perf_counter() - start
        self.lower_read_seconds += elapsed
        if not found:
            reads.failures += 1
            return False
        reads.hits += 1
        reads.bytes_read += obj.nbytes
        reads.read_seconds += elapsed
        self.costs[tier_index].observe(
            obj.nbytes, elapsed, tier.was_page_cached(key), concurrency=concurrency
        )
        return True

    def expect_costs(self, keys: Sequence[ChunkKey], where: Sequence[int]) -> None:
        """Before a claim: each tier whose reads run at two speeds probes how many of the
        located chunks it holds are in the page cache (`LowerTier.cached_share`), and its cost
        model expects that mix (`PageCachedTierCost.expect_cached`)."""
        for index, cost in enumerate(self.costs):
            if isinstance(cost, PageCachedTierCost):
                held = [key for key, tier in zip(keys, where, strict=False) if tier == index]
                cost.expect_cached(self.lower[index].cached_share(held) if held else None)

    def note_declined(self, claim: Claim) -> None:
        """Count what a lookup left unclaimed per tier; the time saved goes to the slowest."""
        for tier_index, chunks in claim.declined.items():
            self.reads[tier_index].declined += chunks
        if claim.declined:
            self.reads[max(claim.declined)].declined_saved_seconds += claim.saved_s

    def promote(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """A lower-tier chunk read into ``obj`` (an L1 staging object) becomes an L1 entry; the
        only promotion path. False when L1 already had it (the caller's object stays its own)."""
        promoted = self.l1.commit(key, obj)
        if promoted:
            self.promotions += 1
        return promoted

    def record_miss(self) -> None:
        """A read that found no usable copy in any tier holding the key."""
        self.misses += 1

    def record_promotion_failure(self) -> None:
        """A lower-tier chunk could not be read up: L1 had no unreferenced room for it."""
        self.promotion_failures += 1

    # -- shutdown ---------------------------------------------------------------------------
    async def flush(self, timeout: float | None = None) -> int:
        """Wait for queued lower-tier writes. Returns how many were still pending at the timeout
        (those stay queued; `aclose` drops them). Dirty write_back chunks stay in L1. Recency of
        L1 hits is passed down first."""
        await self.pass_down_recency()
        joins = [wq.line.join() for wq in self._queues]
        if not joins:
            return 0
        try:
            await asyncio.wait_for(asyncio.gather(*joins), timeout)
        except TimeoutError:
            return sum(len(wq.pending) for wq in self._queues)
        return 0

    async def demote_dirty(self, timeout: float | None = None) -> int:
        """Queue every dirty L1 chunk for its write_back tiers (waiting for queue space up to
        ``timeout``); returns how many could not be queued in time."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        left = 0
        for key in self.l1.dirty_keys():
            peeked = self.l1.peek(key)
            if peeked is None:
                continue
            obj = peeked.ref()  # held across the waits below
            try:
                left += await self._demote(key, obj, loop, deadline)
            finally:
                obj.unref()
        return left

    async def _demote(
        self, key: ChunkKey, obj: MemoryObj, loop: asyncio.AbstractEventLoop, deadline: float | None
    ) -> int:
        """Queue ``obj`` for each write_back tier that lacks it, waiting for room until
        ``deadline``; the number of tiers it could not be queued for in time."""
        left = 0
        for wq in self._queues:
            if wq.policy != WRITE_BACK or key in wq.pending or wq.tier.contains(key):
                continue
            while not wq.line.takes(1, obj.nbytes):
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    break
                self._write_ended.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._write_ended.wait(), remaining)
            if not wq.line.takes(1, obj.nbytes):
                left += 1
                continue
            wq.line.put(key, obj.ref())
            wq.pending.add(key)
            wq.demoted += 1
        return left

    async def aclose(self, timeout: float) -> int:
        """Demote dirty write_back chunks and flush (together bounded by ``timeout``), then drop
        what is left, stop writers, close tiers. Returns the number of writes dropped."""
        if not self._opened:
            return 0
        dropped = 0
        try:
            if self._toucher is not None:
                self._toucher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._toucher
                self._toucher = None
            if self._queues:
                loop = asyncio.get_running_loop()
                deadline = loop.time() + timeout
                dropped += await self.demote_dirty(timeout)
                pending = await self.flush(max(0.0, deadline - loop.time()))
                if pending:
                    logger.warning(
                        "closing with %d lower-tier writes still pending after %.1fs; dropping",
                        pending,
                        timeout,
                    )
        finally:
            if self._toucher is not None:
                self._toucher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._toucher
                self._toucher = None
            for wq in self._queues:
                for task in wq.workers:
                    task.cancel()
                for task in wq.workers:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                for key in list(wq.line.waiting):
                    wq.line.remove(key).unref()
                    wq.pending.discard(key)
                    wq.dropped_close += 1
                wq.workers.clear()
                dropped += wq.dropped_close
            for obj in self._demoting.values():
                obj.unref()
            self._demoting.clear()
            for tier in self.lower:
                await tier.aclose()
            self.l1.clear()
            self._opened = False
        return dropped

    def stats(self) -> StorageStats:
        writes = {
            id(wq.tier): snapshot(
                WriteQueueStats,
                wq,
                queue_depth=len(wq.line.waiting),
                queue_capacity=wq.line.max_chunks,
                queue_bytes=wq.line.bytes,
                queue_bytes_capacity=wq.line.max_bytes,
                pending=len(wq.pending),
                busy_seconds=wq.busy.seconds,
            )
            for wq in self._queues
        }
        tiers = tuple(
            LowerTierTraffic(
                tier.name,
                snapshot(TierReadStats, reads, busy_seconds=reads.busy.seconds),
                writes.get(id(tier)),
            )
            for tier, reads in zip(self.lower, self.reads, strict=True)
        )
        return snapshot(StorageStats, self, demoting=len(self._demoting), tiers=tiers)
