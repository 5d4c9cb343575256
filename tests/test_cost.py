"""The cost model: tier read costs learned from reads, the recompute model, and the claim that
minimises the expected time to first token."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.kvfactory import make_caches
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.cost import (
    MIN_READS,
    PageCachedTierCost,
    RecomputeCost,
    TierCost,
    _DecayingFit,
    choose_claim,
)
from tiered_kv.errors import ConfigError
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

MB = 1_000_000


def _tier(latency_s: float, bps: float, parallelism: int = 4, reads: int = 20) -> TierCost:
    """A tier whose reads share ``bps`` among those in flight, each after ``latency_s``."""
    tier = TierCost("T", parallelism)
    for i in range(reads):
        size = (1 + i % 3) * MB  # sizes and concurrencies vary: latency and rate identifiable
        concurrency = 1 + i % parallelism
        tier.observe(size, latency_s + size * concurrency / bps, concurrency=concurrency)
    return tier


def test_a_tier_learns_latency_and_throughput_from_its_reads() -> None:
    tier = _tier(0.002, 1e9)
    assert tier.chunk_seconds(4 * MB) == pytest.approx(0.002 + 0.004, rel=1e-6)
    # Four at once, sharing 1 GB/s: eight chunks take two rounds of four.
    assert tier.load_seconds([2 * MB] * 8) == pytest.approx(2 * (0.002 + 0.008), rel=1e-6)
    assert tier.load_seconds([2 * MB] * 2) == pytest.approx(0.002 + 0.004, rel=1e-6)
    assert tier.load_seconds([]) == 0.0


def test_chunks_of_one_size_give_a_proportional_estimate() -> None:
    tier = TierCost("T", 2)
    for _ in range(MIN_READS):
        tier.observe(8 * MB, 0.016)
    assert tier.chunk_seconds(8 * MB) == pytest.approx(0.016)
    assert tier.chunk_seconds(4 * MB) == pytest.approx(0.008)
    # Reads all alone: the rate is shared, two at once take twice as long each.
    assert tier.chunk_seconds(8 * MB, 2) == pytest.approx(0.032)
    assert tier.throughput_bps() == pytest.approx(8 * MB / 0.016)


def test_no_estimate_before_enough_reads_unless_seeded() -> None:
    tier = TierCost("T", 4)
    for _ in range(MIN_READS - 1):
        tier.observe(MB, 0.001)
    assert tier.chunk_seconds(MB) is None
    assert tier.load_seconds([MB]) is None
    tier.seed(throughput_bps=4e9)  # aggregate, shared by the reads in flight
    assert tier.chunk_seconds(MB) == pytest.approx(0.00025)
    assert tier.chunks_seconds(4, MB) == pytest.approx(0.001)
    with pytest.raises(ValueError, match="seed"):
        tier.seed(throughput_bps=0)


def test_one_stall_moves_the_estimate_little_and_a_lasting_slowdown_is_followed() -> None:
    tier = _tier(0.0, 1e9, reads=30)
    steady = tier.chunk_seconds(2 * MB, 4)
    assert steady is not None
    tier.observe(2 * MB, 100 * steady, concurrency=4)  # one stall, clipped
    after_stall = tier.chunk_seconds(2 * MB, 4)
    assert after_stall is not None and after_stall < 1.5 * steady
    for i in range(150):  # the tier is 10x slower from now on
        size, concurrency = (1 + i % 3) * MB, 1 + i % 4
        tier.observe(size, size * concurrency / 1e8, concurrency=concurrency)
    slowed = tier.chunk_seconds(2 * MB, 4)
    assert slowed == pytest.approx(10 * steady, rel=0.15)


def test_recompute_is_learned_from_prefills_or_given() -> None:
    def truth(new: int, prefix: int) -> float:
        return 1e-5 * new + 2e-9 * new * (prefix + new / 2) + 0.003

    model = RecomputeCost()
    assert model.seconds(1000, 0) is None
    for new, prefix in [(512, 0), (2048, 0), (1024, 1024), (4096, 4096), (300, 7000), (8192, 0)]:
        model.observe(new, prefix, truth(new, prefix))
    assert model.seconds(16384, 0) == pytest.approx(truth(16384, 0), rel=1e-6)
    assert model.seconds(1, 32767) == pytest.approx(truth(1, 32767), rel=1e-6)
    assert model.seconds(0, 5) == 0.0
    given = RecomputeCost(lambda new, prefix: 0.5)
    assert given.seconds(10, 0) == 0.5


def test_recompute_fits_short_and_long_prefills_alike() -> None:
    """Prefills measured on an H200 with Llama-3-8B shapes, from 1 to 32768 new tokens: every
    estimate within 0.75-1.3x of what was measured. A fit of absolute error let the 32k-token
    prefills set every estimate (8k: 0.29x, one token: 9x) and declined loads worth it. The
    prefix has its own term: 16384 new tokens over 16384 cached took longer than all 32768
    from scratch, so loading half of a 32k prompt never pays there."""
    measured = [
        (2048, 0, 0.0584),
        (1024, 1024, 0.0341),
        (1, 2047, 0.0076),
        (8192, 0, 0.2508),
        (4096, 4096, 0.1723),
        (1, 8191, 0.0084),
        (32768, 0, 1.374),
        (16384, 16384, 1.4273),
        (1, 32767, 0.0109),
    ]
    model = RecomputeCost()
    for new, prefix, seconds in measured:
        model.observe(new, prefix, seconds)
    for new, prefix, seconds in measured:
        estimate = model.seconds(new, prefix)
        assert estimate is not None and 0.75 <= estimate / seconds <= 1.3, (new, prefix)
    half, whole = model.seconds(16384, 16384), model.seconds(32768, 0)
    assert half is not None and whole is not None and half > whole


def test_a_prefix_term_the_prefills_cannot_pin_down_is_not_used() -> None:
    """Prefills from scratch and one short one over a prefix that ran faster than the fixed
    part (as on a loaded CPU): a term of the prefix's own would come out negative, and a
    longer prefix would look cheaper. The estimate uses one attention term then."""
    model = RecomputeCost()
    for new in (200, 400, 700, 1000):
        model.observe(new, 0, 1e-3 * new + 0.05)
    model.observe(12, 1088, 0.04)
    over_prefix, from_scratch = model.seconds(736, 256), model.seconds(736, 0)
    assert over_prefix is not None and from_scratch is not None
    assert over_prefix >= from_scratch


def test_three_prefill_shapes_give_an_estimate_from_the_terms_they_pin_down() -> None:
    """One prompt length's prefills (from scratch, half over a prefix, one token over the
    rest), as measured on an H200: three shapes cannot pin down four terms. The estimate comes
    from the terms they do (non-negative least squares over subsets of the terms), so each
    shape is estimated as measured and loading half of the prompt is still seen not to pay."""
    measured = [(32768, 0, 1.4037), (1, 32767, 0.0110), (16384, 16384, 1.4509)]
    model = RecomputeCost()
    for new, prefix, seconds in measured[:2]:
        model.observe(new, prefix, seconds)
    assert model.seconds(32768, 0) is None  # two prefills: no estimate yet
    model.observe(*measured[2])
    for new, prefix, seconds in measured:
        estimate = model.seconds(new, prefix)
        assert estimate is not None and 0.9 <= estimate / seconds <= 1.1, (new, prefix)
    half, whole = model.seconds(16384, 16384), model.seconds(32768, 0)
    assert half is not None and whole is not None and half > whole


def test_the_nonnegative_fit_is_the_best_one_over_every_subset_of_terms() -> None:
    """A brute-force check of the exact non-negative least squares: no non-negative subset
    fit leaves less squared error than the one chosen."""
    fit = _DecayingFit(3, keep=1.0)
    rows = [
        ((1.0, 2.0, 0.5), 3.0),
        ((2.0, 0.1, 1.0), 1.0),
        ((0.5, 3.0, 2.0), 2.5),
        ((1.5, 1.0, 0.2), 0.4),
    ]
    for x, y in rows:
        fit.add(x, y)
    chosen = fit.solve_nonnegative()
    assert chosen is not None and min(chosen) >= 0

    def error(coef: Sequence[float]) -> float:
        return sum((y - sum(c * v for c, v in zip(coef, x, strict=True))) ** 2 for x, y in rows)

    # A grid of non-negative coefficients never beats it.
    grid = [i * 0.05 for i in range(41)]
    best_grid = min(error((a, b, c)) for a in grid for b in grid for c in grid)
    assert error(chosen) <= best_grid + 1e-9


def _recompute(per_token_s: float) -> RecomputeCost:
    return RecomputeCost(lambda new, prefix: per_token_s * new)


def test_a_fast_tier_is_claimed_whole_and_a_slow_one_declined() -> None:
    # 16 chunks of 256 tokens and 32 MB; recomputing costs 30 us a token (7.7 ms a chunk).
    fast = _tier(0.0, 32e9, parallelism=8)  # 8 at once share 32 GB/s: 16 ms for 16
    slow = _tier(0.0, 1.6e9, parallelism=8)  # 8 at once: 160 ms each
    common = {"chunk_tokens": 256, "chunk_bytes": 32 * MB, "total_tokens": 16 * 256 + 10}
    claim = choose_claim([0] * 16, tiers=[fast], recompute=_recompute(30e-6), **common)
    assert claim.chunks == 16 and claim.declined == {} and claim.saved_s == 0.0
    claim = choose_claim([0] * 16, tiers=[slow], recompute=_recompute(30e-6), **common)
    assert claim.chunks == 0 and claim.declined == {0: 16}
    assert claim.expected_s == pytest.approx(30e-6 * (16 * 256 + 10))
    assert claim.all_loaded_s is not None and claim.saved_s > 0.1


def test_the_l1_part_of_a_prefix_is_claimed_before_a_slow_tier() -> None:
    slow = _tier(0.05, 0.5e9)
    claim = choose_claim(
        [-1, -1, -1, 0, 0, 0],
        chunk_tokens=256,
        chunk_bytes=32 * MB,
        total_tokens=6 * 256,
        tiers=[slow],
        recompute=_recompute(30e-6),
    )
    assert claim.chunks == 3 and claim.declined == {0: 3}


def test_a_page_cached_tier_expects_the_mix_its_probe_reports() -> None:
    """Cached reads at 4 ms a chunk, reads from the device at 40 ms: the estimate follows the
    share the tier's probe reports; unknown, it is the estimate from all reads."""
    tier = PageCachedTierCost("L2", 4)
    for _ in range(MIN_READS):
        tier.observe(32 * MB, 0.004, cached=True, concurrency=4)
        tier.observe(32 * MB, 0.040, cached=False, concurrency=4)
    assert tier.cached.reads == tier.uncached.reads == MIN_READS
    assert tier.reads == 2 * MIN_READS
    tier.expect_cached(1.0)
    assert tier.chunks_seconds(8, 32 * MB) == pytest.approx(2 * 0.004)
    tier.expect_cached(0.0)
    assert tier.chunks_seconds(8, 32 * MB) == pytest.approx(2 * 0.040)
    tier.expect_cached(0.5)
    assert tier.chunks_seconds(8, 32 * MB) == pytest.approx(0.004 + 0.040)
    tier.expect_cached(None)
    mixed = tier.chunks_seconds(8, 32 * MB)
    assert mixed is not None and 2 * 0.004 < mixed < 2 * 0.040
    # A kind never read yet has no estimate of its own: the estimate from all reads stands.
    fresh = PageCachedTierCost("L2", 4)
    for _ in range(MIN_READS):
        fresh.observe(32 * MB, 0.004, cached=True, concurrency=4)
    fresh.expect_cached(0.0)
    assert fresh.chunks_seconds(8, 32 * MB) == pytest.approx(2 * 0.004)


