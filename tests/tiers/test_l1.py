"""L1Tier: staging/commit visibility, LRU eviction that never touches referenced objects."""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tiered_kv.keys import ChunkKey, KeyScope
from tiered_kv.layout import GroupLayout, MemoryLayoutDesc
from tiered_kv.memory import ALIGN, HostArena, MemoryObj
from tiered_kv.tiers.l1 import L1Tier

KiB = 1024
SCOPE = KeyScope("", "test-model", "", 1, 0, "layout")
# 64 bytes per token: a full 16-token chunk is exactly 1 KiB.
LAYOUT = MemoryLayoutDesc((GroupLayout(torch.float16, 2, 2, 8),), chunk_size=16)
# Same bytes per token, chunks up to 64 tokens (4 KiB).
BIG_LAYOUT = MemoryLayoutDesc((GroupLayout(torch.float16, 2, 2, 8),), chunk_size=64)


def key(i: int) -> ChunkKey:
    return ChunkKey(SCOPE, i.to_bytes(16, "little"))


def round_up(value: int) -> int:
    return (value + ALIGN - 1) // ALIGN * ALIGN


def make_tier(capacity: int = 4 * KiB) -> tuple[L1Tier, list[tuple[ChunkKey, MemoryObj]]]:
    evicted: list[tuple[ChunkKey, MemoryObj]] = []
    tier = L1Tier(HostArena(capacity, pin=False), on_evict=lambda k, o: evicted.append((k, o)))
    return tier, evicted


def store(tier: L1Tier, k: ChunkKey, num_tokens: int = 16, fill: int = 0) -> MemoryObj:
    """Allocate, fill, commit and drop the staging reference (the store path)."""
    obj = tier.allocate(LAYOUT, num_tokens)
    assert obj is not None
    obj.raw().fill_(fill)
    assert tier.commit(k, obj)
    obj.unref()
    return obj


# -- visibility ------------------------------------------------------------------------------
def test_staged_object_is_invisible_until_commit() -> None:
    tier, _ = make_tier()
    obj = tier.allocate(LAYOUT, 16)
    assert obj is not None
    assert obj.refcount == 1
    assert not tier.contains(key(1))
    assert tier.get(key(1)) is None
    assert len(tier) == 0
    assert tier.stats().bytes_used == 0
    assert tier.stats().misses == 1
    assert tier.commit(key(1), obj) is True
    assert obj.refcount == 2  # the caller's and the tier's
    assert tier.contains(key(1))
    assert len(tier) == 1
    assert tier.stats().bytes_used == obj.nbytes
    obj.unref()
    assert obj.refcount == 1
    assert tier.arena.used == round_up(obj.nbytes)


def test_commit_of_existing_key_returns_false_and_takes_no_reference() -> None:
    tier, _ = make_tier()
    first = store(tier, key(1), fill=1)
    second = tier.allocate(LAYOUT, 8)
    assert second is not None
    second.raw().fill_(2)
    assert tier.commit(key(1), second) is False
    assert second.refcount == 1
    assert first.refcount == 1
    assert len(tier) == 1
    assert tier.stats().bytes_used == first.nbytes
    got = tier.get(key(1))
    assert got is first  # the first copy wins
    assert torch.all(got.raw() == 1)
    got.unref()
    used = tier.arena.used
    second.unref()  # the loser's memory goes back right away
    assert second.refcount == 0
    assert tier.arena.used == used - round_up(second.nbytes)


def test_get_takes_a_reference_and_counts_hits() -> None:
    tier, _ = make_tier()
    obj = store(tier, key(1))
    got = tier.get(key(1))
    assert got is obj
    assert obj.refcount == 2
    again = tier.get(key(1))
    assert again is obj and obj.refcount == 3
    assert tier.get(key(2)) is None
    stats = tier.stats()
    assert stats.hits == 2 and stats.misses == 1
    obj.unref()
    obj.unref()
    assert obj.refcount == 1


