"""The engine on CUDA KV caches with the torch reference mover and a pinned arena (GPU only)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.kvfactory import FORMATS, expect_copy, make_caches, poison_blocks
from tiered_kv import EngineConfig, TieredKVEngine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("fmt", FORMATS)
async def test_cuda_caches_round_trip_through_pinned_l1_and_l2(
    tmp_path: Path, fmt: str, dtype: torch.dtype
) -> None:
    num_tokens, block, chunk = 80, 16, 32
    per_req = math.ceil(num_tokens / block)
    caches = make_caches(fmt, dtype, num_blocks=2 * per_req + 2, seed=3, device="cuda")
    src = list(range(1, 1 + per_req))
    dst = [2 * per_req + 1 - i for i in range(per_req)]
    tokens = list(range(5, 5 + num_tokens))
    config = EngineConfig(chunk_size=chunk, l1_size="16MiB", l2_path=str(tmp_path / "l2"))
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert engine.stats()["arena"]["pinned"] == 1
        assert await engine.store(tokens, src) == num_tokens
        await engine.flush()
        await engine.evict_l1()
        reference = caches.snapshot()
        for skip in (0, 40):
            poison_blocks(caches, dst)
            expected = caches.snapshot()
            assert await engine.retrieve(tokens, dst, skip_prefix_tokens=skip) == num_tokens
            torch.cuda.synchronize()
            expect_copy(caches, expected, reference, src, dst, range(skip, num_tokens), block)
            assert caches.bytes_equal(expected)