def _drop_page_cache(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file() and not path.name.startswith("."):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages (batched durability) are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def test_l2_reads_teach_the_page_cache_estimates_and_lookups_probe_the_files(
    tmp_path: Path,
) -> None:
    """Real files: a read of a file in the page cache teaches the cached estimate, one of a
    dropped file the device's; a lookup probes the located files first."""
    engine = TieredKVEngine(
        EngineConfig(chunk_size=CHUNK, l1_size="8MiB", l2_path=str(tmp_path / "l2")),
        recompute_seconds=_recompute_seconds,
    )
    await engine.open()
    try:
        caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await engine.store(TOKENS, SRC)
        await engine.flush()
        await engine.evict_l1()
        storage = engine.storage
        cost = storage.costs[0]
        assert isinstance(cost, PageCachedTierCost)
        tier = storage.lower[0]
        keys = engine.chunk_keys(TOKENS, model_name="m")
        if tier.cached_share(keys) is None:
            pytest.skip("this system cannot tell page-cache residency (mincore)")
        assert tier.cached_share(keys) == 1.0  # just written
        assert await _request(engine) == len(TOKENS)
        assert (cost.cached.reads, cost.uncached.reads) == (8, 0)
        assert cost.cached_share == 1.0
        _drop_page_cache(tmp_path / "l2")
        assert tier.cached_share(keys) == 0.0
        assert await engine.lookup(TOKENS) == len(TOKENS)
        assert cost.cached_share == 0.0  # the lookup's probe, before its reads
        result = await engine.retrieve(TOKENS, DST)
        assert result.valid_tokens == len(TOKENS)
        await _settle(engine)
        assert (cost.cached.reads, cost.uncached.reads) == (8, 8)
        assert tier.cached_share(keys) == 1.0  # read again: in the page cache
    finally:
        await engine.aclose()


def test_a_lower_tiers_reads_end_before_the_rest_is_computed() -> None:
    """Loading 8 chunks takes 90 ms, recomputing them 80 ms, the other 8 chunks 80 ms: the
    first layer needs every claimed chunk, so the load is not overlapped with the rest's
    compute (90 + 80 > 160, declined); 60 ms loads are claimed (60 + 80 < 160)."""
    kwargs = {"chunk_tokens": 100, "chunk_bytes": 32 * MB, "total_tokens": 1600}
    for seconds, claimed in ((0.090, 0), (0.060, 8)):
        tier = TierCost("T", 8)
        for _ in range(MIN_READS):
            tier.observe(32 * MB, seconds, concurrency=8)
        claim = choose_claim([0] * 8, tiers=[tier], recompute=_recompute(1e-4), **kwargs)
        assert claim.chunks == claimed


def test_without_an_estimate_the_whole_prefix_is_claimed() -> None:
    unknown = TierCost("T", 4)
    known = _tier(0.0, 1e6)  # very slow, but the recompute side is unknown
    args = {"chunk_tokens": 256, "chunk_bytes": MB, "total_tokens": 1024}
    assert choose_claim([0] * 4, tiers=[unknown], recompute=_recompute(1e-9), **args).chunks == 4
    assert choose_claim([0] * 4, tiers=[known], recompute=RecomputeCost(), **args).chunks == 4
    assert choose_claim([-1] * 4, tiers=[known], recompute=RecomputeCost(), **args).chunks == 4


# -- the engine's claims ---------------------------------------------------------------------

CHUNK = 16
TOKENS = list(range(5000, 5000 + 8 * CHUNK))  # 8 chunks
SRC, DST = list(range(8)), list(range(8, 16))
RECOMPUTE_S_PER_TOKEN = 1e-3  # 16 ms a chunk: 128 ms for the prompt


def _recompute_seconds(new_tokens: int, prefix_tokens: int) -> float:
    return RECOMPUTE_S_PER_TOKEN * new_tokens


async def _engine_over(tier: FaultyTier, **config: object) -> TieredKVEngine:
    engine = TieredKVEngine(
        EngineConfig(chunk_size=CHUNK, l1_size="8MiB", **config),  # type: ignore[arg-type]
        lower_tiers=[tier],
        recompute_seconds=_recompute_seconds,
    )
    await engine.open()
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    delay = tier.get_delay_s
    tier.get_delay_s = 0.0
    await engine.store(TOKENS, SRC)
    await engine.flush()
    await engine.evict_l1()
    tier.get_delay_s = delay
    return engine


async def _request(engine: TieredKVEngine) -> int:
    """A request as a serving engine makes it: lookup, then retrieve what it claimed (which
    consumes the prefetch the lookup started), then L1 emptied once every load ended."""
    claimed = await engine.lookup(TOKENS)
    if claimed:
        result = await engine.retrieve(TOKENS[:claimed], DST)
        assert result.valid_tokens == claimed
    await _settle(engine)
    return claimed


async def _settle(engine: TieredKVEngine) -> None:
    """Wait for loads (prefetches, probes) to end, then empty L1."""
    for _ in range(1000):
        if engine.stats().prefetch.in_flight == 0:
            break
        await asyncio.sleep(0.005)
    assert engine.stats().prefetch.in_flight == 0
    await engine.evict_l1()


async def test_the_engine_declines_a_slow_tier_and_claims_it_again_once_it_is_fast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tiered_kv.cost

    monkeypatch.setattr(tiered_kv.cost, "PROBE_INTERVAL_S", 0.0)  # a probe at every decline
    tier = FaultyTier(MemoryTier(), get_delay_s=0.3)  # 8 chunks at once in 300 ms: > 128 ms
    engine = await _engine_over(tier)
    try:
        # No reads measured yet: the whole hit is claimed, and its loads teach the model.
        assert await _request(engine) == len(TOKENS)
        assert await _request(engine) == 0
        stats = engine.stats()
        name = tier.name.lower()
        reads = stats.storage.tier(name).reads
        assert reads.declined == 8 and reads.declined_saved_seconds > 0
        assert stats.engine.cost_probes == 1
        # The tier becomes fast; the probes of its declined chunks measure it, and the claim
        # comes back.
        tier.get_delay_s = 0.0
        rounds = 0
        claimed = 0
        while claimed != len(TOKENS) and rounds < 60:
            rounds += 1
            claimed = await _request(engine)
        assert claimed == len(TOKENS), "the claim never came back after the tier sped up"
        assert rounds > 1  # it took measurements, not a reset
    finally:
        await engine.aclose()


async def test_a_tier_faster_than_recomputing_is_always_claimed() -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.002)
    engine = await _engine_over(tier)
    try:
        for _ in range(3):
            assert await _request(engine) == len(TOKENS)
        assert engine.stats().storage.tier(tier.name).reads.declined == 0
    finally:
        await engine.aclose()


