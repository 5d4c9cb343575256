"""The engine's async and blocking facades, argument errors, shutdown and cancellation."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from tests.kvfactory import expect_copy, make_caches, poison_blocks
from tiered_kv import (
    EngineConfig,
    EngineStateError,
    KeySalt,
    LayoutError,
    SyncTieredKVEngine,
    TieredKVEngine,
)
from tiered_kv.gpu.reference import TorchMover
from tiered_kv.layout import KVCacheLayout
from tiered_kv.tiers.base import LowerTier
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

TOKENS = list(range(1000, 1100))  # 100 tokens: 3 full chunks of 32 and a partial of 4


def _config(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"chunk_size": 32, "l1_size": "8MiB"}
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def test_blocking_facade_round_trip_runs_its_own_loop_thread() -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    src, dst = list(range(7)), list(range(8, 15))
    with SyncTieredKVEngine(_config()) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        loop_threads = [t.name for t in threading.enumerate() if t.name == "tiered-kv-loop"]
        assert loop_threads == ["tiered-kv-loop"]
        assert engine.store(TOKENS, src) == 100
        assert engine.lookup(TOKENS) == 100
        assert engine.lookup(TOKENS[:50] + [7] * 30) == 32
        reference = caches.snapshot()
        poison_blocks(caches, dst)
        expected = caches.snapshot()
        assert engine.retrieve(TOKENS, dst, skip_prefix_tokens=10).valid_tokens == 100
        expect_copy(caches, expected, reference, src, dst, range(10, 100), 16)
        assert caches.bytes_equal(expected)
        stats = engine.stats()
        assert stats.engine.stored_tokens == 100
        assert stats.storage.l1_hits == 4
    assert not [t for t in threading.enumerate() if t.name == "tiered-kv-loop"]
    with pytest.raises(EngineStateError):
        engine.lookup(TOKENS)


def test_blocking_verbs_have_the_async_verbs_signatures() -> None:
    """Each blocking verb is made from the async one: same parameters and docstring, so the two
    facades cannot drift apart."""
    import inspect

    import tiered_kv.engine

    verbs = ["register_kv_caches", "store", "lookup", "flush"]
    for name in [*verbs, "evict_l1", "stats"]:
        blocking, original = getattr(SyncTieredKVEngine, name), getattr(TieredKVEngine, name)
        assert inspect.signature(blocking) == inspect.signature(original), name
        assert blocking.__doc__ == original.__doc__, name
    # The verbs whose blocking handles change a type are written out: same parameters still.
    for name in ["prefetch", "retrieve", "retrieve_layerwise", "store_layerwise"]:
        blocking = inspect.signature(getattr(SyncTieredKVEngine, name)).parameters
        original = inspect.signature(getattr(TieredKVEngine, name)).parameters
        assert [(p.name, p.kind, p.default) for p in blocking.values()] == [
            (p.name, p.kind, p.default) for p in original.values()
        ], name
    # The blocking facade lives in tiered_kv.sync only (no alias back in engine: no cycle).
    assert not hasattr(tiered_kv.engine, "SyncTieredKVEngine")


async def test_use_before_open_and_after_close_raise() -> None:
    engine = TieredKVEngine(_config())
    caches = make_caches("mla", torch.bfloat16)
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    with pytest.raises(EngineStateError, match="not open"):
        await engine.store(TOKENS[:10], [0])
    await engine.open()
    await engine.aclose()
    with pytest.raises(EngineStateError, match="closed"):
        await engine.lookup(TOKENS)
    with pytest.raises(EngineStateError, match="reopen"):
        await engine.open()


async def test_argument_errors_name_the_problem() -> None:
    caches = make_caches("vllm_nhd", torch.float16, num_blocks=8)
    async with TieredKVEngine(_config()) as engine:
        with pytest.raises(EngineStateError, match="register_kv_caches"):
            await engine.lookup(TOKENS)
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        with pytest.raises(LayoutError, match="need 7 blocks"):
            await engine.store(TOKENS, [0, 1])
        with pytest.raises(LayoutError, match="out of range"):
            await engine.store(TOKENS[:20], [0, 8])
        with pytest.raises(LayoutError, match="skip_prefix_tokens"):
            await engine.retrieve(TOKENS[:20], [0, 1], skip_prefix_tokens=21)
        with pytest.raises(LayoutError, match="token_ids"):
            await engine.lookup([-1, 2, 3])
        engine.register_kv_caches(make_caches("mla", torch.int8).entries, model_name="other")
        with pytest.raises(EngineStateError, match="model_name"):
            await engine.lookup(TOKENS)
        with pytest.raises(EngineStateError, match="not registered"):
            await engine.lookup(TOKENS, model_name="nope")
        assert await engine.lookup(TOKENS, model_name="other") == 0


async def test_two_models_and_two_namespaces_never_share_chunks(tmp_path: Path) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    l2 = str(tmp_path / "l2")
    async with TieredKVEngine(_config(l2_path=l2, namespace="tenant-a")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        engine.register_kv_caches(caches.entries, model_name="m2", layout_hints=caches.hints)
        assert await engine.store(TOKENS, list(range(7)), model_name="m") == 100
        assert await engine.lookup(TOKENS, model_name="m2") == 0
    async with TieredKVEngine(_config(l2_path=l2, namespace="tenant-b")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.lookup(TOKENS) == 0
    async with TieredKVEngine(_config(l2_path=l2, namespace="tenant-a")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.lookup(TOKENS) == 100


async def test_salted_requests_share_chunks_only_under_the_same_salt() -> None:
    """The same tokens stored under one salt are a miss under another or none, a hit under
    the same; a mark in the third chunk leaves the first two shared with unsalted requests."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    tenant_a, tenant_b = KeySalt.of((0, b"a")), KeySalt.of((0, b"b"))
    async with TieredKVEngine(_config()) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(TOKENS, list(range(7)), salt=tenant_a) == 100
        assert await engine.lookup(TOKENS, salt=tenant_b) == 0
        assert await engine.lookup(TOKENS) == 0
        assert await engine.lookup(TOKENS, salt=tenant_a) == 100
        assert (await engine.retrieve(TOKENS, list(range(8, 15)), salt=tenant_b)).valid_tokens == 0
        assert (
            await engine.retrieve(TOKENS, list(range(8, 15)), salt=tenant_a)
        ).valid_tokens == 100
        assert await engine.store(TOKENS, list(range(7))) == 100
        image = KeySalt.of((70, b"image"))
        assert await engine.lookup(TOKENS, salt=image) == 64
        with pytest.raises(TypeError, match="expected a KeySalt"):
            await engine.lookup(TOKENS, salt=b"a")  # type: ignore[arg-type]


