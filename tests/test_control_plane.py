"""The control plane built from its parts (host arena, L1, fault-injecting lower tiers): the
`StorageManager` and `PrefetchController` tested without an engine, a mover or KV caches."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from tiered_kv.keys import ChunkKey, KeyScope, chunk_keys
from tiered_kv.layout import GroupLayout, MemoryLayoutDesc
from tiered_kv.memory import HostArena, MemoryObj
from tiered_kv.prefetch import PrefetchController
from tiered_kv.storage import IN_L1, StorageManager
from tiered_kv.tiers.base import LowerTier
from tiered_kv.tiers.l1 import L1Tier
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

CHUNK = 32
LAYOUT = MemoryLayoutDesc(
    (GroupLayout(torch.float16, num_layers=2, kv_count=2, row_elems=64),), CHUNK
)
NBYTES = LAYOUT.nbytes(CHUNK)  # 16 KiB, a multiple of the arena's alignment
SCOPE = KeyScope("", "m", "", 1, 0, LAYOUT.layout_id)


def make_keys(count: int, *, salt: int = 0) -> list[ChunkKey]:
    return chunk_keys(SCOPE, [salt * 100_003 + i for i in range(count * CHUNK)], CHUNK)


class CountingTier(MemoryTier):
    """Counts batched lookups; ``fail_contains`` makes them raise (a remote index down)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.asked: list[int] = []
        self.fail_contains = False

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self.asked.append(len(keys))
        if self.fail_contains:
            raise ConnectionError("remote down")
        return await super().contains_many(keys)


class Parts:
    """An arena, L1 and a storage manager over ``tiers``; `close` checks no byte leaked."""

    def __init__(self, tiers: Sequence[LowerTier], *, chunks_in_l1: int, **storage: object):
        self.arena = HostArena(chunks_in_l1 * NBYTES, pin=False)
        self.l1 = L1Tier(self.arena)
        self.storage = StorageManager(self.l1, tiers, **storage)  # type: ignore[arg-type]

    def store(self, key: ChunkKey, fill: int) -> bool:
        """Commit a chunk whose bytes are all ``fill`` (what a mover's gather would do)."""
        obj = self.storage.allocate(LAYOUT, CHUNK)
        assert obj is not None
        obj.raw().fill_(fill)
        try:
            return self.storage.commit(key, obj)
        finally:
            obj.unref()

    async def close(self) -> None:
        await self.storage.aclose(5.0)
        assert self.arena.close() == 0, "a reference leaked"


@pytest.fixture
async def parts_factory() -> AsyncIterator[list[Parts]]:
    made: list[Parts] = []
    yield made
    for parts in made:
        await parts.close()


async def open_parts(
    made: list[Parts], tiers: Sequence[LowerTier], *, chunks_in_l1: int = 8, **storage: object
) -> Parts:
    parts = Parts(tiers, chunks_in_l1=chunks_in_l1, **storage)
    await parts.storage.open()
    made.append(parts)
    return parts


def filled_with(obj: MemoryObj, fill: int) -> bool:
    return bool((obj.raw() == fill).all())


# -- StorageManager -----------------------------------------------------------------------------
async def test_locate_asks_each_lower_tier_once_for_what_l1_lacks(
    parts_factory: list[Parts],
) -> None:
    l2, l3 = CountingTier("L2"), CountingTier("L3")
    parts = await open_parts(parts_factory, [l2, l3])
    storage, keys = parts.storage, make_keys(4)
    for index, key in enumerate(keys):
        assert parts.store(key, index)
    assert await storage.flush() == 0
    assert storage.l1.remove(keys[2]) and storage.l1.remove(keys[3])
    await l2.remove(keys[3])  # chunk 3 only in L3
    assert await storage.locate(keys) == [IN_L1, IN_L1, 0, 1]
    assert (l2.asked, l3.asked) == ([2], [1])  # one round trip each, only the missing keys
    # A broken remote index is a miss (the prefix ends there), counted, never raised.
    l3.fail_contains = True
    assert await storage.locate(keys) == [IN_L1, IN_L1, 0]
    stats = storage.stats()
    assert [tier.reads.failures for tier in stats.tiers] == [0, 1]
    assert stats.located_l1 == 4 and stats.located_misses == 1


