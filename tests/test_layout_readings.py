"""Layouts are read, never guessed: every input either round-trips bit-exact or is refused.

The property test builds random physical caches of every format from the physical layouts
tiered_kv documents, hands them over as the physical tensor or as any permutation of the leading
dims, with any subset of truthful hints, and checks that registration either raises
`LayoutError` or the cache round-trips store → evict → retrieve into other blocks exactly (whole
caches compared, destination blocks poisoned first, untouched slots checked). The oracle
addresses tokens through the physical layout the test built, never through `tiered_kv.layout`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import tempfile
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.kvfactory import random_tensor
from tiered_kv import EngineConfig, SyncTieredKVEngine
from tiered_kv.errors import LayoutError
from tiered_kv.gpu.base import KVMover
from tiered_kv.gpu.dispatch import DeviceMover
from tiered_kv.layout import build_layout

POISON = 0xA5
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.float8_e4m3fn)

# Physical layouts, roles outermost first (what docs/layouts.md promises to read).
TEMPLATES: dict[str, tuple[tuple[str, ...], ...]] = {
    "vllm": (("kv", "block", "pos", "head", "elem"), ("kv", "block", "head", "pos", "elem")),
    "flashinfer": (("block", "kv", "pos", "head", "elem"), ("block", "kv", "head", "pos", "elem")),
    "mla": (("block", "pos", "elem"),),
    "separate": (("block", "pos", "head", "elem"), ("block", "head", "pos", "elem")),
    "fused": (("block", "pos", "head", "elem"), ("block", "head", "pos", "elem")),
}


@dataclasses.dataclass
class Physical:
    """One layer's cache: the allocation that owns the bytes, and how to address a token."""

    family: str
    roles: tuple[str, ...]  # of `tensor`'s dims, outermost first
    storages: tuple[torch.Tensor, ...]  # whole allocations (compared byte for byte)
    tensors: tuple[torch.Tensor, ...]  # the physical cache(s), possibly padded views
    head_size: int

    def token(self, tensors: tuple[torch.Tensor, ...], kv: int, block: int, pos: int) -> Any:
        """The bytes of one token's K or V (or latent) row, as a view into ``tensors``."""
        tensor = tensors[kv] if self.family == "separate" else tensors[0]
        fixed = {"kv": kv, "block": block, "pos": pos}
        row = tensor[tuple(fixed.get(role, slice(None)) for role in self.roles)]
        if self.family == "fused":
            row = row[..., kv * self.head_size : (kv + 1) * self.head_size]
        return row


@dataclasses.dataclass
class Case:
    family: str
    layers: list[Physical]
    entries: list[Any]
    hints: dict[str, Any]
    block_size: int
    num_blocks: int
    kv_count: int