# -- eviction --------------------------------------------------------------------------------
def test_allocate_evicts_the_least_recently_used_entry() -> None:
    tier, evicted = make_tier()
    objs = [store(tier, key(i), fill=i) for i in range(4)]
    assert tier.arena.stats().free == 0
    new = tier.allocate(LAYOUT, 16)
    assert new is not None
    assert [k for k, _ in evicted] == [key(0)]
    assert evicted[0][1] is objs[0]
    assert not tier.contains(key(0))
    assert all(tier.contains(key(i)) for i in (1, 2, 3))
    assert tier.stats().evictions == 1
    assert new.offset == objs[0].offset  # reused the evicted bytes
    new.unref()


def test_get_moves_an_entry_to_most_recently_used() -> None:
    tier, evicted = make_tier()
    for i in range(4):
        store(tier, key(i))
    got = tier.get(key(0))
    assert got is not None
    got.unref()
    new = tier.allocate(LAYOUT, 16)
    assert new is not None
    assert [k for k, _ in evicted] == [key(1)]
    assert tier.contains(key(0))
    new.unref()


def test_touch_moves_an_entry_to_most_recently_used() -> None:
    tier, evicted = make_tier()
    for i in range(4):
        store(tier, key(i))
    tier.touch(key(0))
    tier.touch(key(1))
    tier.touch(key(99))  # unknown keys are ignored
    assert len(tier) == 4
    assert tier.evict_unreferenced() == 4 * KiB
    assert [k for k, _ in evicted] == [key(2), key(3), key(0), key(1)]


def test_allocate_evicts_as_many_entries_as_needed() -> None:
    tier, evicted = make_tier()
    for i in range(4):
        store(tier, key(i))
    # LRU order 0, 2, 1, 3: evicting 0 and 2 leaves two 1 KiB holes that are not adjacent.
    tier.touch(key(1))
    tier.touch(key(3))
    big = tier.allocate(BIG_LAYOUT, 48)  # 3 KiB
    assert big is not None
    assert [k for k, _ in evicted] == [key(0), key(2), key(1)]
    assert tier.contains(key(3))
    assert big.offset == 0
    assert tier.stats().evictions == 3
    big.unref()


def test_referenced_entries_are_never_evicted() -> None:
    tier, evicted = make_tier()
    objs = [store(tier, key(i), fill=10 + i) for i in range(4)]
    held = [tier.get(key(i)) for i in range(4)]
    assert tier.allocate(LAYOUT, 1) is None
    assert evicted == []
    assert tier.stats().allocation_failures == 1
    assert tier.stats().evictions == 0
    assert len(tier) == 4
    for i, obj in enumerate(objs):
        assert torch.all(obj.raw() == 10 + i)
    # Release one reader: its entry becomes the only candidate, even though others are older.
    held[2].unref()  # type: ignore[union-attr]
    new = tier.allocate(LAYOUT, 16)
    assert new is not None
    assert [k for k, _ in evicted] == [key(2)]
    for i in (0, 1, 3):
        assert tier.contains(key(i))
        assert torch.all(objs[i].raw() == 10 + i)
    new.unref()
    for obj in (held[0], held[1], held[3]):
        assert obj is not None
        obj.unref()


def test_staged_objects_are_not_evictable() -> None:
    tier, evicted = make_tier()
    staged = [tier.allocate(LAYOUT, 16) for _ in range(4)]
    assert all(s is not None for s in staged)
    assert tier.allocate(LAYOUT, 16) is None
    assert tier.stats().allocation_failures == 1
    assert evicted == []
    for obj in staged:
        assert obj is not None
        obj.unref()
    assert tier.arena.used == 0


def test_allocate_failure_when_request_exceeds_capacity() -> None:
    tier, evicted = make_tier(capacity=2 * KiB)
    store(tier, key(1))
    assert tier.allocate(BIG_LAYOUT, 64) is None  # 4 KiB never fits
    assert tier.stats().allocation_failures == 1
    # Every unreferenced entry was sacrificed trying; that is the documented contract.
    assert [k for k, _ in evicted] == [key(1)]


