"""KV format detection, stride descriptors, layer groups and the host MemoryLayoutDesc."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tiered_kv.errors import LayoutError, TieredKVError
from tiered_kv.layout import (
    GROUP_ALIGN,
    GroupLayout,
    KVCacheLayout,
    MemoryLayoutDesc,
    StrideDesc,
    blocks_needed,
    build_layout,
)

NB, BS, NH, HS = 5, 4, 3, 8  # all distinct and != 2, so a block_size hint alone settles a shape
CHUNK = 16


def filled(*shape: int, dtype: torch.dtype = torch.float32, start: int = 0) -> torch.Tensor:
    """A tensor whose every element is distinct (exact in float32), to check views by value."""
    numel = 1
    for dim in shape:
        numel *= dim
    return (torch.arange(numel, dtype=torch.float32) + start).to(dtype).view(shape)


def storage_view(view: torch.Tensor, strides: StrideDesc) -> torch.Tensor:
    """Rebuild ``[NB, BS, NH, HS]`` from the base pointer and the StrideDesc alone."""
    flat = torch.empty(0, dtype=view.dtype).set_(view.untyped_storage())
    return torch.as_strided(
        flat,
        (strides.num_blocks, strides.block_size, strides.num_heads, strides.head_size),
        (strides.block_stride, strides.pos_stride, strides.head_stride, 1),
        view.storage_offset(),
    )


def check_views(layout: KVCacheLayout, expected: list[tuple[torch.Tensor, ...]]) -> None:
    """Each group's views equal the expected logical tensors, alias them, and match the strides."""
    seen_layers = []
    for group in layout.groups:
        for layer, views in zip(group.layer_indices, group.kv_views, strict=True):
            seen_layers.append(layer)
            assert len(views) == len(expected[layer]) == group.host.kv_count
            for view, want in zip(views, expected[layer], strict=True):
                assert view.shape == want.shape
                assert torch.equal(view, want)
                assert view.data_ptr() == want.data_ptr()  # zero-copy
                assert torch.equal(storage_view(view, group.strides), want)
        pointers = group.kv_pointers()
        assert pointers == tuple(tuple(v.data_ptr() for v in layer) for layer in group.kv_views)
    assert sorted(seen_layers) == list(range(len(expected)))


# -- one case per format -----------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    caches: Any
    hints: dict[str, Any] | None
    fmt: str
    kv_layout: str
    strides: StrideDesc
    kv_count: int
    expected: list[tuple[torch.Tensor, ...]]


def vllm_nhd() -> Case:
    layers = [filled(2, NB, BS, NH, HS, start=i * 10_000) for i in range(3)]
    return Case(
        layers,
        {"kv_layout": "NHD"},  # without a hint BS and NH could be either of dims 2 and 3
        "vllm",
        "NHD",
        StrideDesc(NB, BS, NH, HS, BS * NH * HS, NH * HS, HS),
        2,
        [(t[0], t[1]) for t in layers],
    )


def vllm_hnd_permuted_view() -> Case:
    """`vllm_hnd_hint`'s tensors, handed over as views in NHD order: the same memory, strides and
    expected rows; the hint names the memory order, not the order of the view's shape."""
    case = vllm_hnd_hint()
    case.caches = [p.permute(0, 1, 3, 2, 4) for p in case.caches]  # [2, NB, BS, NH, HS], no copy
    assert not case.caches[0].is_contiguous()
    return case


def vllm_hnd_permuted_view_block_size_hint() -> Case:
    case = vllm_hnd_permuted_view()
    case.hints = {"block_size": BS}  # NH != BS: the size alone says which dim is positions
    return case


def vllm_hnd_hint() -> Case:
    physical = [filled(2, NB, NH, BS, HS, start=i * 10_000) for i in range(3)]
    return Case(
        physical,
        {"kv_layout": "HND"},
        "vllm",
        "HND",
        StrideDesc(NB, BS, NH, HS, NH * BS * HS, HS, BS * HS),
        2,
        [(p[0].permute(0, 2, 1, 3), p[1].permute(0, 2, 1, 3)) for p in physical],
    )


def vllm_hnd_block_size_hint() -> Case:
    case = vllm_hnd_hint()
    case.hints = {"block_size": BS}  # dims are (NH, BS): the hint says the second one is BS
    return case


def vllm_nhd_block_size_hint() -> Case:
    case = vllm_nhd()
    case.hints = {"block_size": BS}
    return case


def flashinfer_nhd() -> Case:
    layers = [filled(NB, 2, BS, NH, HS, start=i * 10_000) for i in range(2)]
    return Case(
        layers,
        {"block_size": BS},
        "flashinfer",
        "NHD",
        StrideDesc(NB, BS, NH, HS, 2 * BS * NH * HS, NH * HS, HS),
        2,
        [(t[:, 0], t[:, 1]) for t in layers],
    )


