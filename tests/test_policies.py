"""Prefetch policies of retrieve (best_effort, wait_complete, timeout) and write policies of lower
tiers (write_through, write_back, selective), bounded write queues, config validation."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from tests.kvfactory import KVCaches, expect_copy, make_caches, poison_blocks
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.errors import ConfigError
from tiered_kv.storage import WRITE_STALL_S
from tiered_kv.tiers.l2 import DiskTier
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

TOKENS = list(range(1000, 1100))  # 3 full chunks of 32 and a partial of 4
SRC, DST = list(range(7)), list(range(8, 15))


def _config(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"chunk_size": 32, "l1_size": "8MiB"}
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def caches() -> KVCaches:
    return make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)


async def _populate(engine: TieredKVEngine, caches: KVCaches, tier: FaultyTier) -> None:
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    delay, tier.get_delay_s = tier.get_delay_s, 0.0
    await engine.store(TOKENS, SRC)
    await engine.flush()
    await engine.evict_l1()
    tier.get_delay_s = delay


async def _no_leak(engine: TieredKVEngine) -> None:
    for _ in range(400):
        await engine.evict_l1()
        if engine.stats().arena.used == 0:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"references leaked: {engine.stats().arena}")


# -- prefetch policies ----------------------------------------------------------------------
async def test_best_effort_uses_only_what_is_ready_and_reports_the_rest(
    caches: KVCaches,
) -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.2)
    async with TieredKVEngine(_config(prefetch_policy="best_effort"), lower_tiers=[tier]) as e:
        await _populate(e, caches, tier)
        assert await e.lookup(TOKENS) == 100
        result = await e.retrieve(TOKENS, DST)
        assert (result.valid_tokens, result.cached_tokens) == (0, 100)
        assert result.stop_reason == "late" and result.late_chunks == (0, 1, 2, 3)
        assert result.policy == "best_effort" and result.waited_s == 0.0
        assert e.stats().prefetch.counters.late == 4
        assert e.stats().engine.retrieve_late_tokens == 100
        # The reads already under way were kept: they land in L1 for the next request.
        await asyncio.sleep(0.4)
        assert e.stats().l1.entries == 4
        assert (await e.retrieve(TOKENS, DST)).valid_tokens == 100
        await _no_leak(e)


async def test_best_effort_delivers_the_ready_part_of_the_prefix(caches: KVCaches) -> None:
    tier = FaultyTier(MemoryTier())
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as e:
        await _populate(e, caches, tier)
        await e.retrieve(TOKENS[:64], DST)  # the first two chunks are now in L1
        tier.get_delay_s = 0.2
        reference = caches.snapshot()
        poison_blocks(caches, DST)
        expected = caches.snapshot()
        assert await e.lookup(TOKENS) == 100
        result = await e.retrieve(TOKENS, DST, policy="best_effort")
        assert (result.valid_tokens, result.stop_reason, result.late_chunks) == (
            64,
            "late",
            (2, 3),
        )
        expect_copy(caches, expected, reference, SRC, DST, range(64), 16)
        assert caches.bytes_equal(expected)  # the prefix is exact and nothing past it written
        await asyncio.sleep(0.3)
        await _no_leak(e)


async def test_wait_complete_waits_for_every_load(caches: KVCaches) -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.05)
    async with TieredKVEngine(_config(prefetch_concurrency=1), lower_tiers=[tier]) as e:
        await _populate(e, caches, tier)
        assert await e.lookup(TOKENS) == 100
        result = await e.retrieve(TOKENS, DST, policy="wait_complete")
        assert (result.valid_tokens, result.stop_reason) == (100, "complete")
        assert result.waited_s > 0 and result.recompute_tokens == 0
        assert tier.max_active == 1  # concurrency is bounded per tier
        await _no_leak(e)


async def test_timeout_waits_up_to_its_budget_then_reports_late_chunks(
    caches: KVCaches,
) -> None:
    # Reads take 0.2 s each, one at a time: chunks are ready at 0.2, 0.4, 0.6 and 0.8 s.
    tier = FaultyTier(MemoryTier(), get_delay_s=0.2)
    config = _config(
        prefetch_policy="timeout",
        prefetch_concurrency=1,
        prefetch_timeout_base_s=0.5,
        prefetch_timeout_per_1k_tokens_s=0.0,
    )
    async with TieredKVEngine(config, lower_tiers=[tier]) as e:
        await _populate(e, caches, tier)
        assert await e.lookup(TOKENS) == 100
        result = await e.retrieve(TOKENS, DST)
        assert (result.valid_tokens, result.stop_reason) == (64, "late")
        assert result.late_chunks == (2, 3) and result.cached_tokens == 100
        await asyncio.sleep(0.5)
        await _no_leak(e)


async def test_timeout_budget_grows_per_1k_tokens_still_loading(caches: KVCaches) -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.05)
    config = _config(
        prefetch_policy="timeout",
        prefetch_timeout_base_s=0.0,
        prefetch_timeout_per_1k_tokens_s=20.0,  # 100 tokens loading: a 2 s budget
    )
    async with TieredKVEngine(config, lower_tiers=[tier]) as e:
        await _populate(e, caches, tier)
        assert await e.lookup(TOKENS) == 100
        result = await e.retrieve(TOKENS, DST)
        assert (result.valid_tokens, result.stop_reason) == (100, "complete")
        await _no_leak(e)


async def test_retrieve_rejects_an_unknown_policy(caches: KVCaches) -> None:
    async with TieredKVEngine(_config()) as e:
        e.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        with pytest.raises(ConfigError, match="best_effort"):
            await e.retrieve(TOKENS, DST, policy="eventually")


# -- write policies -------------------------------------------------------------------------
async def test_write_through_writes_at_store(caches: KVCaches) -> None:
    tier = MemoryTier()
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as e:
        e.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await e.store(TOKENS, SRC)
        await e.flush()
        assert tier.stats().entries == 4
        assert e.stats().storage.tier("L2").writes.done == 4


async def test_write_back_demotes_on_eviction_and_never_loses_a_chunk(
    caches: KVCaches,
) -> None:
    inner = MemoryTier()
    tier = FaultyTier(inner)
    async with TieredKVEngine(_config(write_policy="write_back"), lower_tiers=[tier]) as e:
        e.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await e.store(TOKENS, SRC)
        await e.flush()
        assert inner.stats().entries == 0  # nothing written at store
        assert e.stats().l1.dirty == 4
        tier.gate = asyncio.Event()  # hold the demotions in flight
        await e.evict_l1()
        stats = e.stats()
        assert stats.l1.entries == 0 and stats.storage.tier("L2").writes.demoted == 4
        assert stats.storage.demoting == 4
        assert stats.arena.used > 0  # the write queue holds the bytes until written
        # Evicted but not yet written: still served, from the demotion's copy.
        assert await e.lookup(TOKENS) == 100
        reference = caches.snapshot()
        poison_blocks(caches, DST)
        expected = caches.snapshot()
        assert (await e.retrieve(TOKENS, DST)).valid_tokens == 100
        expect_copy(caches, expected, reference, SRC, DST, range(100), 16)
        assert caches.bytes_equal(expected)
        tier.gate.set()
        await e.flush()
        assert inner.stats().entries == 4
        stats = e.stats()
        assert stats.storage.demoting == 0 and stats.l1.dirty == 0
        await e.evict_l1()  # clean now: evicting queues nothing more
        assert e.stats().storage.tier("L2").writes.demoted == 4
        await _no_leak(e)
        assert (await e.retrieve(TOKENS, DST)).valid_tokens == 100  # from the tier now


async def test_write_back_with_a_full_queue_refuses_eviction_instead_of_dropping(
    caches: KVCaches,
) -> None:
    inner = MemoryTier()
    tier = FaultyTier(inner)
    config = _config(write_policy="write_back", lower_write_queue=1)
    async with TieredKVEngine(config, lower_tiers=[tier]) as e:
        e.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await e.store(TOKENS, SRC)
        tier.gate = asyncio.Event()
        await e.evict_l1()  # one demotion queued; the queue is full for the rest
        await asyncio.sleep(0.01)  # the two writers take one each...
        await e.evict_l1()  # ...which makes room for one more
        stats = e.stats()
        writes = stats.storage.tier("L2").writes
        assert writes.demotions_refused >= 1 and writes.dropped_full == 0
        assert stats.l1.entries >= 1  # refused chunks stay in L1, dirty
        tier.gate.set()
        for _ in range(4):  # each round demotes what the queue accepts; the rest waits in L1
            await e.flush()
            await e.evict_l1()
        await e.flush()
        assert inner.stats().entries == 4  # every chunk reached the tier
        await _no_leak(e)


async def test_write_back_demotes_dirty_chunks_at_close(tmp_path: Path, caches: KVCaches) -> None:
    config = _config(l2_path=str(tmp_path / "l2"), write_policy="write_back")
    async with TieredKVEngine(config) as e:
        e.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await e.store(TOKENS, SRC)
        assert e.stats().tier("L2").entries == 0
    assert e.dropped_on_close == 0 and e.leaked_on_close == 0
    async with TieredKVEngine(config) as e:
        e.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert e.stats().tier("L2").entries == 4
        assert await e.lookup(TOKENS) == 100
        assert (await e.retrieve(TOKENS, DST)).valid_tokens == 100


async def test_selective_writes_after_n_hits(caches: KVCaches) -> None:
    tier = MemoryTier()
    config = _config(write_policy="selective", selective_min_hits=2)
    async with TieredKVEngine(config, lower_tiers=[tier]) as e:
        e.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await e.store(TOKENS, SRC)
        await e.flush()
        assert tier.stats().entries == 0
        assert (await e.retrieve(TOKENS[:64], DST)).valid_tokens == 64  # chunks 0, 1: one hit each
        await e.flush()
        assert tier.stats().entries == 0
        assert (await e.retrieve(TOKENS, DST)).valid_tokens == 100  # 0, 1: second hit; 2, 3: first
        await e.flush()
        assert tier.stats().entries == 2
        assert e.stats().storage.tier("L2").writes.admitted == 2
        assert (await e.retrieve(TOKENS, DST)).valid_tokens == 100
        await e.flush()
        assert tier.stats().entries == 4
        assert (
            await e.retrieve(TOKENS, DST)
        ).valid_tokens == 100  # already there: not written again
        await e.flush()
        writes = e.stats().storage.tier("L2").writes
        assert (writes.admitted, writes.done, tier.puts) == (4, 4, 4)


async def test_per_tier_policies_and_stores_skip_what_a_tier_holds(caches: KVCaches) -> None:
    l2, l3 = MemoryTier("L2"), MemoryTier("L3")
    config = _config(write_policies={"L2": "write_back", "l3": "write_through"})
    async with TieredKVEngine(config, lower_tiers=[l2, l3]) as e:
        e.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert (config.write_policy_for("L2"), config.write_policy_for("L3")) == (
            "write_back",
            "write_through",
        )
        assert (e.storage.write_policy("L2"), e.storage.write_policy("L3")) == (
            "write_back",
            "write_through",
        )
        await e.store(TOKENS, SRC)
        await e.flush()
        assert (l2.stats().entries, l3.stats().entries) == (0, 4)
        await e.evict_l1()
        await e.flush()
        assert (l2.puts, l3.puts) == (4, 4)
        # Promoted back into L1 and committed again: neither tier is written twice.
        assert (await e.retrieve(TOKENS, DST)).valid_tokens == 100
        assert await e.store(TOKENS, SRC) == 0  # (a re-commit: test_control_plane.py)
        await e.evict_l1()
        await e.flush()
        assert (l2.puts, l3.puts) == (4, 4)
        await _no_leak(e)


async def test_a_stuck_tier_stalls_one_store_then_full_queues_drop_their_oldest(
    caches: KVCaches,
) -> None:
    """A tier whose writes never end: the store waits for write room once, gives up after
    `WRITE_STALL_S` without a write ending, and commits the rest to L1, each new chunk taking
    the queue's place of the oldest waiting one (still in L1, so nothing is lost from the
    cache). The next store does not wait at all while the writes stay stalled."""
    inner = MemoryTier()
    tier = FaultyTier(inner)
    tier.gate = asyncio.Event()  # the tier never finishes a write until opened
    async with TieredKVEngine(_config(lower_write_queue=1), lower_tiers=[tier]) as e:
        e.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await asyncio.wait_for(e.store(TOKENS, SRC), 5.0) == 100  # a hang guard
        assert loop.time() - started >= WRITE_STALL_S  # it did wait for the writes
        assert e.storage.writes_stalled and e.storage.write_stalls == 1
        writes = e.stats().storage.tier("L2").writes
        assert writes is not None
        # Chunk 0 went out and is stuck; 1, 2, 3 came after the stall: 1 and then 2 left the
        # queue for the next, 3 is in flight on the second writer.
        assert (writes.dropped_full, writes.dropped_in_l1, writes.pending) == (2, 2, 2)
        keys = e.chunk_keys(TOKENS)
        assert e.storage._queues[0].pending == {keys[0], keys[3]}
        # Stalled: a second prompt's store commits to L1 at once (its writes dropped).
        other = list(range(7000, 7100))
        started = loop.time()
        assert await e.store(other, DST) == 100
        assert loop.time() - started < WRITE_STALL_S
        assert e.storage.write_stalls == 1
        tier.gate.set()
        await e.flush()
        assert not e.storage.writes_stalled  # a write ended
        assert [inner.contains(key) for key in keys] == [True, False, False, True]
        assert await e.lookup(TOKENS) == 100  # still served from L1
        assert await e.lookup(other) == 100


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("prefetch_policy", "later", "prefetch_policy"),
        ("write_policy", "sometimes", "write_policy"),
        ("write_policies", "L2=write_back", "expected a mapping.*TIERED_KV_WRITE_POLICIES"),
        ("write_policies", {"L2": "never"}, "write_policies\\['L2'\\]: expected one of"),
        ("write_policies", {"": "write_back"}, "non-empty strings"),
        ("write_policies", {"L2": "write_back", "l2": "selective"}, "two policies"),
        ("selective_min_hits", 0, "selective_min_hits"),
        ("prefetch_concurrency", True, "prefetch_concurrency"),
        ("prefetch_concurrency", 0, "prefetch_concurrency"),
        ("l2_io_threads", 0, "l2_io_threads"),
        ("l2_io_threads", "8", "l2_io_threads"),
        ("prefetch_l1_fraction", 0.0, "prefetch_l1_fraction"),
        ("prefetch_l1_fraction", 1.5, "prefetch_l1_fraction"),
        ("prefetch_timeout_base_s", -1.0, "prefetch_timeout_base_s"),
        ("retrieve_batch_chunks", 0, "retrieve_batch_chunks"),
    ],
)
def test_policy_config_is_validated(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_write_policies_are_a_read_only_mapping_by_upper_case_name() -> None:
    source = {"l2": "write_back"}
    config = EngineConfig(write_policies=source)  # type: ignore[arg-type]
    source["l3"] = "selective"  # the config keeps its own copy
    assert dict(config.write_policies) == {"L2": "write_back"}
    with pytest.raises(TypeError):
        config.write_policies["L3"] = "selective"  # type: ignore[index]
    assert (config.write_policy_for("l2"), config.write_policy_for("L3")) == (
        "write_back",
        "write_through",
    )
    again = dataclasses.replace(config, chunk_size=128)
    assert again.write_policies == config.write_policies
    assert hash(again) == hash(dataclasses.replace(again))  # left out of the hash: hashable


def test_policy_config_from_env() -> None:
    config = EngineConfig.from_env(
        {
            "TIERED_KV_PREFETCH_POLICY": "timeout",
            "TIERED_KV_PREFETCH_TIMEOUT_BASE_S": "0.02",
            "TIERED_KV_PREFETCH_TIMEOUT_PER_1K_TOKENS_S": "0.004",
            "TIERED_KV_PREFETCH_CONCURRENCY": "3",
            "TIERED_KV_PREFETCH_L1_FRACTION": "0.25",
            "TIERED_KV_PREFETCH_MAX_PENDING": "9",
            "TIERED_KV_RETRIEVE_BATCH_CHUNKS": "4",
            "TIERED_KV_WRITE_POLICY": "selective",
            "TIERED_KV_WRITE_POLICIES": "L2=write_back",
            "TIERED_KV_SELECTIVE_MIN_HITS": "5",
        }
    )
    assert config.prefetch_policy == "timeout"
    assert (config.prefetch_timeout_base_s, config.prefetch_timeout_per_1k_tokens_s) == (
        0.02,
        0.004,
    )
    assert (config.prefetch_concurrency, config.prefetch_max_pending) == (3, 9)
    assert (config.prefetch_l1_fraction, config.retrieve_batch_chunks) == (0.25, 4)
    assert config.write_policy_for("L2") == "write_back"
    assert config.write_policy_for("L3") == "selective"
    assert dict(config.write_policies) == {"L2": "write_back"}
    assert config.selective_min_hits == 5
    for bad in ("L2", "L2=never", "=write_back"):
        with pytest.raises(ConfigError, match="TIERED_KV_WRITE_POLICIES: expected 'TIER=POLICY"):
            EngineConfig.from_env({"TIERED_KV_WRITE_POLICIES": bad})
    with pytest.raises(ConfigError, match="TIERED_KV_PREFETCH_CONCURRENCY"):
        EngineConfig.from_env({"TIERED_KV_PREFETCH_CONCURRENCY": "many"})
    sized = EngineConfig.from_env(
        {"TIERED_KV_PREFETCH_CONCURRENCY": "auto", "TIERED_KV_L2_IO_THREADS": "12"}
    )
    assert (sized.prefetch_concurrency, sized.l2_io_threads) == (None, 12)
    assert EngineConfig().prefetch_concurrency is None and EngineConfig().l2_io_threads is None


async def test_prefetch_takes_each_tier_s_own_parallelism_unless_the_config_sets_one(
    tmp_path: Path,
) -> None:
    """An L2 of 3 I/O threads gets 3 reads in flight, one read through 2 worker processes 8
    (4 per worker); prefetch_concurrency overrides either."""
    cases = (("threads", None, 3), ("threads", 2, 2), ("processes", None, 8), ("processes", 2, 2))
    for plane, concurrency, expected in cases:
        tier = DiskTier(tmp_path / f"l2-{plane}-{concurrency}", 1 << 30, io_threads=3)
        config = _config(prefetch_concurrency=concurrency, io_plane=plane, io_workers=2)
        async with TieredKVEngine(config, lower_tiers=[tier]) as engine:
            assert tier.read_parallelism == (3 if plane == "threads" else 8)
            assert engine.stats().prefetch.read_slots["l2"] == expected


async def test_lookup_loads_nothing_and_retrieve_loads_what_it_needs(caches: KVCaches) -> None:
    tier = FaultyTier(MemoryTier())
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as e:
        await _populate(e, caches, tier)
        assert await e.lookup(TOKENS) == 100
        assert e.stats().prefetch.counters.loads_started == 0
        assert (
            await e.retrieve(TOKENS, DST)
        ).valid_tokens == 100  # wait_complete loads at retrieve
        await _no_leak(e)


@pytest.mark.parametrize(
    ("tiers", "l2", "named"),
    [
        (["L2"], True, "'L2' and 'L2'"),  # a custom tier named like the engine's own L2
        (["cold", "Cold"], False, "'Cold' and 'cold'"),  # names compare without case
        (["l1"], False, "'l1' and 'L1'"),
    ],
)
async def test_two_tiers_of_one_name_are_refused_and_the_arena_is_freed(
    tmp_path: Path, tiers: list[str], l2: bool, named: str
) -> None:
    """A tier's name keys its write policy and its statistics: two tiers sharing one would
    share both, so the engine refuses to open, and gives back the L1 arena it had allocated."""
    config = _config(l2_path=str(tmp_path / "l2")) if l2 else _config()
    engine = TieredKVEngine(config, lower_tiers=[MemoryTier(name) for name in tiers])
    with pytest.raises(ConfigError, match=f"two tiers are named {named}"):
        await engine.open()
    assert engine.stats().arena is None  # freed, not left pinned
    async with TieredKVEngine(config, lower_tiers=[MemoryTier("cold")]) as e:
        names = [t.name for t in e.stats().storage.tiers]
        assert names == (["L2", "cold"] if l2 else ["cold"])