def test_on_evict_is_called_before_the_memory_is_released() -> None:
    arena = HostArena(4 * KiB, pin=False)
    seen: list[tuple[ChunkKey, int, int, bool, bool]] = []

    def on_evict(k: ChunkKey, obj: MemoryObj) -> None:
        seen.append(
            (
                k,
                obj.refcount,
                arena.used,
                bool(torch.all(obj.raw() == 42)),
                tier.contains(k),
            )
        )

    tier = L1Tier(arena, on_evict=on_evict)
    store(tier, key(7), fill=42)
    used_before = arena.used
    assert tier.evict_unreferenced() == KiB
    assert seen == [(key(7), 1, used_before, True, True)]
    assert arena.used == 0
    assert not tier.contains(key(7))


def test_on_evict_hook_may_keep_the_object_alive() -> None:
    kept: list[MemoryObj] = []
    tier = L1Tier(HostArena(4 * KiB, pin=False), on_evict=lambda k, o: kept.append(o.ref()))
    store(tier, key(1), fill=5)
    new = tier.allocate(BIG_LAYOUT, 64)  # needs the whole arena: the kept object blocks it
    assert new is None
    assert len(kept) == 1 and kept[0].refcount == 1
    assert not tier.contains(key(1))
    assert tier.stats().bytes_used == 0
    assert torch.all(kept[0].raw() == 5)  # a write-back demotion can still read it
    kept[0].unref()
    assert tier.arena.used == 0
    assert tier.allocate(BIG_LAYOUT, 64) is not None


def test_evict_unreferenced() -> None:
    tier, evicted = make_tier()
    objs = [store(tier, key(i)) for i in range(4)]
    reader = tier.get(key(1))
    assert reader is not None
    freed = tier.evict_unreferenced()
    assert freed == 3 * KiB
    assert [k for k, _ in evicted] == [key(0), key(2), key(3)]
    assert len(tier) == 1 and tier.contains(key(1))
    assert tier.stats().bytes_used == objs[1].nbytes
    assert tier.stats().evictions == 3
    assert tier.arena.used == round_up(objs[1].nbytes)
    reader.unref()


def test_evict_unreferenced_with_max_bytes_stops_early() -> None:
    tier, evicted = make_tier()
    for i in range(4):
        store(tier, key(i))
    assert tier.evict_unreferenced(max_bytes=1500) == 2 * KiB
    assert [k for k, _ in evicted] == [key(0), key(1)]
    assert tier.evict_unreferenced(max_bytes=0) == 0
    assert len(tier) == 2


def test_remove_keeps_readers_alive() -> None:
    tier, evicted = make_tier()
    obj = store(tier, key(1), fill=9)
    reader = tier.get(key(1))
    assert reader is obj
    assert tier.remove(key(1)) is True
    assert tier.remove(key(1)) is False
    assert not tier.contains(key(1))
    assert tier.stats().bytes_used == 0
    assert evicted == []  # remove is not an eviction
    assert tier.stats().evictions == 0
    assert obj.refcount == 1
    assert torch.all(obj.raw() == 9)
    obj.unref()
    assert tier.arena.used == 0


def test_clear_drops_everything_without_the_hook() -> None:
    tier, evicted = make_tier()
    objs = [store(tier, key(i), fill=i) for i in range(3)]
    reader = tier.get(key(2))
    assert reader is not None
    tier.clear()
    assert evicted == []
    assert len(tier) == 0
    assert tier.stats().bytes_used == 0
    assert tier.stats().evictions == 0
    assert objs[0].refcount == 0 and objs[1].refcount == 0
    assert tier.arena.used == round_up(objs[2].nbytes)
    assert torch.all(reader.raw() == 2)
    reader.unref()
    assert tier.arena.used == 0


def test_partial_chunks_account_their_logical_size() -> None:
    tier, _ = make_tier()
    obj = store(tier, key(1), num_tokens=3)
    assert obj.nbytes == 3 * 64
    assert tier.stats().bytes_used == 3 * 64
    assert tier.arena.used == 256