def flashinfer_hnd() -> Case:
    layers = [filled(NB, 2, NH, BS, HS, start=i * 10_000) for i in range(2)]
    return Case(
        layers,
        {"kv_layout": "hnd"},  # case-insensitive
        "flashinfer",
        "HND",
        StrideDesc(NB, BS, NH, HS, 2 * NH * BS * HS, HS, BS * HS),
        2,
        [(t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3)) for t in layers],
    )


def mla() -> Case:
    width = 72
    layers = [filled(NB, BS, width, start=i * 10_000) for i in range(2)]
    return Case(
        layers,
        None,
        "mla",
        "NHD",
        StrideDesc(NB, BS, 1, width, BS * width, width, width),
        1,
        [(t.view(NB, BS, 1, width),) for t in layers],
    )


def separate_nhd() -> Case:
    layers = [
        (filled(NB, BS, NH, HS, start=i * 10_000), filled(NB, BS, NH, HS, start=i * 10_000 + 5000))
        for i in range(2)
    ]
    return Case(
        layers,
        {"block_size": BS},
        "separate",
        "NHD",
        StrideDesc(NB, BS, NH, HS, BS * NH * HS, NH * HS, HS),
        2,
        list(layers),
    )


def separate_hnd() -> Case:
    layers = [
        [filled(NB, NH, BS, HS, start=i * 10_000), filled(NB, NH, BS, HS, start=i * 10_000 + 5000)]
        for i in range(2)
    ]  # lists are accepted as (K, V) pairs too
    return Case(
        layers,
        {"kv_layout": "HND"},
        "separate",
        "HND",
        StrideDesc(NB, BS, NH, HS, NH * BS * HS, HS, BS * HS),
        2,
        [(k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)) for k, v in layers],
    )


def fused() -> Case:
    layers = [filled(NB, NH, BS, 2 * HS, start=i * 10_000) for i in range(2)]
    return Case(
        layers,
        {"block_size": BS},
        "fused",
        "HND",
        StrideDesc(NB, BS, NH, HS, NH * BS * 2 * HS, 2 * HS, BS * 2 * HS),
        2,
        [(t[..., :HS].permute(0, 2, 1, 3), t[..., HS:].permute(0, 2, 1, 3)) for t in layers],
    )


def fused_nhd() -> Case:
    layers = [filled(NB, BS, NH, 2 * HS, start=i * 10_000) for i in range(2)]
    return Case(
        layers,
        {"kv_layout": "NHD"},
        "fused",
        "NHD",
        StrideDesc(NB, BS, NH, HS, BS * NH * 2 * HS, NH * 2 * HS, 2 * HS),
        2,
        [(t[..., :HS], t[..., HS:]) for t in layers],
    )


def format_hint_ambiguous_vllm() -> Case:
    # NB == 2: [2, 2, BS, NH, HS] is ambiguous without the format hint.
    layers = [filled(2, 2, BS, NH, HS)]
    return Case(
        layers,
        {"format": "vllm", "block_size": BS},
        "vllm",
        "NHD",
        StrideDesc(2, BS, NH, HS, BS * NH * HS, NH * HS, HS),
        2,
        [(layers[0][0], layers[0][1])],
    )


def format_hint_ambiguous_flashinfer() -> Case:
    layers = [filled(2, 2, BS, NH, HS)]
    return Case(
        layers,
        {"format": "flashinfer", "block_size": BS},
        "flashinfer",
        "NHD",
        StrideDesc(2, BS, NH, HS, 2 * BS * NH * HS, NH * HS, HS),
        2,
        [(layers[0][:, 0], layers[0][:, 1])],
    )


