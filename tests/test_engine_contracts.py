"""The engine's contracts under load and misuse: a retrieve of a prefix that grew since its
lookup, hot prefixes kept through L2 eviction and a restart, close with calls in flight and
after (and statistics while it drains), and arguments of the wrong type refused with an error
that names them (and not counted)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from tests.kvfactory import expect_copy, make_caches, poison_blocks
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.errors import EngineStateError, LayoutError
from tiered_kv.tiers.testing import MemoryTier

CHUNK = 64


def _tokens(n: int) -> list[int]:
    return list(range(7000, 7000 + n))


async def test_retrieve_of_a_prefix_grown_since_lookup_extends_its_handle(tmp_path: Path) -> None:
    """store(P[:3 chunks]) → evict → lookup(P) (an implicit prefetch of 3 chunks) → store(P) →
    lookup(P[:4 chunks]) → only chunk 4 leaves L1 → retrieve(P). The implicit handle covers
    chunks 0-2, so chunk 4's reservation lay outside it: retrieve raised and leaked it."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=48, block_size=16)
    prompt = _tokens(5 * CHUNK)
    src, dst = list(range(20)), list(range(24, 44))
    config = EngineConfig(
        chunk_size=CHUNK, l1_size="16MiB", l2_path=str(tmp_path / "l2"), l2_durability="none"
    )
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(prompt[: 3 * CHUNK], src) == 3 * CHUNK
        await engine.flush()
        await engine.evict_l1()
        assert await engine.lookup(prompt) == 3 * CHUNK
        assert await engine.store(prompt, src) == 2 * CHUNK
        await engine.flush()
        assert await engine.lookup(prompt[: 4 * CHUNK]) == 4 * CHUNK
        # The least recently used unreferenced chunk is the last one (the lookups touched 0-3).
        one_chunk = engine.layout_desc().nbytes(CHUNK)
        assert await engine.evict_l1(one_chunk) == one_chunk
        reference = caches.snapshot()
        poison_blocks(caches, dst)
        expected = caches.snapshot()
        result = await engine.retrieve(prompt, dst)
        assert (result.valid_tokens, result.stop_reason) == (5 * CHUNK, "complete")
        expect_copy(caches, expected, reference, src, dst, range(5 * CHUNK), 16)
        assert caches.bytes_equal(expected)
    assert engine.leaked_on_close == 0


async def test_a_hot_prefix_served_from_l1_survives_l2_eviction_and_a_restart(
    tmp_path: Path,
) -> None:
    """A system prompt served from L1 again and again must not be the first chunk L2 evicts:
    L1 hits refresh its recency in L2, and that recency survives a restart."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=8, block_size=16)
    system = _tokens(CHUNK)
    chunk_bytes = 2 * 2 * CHUNK * 2 * 8 * 2  # layers x K/V x tokens x heads x head_size x bf16

    def config() -> EngineConfig:
        # L2 holds about 6 chunks; L1 holds them all, so the system prompt always hits in L1.
        return EngineConfig(
            chunk_size=CHUNK,
            l1_size="4MiB",
            l2_path=str(tmp_path / "l2"),
            l2_size=6 * chunk_bytes + 6 * 4096,
            l2_durability="none",
        )

    async def serve_turns(engine: TieredKVEngine, first: int, count: int) -> None:
        for turn in range(first, first + count):
            prompt = system + list(range(100_000 + turn * CHUNK, 100_000 + (turn + 1) * CHUNK))
            assert await engine.lookup(prompt) >= CHUNK  # the system prompt hits
            # Served as a request is: its hit loaded (an L2 read refreshes the file's recency).
            assert (await engine.retrieve(prompt, [0, 1, 2, 3, 4, 5, 6, 7])).valid_tokens >= CHUNK
            await engine.store(prompt, [0, 1, 2, 3, 4, 5, 6, 7])
            await engine.flush()

    async with TieredKVEngine(config()) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(system, [0, 1, 2, 3]) == CHUNK
        await engine.flush()
        await serve_turns(engine, 0, 20)  # 20 more chunks through a 6-chunk L2
    async with TieredKVEngine(config()) as engine:  # restart: L1 empty, L2 rebuilt from disk
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.lookup(system) == CHUNK, "L2 evicted the hot system prompt"
        await serve_turns(engine, 20, 20)
    async with TieredKVEngine(config()) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.lookup(system) == CHUNK, "lost after the restart"
        assert engine.stats().storage.touches_sent == 0  # nothing hit in L1 yet


async def test_close_with_calls_in_flight_keeps_what_was_reported_stored(tmp_path: Path) -> None:
    """aclose while 12 calls run: every store that reported tokens stored must be on disk after
    a reopen, calls still running at the deadline end cleanly, and no host byte leaks."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=64, block_size=16)
    config = EngineConfig(
        chunk_size=CHUNK, l1_size="16MiB", l2_path=str(tmp_path / "l2"), l2_durability="none"
    )
    prompts = [list(range(10_000 * (i + 1), 10_000 * (i + 1) + 3 * CHUNK)) for i in range(6)]
    blocks = list(range(12))
    engine = TieredKVEngine(config)
    await engine.open()
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    await engine.store(prompts[0], blocks)
    calls = [asyncio.create_task(engine.store(p, blocks)) for p in prompts[1:]]
    calls += [asyncio.create_task(engine.retrieve(prompts[0], blocks)) for _ in range(3)]
    calls += [asyncio.create_task(engine.lookup(p)) for p in prompts[:4]]
    await asyncio.sleep(0)  # every call has started and is at its first await
    await engine.aclose()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert engine.leaked_on_close == 0
    stored = [p for p, r in zip(prompts[1:], results[:5], strict=True) if r == 3 * CHUNK]
    assert stored, f"no store finished: {results[:5]}"
    assert not [r for r in results if isinstance(r, BaseException)], results
    async with TieredKVEngine(config) as reopened:
        reopened.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        for prompt in stored:
            assert await reopened.lookup(prompt) == 3 * CHUNK