# -- stateful property test ------------------------------------------------------------------
NUM_KEYS = 10
STATEFUL_LAYOUT = MemoryLayoutDesc(
    (GroupLayout(torch.bfloat16, 2, 2, 8), GroupLayout(torch.int8, 1, 1, 132)), chunk_size=16
)


class L1StateMachine(RuleBasedStateMachine):
    """Random stores, reads, releases, removals and evictions against a model of the tier."""

    @initialize()
    def setup(self) -> None:
        self.arena = HostArena(12 * KiB, pin=False)
        self.tier = L1Tier(self.arena, on_evict=self._on_evict)
        self.present: dict[ChunkKey, MemoryObj] = {}  # what the tier must hold
        self.held: list[MemoryObj] = []  # references this test owns
        self.patterns: dict[int, int] = {}  # id(obj) -> fill byte
        self.every_obj: list[MemoryObj] = []
        self.evictions_seen = 0
        self.failures = 0
        self.next_fill = 1

    def _on_evict(self, k: ChunkKey, obj: MemoryObj) -> None:
        assert self.present.get(k) is obj, "evicted an entry the tier should not have"
        assert obj.refcount == 1, f"evicted a referenced object (refcount {obj.refcount})"
        assert not any(h is obj for h in self.held), "evicted an object a reader holds"
        self._check_bytes(obj)
        del self.present[k]
        self.evictions_seen += 1

    def _check_bytes(self, obj: MemoryObj) -> None:
        assert torch.all(obj.raw() == self.patterns[id(obj)]), "object bytes were overwritten"

    def _live(self) -> dict[int, MemoryObj]:
        live = {id(o): o for o in self.present.values()}
        live.update({id(o): o for o in self.held})
        return live

    @rule(
        key_id=st.integers(0, NUM_KEYS - 1),
        num_tokens=st.integers(1, 16),
        keep_staging_ref=st.booleans(),
    )
    def store(self, key_id: int, num_tokens: int, keep_staging_ref: bool) -> None:
        k = key(key_id)
        obj = self.tier.allocate(STATEFUL_LAYOUT, num_tokens)
        if obj is None:
            self.failures += 1
            assert self.tier.stats().allocation_failures == self.failures
            # Allocation only fails once every committed entry is referenced by someone else.
            assert all(o.refcount > 1 for o in self.present.values())
            assert self.arena.stats().largest_free < round_up(STATEFUL_LAYOUT.nbytes(num_tokens))
            return
        assert obj.refcount == 1
        assert obj.nbytes == STATEFUL_LAYOUT.nbytes(num_tokens)
        fill = self.next_fill
        self.next_fill = self.next_fill % 255 + 1
        obj.raw().fill_(fill)
        self.patterns[id(obj)] = fill
        self.every_obj.append(obj)
        committed = self.tier.commit(k, obj)
        if k in self.present:
            assert committed is False
            assert obj.refcount == 1
        else:
            assert committed is True
            assert obj.refcount == 2
            self.present[k] = obj
        if keep_staging_ref:
            self.held.append(obj)
        else:
            obj.unref()

    @rule(key_id=st.integers(0, NUM_KEYS - 1))
    def get(self, key_id: int) -> None:
        k = key(key_id)
        expected = self.present.get(k)
        refs_before = expected.refcount if expected is not None else 0
        obj = self.tier.get(k)
        if expected is None:
            assert obj is None
            return
        assert obj is expected
        assert obj.refcount == refs_before + 1
        self.held.append(obj)

    @precondition(lambda self: bool(self.held))
    @rule(pick=st.integers(0, 10**6))
    def release(self, pick: int) -> None:
        obj = self.held.pop(pick % len(self.held))
        obj.unref()

    @rule(key_id=st.integers(0, NUM_KEYS - 1))
    def remove(self, key_id: int) -> None:
        k = key(key_id)
        assert self.tier.remove(k) is (k in self.present)
        self.present.pop(k, None)

    @rule(key_id=st.integers(0, NUM_KEYS - 1))
    def touch(self, key_id: int) -> None:
        self.tier.touch(key(key_id))

    @rule(max_bytes=st.none() | st.integers(0, 8 * KiB))
    def evict_unreferenced(self, max_bytes: int | None) -> None:
        unreferenced = {k for k, o in self.present.items() if o.refcount == 1}
        referenced = {k: o for k, o in self.present.items() if o.refcount > 1}
        before = dict(self.present)
        freed = self.tier.evict_unreferenced(max_bytes)
        gone = set(before) - set(self.present)
        assert gone <= unreferenced
        assert freed == sum(before[k].nbytes for k in gone)
        if max_bytes is None:
            assert gone == unreferenced
        else:
            assert freed >= min(max_bytes, sum(before[k].nbytes for k in unreferenced))
        for k, o in referenced.items():
            assert self.present[k] is o

    @invariant()
    def tier_matches_model(self) -> None:
        if not hasattr(self, "tier"):
            return
        for key_id in range(NUM_KEYS):
            assert self.tier.contains(key(key_id)) is (key(key_id) in self.present)
        stats = self.tier.stats()
        assert len(self.tier) == stats.entries == len(self.present)
        assert stats.bytes_used == sum(o.nbytes for o in self.present.values())
        assert stats.evictions == self.evictions_seen

    @invariant()
    def arena_accounting(self) -> None:
        if not hasattr(self, "tier"):
            return
        stats = self.arena.stats()
        assert stats.used <= stats.capacity
        assert stats.used + stats.free == stats.capacity
        live = self._live()
        assert stats.used == sum(round_up(o.nbytes) for o in live.values())
        assert stats.allocations == len(live)

    @invariant()
    def refcounts_and_bytes(self) -> None:
        if not hasattr(self, "tier"):
            return
        in_tier = {id(o) for o in self.present.values()}
        for obj in self._live().values():
            holders = sum(1 for h in self.held if h is obj)
            assert obj.refcount == holders + (1 if id(obj) in in_tier else 0)
            self._check_bytes(obj)
        spans = sorted((o.offset, o.offset + o.nbytes) for o in self._live().values())
        for (_, end_a), (start_b, _) in itertools.pairwise(spans):
            assert end_a <= start_b, "live objects overlap"

    def teardown(self) -> None:
        if not hasattr(self, "tier"):
            return
        while self.held:
            self.held.pop().unref()
        self.tier.clear()
        assert len(self.tier) == 0
        assert self.tier.stats().bytes_used == 0
        assert self.arena.used == 0
        assert self.arena.stats().largest_free == self.arena.capacity
        assert all(o.refcount == 0 for o in self.every_obj)


L1StateMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestL1StateMachine = L1StateMachine.TestCase


class L1ReuseStateMachine(L1StateMachine):
    """The same model with the reuse order and requests reported through ``use``: it evicts
    only unreferenced entries, and its order holds exactly the tier's keys."""

    @initialize()
    def setup(self) -> None:
        super().setup()
        self.tier = L1Tier(self.arena, on_evict=self._on_evict, eviction="reuse")

    @rule(key_ids=st.lists(st.integers(0, NUM_KEYS - 1), max_size=5, unique=True))
    def use(self, key_ids: list[int]) -> None:
        self.tier.use([key(i) for i in key_ids])

    @invariant()
    def order_holds_the_keys(self) -> None:
        if not hasattr(self, "tier"):
            return
        victims = list(self.tier.order.victims())
        assert len(victims) == len(set(victims)) and set(victims) == set(self.present)
        stats = self.tier.stats()
        assert stats.keys_reused + stats.keys_first + stats.keys_partial == len(self.present)


L1ReuseStateMachine.TestCase.settings = L1StateMachine.TestCase.settings
TestL1ReuseStateMachine = L1ReuseStateMachine.TestCase