CASES: dict[str, Callable[[], Case]] = {
    f.__name__: f
    for f in (
        vllm_nhd,
        vllm_hnd_permuted_view,
        vllm_hnd_permuted_view_block_size_hint,
        vllm_hnd_hint,
        vllm_hnd_block_size_hint,
        vllm_nhd_block_size_hint,
        flashinfer_nhd,
        flashinfer_hnd,
        mla,
        separate_nhd,
        separate_hnd,
        fused,
        fused_nhd,
        format_hint_ambiguous_vllm,
        format_hint_ambiguous_flashinfer,
    )
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_format_detection(name: str) -> None:
    case = CASES[name]()
    layout = build_layout(case.caches, chunk_size=CHUNK, layout_hints=case.hints)
    assert len(layout.groups) == 1
    group = layout.groups[0]
    assert group.index == 0
    assert group.format == case.fmt
    assert group.kv_layout == case.kv_layout
    assert group.strides == case.strides
    assert group.layer_indices == tuple(range(len(case.expected)))
    host = group.host
    assert host.dtype == torch.float32
    assert host.num_layers == len(case.expected)
    assert host.kv_count == case.kv_count
    assert host.row_elems == case.strides.num_heads * case.strides.head_size
    assert layout.layout_desc.groups == (host,)
    assert layout.layout_desc.chunk_size == CHUNK
    assert layout.block_size == case.strides.block_size
    assert layout.num_blocks == case.strides.num_blocks
    assert layout.device == torch.device("cpu")
    assert layout.num_layers == len(case.expected)
    assert layout.layer_names == tuple(f"layer{i}" for i in range(len(case.expected)))
    check_views(layout, case.expected)


def test_permuted_hnd_view_and_hinted_contiguous_hnd_agree() -> None:
    permuted = build_layout(
        vllm_hnd_permuted_view().caches, chunk_size=CHUNK, layout_hints={"block_size": BS}
    )
    hinted = build_layout(
        vllm_hnd_hint().caches, chunk_size=CHUNK, layout_hints={"kv_layout": "HND"}
    )
    assert permuted.groups[0].strides == hinted.groups[0].strides
    assert permuted.groups[0].strides.pos_stride == HS
    assert permuted.groups[0].strides.head_stride == BS * HS
    assert permuted.layout_desc == hinted.layout_desc


def test_views_write_through_to_the_engine_cache() -> None:
    physical = torch.zeros(2, NB, NH, BS, HS, dtype=torch.bfloat16)
    layout = build_layout(
        [physical.permute(0, 1, 3, 2, 4)], chunk_size=CHUNK, layout_hints={"kv_layout": "HND"}
    )
    key_view, value_view = layout.groups[0].kv_views[0]
    key_view[3, 1, 2].fill_(1.5)  # block 3, position 1, head 2
    value_view[0, 3, 0].fill_(-2.0)
    assert torch.all(physical[0, 3, 2, 1] == 1.5)
    assert torch.all(physical[1, 0, 0, 3] == -2.0)
    assert int((physical != 0).sum()) == 2 * HS  # nothing else touched


def test_dict_input_keeps_names() -> None:
    caches = {
        "model.layers.0.attn": torch.zeros(2, NB, BS, NH, HS, dtype=torch.float16),
        "model.layers.1.attn": torch.zeros(2, NB, BS, NH, HS, dtype=torch.float16),
    }
    layout = build_layout(caches, chunk_size=CHUNK, layout_hints={"block_size": BS})
    assert layout.layer_names == ("model.layers.0.attn", "model.layers.1.attn")
    assert layout.groups[0].layer_indices == (0, 1)
    assert layout.num_layers == 2


def test_block_size_hint_picks_the_dim_order() -> None:
    # [2, NB, 6, 7, HS]: with block_size 6 the dims are (BS, NH); with 7 they are (NH, BS).
    cache = torch.zeros(2, NB, 6, 7, HS, dtype=torch.float16)
    nhd = build_layout([cache], chunk_size=CHUNK, layout_hints={"block_size": 6})
    hnd = build_layout([cache], chunk_size=CHUNK, layout_hints={"block_size": 7})
    assert nhd.groups[0].kv_layout == "NHD"
    assert (nhd.block_size, nhd.groups[0].strides.num_heads) == (6, 7)
    assert nhd.groups[0].strides.pos_stride == 7 * HS
    assert hnd.groups[0].kv_layout == "HND"
    assert (hnd.block_size, hnd.groups[0].strides.num_heads) == (7, 6)
    assert hnd.groups[0].strides.pos_stride == HS
    assert hnd.groups[0].strides.head_stride == 7 * HS


# -- heterogeneous models ---------------------------------------------------------------------
def test_heterogeneous_bf16_vllm_and_int8_mla_layers() -> None:
    vllm_layers = [torch.zeros(2, NB, BS, NH, HS, dtype=torch.bfloat16) for _ in range(4)]
    mla_layers = [torch.zeros(NB, BS, 132, dtype=torch.int8) for _ in range(2)]
    layout = build_layout(
        [*vllm_layers, *mla_layers], chunk_size=CHUNK, layout_hints={"block_size": BS}
    )
    assert len(layout.groups) == 2
    bf16, int8 = layout.groups
    assert (bf16.index, int8.index) == (0, 1)
    assert bf16.format == "vllm" and int8.format == "mla"
    assert bf16.layer_indices == (0, 1, 2, 3)
    assert int8.layer_indices == (4, 5)
    assert bf16.host == GroupLayout(torch.bfloat16, 4, 2, NH * HS)
    assert int8.host == GroupLayout(torch.int8, 2, 1, 132)
    assert int8.host.row_bytes == 132
    assert bf16.host.row_bytes == NH * HS * 2
    assert layout.layout_desc.groups == (bf16.host, int8.host)
    assert layout.block_size == BS
    assert layout.num_layers == 6
    for group, layers in ((bf16, vllm_layers), (int8, mla_layers)):
        for views, cache in zip(group.kv_views, layers, strict=True):
            assert views[0].data_ptr() == cache.data_ptr()


def test_groups_are_ordered_by_first_layer() -> None:
    def mla_layer() -> torch.Tensor:
        return torch.zeros(NB, BS, 132, dtype=torch.int8)

    def vllm_layer() -> torch.Tensor:
        return torch.zeros(2, NB, BS, NH, HS, dtype=torch.bfloat16)

    layout = build_layout(
        [mla_layer(), vllm_layer(), vllm_layer(), mla_layer(), vllm_layer(), vllm_layer()],
        chunk_size=CHUNK,
        layout_hints={"block_size": BS},
    )
    assert [g.format for g in layout.groups] == ["mla", "vllm"]
    assert layout.groups[0].layer_indices == (0, 3)
    assert layout.groups[1].layer_indices == (1, 2, 4, 5)
    assert [g.index for g in layout.groups] == [0, 1]
    assert layout.layout_desc.groups[0].dtype == torch.int8


def test_different_head_counts_make_separate_groups() -> None:
    small = torch.zeros(2, NB, BS, NH, HS, dtype=torch.float16)
    wide = torch.zeros(2, NB, BS, 2 * NH, HS, dtype=torch.float16)
    layout = build_layout(
        [small, wide, small.clone(), wide.clone()],
        chunk_size=CHUNK,
        layout_hints={"block_size": BS},
    )
    assert [g.layer_indices for g in layout.groups] == [(0, 2), (1, 3)]
    assert [g.host.row_elems for g in layout.groups] == [NH * HS, 2 * NH * HS]


def test_fp8_caches_are_supported() -> None:
    cache = torch.zeros(2, NB, BS, NH, HS, dtype=torch.float8_e4m3fn)
    layout = build_layout([cache], chunk_size=CHUNK, layout_hints={"block_size": BS})
    assert layout.groups[0].host.dtype == torch.float8_e4m3fn
    assert layout.groups[0].host.row_bytes == NH * HS


# -- MemoryLayoutDesc ---------------------------------------------------------------------------
DESC = MemoryLayoutDesc(
    (GroupLayout(torch.bfloat16, 4, 2, 24), GroupLayout(torch.int8, 2, 1, 132)), chunk_size=16
)


@pytest.mark.parametrize(
    ("num_tokens", "offsets", "nbytes", "payload"),
    [
        (16, (0, 6144), 6144 + 4224, 6144 + 4224),
        (3, (0, 1280), 1280 + 792, 1152 + 792),
        (1, (0, 512), 512 + 264, 384 + 264),
    ],
)
def test_layout_desc_sizes(
    num_tokens: int, offsets: tuple[int, ...], nbytes: int, payload: int
) -> None:
    assert DESC.group_offsets(num_tokens) == offsets
    assert all(o % GROUP_ALIGN == 0 for o in offsets)
    assert DESC.nbytes(num_tokens) == nbytes
    assert DESC.payload_nbytes(num_tokens) == payload
    assert [g.nbytes(num_tokens) for g in DESC.groups] == [
        4 * 2 * num_tokens * 48,
        2 * 1 * num_tokens * 132,
    ]


@pytest.mark.parametrize("num_tokens", range(1, 17))
def test_layout_desc_groups_are_aligned_and_disjoint(num_tokens: int) -> None:
    desc = MemoryLayoutDesc(
        (
            GroupLayout(torch.int8, 1, 1, 132),
            GroupLayout(torch.float8_e5m2, 3, 2, 40),
            GroupLayout(torch.float16, 1, 1, 8),
        ),
        chunk_size=16,
    )
    offsets = desc.group_offsets(num_tokens)
    ends = [o + g.nbytes(num_tokens) for o, g in zip(offsets, desc.groups, strict=True)]
    assert offsets[0] == 0
    for index in range(1, len(offsets)):
        assert offsets[index] % GROUP_ALIGN == 0
        assert ends[index - 1] <= offsets[index] < ends[index - 1] + GROUP_ALIGN
    assert desc.nbytes(num_tokens) == ends[-1]


@pytest.mark.parametrize("num_tokens", [0, -1, 17])
def test_layout_desc_rejects_bad_token_counts(num_tokens: int) -> None:
    with pytest.raises(LayoutError, match=r"num_tokens must be in \[1, chunk_size=16\]"):
        DESC.nbytes(num_tokens)


def test_layout_desc_validation() -> None:
    with pytest.raises(LayoutError):
        MemoryLayoutDesc((), chunk_size=16)
    with pytest.raises(LayoutError):
        MemoryLayoutDesc(DESC.groups, chunk_size=0)
    for bad in (
        (torch.float16, 0, 2, 8),
        (torch.float16, 1, 3, 8),
        (torch.float16, 1, 2, 0),
        (torch.float64, 1, 2, 8),
    ):
        with pytest.raises(LayoutError):
            GroupLayout(*bad)


def _vllm(num_blocks: int = NB, block_size: int = BS, heads: int = NH, **kw: Any) -> torch.Tensor:
    return torch.zeros(2, num_blocks, block_size, heads, HS, dtype=kw.get("dtype", torch.bfloat16))


def _layout_id(layers: list[Any], **hints: Any) -> str:
    return build_layout(layers, chunk_size=CHUNK, layout_hints=hints or None).layout_desc.layout_id


def test_layout_id_is_stable() -> None:
    # Stored chunks carry this id in their keys: it must not change between processes/releases.
    assert _layout_id([_vllm()] * 4, block_size=BS) == "a9eda0d1ab0dbbc9"
    assert _layout_id([_vllm()] * 4, kv_layout="NHD") == "a9eda0d1ab0dbbc9"  # hints only read
    assert _layout_id([_vllm()] * 4, block_size=BS) == _layout_id([_vllm()] * 4, block_size=BS)
    assert re.fullmatch(r"[0-9a-f]{16}", _layout_id([_vllm()], block_size=BS))


def test_layout_id_ignores_block_geometry() -> None:
    base = _layout_id([_vllm()] * 2, block_size=BS)
    assert _layout_id([_vllm(num_blocks=NB + 7)] * 2, block_size=BS) == base
    assert _layout_id([_vllm(block_size=16)] * 2, block_size=16) == base
    # The host layout does not depend on the GPU format either.
    flashinfer = torch.zeros(NB, 2, BS, NH, HS, dtype=torch.bfloat16)
    assert _layout_id([flashinfer] * 2, block_size=BS) == base
    pair = (torch.zeros(NB, BS, NH, HS, dtype=torch.bfloat16),) * 2
    assert _layout_id([pair, pair], block_size=BS) == base
    # Nor on the order the dims are presented in: the same memory read through a permuted view.
    assert _layout_id([_vllm().permute(0, 1, 3, 2, 4)] * 2, block_size=BS) == base
    # Read with NH and BS swapped (NH=4 heads per row), the rows differ.
    assert _layout_id([_vllm()] * 2, block_size=NH) != base


def test_layout_id_changes_with_dtype_heads_and_layers() -> None:
    base = _layout_id([_vllm()] * 2, block_size=BS)
    others = {
        _layout_id([_vllm(dtype=torch.float16)] * 2, block_size=BS),
        _layout_id([_vllm(dtype=torch.float8_e4m3fn)] * 2, block_size=BS),
        # NH + 1 == BS: the block size no longer tells the dims apart, the memory order does.
        _layout_id([_vllm(heads=NH + 1)] * 2, block_size=BS, kv_layout="NHD"),
        _layout_id([_vllm()] * 3, block_size=BS),
        _layout_id([torch.zeros(NB, BS, NH * HS, dtype=torch.bfloat16)] * 2),  # MLA: K=1
    }
    assert base not in others
    assert len(others) == 5


def test_blocks_needed() -> None:
    assert [blocks_needed(n, 16) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


# -- format 'blocks': whole contiguous blocks, moved as they lie ---------------------------------
BLOCKS = {"format": "blocks", "block_size": BS}


def test_blocks_format_moves_whole_blocks() -> None:
    layers = [filled(NB, NH, BS, 2 * HS, start=i * 10_000) for i in range(2)]
    layout = build_layout(layers, chunk_size=CHUNK, layout_hints=BLOCKS)
    assert len(layout.groups) == 1
    group = layout.groups[0]
    assert group.format == "blocks"
    assert group.layer_indices == (0, 1)
    row = NH * 2 * HS
    assert group.strides == StrideDesc(NB, BS, 1, row, NH * BS * 2 * HS, row, row)
    assert group.host == GroupLayout(torch.float32, 2, 1, row, BS, (NH, BS, 2 * HS))
    assert group.host.block_size == BS and group.host.block_shape == (NH, BS, 2 * HS)
    assert layout.block_size == BS and layout.num_blocks == NB
    assert layout.layout_desc.token_multiple == BS
    for views, tensor in zip(group.kv_views, layers, strict=True):
        assert len(views) == 1
        (view,) = views
        assert view.shape == (NB, BS, 1, row)
        assert view.data_ptr() == tensor.data_ptr()  # zero-copy
        assert torch.equal(storage_view(view, group.strides), view)
        for block in range(NB):
            assert torch.equal(view[block].flatten(), tensor[block].flatten())
    view = group.kv_views[0][0]
    view[2].fill_(-1.0)  # writes land in block 2 of the engine's tensor, nowhere else
    assert torch.all(layers[0][2] == -1.0)
    assert int((layers[0] == -1.0).sum()) == NH * BS * 2 * HS


def test_blocks_format_keeps_the_memory_order_of_a_permuted_view() -> None:
    physical = filled(NB, NH, BS, 2 * HS)
    layout = build_layout([physical.permute(0, 2, 1, 3)], chunk_size=CHUNK, layout_hints=BLOCKS)
    group = layout.groups[0]
    assert group.host.block_shape == (NH, BS, 2 * HS)  # the block's dims in memory order
    for block in range(NB):
        assert torch.equal(group.kv_views[0][0][block].flatten(), physical[block].flatten())


def test_blocks_format_errors() -> None:
    cache = filled(NB, NH, BS, 2 * HS)
    message = _raises([cache], {"format": "blocks"})
    assert "block_size" in message and "kv_caches['layer0']" in message
    message = _raises([cache[:, :, :, :HS]], BLOCKS)
    assert "contiguous" in message and "(5, 3, 4, 8)" in message
    with pytest.raises(LayoutError, match="whole number of blocks"):
        build_layout([cache], chunk_size=BS + 2, layout_hints=BLOCKS)
    build_layout([cache], chunk_size=2 * BS, layout_hints=BLOCKS)  # a multiple is fine


def test_blocks_layout_id_differs_from_rows() -> None:
    blocks = _layout_id([filled(NB, NH, BS, 2 * HS)], **BLOCKS)
    rows = build_layout([filled(NB, BS, NH * 2 * HS)], chunk_size=CHUNK)  # MLA: same rows
    assert rows.layout_desc.groups[0].row_elems == NH * 2 * HS
    assert rows.layout_desc.groups[0].dtype == torch.float32
    assert blocks != rows.layout_desc.layout_id
    # The block's shape is part of the id: the same bytes in another order are another layout.
    assert blocks != _layout_id([filled(NB, BS, NH, 2 * HS)], **BLOCKS)


# -- errors -------------------------------------------------------------------------------------
def _raises(caches: Any, hints: dict[str, Any] | None = None) -> str:
    with pytest.raises(LayoutError) as info:
        build_layout(caches, chunk_size=CHUNK, layout_hints=hints)
    assert isinstance(info.value, TieredKVError)
    return str(info.value)


def test_ambiguous_five_d_shape() -> None:
    # NB == 2: with the block size known, vLLM [2, NB, ...] and FlashInfer [NB, 2, ...] remain.
    cache = torch.zeros(2, 2, BS, NH, HS, dtype=torch.float16)
    message = _raises([cache], {"block_size": BS})
    assert "(2, 2, 4, 3, 8)" in message
    assert "has 2 readings" in message
    assert "vllm NHD" in message and "flashinfer NHD" in message
    assert "layout_hints={'format': 'vllm' or 'flashinfer'}" in message
    assert "kv_caches['layer0']" in message
    # Without hints all four readings remain, and every hint that may be needed is named.
    message = _raises([cache])
    assert "has 4 readings" in message
    assert "'block_size'" in message and "'kv_layout'" in message and "'format'" in message


def test_no_hint_contiguous_five_d_is_refused() -> None:
    # Contiguous [2, NB, BS, NH, HS] is equally vLLM NHD with BS=shape[2] and vLLM HND with
    # BS=shape[3]: the strides cannot tell, so registration refuses instead of guessing.
    message = _raises([_vllm()])
    assert "kv_caches['layer0']: shape (2, 5, 4, 3, 8) with strides (480, 96, 24, 8, 1)" in message
    assert "has 2 readings with no layout_hints" in message
    assert f"vllm NHD (num_blocks={NB}, block_size={BS}, kv_heads={NH})" in message
    assert f"vllm HND (num_blocks={NB}, block_size={NH}, kv_heads={BS})" in message
    assert f"layout_hints={{'block_size': {BS} or {NH}}}" in message
    assert "layout_hints={'kv_layout': 'NHD' or 'HND'}" in message


def test_kv_layout_names_memory_order() -> None:
    view = vllm_hnd_permuted_view().caches  # [2, NB, BS, NH, HS] view of [2, NB, NH, BS, HS]
    contiguous = vllm_hnd_hint().caches
    from_view = build_layout(view, chunk_size=CHUNK, layout_hints={"kv_layout": "HND"})
    from_physical = build_layout(contiguous, chunk_size=CHUNK, layout_hints={"kv_layout": "HND"})
    assert from_view.groups[0].strides == from_physical.groups[0].strides
    assert from_view.groups[0].strides.pos_stride == HS
    assert from_view.groups[0].strides.head_stride == BS * HS
    assert from_view.block_size == from_physical.block_size == BS
    assert from_view.groups[0].kv_layout == from_physical.groups[0].kv_layout == "HND"
    assert from_view.layout_desc == from_physical.layout_desc
    # The memory is HND with BS positions: an NHD hint cannot be reconciled with that.
    message = _raises(view, {"kv_layout": "NHD", "block_size": BS})
    assert "cannot be read with layout_hints={'kv_layout': 'NHD', 'block_size': 4}" in message
    assert f"vllm HND (num_blocks={NB}, block_size={BS}, kv_heads={NH})" in message
    # Alone, an NHD hint reads the same memory as NHD with the outer dim (size NH) as positions.
    swapped = build_layout(view, chunk_size=CHUNK, layout_hints={"kv_layout": "NHD"})
    assert swapped.groups[0].kv_layout == "NHD"
    assert (swapped.block_size, swapped.groups[0].strides.num_heads) == (NH, BS)
    assert swapped.groups[0].strides.pos_stride == BS * HS


def test_nh_equal_bs_needs_kv_layout() -> None:
    cache = filled(2, NB, BS, BS, HS)
    message = _raises([cache], {"block_size": BS})
    assert "has 2 readings" in message
    # both readings have BS positions: only kv_layout is offered as the way out
    assert message.endswith("Pass layout_hints={'kv_layout': 'NHD' or 'HND'} to say which")
    nhd = build_layout(
        [cache], chunk_size=CHUNK, layout_hints={"block_size": BS, "kv_layout": "NHD"}
    )
    hnd = build_layout([cache], chunk_size=CHUNK, layout_hints={"kv_layout": "HND"})
    assert nhd.groups[0].kv_layout == "NHD"
    assert nhd.groups[0].strides == StrideDesc(NB, BS, BS, HS, BS * BS * HS, BS * HS, HS)
    check_views(nhd, [(cache[0], cache[1])])
    assert hnd.groups[0].kv_layout == "HND"
    assert hnd.groups[0].strides == StrideDesc(NB, BS, BS, HS, BS * BS * HS, HS, BS * HS)
    check_views(hnd, [(cache[0].transpose(1, 2), cache[1].transpose(1, 2))])


def test_size_one_heads_read_without_block_size() -> None:
    # Dims 2 and 3 of [2, NB, BS, 1, HS] leave two NHD readings (BS=4 x 1 head, or 1 x 4 heads);
    # the size-1 dim's stride as given places it inside the positions.
    cache = filled(2, NB, BS, 1, HS)
    layout = build_layout([cache], chunk_size=CHUNK, layout_hints={"kv_layout": "NHD"})
    group = layout.groups[0]
    assert layout.block_size == BS
    assert group.strides.num_heads == 1
    assert group.strides.block_size == BS
    assert group.strides.pos_stride == HS
    assert group.host.row_elems == HS
    check_views(layout, [(cache[0], cache[1])])


def test_five_d_without_kv_dim() -> None:
    message = _raises([torch.zeros(3, NB, BS, NH, HS, dtype=torch.float16)])
    assert "(3, 5, 4, 3, 8)" in message


def test_six_d_shape() -> None:
    message = _raises([torch.zeros(2, NB, BS, NH, HS, 1, dtype=torch.float16)])
    assert "(2, 5, 4, 3, 8, 1)" in message
    assert "supported" in message


@pytest.mark.parametrize("shape", [(NB * BS * NH * HS,), (NB, BS)])
def test_low_rank_shapes(shape: tuple[int, ...]) -> None:
    message = _raises([torch.zeros(shape, dtype=torch.float16)])
    assert str(shape) in message


def test_odd_fused_last_dim() -> None:
    message = _raises([torch.zeros(NB, NH, BS, 2 * HS - 1, dtype=torch.float16)])
    assert "(5, 3, 4, 15)" in message
    assert "even" in message


def test_non_contiguous_last_dim() -> None:
    cache = torch.zeros(2, NB, BS, HS, NH, dtype=torch.float16).transpose(-1, -2)
    assert cache.shape == (2, NB, BS, NH, HS)
    message = _raises([cache])
    assert "contiguous" in message
    assert "kv_caches['layer0']" in message


def test_mixed_devices() -> None:
    cpu = torch.zeros(2, NB, BS, NH, HS, dtype=torch.float16)
    meta = torch.empty(2, NB, BS, NH, HS, dtype=torch.float16, device="meta")
    hints = {"block_size": BS}  # each layer reads on its own: only the devices disagree
    build_layout([cpu], chunk_size=CHUNK, layout_hints=hints)
    build_layout([meta], chunk_size=CHUNK, layout_hints=hints)
    message = _raises([cpu, meta], hints)
    assert "kv_caches['layer1']: on meta, other layers on cpu" in message
    pair_message = _raises([(cpu[0], meta[0])], hints)
    assert "kv_caches['layer0']: on meta, other layers on cpu" in pair_message
    # Devices are checked before a layer is read: no hints, and still the device is named.
    assert "on meta, other layers on cpu" in _raises([(cpu[0], meta[0])])


@pytest.mark.parametrize(
    ("hints", "fragment"),
    [
        ({"kv_layuot": "HND"}, "kv_layuot"),
        ({"format": "vllm", "page_size": 16}, "page_size"),
        ({"format": "trtllm"}, "'trtllm'"),
        ({"kv_layout": "NDH"}, "'NDH'"),
        ({"kv_layout": 1}, "kv_layout"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": -4}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"block_size": "4"}, "block_size"),
        ({"block_size": 4.0}, "block_size"),
    ],
)
def test_bad_hints(hints: dict[str, Any], fragment: str) -> None:
    message = _raises([_vllm()], hints)
    assert fragment in message
    assert "layout_hints" in message


def test_block_size_hint_matching_no_dim() -> None:
    message = _raises([_vllm()], {"block_size": 16})
    assert "cannot be read with layout_hints={'block_size': 16}" in message
    # names what the tensor reads as without the hint: block size 4 or 3
    assert "without the hints it reads as" in message
    assert "block_size=4, kv_heads=3" in message and "block_size=3, kv_heads=4" in message


def test_block_size_hint_contradicting_the_caches() -> None:
    # MLA has a single block-position dim, so the hint is only checked against the result.
    message = _raises([torch.zeros(NB, BS, 64, dtype=torch.float16)], {"block_size": BS + 1})
    assert "block_size" in message and str(BS + 1) in message and str(BS) in message


def test_mismatched_block_sizes_across_groups() -> None:
    # kv_layout settles the vLLM layer (BS 4) and leaves MLA (one position dim, BS 8) alone.
    message = _raises(
        [_vllm(block_size=4), torch.zeros(NB, 8, 64, dtype=torch.bfloat16)], {"kv_layout": "NHD"}
    )
    assert "[4, 8]" in message
    assert "block size" in message


def test_format_hint_contradicting_the_shape() -> None:
    message = _raises([_vllm()], {"format": "mla"})
    assert "'mla'" in message and "(2, 5, 4, 3, 8)" in message
    assert "separate" in _raises([_vllm()], {"format": "separate"})
    pair = (torch.zeros(NB, BS, NH, HS), torch.zeros(NB, BS, NH, HS))
    assert "'vllm'" in _raises([pair], {"format": "vllm"})


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bool])
def test_unsupported_dtype(dtype: torch.dtype) -> None:
    message = _raises([torch.zeros(2, NB, BS, NH, HS, dtype=dtype)])
    assert str(dtype) in message
    assert "bfloat16" in message  # lists what is supported


@pytest.mark.parametrize("caches", [[], {}, ()])
def test_no_layers(caches: Any) -> None:
    assert "no layers" in _raises(caches)


@pytest.mark.parametrize("entry", [None, 3, "cache", [1, 2]])
def test_entry_that_is_not_a_tensor(entry: Any) -> None:
    assert "kv_caches[" in _raises([_vllm(), entry])


def test_separate_kv_tuples_must_be_pairs_of_equal_tensors() -> None:
    k = torch.zeros(NB, BS, NH, HS, dtype=torch.float16)
    assert "(K, V)" in _raises([(k, k, k)])
    message = _raises([(k, torch.zeros(NB, BS, NH, HS + 1, dtype=torch.float16))])
    assert "differ" in message
    assert "differ" in _raises([(k, k.to(torch.bfloat16))])
    flat = torch.zeros(NB, BS, NH * HS, dtype=torch.float16)
    assert "[NB, BS, NH, HS]" in _raises([(flat, flat)])


def test_empty_dimension() -> None:
    assert "empty" in _raises([torch.zeros(2, 0, BS, NH, HS, dtype=torch.float16)])