async def test_store_can_leave_out_a_prefix_and_prefetch_can_start_past_it() -> None:
    """A sliding-window layer group's store leaves out the chunks before its window (their
    blocks hold nothing any more): a prefix lookup misses, a prefetch from the window's chunk
    finds the rest, and only whole chunks may be left out."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    async with TieredKVEngine(_config()) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        with pytest.raises(LayoutError, match="whole number >= 0 of chunks of 32"):
            await engine.store(TOKENS, list(range(7)), skip_prefix_tokens=16)
        assert await engine.store(TOKENS, list(range(7)), skip_prefix_tokens=64) == 36
        assert await engine.lookup(TOKENS) == 0
        keys = engine.chunk_keys(TOKENS)
        assert [engine.tier_of(key) for key in keys] == [None, None, "L1", "L1"]
        handle = await engine.prefetch(TOKENS, from_token=70)
        assert handle.first_chunk == 2
        assert handle.ready_chunks() == [True, True]
        assert handle.ready_tokens() == 36
        handle.close()
        whole = await engine.prefetch(TOKENS)
        assert whole.ready_chunks() == [] and whole.ready_tokens() == 0
        whole.close()
        assert (
            await engine.retrieve(TOKENS, list(range(8, 15)), skip_prefix_tokens=64)
        ).valid_tokens == 100


async def test_l1_too_small_for_a_chunk_skips_the_store() -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16, num_heads=8, head_size=128)
    # One 32-token chunk of 2 layers x 2 x 8 x 128 bf16 is 256 KiB; L1 holds 128 KiB.
    async with TieredKVEngine(_config(l1_size="128KiB")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(TOKENS, list(range(7))) == 0
        stats = engine.stats()
        assert stats.engine.store_skipped_no_space == 4
        assert stats.arena.used == 0


# One 32-token chunk of these caches (2 layers x 2 x 8 heads x 128 x bf16) is 256 KiB.
_BIG_CHUNK = {"num_heads": 8, "head_size": 128}
_LONG = list(range(5000, 5000 + 16 * 32))  # 16 chunks: 4 MiB of KV


@pytest.mark.parametrize("write_queue", [256, 2])
async def test_a_prompt_larger_than_l1_streams_through_it_to_l2(
    tmp_path: Path, write_queue: int
) -> None:
    """A 4 MiB prompt through a 1 MiB L1: the store waits for L2's writes to free room and
    stores it whole (a write queue shorter than L1's chunks never drops one); then every chunk
    reads back bit-exact from L2."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=70, **_BIG_CHUNK)
    config = _config(
        l1_size="1MiB",
        l2_path=str(tmp_path / "l2"),
        l2_durability="none",
        lower_write_queue=write_queue,
    )
    src, dst = list(range(1, 33)), list(range(33, 65))
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(_LONG, src) == len(_LONG)
        stats = engine.stats()
        assert stats.engine.store_skipped_no_space == 0
        writes = stats.storage.tiers[0].writes
        assert writes is not None and writes.dropped_full == 0
        assert await engine.flush(timeout=30) == 0
        assert engine.stats().storage.tiers[0].writes.done == 16  # type: ignore[union-attr]
        await engine.evict_l1()
        reference = caches.snapshot()
        poison_blocks(caches, dst)
        expected = caches.snapshot()
        assert (await engine.retrieve(_LONG, dst)).valid_tokens == len(_LONG)
        expect_copy(caches, expected, reference, src, dst, range(len(_LONG)), 16)
        assert caches.bytes_equal(expected)


async def test_a_32k_prompt_is_stored_whole_through_a_64_mib_l1(tmp_path: Path) -> None:
    """The issue's case: 32768 tokens of 2 MiB chunks (256 MiB of KV) through a 64 MiB L1.
    Every chunk reaches L2 (none skipped, no write dropped), and the whole prompt reads back
    bit-exact into its poisoned blocks."""
    caches = make_caches(
        "vllm_nhd", torch.bfloat16, num_layers=4, num_blocks=2049, num_heads=8, head_size=64
    )
    tokens = list(range(100_000, 100_000 + 32768))
    blocks = list(range(1, 2049))
    config = _config(
        chunk_size=256, l1_size="64MiB", l2_path=str(tmp_path / "l2"), l2_durability="none"
    )
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(tokens, blocks) == 32768
        assert await engine.flush(timeout=60) == 0
        stats = engine.stats()
        assert stats.engine.store_skipped_no_space == 0
        writes = stats.storage.tiers[0].writes
        assert writes is not None and (writes.done, writes.dropped_full) == (128, 0)
        assert stats.tier("L2").entries == 128
        reference = caches.snapshot()
        poison_blocks(caches, blocks)
        assert (await engine.retrieve(tokens, blocks)).valid_tokens == 32768
        assert caches.bytes_equal(reference)


@pytest.mark.parametrize("how", ["no lower tier", "store_wait_s=0", "writes too slow"])
async def test_a_prompt_larger_than_l1_keeps_what_fits_when_nothing_below_frees_room(
    how: str,
) -> None:
    """Without a tier below (nothing will free room), with ``store_wait_s=0``, or when the
    writes do not free room within ``store_wait_s``: L1 keeps its 4 chunks, the other 12 are
    skipped and counted, and the store never waits past its bound."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=40, **_BIG_CHUNK)
    lower: list[LowerTier] = []
    if how != "no lower tier":
        lower = [FaultyTier(MemoryTier(), put_delay_s=5.0)]
    wait_s = {"no lower tier": 10.0, "store_wait_s=0": 0.0, "writes too slow": 0.3}[how]
    async with TieredKVEngine(
        _config(l1_size="1MiB", store_wait_s=wait_s, close_timeout_s=0.05), lower_tiers=lower
    ) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        started = asyncio.get_running_loop().time()
        assert await engine.store(_LONG, list(range(1, 33))) == 4 * 32
        elapsed = asyncio.get_running_loop().time() - started
        assert engine.stats().engine.store_skipped_no_space == 12
        assert elapsed < wait_s + 2.0, elapsed  # bounded by store_wait_s, not by the writes


async def test_clean_close_flushes_pending_l2_writes(tmp_path: Path) -> None:
    caches = make_caches("separate", torch.bfloat16, num_blocks=40)
    tokens = list(range(600))
    config = _config(l2_path=str(tmp_path / "l2"))
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(tokens, list(range(38))) == 600
        # No flush: closing must wait for the 19 queued writes.
    assert engine.dropped_on_close == 0
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert engine.stats().tier("L2").entries == 19
        assert await engine.lookup(tokens) == 600


async def test_close_timeout_drops_and_reports_pending_writes_without_leaking() -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    slow = FaultyTier(MemoryTier(), delay_s=5.0)
    engine = TieredKVEngine(_config(close_timeout_s=0.05), lower_tiers=[slow])
    async with engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(TOKENS, list(range(7))) == 100
    # Two writers were mid-put (cancelled), two chunks were still queued: all four dropped.
    assert engine.dropped_on_close == 4
    assert engine.leaked_on_close == 0  # every host byte was given back


async def test_cancelled_retrieve_releases_every_reference() -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    tier = FaultyTier(MemoryTier(), delay_s=0.2)
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await engine.store(TOKENS, list(range(7)))
        tier.delay_s = 0.0
        await engine.flush()
        await engine.evict_l1()
        assert engine.stats().arena.used == 0
        tier.delay_s = 0.2
        task = asyncio.create_task(engine.retrieve(TOKENS, list(range(8, 15))))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.3)  # let the shielded loads finish and drop their references
        await engine.evict_l1()
        assert engine.stats().arena.used == 0


async def test_cancelled_store_releases_its_staging_objects() -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    async with TieredKVEngine(_config()) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        task = asyncio.create_task(engine.store(TOKENS, list(range(7))))
        await asyncio.sleep(0)  # the store is now inside the mover's copy
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the worker thread finishes its copy, then releases
            if engine.stats().arena.used == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().arena.used == 0
        assert await engine.lookup(TOKENS) == 0  # nothing half-written became visible


async def test_lower_tier_failures_are_misses_not_errors() -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    tier = FaultyTier(MemoryTier(), seed=3, get_failure_rate=1.0)
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await engine.store(TOKENS, list(range(7)))
        await engine.flush()
        await engine.evict_l1()
        assert await engine.lookup(TOKENS) == 100  # the index says present
        assert (await engine.retrieve(TOKENS, list(range(8, 15)))).valid_tokens == 0
        assert engine.stats().storage.misses >= 1
        assert engine.stats().arena.used == 0


async def test_retrieve_of_a_prefix_larger_than_l1_scatters_in_batches() -> None:
    # 32-token chunks of 2 layers x 2 x 8 x 128 bf16 are 256 KiB; L1 holds two of them, and the
    # prefix is four: retrieve must release each delivered batch before loading the next chunk.
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16, num_heads=8, head_size=128)
    tier = MemoryTier()
    src, dst = list(range(7)), list(range(8, 15))
    async with TieredKVEngine(_config(l1_size="640KiB"), lower_tiers=[tier]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        stored = 0
        for end in (32, 64, 96, 100):  # one chunk at a time, so L1 can always stage it
            stored += await engine.store(TOKENS[:end], src)
            await engine.flush()
        assert stored == 100
        assert tier.stats().entries == 4
        await engine.evict_l1()
        assert await engine.lookup(TOKENS) == 100
        reference = caches.snapshot()
        poison_blocks(caches, dst)
        expected = caches.snapshot()
        result = await engine.retrieve(TOKENS, dst)
        assert (result.valid_tokens, result.stop_reason) == (100, "complete")
        stats = engine.stats()
        assert stats.prefetch.counters.stopped_budget >= 1  # lookup reserved only half of L1
        assert stats.engine.retrieve_scatter_batches >= 3
        expect_copy(caches, expected, reference, src, dst, range(100), 16)
        assert caches.bytes_equal(expected)
        await engine.evict_l1()
        assert engine.stats().arena.used == 0


async def test_retrieve_under_l1_pressure_returns_a_shorter_prefix_not_an_error() -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16, num_heads=8, head_size=128)
    tier = MemoryTier()  # outlives the engines below, as a disk or remote store does
    src, dst = list(range(7)), list(range(8, 15))
    async with TieredKVEngine(_config(l1_size="1MiB"), lower_tiers=[tier]) as engine:
        desc = engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        for end in (32, 64, 96, 100):
            await engine.store(TOKENS[:end], src)
            await engine.flush()
    chunk = desc.nbytes(32)
    reference = caches.snapshot()
    # L1 holds one chunk: each batch is scattered and released before the next load, so all
    # four arrive.
    async with TieredKVEngine(_config(l1_size=chunk), lower_tiers=[tier]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        poison_blocks(caches, dst)
        expected = caches.snapshot()
        assert (await engine.retrieve(TOKENS, dst)).valid_tokens == 100
        expect_copy(caches, expected, reference, src, dst, range(100), 16)
        assert caches.bytes_equal(expected)
    # L1 holds less than a chunk: nothing can be delivered, and retrieve says so.
    async with TieredKVEngine(_config(l1_size=chunk // 2), lower_tiers=[tier]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        poison_blocks(caches, dst)
        expected = caches.snapshot()
        result = await engine.retrieve(TOKENS, dst)
        assert (result.valid_tokens, result.cached_tokens) == (0, 100)
        assert result.stop_reason == "no_space" and result.recompute_tokens == 100
        assert engine.stats().storage.promotion_failures >= 1
        assert caches.bytes_equal(expected)  # nothing delivered, nothing written
        await engine.evict_l1()
        assert engine.stats().arena.used == 0


class _UnpreparableMover(TorchMover):
    """Fault injection: a mover that cannot get ready for the caches it is given."""

    def prepare(self, layout: KVCacheLayout) -> None:
        raise LayoutError(f"cannot prepare {layout.num_layers} layers")


async def test_a_mover_that_cannot_prepare_fails_the_registration() -> None:
    """Kernel compilation and buffer set-up happen at registration (`KVMover.prepare`), so a
    failure shows there, not at the first store, and leaves no half registration behind."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    async with TieredKVEngine(_config(), mover=_UnpreparableMover()) as engine:
        with pytest.raises(LayoutError, match="cannot prepare 2 layers"):
            engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        with pytest.raises(EngineStateError, match="'m' is not registered"):
            engine.layout_desc("m")


async def test_caches_registered_before_open_are_prepared_at_open() -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    engine = TieredKVEngine(_config(), mover=_UnpreparableMover())
    engine.register_kv_caches(
        caches.entries, model_name="m", layout_hints=caches.hints
    )  # no mover yet: nothing to prepare
    with pytest.raises(LayoutError, match="cannot prepare"):
        await engine.open()
    with pytest.raises(EngineStateError):  # closed, its host memory released
        await engine.open()


def test_a_loop_thread_bounds_its_calls_and_refuses_its_own_thread() -> None:
    from tiered_kv.sync import LoopThread

    loop = LoopThread("tkv-test-loop")
    ended: list[str] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        finally:
            ended.append("slow")

    async def inner_call() -> object:
        return loop.run(asyncio.sleep(0, "never"))

    try:
        assert loop.run(asyncio.sleep(0, "done")) == "done"
        with pytest.raises(TimeoutError):
            loop.run(slow(), timeout_s=0.05)
        assert ended == ["slow"]  # cancelled and finished on the loop before run returned
        with pytest.raises(EngineStateError, match="loop's own thread"):
            loop.run(inner_call())
    finally:
        loop.close()
    assert loop.closed
    with pytest.raises(EngineStateError, match="closed"):
        loop.run(asyncio.sleep(0))
    loop.close()  # twice: nothing
