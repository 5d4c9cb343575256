"""`TorchMover`'s CPU copies: caches whose token rows are contiguous within a block move as one
memmove per contiguous piece; every format gives the same bytes as the per-run torch copies."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tests.kvfactory import FORMATS, make_caches, random_tensor
from tiered_kv.errors import LayoutError
from tiered_kv.gpu import reference
from tiered_kv.gpu.base import ChunkTransfer
from tiered_kv.layout import KVCacheLayout, build_layout
from tiered_kv.memory import HostArena

CHUNK = 32
BLOCK = 16


def _blocks_caches(seed: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """vLLM's CPU-backend cache: [NB, NH, BS, 2 * HS] per layer, moved as whole blocks."""
    gen = torch.Generator().manual_seed(seed)
    entries = [random_tensor((16, 2, BLOCK, 16), torch.float32, gen) for _ in range(2)]
    return entries, {"format": "blocks", "block_size": BLOCK}


def _layout(fmt: str, seed: int) -> tuple[KVCacheLayout, list[torch.Tensor]]:
    if fmt == "blocks":
        entries, hints = _blocks_caches(seed)
        physical: list[Any] = entries
    else:
        caches = make_caches(fmt, torch.bfloat16, seed=seed, block_size=BLOCK)
        entries, hints, physical = caches.entries, caches.hints, caches.physical
    layout = build_layout(entries, chunk_size=CHUNK, layout_hints=hints)
    flat = [t for p in physical for t in (p if isinstance(p, tuple) else (p,))]
    return layout, flat


def _transfers(arena: HostArena, layout: KVCacheLayout, starts: list[int]) -> list[ChunkTransfer]:
    out = []
    gen = torch.Generator().manual_seed(7)
    for start in starts:
        obj = arena.allocate_obj(layout.layout_desc, CHUNK)
        assert obj is not None
        obj.raw().copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
        out.append(ChunkTransfer(obj, start))
    return out


@pytest.mark.parametrize("fmt", [*FORMATS, "blocks"])
def test_memmove_copies_match_torch_copies_for_every_format(
    fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Gather and scatter (with skipped tokens) through the memmove pieces and through the
    torch runs give identical bytes, with block tables that mix adjacent and scattered ids."""
    layout, _ = _layout(fmt, seed=1)
    rng = random.Random(fmt)
    ids = [3, 4, 5, 9, 8, 0, 1, 15]  # runs over adjacent blocks and jumps
    rng.shuffle(ids[5:])
    block_ids = torch.as_tensor(ids, dtype=torch.long)
    contiguous = fmt in ("vllm_nhd", "flashinfer_nhd", "mla", "separate", "blocks")
    runs = reference.block_runs(layout, block_ids, 0, CHUNK)
    assert all(
        (reference.contiguous_pieces(group, runs) is not None) == contiguous
        for group in layout.groups
    )
    results = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(reference, "contiguous_pieces", lambda group, runs: None)
        arena = HostArena(8 << 20, pin=False)
        layout, tensors = _layout(fmt, seed=1)
        gathered = _transfers(arena, layout, [0, CHUNK])
        for transfer in gathered:
            reference.gather_chunk(layout, block_ids, transfer)
        loads = _transfers(arena, layout, [0, CHUNK])
        skipped = ChunkTransfer(loads[1].obj, CHUNK, skip_tokens=BLOCK + 3)
        for transfer in (loads[0], skipped):
            reference.scatter_chunk(layout, block_ids, transfer)
        results.append(
            (
                [t.obj.raw().clone() for t in gathered],
                [t.view(torch.uint8).clone() for t in tensors],
            )
        )
        for transfer in (*gathered, *loads):
            transfer.obj.unref()
        assert arena.close() == 0
    (fast_host, fast_caches), (slow_host, slow_caches) = results
    assert all(torch.equal(a, b) for a, b in zip(fast_host, slow_host, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(fast_caches, slow_caches, strict=True))


def test_memmove_pieces_merge_adjacent_blocks_and_refuse_ids_out_of_range() -> None:
    layout, _ = _layout("blocks", seed=2)
    group = layout.groups[0]
    block_bytes = group.strides.block_stride * group.host.dtype.itemsize
    ids = torch.as_tensor([4, 5, 7, 6], dtype=torch.long)
    pieces = reference.contiguous_pieces(group, reference.block_runs(layout, ids, 0, 4 * BLOCK))
    # 4 and 5 are adjacent (one piece of two blocks); 7 then 6 are not.
    assert pieces == [
        (4 * block_bytes, 0, 2 * BLOCK),
        (7 * block_bytes, 2 * BLOCK, BLOCK),
        (6 * block_bytes, 3 * BLOCK, BLOCK),
    ]
    bad = torch.as_tensor([4, 16], dtype=torch.long)
    with pytest.raises(LayoutError, match="block id 16 out of range"):
        reference.contiguous_pieces(group, reference.block_runs(layout, bad, 0, 2 * BLOCK))