async def test_a_chunk_being_demoted_stays_readable_and_is_written_once(
    parts_factory: list[Parts],
) -> None:
    inner = MemoryTier()
    tier = FaultyTier(inner)
    parts = await open_parts(parts_factory, [tier], write_policies={"L2": "write_back"})
    storage, keys = parts.storage, make_keys(4)
    for index, key in enumerate(keys):
        assert parts.store(key, 10 + index)
    tier.gate = asyncio.Event()  # writes wait: evicted chunks sit in the queue
    assert storage.l1.evict_unreferenced() == 4 * NBYTES
    assert storage.stats().demoting == 4 and len(storage.l1) == 0
    assert storage.tier_of(keys[0]) == "L1"  # readable while demoting
    obj = storage.get_l1(keys[0])  # ... and back in L1 on a read
    assert obj is not None and filled_with(obj, 10) and storage.l1.contains(keys[0])
    obj.unref()
    tier.gate.set()
    assert await storage.flush() == 0
    assert inner.stats().entries == 4 and inner.puts == 4  # each written once
    assert storage.stats().demoting == 0 and storage.l1.stats().dirty == 0


async def test_a_full_queue_drops_its_oldest_write_still_in_l1_and_keeps_one_l1_lost(
    parts_factory: list[Parts],
) -> None:
    """A queue of 2 behind a stuck tier (each writer holds one chunk): chunk 2 waits, then its
    L1 entry goes (its bytes live only in the queue now); chunk 3 waits. Chunks 4 and 5 each
    take the place of the oldest waiting write whose chunk is still in L1 (3, then 4), never
    chunk 2's, which would be lost from the cache altogether."""
    tier = FaultyTier(MemoryTier())
    tier.gate = asyncio.Event()
    parts = await open_parts(parts_factory, [tier], write_queue=2)
    keys = make_keys(6)
    for index in range(4):
        assert parts.store(keys[index], index)
        if index < 2:
            for _ in range(3):  # an idle writer takes it (and waits at the gate)
                await asyncio.sleep(0)
        if index == 2:
            assert parts.l1.remove(keys[2])
    wq = parts.storage._queues[0]
    assert list(wq.line.waiting) == [keys[2], keys[3]]
    assert parts.store(keys[4], 4)
    assert list(wq.line.waiting) == [keys[2], keys[4]]
    assert parts.store(keys[5], 5)
    assert list(wq.line.waiting) == [keys[2], keys[5]]
    (traffic,) = parts.storage.stats().tiers
    assert traffic.writes is not None
    assert (traffic.writes.dropped_full, traffic.writes.dropped_in_l1) == (2, 2)
    tier.gate.set()
    assert await parts.storage.flush() == 0
    assert [tier.contains(key) for key in keys] == [True, True, True, False, False, True]
    # Chunk 2 reads back from the tier with its own bytes.
    obj = parts.storage.allocate(LAYOUT, CHUNK)
    assert obj is not None
    try:
        assert await tier.get_into(keys[2], obj)
        assert bool((obj.raw() == 2).all())
    finally:
        obj.unref()


