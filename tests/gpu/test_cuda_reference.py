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
        assert engine.stats().arena.pinned == 1
        assert await engine.store(tokens, src) == num_tokens
        await engine.flush()
        await engine.evict_l1()
        reference = caches.snapshot()
        for skip in (0, 40):
            poison_blocks(caches, dst)
            expected = caches.snapshot()
            assert (
                await engine.retrieve(tokens, dst, skip_prefix_tokens=skip)
            ).valid_tokens == num_tokens
            torch.cuda.synchronize()
            expect_copy(caches, expected, reference, src, dst, range(skip, num_tokens), block)
            assert caches.bytes_equal(expected)


def test_pinned_arena_over_2gib_is_registered_not_rounded_up() -> None:
    from tiered_kv.memory import HostArena

    capacity = 3 * 2**30 + 5 * 4096  # not a power of two
    arena = HostArena(capacity, pin=True)
    try:
        assert arena.pinned and arena.capacity == capacity
        assert arena.base_ptr % 4096 == 0
        offset = 2**31 + 4096  # past the 2 GiB mark
        view = arena.view(offset, 1 << 20)
        # torch's is_pinned() only knows its own allocator; ask CUDA about the registration.
        from cuda.bindings import runtime

        err, attrs = runtime.cudaPointerGetAttributes(view.data_ptr())
        assert err == runtime.cudaError_t.cudaSuccess
        assert attrs.type == runtime.cudaMemoryType.cudaMemoryTypeHost
        pattern = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
        view.copy_(pattern, non_blocking=True)
        torch.cuda.synchronize()
        back = torch.empty_like(pattern)
        back.copy_(view, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, pattern)
    finally:
        assert arena.close() == 0