async def test_load_policy_always_claims_every_hit() -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.1)
    engine = await _engine_over(tier, load_policy="always")
    try:
        for _ in range(2):
            assert await _request(engine) == len(TOKENS)
        assert engine.stats().engine.cost_probes == 0
    finally:
        await engine.aclose()


async def test_a_lookup_may_override_the_configured_policy() -> None:
    """``lookup(load_policy=...)``: one call claims everything (a benchmark's load-all rows,
    a caller that must load) or asks the cost model, whatever the config says."""
    tier = FaultyTier(MemoryTier(), get_delay_s=0.3)
    engine = await _engine_over(tier, load_policy="always")
    try:
        assert await _request(engine) == len(TOKENS)  # "always": its loads teach the model
        assert await engine.lookup(TOKENS, load_policy="cost") == 0
        await _settle(engine)
        assert engine.stats().storage.tier(tier.name).reads.declined == 8
        assert await engine.lookup(TOKENS) == len(TOKENS)  # the config's "always" again
        await _settle(engine)
        with pytest.raises(ConfigError, match="load_policy: expected one of"):
            await engine.lookup(TOKENS, load_policy="never")
    finally:
        await engine.aclose()


def test_load_policy_is_validated() -> None:
    with pytest.raises(ConfigError, match="load_policy"):
        EngineConfig(load_policy="sometimes")