async def test_a_queue_bounded_in_bytes_takes_one_chunk_however_large_when_empty(
    parts_factory: list[Parts],
) -> None:
    """``write_queue_bytes`` of 1.5 chunks: one chunk waits, the second does not fit; a bound
    below one chunk still lets one wait (else nothing larger than it would ever be written),
    and `write_room` counts what fits without dropping."""
    for bound, room in ((NBYTES * 3 // 2, 1), (NBYTES // 2, 1)):
        tier = FaultyTier(MemoryTier())
        tier.gate = asyncio.Event()
        parts = await open_parts(parts_factory, [tier], write_queue=100, write_queue_bytes=bound)
        keys = make_keys(5, salt=bound)
        for index in range(2):  # both writers busy at the gate
            assert parts.store(keys[index], index)
            for _ in range(3):
                await asyncio.sleep(0)
        assert parts.storage.write_room([NBYTES] * 3) == room
        assert parts.store(keys[2], 2)
        assert parts.storage.write_room([NBYTES]) == 0
        assert parts.store(keys[3], 3)  # L1 takes it; the queue drops chunk 2 for it
        (traffic,) = parts.storage.stats().tiers
        assert traffic.writes is not None
        assert (traffic.writes.queue_depth, traffic.writes.queue_bytes) == (1, NBYTES)
        assert traffic.writes.dropped_full == 1
        tier.gate.set()
        assert await parts.storage.flush() == 0


async def test_a_full_write_queue_drops_write_through_copies_and_counts_them(
    parts_factory: list[Parts],
) -> None:
    tier = FaultyTier(MemoryTier())
    tier.gate = asyncio.Event()
    parts = await open_parts(parts_factory, [tier], write_queue=1)
    keys = make_keys(5)
    for index, key in enumerate(keys):
        assert parts.store(key, index)  # L1 always takes it; the lower copy may be dropped
        for _ in range(3):  # an idle writer takes the chunk (and waits at the gate)
            await asyncio.sleep(0)
    # Two writers hold one chunk each, one chunk waits in the queue, two were dropped.
    (traffic,) = parts.storage.stats().tiers
    assert traffic.writes is not None
    assert (traffic.writes.queue_depth, traffic.writes.queue_capacity) == (1, 1)
    assert traffic.writes.dropped_full == 2 and traffic.writes.pending == 3
    tier.gate.set()
    assert await parts.storage.flush() == 0
    (traffic,) = parts.storage.stats().tiers
    assert traffic.writes is not None and traffic.writes.done == 3


async def test_reads_into_l1_promote_count_and_turn_failures_into_misses(
    parts_factory: list[Parts],
) -> None:
    good = MemoryTier("L2")
    bad = FaultyTier(MemoryTier("L3"), get_failure_rate=1.0)
    parts = await open_parts(parts_factory, [good, bad])
    storage, keys = parts.storage, make_keys(2)
    assert parts.store(keys[0], 7)
    assert await storage.flush() == 0
    storage.l1.clear()
    obj = storage.allocate(LAYOUT, CHUNK)
    assert obj is not None
    obj.raw().fill_(0)
    assert not await storage.read_into(1, keys[0], obj)  # L3 fails every read: a miss
    assert await storage.read_into(0, keys[0], obj) and filled_with(obj, 7)
    assert storage.promote(keys[0], obj) and not storage.promote(keys[0], obj)
    obj.unref()
    stats = storage.stats()
    assert stats.promotions == 1
    assert [(t.name, t.reads.hits, t.reads.failures) for t in stats.tiers] == [
        ("L2", 1, 0),
        ("L3", 0, 1),
    ]
    assert stats.tiers[0].reads.bytes_read == NBYTES


async def test_a_chunk_committed_again_is_written_to_no_tier_twice(
    parts_factory: list[Parts],
) -> None:
    l2, l3 = MemoryTier("L2"), MemoryTier("L3")
    policies = {"L2": "write_back", "L3": "write_through"}
    parts = await open_parts(parts_factory, [l2, l3], write_policies=policies)
    storage, keys = parts.storage, make_keys(2)
    for index, key in enumerate(keys):
        assert parts.store(key, index)
    assert await storage.flush() == 0
    assert (l2.puts, l3.puts) == (0, 2)  # write_back waits for the eviction
    storage.l1.evict_unreferenced()
    assert await storage.flush() == 0
    assert (l2.puts, l3.puts) == (2, 2)
    obj = storage.allocate(LAYOUT, CHUNK)  # read up again and committed anew
    assert obj is not None and await storage.read_into(0, keys[0], obj)
    assert storage.commit(keys[0], obj)
    obj.unref()
    assert not storage.l1.is_dirty(keys[0])  # L2 holds it: nothing to demote
    storage.l1.evict_unreferenced()
    assert await storage.flush() == 0
    assert (l2.puts, l3.puts) == (2, 2)


def test_write_policies_are_per_tier() -> None:
    """Each tier gets the policy named for it (the config checked them: test_policies.py), a
    tier left out is written through, and a name no tier has is no policy."""
    arena = HostArena(NBYTES, pin=False)
    storage = StorageManager(
        L1Tier(arena),
        [MemoryTier("L2"), MemoryTier("L3"), MemoryTier("L4")],
        write_policies={"L2": "write_back", "L3": "selective"},
    )
    assert [storage.write_policy(name) for name in ("L2", "L3", "L4")] == [
        "write_back",
        "selective",
        "write_through",
    ]
    assert storage.write_policy("L5") is None
    assert arena.close() == 0


# -- PrefetchController -------------------------------------------------------------------------
async def test_prefetch_loads_dedups_and_commits_into_l1(parts_factory: list[Parts]) -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.01)
    parts = await open_parts(parts_factory, [tier])
    storage, keys = parts.storage, make_keys(3)
    for index, key in enumerate(keys):
        assert parts.store(key, 20 + index)
    assert await storage.flush() == 0
    storage.l1.clear()
    controller = PrefetchController(storage, concurrency=2, l1_budget_bytes=8 * NBYTES)
    located = await storage.locate(keys)
    slots = [(key, CHUNK, where) for key, where in zip(keys, located, strict=True)]
    first = controller.start(slots, LAYOUT)
    second = controller.start(slots[:2], LAYOUT)  # joins the loads already under way
    assert controller.stats().counters.loads_deduplicated == 2
    assert controller.stats().in_flight == 3
    assert await first == 3 * CHUNK and await second == 2 * CHUNK
    for index, key in enumerate(keys):
        obj = storage.get_l1(key)
        assert obj is not None and filled_with(obj, 20 + index)
        obj.unref()
    first.cancel()
    second.cancel()
    stats = controller.stats()
    assert (stats.in_flight, stats.reserved_bytes, stats.live_handles) == (0, 0, 0)
    assert stats.counters.loads_started == 3 and storage.stats().promotions == 3
    await controller.aclose()


async def test_prefetch_stops_at_the_first_chunk_l1_has_no_room_for(
    parts_factory: list[Parts],
) -> None:
    """Prefetch never evicts what is referenced: with room for one chunk, it reserves one and
    stops there (the rest stays in the lower tier), counted as stopped_no_space."""
    source = MemoryTier()
    donor = await open_parts(parts_factory, [source])
    keys = make_keys(4)
    for index, key in enumerate(keys):
        assert donor.store(key, 30 + index)
    assert await donor.storage.flush() == 0
    parts = await open_parts(parts_factory, [source], chunks_in_l1=2)
    held = parts.arena.allocate(NBYTES)  # someone else's bytes: one chunk of room left
    assert held is not None
    controller = PrefetchController(parts.storage, concurrency=4, l1_budget_bytes=4 * NBYTES)
    handle = controller.start([(key, CHUNK, 0) for key in keys], LAYOUT)
    assert handle.reserved_chunks() == 1
    assert controller.stats().counters.stopped_no_space == 1
    assert parts.storage.stats().promotion_failures == 1
    assert await handle == CHUNK
    handle.cancel()
    await controller.aclose()
    parts.arena.free(held)


async def test_prefetch_budget_bounds_reservations(parts_factory: list[Parts]) -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.01)
    parts = await open_parts(parts_factory, [tier])
    keys = make_keys(4)
    for index, key in enumerate(keys):
        assert parts.store(key, index)
    assert await parts.storage.flush() == 0
    parts.storage.l1.clear()
    controller = PrefetchController(parts.storage, concurrency=4, l1_budget_bytes=2 * NBYTES)
    handle = controller.start([(key, CHUNK, 0) for key in keys], LAYOUT)
    assert handle.reserved_chunks() == 2
    assert controller.stats().counters.stopped_budget == 1
    assert controller.stats().reserved_bytes == 2 * NBYTES
    handle.cancel()  # loads nobody holds are cancelled, their reservations given back
    await controller.aclose()
    assert controller.stats().reserved_bytes == 0


async def test_a_failed_load_is_a_miss_and_frees_its_reservation(
    parts_factory: list[Parts],
) -> None:
    tier = FaultyTier(MemoryTier(), get_failure_rate=1.0)
    parts = await open_parts(parts_factory, [tier])
    (key,) = make_keys(1)
    assert parts.store(key, 1)
    assert await parts.storage.flush() == 0
    parts.storage.l1.clear()
    controller = PrefetchController(parts.storage, concurrency=1, l1_budget_bytes=NBYTES)
    handle = controller.start([(key, CHUNK, 0)], LAYOUT)
    assert await handle == 0
    handle.cancel()
    stats = controller.stats()
    assert stats.counters.failed == 1 and stats.reserved_bytes == 0
    assert parts.storage.stats().misses == 1 and not parts.storage.l1.contains(key)
    await controller.aclose()
