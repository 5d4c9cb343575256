"""Bit-exact store → (evict L1) → retrieve through the engine, for every format and dtype."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.kvfactory import (
    DTYPES,
    FORMATS,
    KVCaches,
    expect_copy,
    make_caches,
    poison_blocks,
)
from tiered_kv import EngineConfig, TieredKVEngine

CHUNK = 32
BLOCK = 16


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=gen).tolist()


def _config(tmp_path: Path, **kw: object) -> EngineConfig:
    return EngineConfig(
        chunk_size=CHUNK, l1_size="16MiB", l2_path=str(tmp_path / "l2"), l2_durability="none", **kw
    )


@pytest.mark.parametrize("num_tokens", [64, 80])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", FORMATS)
async def test_store_evict_retrieve_bit_exact(
    tmp_path: Path, fmt: str, dtype_name: str, num_tokens: int
) -> None:
    blocks_per_req = math.ceil(num_tokens / BLOCK)
    caches = make_caches(
        fmt,
        DTYPES[dtype_name],
        num_blocks=2 * blocks_per_req + 2,
        block_size=BLOCK,
        seed=num_tokens,
    )
    src_blocks = list(range(1, 1 + blocks_per_req))
    dst_blocks = [2 * blocks_per_req + 1 - i for i in range(blocks_per_req)]  # reversed order
    tokens = _tokens(num_tokens, seed=7)
    async with TieredKVEngine(_config(tmp_path)) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(tokens, src_blocks) == num_tokens
        assert await engine.store(tokens, src_blocks) == 0  # already cached
        assert await engine.flush(timeout=30) == 0
        assert await engine.evict_l1() > 0
        assert await engine.lookup(tokens) == num_tokens
        reference = caches.snapshot()
        for skip in (0, 16, 40, num_tokens):
            poison_blocks(caches, dst_blocks)
            expected = caches.snapshot()
            got = (await engine.retrieve(tokens, dst_blocks, skip_prefix_tokens=skip)).valid_tokens
            assert got == num_tokens
            expect_copy(
                caches,
                expected,
                reference,
                src_blocks,
                dst_blocks,
                range(skip, num_tokens),
                BLOCK,
            )
            assert caches.bytes_equal(expected), f"skip={skip}"
        stats = engine.stats()
        assert stats.storage.tier("L2").reads.hits >= math.ceil(num_tokens / CHUNK)
    assert stats.arena.used > 0  # chunks were promoted back into L1


async def test_heterogeneous_groups_incl_132_byte_int8_rows(tmp_path: Path) -> None:
    attn = make_caches("vllm_nhd", torch.bfloat16, num_layers=3, num_blocks=12, seed=1)
    indexer = make_caches("mla", torch.int8, num_layers=2, num_blocks=12, mla_width=132, seed=2)
    entries = {
        "attn.0": attn.entries[0],
        "indexer.0": indexer.entries[0],
        "attn.1": attn.entries[1],
        "indexer.1": indexer.entries[1],
        "attn.2": attn.entries[2],
    }
    tokens = _tokens(70, seed=3)
    src, dst = [0, 1, 2, 3, 4], [11, 10, 9, 8, 7]
    async with TieredKVEngine(_config(tmp_path)) as engine:
        desc = engine.register_kv_caches(entries, model_name="hetero", layout_hints=attn.hints)
        assert [g.row_bytes for g in desc.groups] == [2 * 8 * 2, 132]
        assert [g.num_layers for g in desc.groups] == [3, 2]
        assert await engine.store(tokens, src) == 70
        await engine.flush()
        await engine.evict_l1()
        ref_a, ref_i = attn.snapshot(), indexer.snapshot()
        poison_blocks(attn, dst)
        poison_blocks(indexer, dst)
        exp_a, exp_i = attn.snapshot(), indexer.snapshot()
        assert (await engine.retrieve(tokens, dst, skip_prefix_tokens=5)).valid_tokens == 70
        expect_copy(attn, exp_a, ref_a, src, dst, range(5, 70), 16)
        expect_copy(indexer, exp_i, ref_i, src, dst, range(5, 70), 16)
        assert attn.bytes_equal(exp_a)
        assert indexer.bytes_equal(exp_i)


async def _store_and_close(
    tmp_path: Path, caches: KVCaches, tokens: list[int], src: list[int]
) -> int:
    """An engine on ``tmp_path``'s L2 stores ``tokens`` from blocks ``src``, then closes (flushing
    its writes to L2); how many tokens it stored."""
    async with TieredKVEngine(_config(tmp_path)) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        return await engine.store(tokens, src)


async def test_restart_recovers_from_l2(tmp_path: Path) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16, seed=4)
    tokens = _tokens(100, seed=5)
    src, dst = list(range(7)), list(range(8, 15))
    assert await _store_and_close(tmp_path, caches, tokens, src) == 100
    # A new engine (as after a process restart) finds the chunks on disk.
    reference = caches.snapshot()
    poison_blocks(caches, dst)
    expected = caches.snapshot()
    async with TieredKVEngine(_config(tmp_path)) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.lookup(tokens) == 100
        assert (await engine.retrieve(tokens, dst)).valid_tokens == 100
        assert engine.stats().storage.tier("L2").reads.hits == 4
    expect_copy(caches, expected, reference, src, dst, range(100), 16)
    assert caches.bytes_equal(expected)


async def test_corrupt_l2_file_is_a_miss_never_wrong_data(tmp_path: Path) -> None:
    caches = make_caches("flashinfer_nhd", torch.float16, num_blocks=16, seed=6)
    tokens = _tokens(96, seed=8)
    src, dst = list(range(6)), list(range(8, 14))
    await _store_and_close(tmp_path, caches, tokens, src)
    files = sorted(p for p in (tmp_path / "l2").rglob("*") if p.is_file() and p.name != ".lock")
    assert len(files) == 3
    # Flip one payload byte in the second chunk's file (its key is the 2nd in the prefix chain).
    keys_by_name = {p.name: p for p in files}
    async with TieredKVEngine(_config(tmp_path)) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        second = keys_by_name[engine.chunk_keys(tokens)[1].hex]
        data = bytearray(second.read_bytes())
        data[-10] ^= 0xFF
        second.write_bytes(bytes(data))
        poison_blocks(caches, dst)
        before = caches.snapshot()
        reference = caches.snapshot()
        got = (await engine.retrieve(tokens, dst)).valid_tokens
        assert got == CHUNK  # only the first chunk: the corrupt second ends the prefix
        assert not second.exists()  # quarantined
        assert engine.stats().tier("L2").corrupt_removed == 1
    expect_copy(caches, before, reference, src, dst, range(CHUNK), 16)
    assert caches.bytes_equal(before)
