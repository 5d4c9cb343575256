"""L1's write_back eviction hook. The StorageManager and PrefetchController built from their
parts (location across tiers, demotions, queues, reads into L1) are in test_control_plane.py."""

from __future__ import annotations

import torch

from tests.kvfactory import make_caches
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.keys import ChunkKey

TOKENS = list(range(1000, 1100))
SRC = list(range(7))


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
