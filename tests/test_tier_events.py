"""Tier events (`TierEventLog`, `TieredKVEngine.watch_tiers`): chunks stored into and removed
from each tier, as a router's KV events are made from them (tests/vllm/test_vllm_events.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.kvfactory import make_caches
from tests.remote_fixtures import BLOCK, CHUNK, tkv_server, tokens_for  # noqa: F401
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.keys import ChunkKey
from tiered_kv.tiers.base import TierEvent, TierEventLog
from tiered_kv.tiers.remote.server import RemoteCacheServer


def _kinds(events: list[TierEvent]) -> list[tuple[str, str, ChunkKey, int]]:
    return [(e.kind, e.tier, e.key, e.num_tokens) for e in events]


def test_the_log_is_bounded_drops_the_oldest_and_counts_them() -> None:
    log = TierEventLog(capacity=2)
    keys = [ChunkKey.from_bytes(k) for k in _some_key_bytes(3)]
    for key in keys:
        log.emit("stored", "L1", key, 32)
    assert len(log) == 2 and log.dropped == 1 and log.emitted == 3
    assert [e.key for e in log.drain()] == keys[1:]
    assert log.drain() == [] and len(log) == 0
    with pytest.raises(ValueError, match="capacity"):
        TierEventLog(capacity=0)


async def test_stores_and_evictions_of_every_tier_are_events(
    tkv_server: RemoteCacheServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    caches = make_caches("vllm_nhd", torch.float16, num_blocks=32, block_size=BLOCK)
    tokens = tokens_for(3 * CHUNK + BLOCK, seed=3)  # three whole chunks and a partial one
    config = EngineConfig(
        chunk_size=CHUNK, l1_size="8MiB", l2_path=str(tmp_path), l2_durability="none",
        l3_url=tkv_server.url,
    )  # fmt: skip
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        keys = engine.chunk_keys(tokens)
        sizes = [CHUNK, CHUNK, CHUNK, BLOCK]
        unwatched = tokens_for(CHUNK, seed=4)
        await engine.store(unwatched, [1, 2])  # before anyone watches: no events, ever
        assert await engine.flush(timeout=30) == 0
        log = engine.watch_tiers()
        blocks = list(range(3, 3 + -(-len(tokens) // BLOCK)))
        assert await engine.store(tokens, blocks) == len(tokens)
        assert await engine.flush(timeout=30) == 0
        events = _kinds(log.drain())
        for tier in ("L1", "L2", "L3"):
            stored = [(k, n) for kind, t, k, n in events if kind == "stored" and t == tier]
            expected = list(zip(keys, sizes, strict=True))
            # L1 in order; lower tiers as their writes end (two writers per tier)
            assert stored == expected if tier == "L1" else set(stored) == set(expected)
        assert all(kind == "stored" for kind, *_ in events)
        assert len(events) == 3 * len(keys)

        await engine.evict_l1()  # L1 drops the watched chunks and the one stored before
        removed = [(k, t) for kind, t, k, _ in _kinds(log.drain()) if kind == "removed"]
        assert {k for k, t in removed if t == "L1"} >= set(keys)
        assert {t for _, t in removed} == {"L1"}

        # The remote store loses a chunk behind the engine's back: a lookup learns it.
        tkv_server.store.clear()
        await engine.evict_l1()
        l2 = next(t for t in engine.storage.lower if t.name == "L2")
        assert await l2.remove(keys[0])  # L2 drops one (as its eviction would)
        assert await engine.lookup(tokens) == 0  # L2 has no first chunk, L3 nothing
        later = _kinds(log.drain())
        assert ("removed", "L2", keys[0], 0) in later
        assert ("removed", "L3", keys[0], 0) in later


async def test_l2_eviction_for_room_is_announced(tmp_path: Path) -> None:
    caches = make_caches("vllm_nhd", torch.float16, num_blocks=32, block_size=BLOCK)
    first, second = tokens_for(2 * CHUNK, seed=5), tokens_for(2 * CHUNK, seed=6)
    probe = EngineConfig(chunk_size=CHUNK, l1_size="8MiB")
    async with TieredKVEngine(probe) as engine:
        desc = engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    frame = desc.nbytes(CHUNK) + 4096  # a chunk's file: its payload and a header page
    config = EngineConfig(
        chunk_size=CHUNK, l1_size="8MiB", l2_path=str(tmp_path), l2_durability="none",
        l2_size=3 * frame + 100,
    )  # fmt: skip
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        first_keys = engine.chunk_keys(first)
        log = engine.watch_tiers()
        await engine.store(first, [1, 2, 3, 4])
        await engine.flush(timeout=30)
        await engine.store(second, [5, 6, 7, 8])
        await engine.flush(timeout=30)
        events = _kinds(log.drain())
    removed = [k for kind, tier, k, _ in events if kind == "removed" and tier == "L2"]
    assert removed and set(removed) <= set(first_keys)  # four chunks, room for three


def _some_key_bytes(count: int) -> list[bytes]:
    from tiered_kv.keys import KeyScope, chunk_keys

    scope = KeyScope("", "m", "", 1, 0, "layout")
    return [key.to_bytes() for key in chunk_keys(scope, list(range(count * 4)), 4)]