async def test_calls_after_close_began_are_refused(tmp_path: Path) -> None:
    caches = make_caches("mla", torch.bfloat16)
    engine = TieredKVEngine(EngineConfig(chunk_size=CHUNK, l1_size="4MiB"))
    await engine.open()
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    closing = asyncio.create_task(engine.aclose())
    await asyncio.sleep(0)
    with pytest.raises(EngineStateError, match="clos"):
        await engine.store(_tokens(CHUNK), [0, 1, 2, 3])
    await closing


class HeldCloseTier(MemoryTier):
    """A memory tier whose `aclose` waits for ``release``: holds the engine's close there, after
    its pending writes were flushed and before its arena is freed."""

    def __init__(self) -> None:
        super().__init__("L2")
        self.closing = asyncio.Event()
        self.release = asyncio.Event()

    async def aclose(self) -> None:
        self.closing.set()
        await self.release.wait()
        await super().aclose()


async def test_stats_during_close_report_every_section_until_the_arena_is_freed() -> None:
    """A monitor scraping stats while close drains sees the arena, L1 and the flushed writes;
    once close ends only the engine's counters are left."""
    caches = make_caches("mla", torch.bfloat16, num_blocks=16)
    tier = HeldCloseTier()
    engine = TieredKVEngine(EngineConfig(chunk_size=CHUNK, l1_size="4MiB"), lower_tiers=[tier])
    with pytest.raises(EngineStateError, match="not open"):
        _ = engine.storage
    await engine.open()
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    assert await engine.store(_tokens(2 * CHUNK), list(range(8))) == 2 * CHUNK
    closing = asyncio.create_task(engine.aclose())
    try:
        await tier.closing.wait()
        stats = engine.stats()
        assert stats.arena is not None and stats.arena.used > 0  # L1 still holds the chunks
        assert stats.l1 is not None and stats.l1.entries == 2
        assert stats.storage is not None
        writes = stats.storage.tier("L2").writes
        assert writes is not None and (writes.done, writes.pending) == (2, 0)
        assert stats.engine.store_calls == 1
        with pytest.raises(EngineStateError, match="closed"):
            _ = engine.storage  # the engine's verbs and hooks are refused from close on
    finally:
        tier.release.set()
        await closing
    stats = engine.stats()
    assert (stats.arena, stats.l1, stats.storage) == (None, None, None)
    assert stats.engine.store_calls == 1
    assert engine.leaked_on_close == 0


