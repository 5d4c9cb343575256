"""StorageManager: batched location across tiers, the write_back eviction hook, demotions."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from tests.kvfactory import make_caches
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.keys import ChunkKey
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

TOKENS = list(range(1000, 1100))
SRC = list(range(7))


class _CountingTier(MemoryTier):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.asked: list[int] = []
        self.fail_contains = False

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self.asked.append(len(keys))
        if self.fail_contains:
            raise ConnectionError("remote down")
        return await super().contains_many(keys)


async def test_lookup_asks_each_lower_tier_once_for_what_l1_lacks() -> None:
    l2, l3 = _CountingTier("L2"), _CountingTier("L3")
    config = EngineConfig(chunk_size=32, l1_size="8MiB", prefetch=False)
    async with TieredKVEngine(config, lower_tiers=[l2, l3]) as engine:
        engine.register_kv_caches(make_caches("mla", torch.float16).entries, model_name="m")
        await engine.store(TOKENS, SRC)
        await engine.flush()
        keys = engine.chunk_keys(TOKENS)
        storage = engine._storage
        assert storage is not None
        storage.l1.remove(keys[2])
        storage.l1.remove(keys[3])
        await l2.remove(keys[3])  # chunk 3 only in L3
        assert await engine.lookup(TOKENS) == 100
        assert (l2.asked, l3.asked) == ([2], [1])  # one round trip each, only missing keys
        assert await storage.locate(keys) == [-1, -1, 0, 1]
        # A broken remote index is a miss, not an error.
        l3.fail_contains = True
        assert await engine.lookup(TOKENS) == 96
        assert engine.stats()["storage"]["l3_read_failures"] == 1


async def test_a_chunk_being_demoted_can_be_stored_again_and_read() -> None:
    inner = MemoryTier()
    tier = FaultyTier(inner)
    config = EngineConfig(chunk_size=32, l1_size="8MiB", write_policy="write_back")
    async with TieredKVEngine(config, lower_tiers=[tier]) as engine:
        engine.register_kv_caches(make_caches("mla", torch.float16).entries, model_name="m")
        await engine.store(TOKENS, SRC)
        tier.gate = asyncio.Event()
        await engine.evict_l1()
        storage = engine._storage
        assert storage is not None
        assert storage.tier_of(engine.chunk_keys(TOKENS)[0]) == "L1"  # readable while demoting
        assert await engine.store(TOKENS, SRC) == 0  # present: nothing stored twice
        tier.gate.set()
        await engine.flush()
        assert inner.stats().entries == 4 and storage.stats().demoting == 0
        await engine.evict_l1()
        assert engine.stats()["arena"]["used"] == 0


def test_l1_evicts_clean_chunks_before_dirty_ones_and_honours_a_refusal() -> None:
    from tiered_kv.memory import HostArena
    from tiered_kv.tiers.l1 import L1Tier

    engine = TieredKVEngine(EngineConfig(chunk_size=32))
    desc = engine.register_kv_caches(make_caches("mla", torch.float16).entries, model_name="m")
    keys = engine.chunk_keys(list(range(128)))
    nbytes = desc.nbytes(32)
    refused: list[ChunkKey] = []

    def hook(key: ChunkKey, obj: object) -> bool:
        if key == keys[0]:
            refused.append(key)
            return False
        return True

    tier = L1Tier(HostArena(4 * ((nbytes + 255) // 256 * 256), pin=False), on_evict=hook)
    for key in keys:
        obj = tier.allocate(desc, 32)
        assert obj is not None
        assert tier.commit(key, obj)
        obj.unref()
    tier.mark_dirty(keys[0])  # least recently used, but dirty
    tier.mark_dirty(keys[1])
    assert tier.evict_unreferenced(nbytes) == nbytes
    assert not tier.contains(keys[2]) and tier.contains(keys[0])  # clean LRU went first
    assert tier.evict_unreferenced() == 2 * nbytes  # keys[0] refused, keys[3] and keys[1] go
    assert tier.contains(keys[0]) and len(tier) == 1 and refused == [keys[0]]
    assert tier.stats().evictions_refused == 1 and tier.stats().dirty == 1
    tier.clear()
    assert tier.arena.close() == 0
