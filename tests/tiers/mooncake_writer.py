"""A second engine in its own process, for the Mooncake tests: stores a prompt through
``l3_url`` (its segment holds what it puts), says ``stored``, and keeps its segment in the pool
until its stdin closes (or it is killed).

Usage: ``python -m tests.tiers.mooncake_writer L3_URL SEED NUM_TOKENS``.
"""

from __future__ import annotations

import asyncio
import sys

import torch

from tests.kvfactory import make_caches
from tests.remote_fixtures import BLOCK, CHUNK, store_and_drop_l1, tokens_for
from tiered_kv import EngineConfig, TieredKVEngine

FORMAT = ("vllm_nhd", torch.bfloat16)


async def main(url: str, seed: int, num_tokens: int) -> None:
    caches = make_caches(*FORMAT, num_blocks=24, block_size=BLOCK, seed=seed)
    tokens = tokens_for(num_tokens, seed=seed)
    config = EngineConfig(chunk_size=CHUNK, l1_size="8MiB", l3_url=url, l3_timeout_s=10.0)
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await store_and_drop_l1(engine, caches, tokens)
        stats = engine.stats().tier("L3")
        print(f"stored {stats.puts} {stats.put_failures}", flush=True)
        await asyncio.to_thread(sys.stdin.read)  # keeps the segment in the pool until EOF


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
