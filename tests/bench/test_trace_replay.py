"""A trace replayed through the real engine: the hand-worked trace of test_trace_sim.py gives
LRU's figure with L1 alone and more with L2 under it, and the synthetic trace's first requests
match the LRU simulation (the engine's L1 evicts by recency)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiered_kv.benchmarks.trace_replay import replay
from tiered_kv.benchmarks.trace_sim import load_trace, simulate_lru

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake_synthetic_trace.jsonl"
TINY = [
    {"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]},
    {"timestamp": 1, "input_length": 512, "hash_ids": [3]},
    {"timestamp": 2, "input_length": 1024, "hash_ids": [1, 2]},
    {"timestamp": 3, "input_length": 1100, "hash_ids": [1, 2, 4]},
]


def _tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in TINY))
    return path


async def test_the_hand_worked_trace_through_the_engine(tmp_path: Path) -> None:
    requests = load_trace(_tiny(tmp_path))
    alone = await replay(requests, l1_blocks=2)
    # L1 alone is LRU: r2 misses (block 1 went for block 3), r3 is served 1024 tokens.
    assert (alone.prompt_tokens, alone.hit_tokens) == (3660, 1024)
    assert (alone.l1_chunks, alone.l2_chunks) == (2, 0)
    # With L2 under it, block 1 comes back from disk at r2: 1024 tokens more.
    both = await replay(requests, l1_blocks=2, l2_blocks=10, l2_dir=tmp_path / "l2")
    assert both.hit_tokens == 2048
    assert both.l2_chunks >= 1 and both.l2_writes == 4 and both.l2_writes_dropped == 0


@pytest.mark.skipif(not DATA.exists(), reason="../shared/data is not beside this checkout")
async def test_the_engine_l1_keeps_what_lru_keeps() -> None:
    requests = load_trace(DATA)[:400]
    for blocks in (250, 1000):
        ours = await replay(requests, l1_blocks=blocks)
        lru = simulate_lru(requests, blocks)
        assert ours.prompt_tokens == lru.prompt_tokens
        assert ours.hit_tokens > 0
        assert abs(ours.ratio - lru.ratio) <= 0.005, (blocks, ours.ratio, lru.ratio)