async def test_calls_refused_for_their_arguments_are_not_counted() -> None:
    """Every verb counts the calls whose arguments it accepted: a bad salt (or a prefetch
    handle of other tokens) is refused before any counter moves."""
    caches = make_caches("mla", torch.bfloat16, num_blocks=16)
    tokens, other = _tokens(CHUNK), list(range(CHUNK))
    async with TieredKVEngine(EngineConfig(chunk_size=CHUNK, l1_size="4MiB")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(tokens, [0, 1, 2, 3]) == CHUNK
        before = engine.stats().engine
        bad = b"not a KeySalt"
        refused = [
            engine.store(tokens, [0, 1, 2, 3], salt=bad),  # type: ignore[arg-type]
            engine.lookup(tokens, salt=bad),  # type: ignore[arg-type]
            engine.prefetch(tokens, salt=bad),  # type: ignore[arg-type]
            engine.retrieve(tokens, [4, 5, 6, 7], salt=bad),  # type: ignore[arg-type]
            engine.retrieve_layerwise(tokens, [4, 5, 6, 7], salt=bad),  # type: ignore[arg-type]
            engine.store_layerwise(tokens, [4, 5, 6, 7], salt=bad),  # type: ignore[arg-type]
        ]
        for call in refused:
            with pytest.raises(TypeError, match="salt"):
                await call
        handle = await engine.prefetch(tokens)  # chunk 0 of ``tokens``, in L1
        with pytest.raises(LayoutError, match="other tokens"):
            await engine.retrieve(other, [4, 5, 6, 7], prefetch=handle)
        after = engine.stats().engine
        assert after == dataclasses.replace(before, prefetch_calls=before.prefetch_calls + 1)
        result = await engine.retrieve(tokens, [4, 5, 6, 7])
        assert result.valid_tokens == CHUNK
        assert engine.stats().engine.retrieve_calls == before.retrieve_calls + 1


@pytest.mark.parametrize(
    ("block_ids", "fragment"),
    [
        (None, "block_ids"),
        ([0, 1, 40.5, 3], "block_ids[2]"),
        (["0", "1", "2", "3"], "block_ids[0]"),
        ([0, True, 2, 3], "block_ids[1]"),
        ("0123", "block_ids"),
        (torch.tensor([0.0, 1.0, 2.0, 3.0]), "float"),
        (torch.tensor([True, False, True, True]), "bool"),
        (torch.zeros(2, 2, dtype=torch.long), "shape"),
    ],
)
async def test_block_ids_that_are_not_ints_are_refused(block_ids: object, fragment: str) -> None:
    caches = make_caches("mla", torch.bfloat16, num_blocks=16)
    async with TieredKVEngine(EngineConfig(chunk_size=CHUNK, l1_size="4MiB")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        for call in (engine.store, engine.retrieve):
            with pytest.raises(LayoutError, match=re.escape(fragment)):
                await call(_tokens(CHUNK), block_ids)  # type: ignore[operator]
        assert engine.stats().arena.used == 0


async def test_integer_block_ids_of_every_kind_are_accepted() -> None:
    np = pytest.importorskip("numpy")  # NumPy is optional; its integers must work when present
    caches = make_caches("mla", torch.bfloat16, num_blocks=16)
    async with TieredKVEngine(EngineConfig(chunk_size=CHUNK, l1_size="4MiB")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        tokens = _tokens(CHUNK)
        kinds = (
            [0, 1, 2, 3],
            (0, 1, 2, 3),
            range(4),
            torch.arange(4),
            torch.arange(4, dtype=torch.int32),
            np.arange(4),
            [np.int64(i) for i in range(4)],
        )
        for ids in kinds:
            assert (await engine.retrieve(tokens, ids)).valid_tokens in (0, CHUNK)
        assert await engine.store(tokens, torch.arange(4)) == CHUNK
        assert (await engine.retrieve(tokens, np.arange(4, 8))).valid_tokens == CHUNK


@pytest.mark.parametrize("skip", [64.0, None, "64", True, 1.5])
async def test_skip_prefix_tokens_that_is_not_an_int_is_refused(skip: object) -> None:
    caches = make_caches("mla", torch.bfloat16, num_blocks=16)
    async with TieredKVEngine(EngineConfig(chunk_size=CHUNK, l1_size="4MiB")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        with pytest.raises(LayoutError, match="skip_prefix_tokens"):
            await engine.retrieve(_tokens(CHUNK), [0, 1, 2, 3], skip_prefix_tokens=skip)  # type: ignore[arg-type]


@pytest.mark.parametrize("token_ids", [bytes(256), bytearray(256), memoryview(bytes(256)), "ab"])
async def test_byte_strings_as_token_ids_are_refused(token_ids: object) -> None:
    """bytes were counted as one token per byte but hashed as packed uint32 ids: store said 256
    tokens and retrieve then failed inside the mover."""
    caches = make_caches("mla", torch.bfloat16, num_blocks=32)
    async with TieredKVEngine(EngineConfig(chunk_size=CHUNK, l1_size="4MiB")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        for call in (engine.lookup, engine.prefetch):
            with pytest.raises(LayoutError, match="ambiguous"):
                await call(token_ids)  # type: ignore[operator]
        with pytest.raises(LayoutError, match="ambiguous"):
            await engine.store(token_ids, list(range(16)))  # type: ignore[arg-type]
