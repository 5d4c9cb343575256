"""Prefetch: a caller-owned handle loads lower-tier chunks ahead of the retrieve it is given to;
dedup, gaps, L1 pressure, handle ownership, and cancellation at every await point leaving no
reservation behind. `lookup` loads nothing."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import torch

from tests.kvfactory import KVCaches, expect_copy, make_caches, poison_blocks
from tiered_kv import EngineConfig, SyncTieredKVEngine, TieredKVEngine
from tiered_kv.errors import ConfigError, LayoutError
from tiered_kv.gpu.base import ChunkTransfer
from tiered_kv.gpu.reference import TorchMover
from tiered_kv.layout import KVCacheLayout
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

TOKENS = list(range(1000, 1100))  # 100 tokens: 3 full chunks of 32 and a partial of 4
SRC, DST = list(range(7)), list(range(8, 15))


def _config(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"chunk_size": 32, "l1_size": "8MiB"}
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


async def _populate(engine: TieredKVEngine, tier: FaultyTier, tokens: list[int] = TOKENS) -> None:
    """Store ``tokens`` and leave them in the lower tier only."""
    delay = tier.delay_s, tier.get_delay_s
    tier.delay_s, tier.get_delay_s = 0.0, 0.0
    await engine.store(tokens, SRC)
    await engine.flush()
    await engine.evict_l1()
    tier.delay_s, tier.get_delay_s = delay
    assert engine.stats().arena.used == 0


async def _settle(engine: TieredKVEngine) -> None:
    """Let cancelled loads and the mover's copies end (a cancelled scatter's worker thread
    keeps its references until its copy is done), then check nothing is referenced: evicting
    L1 frees every byte."""
    for _ in range(400):
        await engine.evict_l1()
        stats = engine.stats()
        if stats.prefetch.in_flight == 0 and stats.arena.used == 0:
            break
        await asyncio.sleep(0.005)
    assert stats.prefetch.in_flight == 0
    assert stats.prefetch.reserved_bytes == 0
    assert stats.arena.used == 0, "a reservation or reference leaked"


@pytest.fixture
def caches() -> KVCaches:
    return make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)


@pytest.fixture
async def setup(caches: KVCaches) -> AsyncIterator[tuple[TieredKVEngine, FaultyTier]]:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.05)
    engine = TieredKVEngine(_config(), lower_tiers=[tier])
    async with engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await _populate(engine, tier)
        yield engine, tier
    assert engine.leaked_on_close == 0


async def test_a_prefetch_hides_the_latency_when_lead_time_allows(
    setup: tuple[TieredKVEngine, FaultyTier], caches: KVCaches
) -> None:
    engine, tier = setup
    reference = caches.snapshot()
    poison_blocks(caches, DST)
    expected = caches.snapshot()
    handle = await engine.prefetch(TOKENS)
    assert handle.hit_tokens == 100
    assert engine.stats().prefetch.counters.loads_started == 4
    await asyncio.sleep(0.3)  # lead time: the scheduler's gap between prefetch and retrieve
    result = await engine.retrieve(TOKENS, DST, prefetch=handle)
    assert (result.valid_tokens, result.stop_reason) == (100, "complete")
    assert handle.closed  # the retrieve it was given to ended it
    assert result.waited_s == 0.0
    stats = engine.stats().prefetch
    assert (stats.counters.ready_in_time, stats.counters.ready_after_wait) == (4, 0)
    expect_copy(caches, expected, reference, SRC, DST, range(100), 16)
    assert caches.bytes_equal(expected)
    assert tier.calls["get"] == 4
    await _settle(engine)


async def test_without_lead_time_retrieve_waits_for_the_same_loads(
    setup: tuple[TieredKVEngine, FaultyTier],
) -> None:
    engine, tier = setup
    handle = await engine.prefetch(TOKENS)
    result = await engine.retrieve(TOKENS, DST, prefetch=handle)  # wait_complete by default
    assert result.valid_tokens == 100 and result.waited_s > 0
    stats = engine.stats().prefetch.counters
    assert stats.ready_after_wait >= 1 and stats.ready_in_time + stats.ready_after_wait == 4
    assert tier.calls["get"] == 4  # retrieve used the handle's loads, it did not start its own
    await _settle(engine)


async def test_concurrent_prefetches_of_one_prefix_share_their_loads(
    setup: tuple[TieredKVEngine, FaultyTier],
) -> None:
    engine, tier = setup
    tier.gate = asyncio.Event()
    first = await engine.prefetch(TOKENS)
    second = await engine.prefetch(TOKENS)
    other = await engine.prefetch(TOKENS[:64] + list(range(5000, 5040)))  # shares 2 chunks
    assert await engine.lookup(TOKENS) == 100  # loads nothing
    stats = engine.stats().prefetch
    assert stats.counters.loads_started == 4
    assert stats.counters.loads_deduplicated == 4 + 2
    assert not first.done() and first.ready_tokens() == 0
    tier.gate.set()
    assert await first == 100
    assert await second.wait() == 100 and second.done()
    assert await other == 64  # the prefix of `other` in the cache ends after two chunks
    assert tier.calls["get"] == 4
    assert (await engine.retrieve(TOKENS, DST)).valid_tokens == 100
    for handle in (first, second, other):
        handle.close()
    await _settle(engine)


async def test_a_gap_ends_the_prefix_and_nothing_past_it_is_loaded(
    setup: tuple[TieredKVEngine, FaultyTier],
) -> None:
    engine, tier = setup
    keys = engine.chunk_keys(TOKENS)
    assert await tier.remove(keys[1])
    assert await engine.lookup(TOKENS) == 32
    handle = await engine.prefetch(TOKENS)
    assert handle.hit_tokens == 32
    assert engine.stats().prefetch.counters.loads_started == 1
    result = await engine.retrieve(TOKENS, DST, prefetch=handle)
    assert (result.valid_tokens, result.cached_tokens, result.stop_reason) == (32, 32, "gap")
    assert tier.calls["get"] == 1
    await _settle(engine)


async def test_a_failed_load_ends_the_delivered_prefix_and_is_reported(
    caches: KVCaches,
) -> None:
    probe = FaultyTier(MemoryTier(), get_failure_rate=0.5)
    async with TieredKVEngine(_config(), lower_tiers=[probe]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        keys = engine.chunk_keys(TOKENS)
    # A seed whose failures hit chunk 1 only: the outcome is repeatable.
    seed = next(
        s
        for s in range(1000)
        if [FaultyTier(MemoryTier(), seed=s, get_failure_rate=0.5).fails(k, "get") for k in keys]
        == [False, True, False, False]
    )
    tier = FaultyTier(MemoryTier(), seed=seed)
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await _populate(engine, tier)
        tier.get_failure_rate = 0.5
        assert await engine.lookup(TOKENS) == 100
        result = await engine.retrieve(TOKENS, DST)
        assert result.valid_tokens == 32
        assert (result.stop_reason, result.failed_chunks) == ("failed", (1,))
        assert result.cached_tokens == 100 and result.recompute_tokens == 68
        stats = engine.stats()
        assert stats.prefetch.counters.failed == 1
        assert stats.engine.retrieve_failed_tokens == 68
        await _settle(engine)
    assert engine.leaked_on_close == 0


async def test_prefetch_stops_under_l1_pressure_and_never_evicts_referenced_chunks() -> None:
    # 32-token chunks of 2 layers x 2 x 8 x 128 bf16 are 256 KiB; L1 is 1 MiB (four chunks).
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16, num_heads=8, head_size=128)
    tier = FaultyTier(MemoryTier())
    config = _config(l1_size="1MiB", prefetch_l1_fraction=0.5)
    async with TieredKVEngine(config, lower_tiers=[tier]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        for end in (32, 64, 96, 100):
            await engine.store(TOKENS[:end], SRC)
            await engine.flush()
        await engine.evict_l1()
        tier.gate = asyncio.Event()
        handle = await engine.prefetch(TOKENS)
        stats = engine.stats().prefetch.counters
        assert stats.loads_started == 2 and stats.stopped_budget == 1  # half of L1
        assert handle.reserved_chunks() == 2
        tier.gate.set()
        assert await handle == 64  # the reserved part; the rest is loaded by retrieve
        assert await engine.evict_l1() == 0  # both chunks are referenced by the handle
        assert engine.stats().l1.entries == 2
        # Everything the handle does not hold may be evicted; what it holds never is.
        other = await engine.prefetch(TOKENS)
        assert other.reserved_chunks() == 0  # the budget is spent: stop rather than thrash
        other.close()
        assert (await engine.retrieve(TOKENS, DST, prefetch=handle)).valid_tokens == 100
        assert handle.closed
        await _settle(engine)
    assert engine.leaked_on_close == 0


async def test_each_registration_prefetches_with_its_own_layout() -> None:
    bf16 = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    mla = make_caches("mla", torch.int8, num_blocks=16, seed=1)
    tier = FaultyTier(MemoryTier(), get_delay_s=0.01)
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as engine:
        desc_a = engine.register_kv_caches(bf16.entries, model_name="a", layout_hints=bf16.hints)
        desc_b = engine.register_kv_caches(mla.entries, model_name="b", layout_hints=mla.hints)
        assert desc_a.layout_id != desc_b.layout_id
        await engine.store(TOKENS, SRC, model_name="a")
        await engine.store(TOKENS, SRC, model_name="b")
        await engine.flush()
        await engine.evict_l1()
        handles = {model: await engine.prefetch(TOKENS, model_name=model) for model in "ab"}
        assert engine.stats().prefetch.counters.loads_started == 8
        for caches, model in ((bf16, "a"), (mla, "b")):
            reference = caches.snapshot()
            poison_blocks(caches, DST)
            expected = caches.snapshot()
            result = await engine.retrieve(TOKENS, DST, model_name=model, prefetch=handles[model])
            assert result.valid_tokens == 100
            expect_copy(caches, expected, reference, SRC, DST, range(100), 16)
            assert caches.bytes_equal(expected)
        await _settle(engine)


async def test_lookup_loads_nothing_and_holds_nothing(
    setup: tuple[TieredKVEngine, FaultyTier],
) -> None:
    engine, tier = setup
    for _ in range(5):
        assert await engine.lookup(TOKENS) == 100
    stats = engine.stats()
    assert stats.prefetch.counters.loads_started == 0 and stats.prefetch.live_handles == 0
    assert tier.calls["get"] == 0 and stats.arena.used == 0
    assert (await engine.retrieve(TOKENS, DST)).valid_tokens == 100  # retrieve loads itself
    assert tier.calls["get"] == 4
    await _settle(engine)


@pytest.mark.parametrize("layerwise", [False, True])
async def test_a_retrieve_that_skips_every_chunk_closes_the_prefetch_it_is_given(
    setup: tuple[TieredKVEngine, FaultyTier], layerwise: bool
) -> None:
    """The engine's own prefix cache held the whole prompt: the retrieve copies nothing, but
    the prefetch handed to it ends with it (its chunks would stay pinned in L1 otherwise)."""
    engine, _ = setup
    prompt = TOKENS[:96]  # three whole chunks
    handle = await engine.prefetch(prompt)
    assert engine.stats().prefetch.live_handles == 1
    if layerwise:
        load = await engine.retrieve_layerwise(prompt, DST, skip_prefix_tokens=96, prefetch=handle)
        assert load.result.valid_tokens == 96
        await load.wait()
    else:
        result = await engine.retrieve(prompt, DST, skip_prefix_tokens=96, prefetch=handle)
        assert result.valid_tokens == 96
    assert engine.stats().prefetch.live_handles == 0 and handle.closed
    await _settle(engine)


async def test_a_handle_ends_with_its_async_with_block(
    setup: tuple[TieredKVEngine, FaultyTier],
) -> None:
    engine, tier = setup
    tier.gate = asyncio.Event()
    async with await engine.prefetch(TOKENS) as handle:
        assert handle.reserved_chunks() == 4 and not handle.closed
    assert handle.closed
    assert engine.stats().prefetch.counters.cancelled == 4  # nobody else wanted the loads
    handle.close()  # idempotent
    tier.gate.set()
    await _settle(engine)


async def test_a_handle_for_other_tokens_is_refused_by_retrieve(
    setup: tuple[TieredKVEngine, FaultyTier], caches: KVCaches
) -> None:
    """Another prompt's loads would be another prompt's KV: refused, nothing copied, and the
    handle's loads released; a handle for a prompt the retrieve's tokens extend is used."""
    engine, _ = setup
    other = [*TOKENS[:32], *range(7000, 7068)]  # shares chunk 0 only
    await engine.store(other, SRC)
    await engine.flush()
    await engine.evict_l1()
    before = caches.snapshot()
    handle = await engine.prefetch(other)
    with pytest.raises(LayoutError, match="covers chunk 1 of other tokens"):
        await engine.retrieve(TOKENS, DST, prefetch=handle)
    assert caches.bytes_equal(before)
    assert engine.stats().prefetch.live_handles == 0
    refused = await engine.prefetch(TOKENS)
    with pytest.raises(LayoutError, match="block_ids"):
        await engine.retrieve(TOKENS, [0, 1], prefetch=refused)  # too few blocks
    assert refused.closed  # handed over: ended however the retrieve ended
    with pytest.raises(ConfigError, match="must be a PrefetchHandle"):
        await engine.retrieve(TOKENS, DST, prefetch=object())  # type: ignore[arg-type]
    shorter = await engine.prefetch(TOKENS[:64])
    assert (await engine.retrieve(TOKENS, DST, prefetch=shorter)).valid_tokens == 100
    await _settle(engine)


async def test_a_handle_dropped_unclosed_is_freed_and_counted_as_leaked(
    setup: tuple[TieredKVEngine, FaultyTier],
) -> None:
    engine, tier = setup
    tier.gate = asyncio.Event()
    handle = await engine.prefetch(TOKENS)
    assert handle.reserved_chunks() == 4
    del handle
    gc.collect()
    await asyncio.sleep(0)  # the finalizer hops to the loop
    await asyncio.sleep(0)
    stats = engine.stats().prefetch
    assert stats.counters.cancelled == 4 and stats.counters.handles_leaked == 1
    tier.gate.set()
    await _settle(engine)


async def test_close_with_live_handles_and_loads_frees_everything(caches: KVCaches) -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.0)
    engine = TieredKVEngine(_config(), lower_tiers=[tier])
    async with engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await _populate(engine, tier)
        tier.gate = asyncio.Event()
        handle = await engine.prefetch(TOKENS)
        await asyncio.sleep(0.01)
    assert handle.closed and engine.leaked_on_close == 0


# Await points of a prefetch + retrieve, reached in turn as the loop advances: the prefetch's
# batched contains_many, the load's delay, the tier slot, the read, retrieve's wait for a load,
# the mover's scatter, the release. Cancelling after every number of loop turns hits each one.
@pytest.mark.parametrize("turns", [0, 1, 2, 3, 4, 5, 6, 8, 10, 13, 17, 25, 40])
@pytest.mark.parametrize("target", ["retrieve", "handle"])
@pytest.mark.parametrize("gated", [False, True], ids=["free", "reads-held"])
async def test_cancellation_at_every_await_point_leaves_no_reservation(
    caches: KVCaches, turns: int, target: str, gated: bool
) -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.0, contains_delay_s=0.0)
    engine = TieredKVEngine(_config(prefetch_concurrency=1), lower_tiers=[tier])
    async with engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await _populate(engine, tier)

        async def request() -> int:
            async with await engine.prefetch(TOKENS) as handle:
                if target == "handle":
                    return await handle
                return (await engine.retrieve(TOKENS, DST, prefetch=handle)).valid_tokens

        if gated:  # every read blocks inside the tier until the request is cancelled
            tier.gate = asyncio.Event()
        task = asyncio.create_task(request())
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if tier.gate is not None:
            tier.gate.set()
        await _settle(engine)
        # Whatever was cancelled, the cache still serves the prefix afterwards.
        assert await engine.lookup(TOKENS) == 100
        assert (await engine.retrieve(TOKENS, DST)).valid_tokens == 100
        await _settle(engine)
    assert engine.leaked_on_close == 0


def test_blocking_facade_prefetch_handle_with_the_real_l2(tmp_path: Path) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    config = _config(l2_path=str(tmp_path / "l2"))
    with SyncTieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert engine.store(TOKENS, SRC) == 100
        engine.flush()
        engine.evict_l1()
        handle = engine.prefetch(TOKENS)
        assert handle.hit_tokens == 100
        assert handle.wait(timeout=10) == 100
        assert handle.done() and handle.ready_tokens() == 100
        assert engine.stats().prefetch.counters.loads_started == 4
        reference = caches.snapshot()
        poison_blocks(caches, DST)
        expected = caches.snapshot()
        result = engine.retrieve(TOKENS, DST, prefetch=handle)
        assert (result.valid_tokens, result.stop_reason) == (100, "complete")
        expect_copy(caches, expected, reference, SRC, DST, range(100), 16)
        assert caches.bytes_equal(expected)
        handle.close()  # closed by the retrieve already: idempotent
        with engine.prefetch(TOKENS) as scoped:
            assert scoped.wait(timeout=10) == 100
        engine.evict_l1()
        assert engine.stats().arena.used == 0
        pending = engine.prefetch(TOKENS)  # left to close
        assert pending.hit_tokens == 100
    assert engine.engine.leaked_on_close == 0


class _EvictingMover(TorchMover):
    """Evicts every unreferenced L1 chunk of ``engine`` after its next scatter: the rest of a
    prefix the retrieve found in L1 leaves it while the retrieve walks the prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.engine: TieredKVEngine | None = None

    async def scatter(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        await super().scatter(layout, block_ids, transfers)
        engine, self.engine = self.engine, None
        if engine is not None:
            assert await engine.evict_l1() > 0


async def test_a_prefix_that_leaves_l1_while_retrieved_is_loaded_from_below(
    caches: KVCaches,
) -> None:
    """A retrieve that finds its whole prefix in L1 starts no prefetch; a chunk evicted while
    the retrieve walks (after the first batch is scattered) is then loaded from the tier below
    through a handle opened for it, and every byte arrives."""
    tier = FaultyTier(MemoryTier())
    mover = _EvictingMover()
    engine = TieredKVEngine(_config(retrieve_batch_chunks=1), mover=mover, lower_tiers=[tier])
    async with engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await engine.store(TOKENS, SRC)
        await engine.flush()  # in L1 and below
        reference = caches.snapshot()
        poison_blocks(caches, DST)
        expected = caches.snapshot()
        handles = engine.stats().prefetch.counters.handles
        mover.engine = engine
        result = await engine.retrieve(TOKENS, DST)  # no lookup: no prefetch of its own
        assert (result.valid_tokens, result.stop_reason) == (100, "complete")
        assert tier.calls["get"] == 3  # chunks 1-3, evicted after chunk 0's scatter
        assert engine.stats().prefetch.counters.handles == handles + 1  # opened by the walk
        expect_copy(caches, expected, reference, SRC, DST, range(100), 16)
        assert caches.bytes_equal(expected)
        await _settle(engine)
    assert engine.leaked_on_close == 0


async def test_a_retrieve_of_the_claimed_tokens_uses_the_whole_prompts_prefetch(
    setup: tuple[TieredKVEngine, FaultyTier],
) -> None:
    """A serving engine retrieves what lookup claimed, not the whole prompt: a prefetch of the
    whole prompt given to that retrieve is used and ended by it."""
    engine, _ = setup
    prompt = [*TOKENS[:96], *range(90_000, 90_016)]  # three cached chunks, then 16 new tokens
    assert await engine.lookup(prompt) == 96
    handle = await engine.prefetch(prompt)
    assert engine.stats().prefetch.live_handles == 1
    assert (await engine.retrieve(prompt[:96], DST, prefetch=handle)).valid_tokens == 96
    stats = engine.stats()
    assert stats.prefetch.live_handles == 0
    assert stats.prefetch.counters.loads_started == 3  # the handle's loads only
    await _settle(engine)


async def test_a_prefetch_whose_loads_failed_reports_them_and_the_next_retrieve_loads_again(
    setup: tuple[TieredKVEngine, FaultyTier],
) -> None:
    """The tier failed every read of a prefetch: the retrieve given it says so (nothing
    delivered, "failed"), and a later retrieve reads the chunks again."""
    engine, tier = setup
    tier.get_failure_rate = 1.0
    handle = await engine.prefetch(TOKENS)
    await handle.wait()
    assert handle.failed_loads()
    tier.get_failure_rate = 0.0
    result = await engine.retrieve(TOKENS, DST, prefetch=handle)
    assert (result.valid_tokens, result.stop_reason) == (0, "failed")
    assert (await engine.retrieve(TOKENS, DST)).valid_tokens == 100
    await _settle(engine)


async def test_a_prefetch_right_after_a_close_does_not_join_the_cancelled_loads(
    setup: tuple[TieredKVEngine, FaultyTier],
) -> None:
    """The closed handle's loads are cancelled but still ending: a new prefetch of the same
    chunks starts loads of its own (joining the cancelled ones failed every chunk)."""
    engine, tier = setup
    tier.gate = asyncio.Event()
    first = await engine.prefetch(TOKENS)
    first.close()
    second = await engine.prefetch(TOKENS)
    stats = engine.stats().prefetch
    assert (stats.counters.loads_started, stats.counters.loads_deduplicated) == (8, 0)
    assert stats.in_flight == 8  # the cancelled loads count until they end
    tier.gate.set()
    assert await second == 100 and not second.failed_loads()
    assert (await engine.retrieve(TOKENS, DST, prefetch=second)).valid_tokens == 100
    await _settle(engine)