@st.composite
def cases(draw: st.DrawFn, device: str = "cpu") -> Case:
    family = draw(st.sampled_from([*TEMPLATES, "blocks"]))
    # Small sizes drawn from one pool, so that coincidences (NH == BS, NB == 2, BS == 2, a
    # size-1 dim) are frequent.
    size = st.sampled_from([1, 2, 2, 3, 4, 4])
    num_blocks = draw(st.sampled_from([2, 3, 4, 6]))
    block_size = draw(size)
    heads = draw(size)
    head_size = draw(st.sampled_from([1, 2, 4, 8]))
    dtype = draw(st.sampled_from(DTYPES))
    padded = draw(st.booleans())  # blocks further apart than their size (cross-layer caches)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if family == "blocks":
        inner = draw(st.permutations([heads, block_size, 2 * head_size]))
        roles: tuple[str, ...] = ("block", "i0", "i1", "i2")
        shape = (num_blocks, *inner)
    else:
        roles = draw(st.sampled_from(TEMPLATES[family]))
        sizes = {"kv": 2, "block": num_blocks, "pos": block_size, "head": heads}
        sizes["elem"] = {"mla": heads * head_size, "fused": 2 * head_size}.get(family, head_size)
        shape = tuple(sizes[r] for r in roles)
    if family == "blocks":
        # The format names presented dim 0 as the blocks; the block's inner dims may come in any
        # order (their bytes are moved as one range).
        perm = (0, *draw(st.permutations(range(1, len(shape)))))
    else:
        perm = (*draw(st.permutations(range(len(shape) - 1))), len(shape) - 1)
    layers, entries = [], []
    for _ in range(2):
        count = 2 if family == "separate" else 1
        storages, tensors = [], []
        for _ in range(count):
            if padded:
                at = roles.index("block") + 1
                storage = random_tensor((*shape[:at], 2, *shape[at:]), dtype, gen, device)
                tensor = storage.select(at, 0)
            else:
                storage = tensor = random_tensor(shape, dtype, gen, device)
            storages.append(storage)
            tensors.append(tensor)
        layers.append(Physical(family, roles, tuple(storages), tuple(tensors), head_size))
        views = tuple(t.permute(perm) for t in tensors)
        entries.append(views if family == "separate" else views[0])
    hints: dict[str, Any] = {}
    if family == "blocks":
        hints = {"format": "blocks", "block_size": block_size}
    else:
        presented = [roles[p] for p in perm]
        if draw(st.booleans()):
            hints["block_size"] = block_size
        if "head" in roles and draw(st.booleans()):
            hints["kv_layout"] = "NHD" if roles.index("pos") < roles.index("head") else "HND"
        if draw(st.booleans()):
            if family in ("vllm", "flashinfer"):
                lead = tuple(presented[:2])
                named = {("kv", "block"): "vllm", ("block", "kv"): "flashinfer"}.get(lead)
                if named is not None:
                    hints["format"] = named
            else:
                hints["format"] = family
    kv_count = 1 if family in ("mla", "blocks") else 2
    return Case(family, layers, entries, hints, block_size, num_blocks, kv_count)


def expected_after_retrieve(
    case: Case,
    snapshot: list[tuple[torch.Tensor, ...]],
    src: list[int],
    dst: list[int],
    tokens: range,
) -> list[tuple[torch.Tensor, ...]]:
    """The caches after ``tokens`` are copied from ``src`` blocks to ``dst`` blocks."""
    expected = []
    for layer, storages in zip(case.layers, snapshot, strict=True):
        copies = tuple(s.clone() for s in storages)
        # Address the copies through the same views the layer's tensors are of its storages.
        views = tuple(
            torch.as_strided(c, t.shape, t.stride(), t.storage_offset())
            for c, t in zip(copies, layer.tensors, strict=True)
        )
        sources = tuple(
            torch.as_strided(s, t.shape, t.stride(), t.storage_offset())
            for s, t in zip(storages, layer.tensors, strict=True)
        )
        bs = case.block_size
        for t in tokens:
            b, p = t // bs, t % bs
            if case.family == "blocks":
                if p == 0:
                    views[0][dst[b]].copy_(sources[0][src[b]])
                continue
            for kv in range(case.kv_count):
                layer.token(views, kv, dst[b], p).copy_(layer.token(sources, kv, src[b], p))
        expected.append(copies)
    return expected


def poison(case: Case, blocks: list[int]) -> None:
    for layer in case.layers:
        for b in blocks:
            if case.family == "blocks":
                layer.tensors[0][b].view(torch.uint8).fill_(POISON)
                continue
            for kv, p in itertools.product(range(case.kv_count), range(case.block_size)):
                layer.token(layer.tensors, kv, b, p).view(torch.uint8).fill_(POISON)


def snapshot(case: Case) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(s.clone() for s in layer.storages) for layer in case.layers]


def same_bytes(case: Case, expected: list[tuple[torch.Tensor, ...]]) -> bool:
    return all(
        torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))
        for layer, storages in zip(case.layers, expected, strict=True)
        for mine, theirs in zip(layer.storages, storages, strict=True)
    )


SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@settings(SETTINGS, max_examples=300)
@given(case=cases(), data=st.data())
@pytest.mark.slow
def test_every_input_round_trips_exactly_or_is_refused(case: Case, data: st.DataObject) -> None:
    round_trip_or_refusal(case, data, mover=None)


@pytest.mark.gpu
@settings(SETTINGS, max_examples=150)
@given(case=cases(device="cuda"), data=st.data())
def test_every_input_round_trips_exactly_or_is_refused_on_the_gpu(
    case: Case, data: st.DataObject
) -> None:
    """The same on CUDA caches through `CudaMover`, on each of its paths."""
    path = data.draw(st.sampled_from(["auto", "staging", "mapped", "dma"]))
    round_trip_or_refusal(case, data, mover=DeviceMover(cuda_path=path))


def round_trip_or_refusal(case: Case, data: st.DataObject, mover: KVMover | None) -> None:
    bs = case.block_size
    if case.family == "blocks":
        chunk = bs * data.draw(st.integers(1, 3))
    else:
        chunk = data.draw(st.integers(1, 8))
    half = case.num_blocks // 2
    num_tokens = data.draw(st.integers(1, half * bs))
    order = data.draw(st.permutations(range(case.num_blocks)))
    needed = math.ceil(num_tokens / bs)
    src, dst = list(order[:needed]), list(order[half : half + needed])
    multiple = bs if case.family == "blocks" else 1
    usable = num_tokens - num_tokens % multiple
    skip = multiple * data.draw(st.integers(0, usable // multiple))
    tokens = data.draw(st.lists(st.integers(0, 50_000), min_size=num_tokens, max_size=num_tokens))
    with tempfile.TemporaryDirectory() as tmp:
        config = EngineConfig(chunk_size=chunk, l1_size="4MiB", l2_path=tmp, l2_durability="none")
        with SyncTieredKVEngine(config, mover=mover) as engine:
            try:
                engine.register_kv_caches(case.entries, model_name="m", layout_hints=case.hints)
            except LayoutError:
                event(f"{case.family}: refused at registration")
                return
            event(f"{case.family}: read")
            assert engine.store(tokens, src) == usable
            assert engine.flush(timeout=30) == 0
            engine.evict_l1()
            assert engine.lookup(tokens) == usable
            poison(case, dst)
            poisoned = snapshot(case)
            assert engine.retrieve(tokens, dst, skip_prefix_tokens=skip).valid_tokens == usable
            if case.layers[0].tensors[0].is_cuda:
                torch.cuda.synchronize()
    # Whole allocations compared: the copied slots, the poison left in every other destination
    # slot, the source blocks and any padding between blocks.
    assert same_bytes(case, expected_after_retrieve(case, poisoned, src, dst, range(skip, usable)))


# -- the two failures the issue reported, as a new user hit them --------------------------------
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", [16, 2])
def test_vllm_hnd_view_with_hnd_hint_round_trips(heads: int, device: str) -> None:
    """vLLM with VLLM_KV_CACHE_LAYOUT=HND hands over the NHD-ordered view of HND memory, and
    LMCache-style callers pass kv_layout='HND' with it. Before the fix: with 16 heads the last
    partial block came back wrong and slots outside the request were written; with 2 heads
    store raised (block_size read as 2)."""
    nb, bs, hs = 8, 16, 32
    gen = torch.Generator().manual_seed(heads)
    physical = [torch.randn(2, nb, heads, bs, hs, generator=gen).to(device) for _ in range(2)]
    view = [p.permute(0, 1, 3, 2, 4) for p in physical]
    tokens = list(range(40))
    config = EngineConfig(chunk_size=32, l1_size="16MiB")
    with SyncTieredKVEngine(config) as engine:
        engine.register_kv_caches(view, model_name="m", layout_hints={"kv_layout": "HND"})
        assert engine.store(tokens, [0, 1, 2]) == 40
        _sync(device)
        for p in physical:
            p[:, 5:8] = 0
        reference = [p.clone() for p in physical]
        assert engine.retrieve(tokens, [5, 6, 7]).valid_tokens == 40
        _sync(device)
    for p, ref in zip(physical, reference, strict=True):
        for src, dst in ((0, 5), (1, 6)):
            assert torch.equal(p[:, dst], p[:, src])  # whole blocks
        assert torch.equal(p[:, 7, :, :8], p[:, 2, :, :8])  # the 8 tokens of the partial block
        assert torch.equal(p[:, 7, :, 8:], ref[:, 7, :, 8:])  # the rest of it untouched
        assert not p[:, 7, :, 8:].any()
        rest = [b for b in range(nb) if b not in (5, 6, 7)]
        assert torch.equal(p[:, rest], ref[:, rest])


@pytest.mark.parametrize("device", DEVICES)
def test_whole_block_caches_round_trip_and_refuse_partial_blocks(device: str) -> None:
    """vLLM 0.32's CPU backend layout: per layer [NB, NH, BS, 2*HS] with K stored transposed
    inside each block, so only whole blocks may move. A partial last block is not stored."""
    nb, nh, bs, hs = 10, 2, 16, 32
    gen = torch.Generator().manual_seed(3)
    caches = [torch.randn(nb, nh, bs, 2 * hs, generator=gen).to(device) for _ in range(3)]
    hints = {"format": "blocks", "block_size": bs}
    tokens = list(range(1000, 1072))  # 4.5 blocks
    config = EngineConfig(chunk_size=32, l1_size="16MiB")
    with SyncTieredKVEngine(config) as engine:
        desc = engine.register_kv_caches(caches, model_name="m", layout_hints=hints)
        assert desc.token_multiple == bs
        assert engine.store(tokens, [0, 1, 2, 3, 4]) == 64
        _sync(device)
        assert engine.lookup(tokens) == 64
        for c in caches:
            c[5:].fill_(7.0)
        reference = [c.clone() for c in caches]
        with pytest.raises(LayoutError, match="whole number of blocks"):
            engine.retrieve(tokens, [5, 6, 7, 8, 9], skip_prefix_tokens=8)
        assert engine.retrieve(tokens, [5, 6, 7, 8, 9], skip_prefix_tokens=16).valid_tokens == 64
        _sync(device)
        for c, ref in zip(caches, reference, strict=True):
            assert torch.equal(c[6:9], c[1:4])
            assert torch.equal(c[5], ref[5])  # skipped block untouched
            assert torch.equal(c[9], ref[9])  # the partial block is never loaded
    config = EngineConfig(chunk_size=24, l1_size="16MiB")
    with SyncTieredKVEngine(config) as engine, pytest.raises(LayoutError, match="whole number"):
        engine.register_kv_caches(caches, model_name="m", layout_hints=hints)


def test_kv_layout_read_as_memory_order_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """The HND hint with vLLM's NHD-ordered view is what LMCache-style callers mean: read as the
    memory order, and said once (not once per layer or per registration)."""
    physical = [torch.zeros(2, 9, 5, 7, 8) for _ in range(3)]  # sizes no other test uses
    view = [p.permute(0, 1, 3, 2, 4) for p in physical]
    caplog.set_level(logging.INFO, logger="tiered_kv.layout")
    for _ in range(2):
        layout = build_layout(view, chunk_size=16, layout_hints={"kv_layout": "HND"})
        assert (layout.block_size, layout.groups[0].strides.num_heads) == (7, 5)
    lines = [r.getMessage() for r in caplog.records if "names the memory order" in r.message]
    assert len(lines) == 1
    assert "(2, 9, 7, 5, 8)" in lines[0] and "block_size=7" in lines[0]
    caplog.clear()
    build_layout(physical, chunk_size=16, layout_hints={"kv_layout": "HND"})  # shape in HND order
    assert not [r for r in caplog.records if "names the memory order" in r.getMessage()]
