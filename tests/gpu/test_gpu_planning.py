"""The CUDA mover's planning on CPU layouts: copy widths, paths, DMA runs, staging fills in
chunk-major and layer-major order, object references. The byte movement itself is tested on the
GPU (test_cuda_mover, test_layerwise)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import pytest
import torch

from tests.kvfactory import FORMATS, make_caches
from tiered_kv.errors import LayoutError, TieredKVError
from tiered_kv.gpu.base import ChunkTransfer, check_layers, layer_places
from tiered_kv.gpu.calls import hold
from tiered_kv.gpu.mover import MoverOptions
from tiered_kv.gpu.plan import (
    MAX_JOBS,
    Fill,
    LayoutPlan,
    block_span,
    choose_path,
    copy_width,
    group_plan,
    moved_bytes,
    moves_at_most,
    pack_fills,
    runs,
    slot_fills,
)
from tiered_kv.layout import KVCacheLayout, build_layout
from tiered_kv.memory import HostArena


def test_copy_width_is_the_widest_that_divides_everything() -> None:
    assert copy_width(256, 4096, 256) == 16
    assert copy_width(132, 132 * 16) == 4
    assert copy_width(256, 8) == 8
    assert copy_width(6) == 2
    assert copy_width(9) == 1


def test_block_span_covers_every_touched_block_and_checks_the_table() -> None:
    layout, _ = _layout("vllm_nhd")
    arena = HostArena(1 << 20)
    try:
        a = arena.allocate_obj(layout.layout_desc, 32)
        b = arena.allocate_obj(layout.layout_desc, 20)  # a partial last chunk
        assert a is not None and b is not None
        transfers = [ChunkTransfer(b, 96, 5), ChunkTransfer(a, 32)]
        assert block_span(16, transfers, 8) == (2, 8)  # tokens 32..115: blocks 2..7
        assert block_span(16, [ChunkTransfer(b, 96)], 8) == (6, 8)  # one chunk: its own blocks
        with pytest.raises(LayoutError, match="has 7 ids, but the chunks reach block 7"):
            block_span(16, transfers, 7)
        a.unref()
        b.unref()
    finally:
        assert arena.close() == 0


def _layout(
    fmt: str, dtype: torch.dtype = torch.bfloat16, **kw: int
) -> tuple[KVCacheLayout, object]:
    caches = make_caches(fmt, dtype, **kw)
    return build_layout(caches.entries, chunk_size=32, layout_hints=caches.hints), caches


def _plan(layout: KVCacheLayout) -> LayoutPlan:
    groups = tuple(group_plan(group, torch.device("cpu")) for group in layout.groups)
    return LayoutPlan(layout, groups, "staging")


def test_block_rows_widen_narrow_contiguous_rows_only() -> None:
    """132-byte int8 rows copy at width 4; a whole block of them (16 x 132 = 2112 bytes) at 16."""
    int8, _ = _layout("vllm_nhd", torch.int8, num_heads=1, head_size=132)
    (plan,) = _plan(int8).groups
    assert plan.width == 4
    assert plan.block_rows is not None
    assert plan.block_rows.width == 16
    assert plan.block_rows.row_bytes == 16 * 132 == plan.block_rows.head_bytes
    assert plan.block_rows.pos_stride == plan.block_stride  # one "row" per block
    assert plan.block_rows.slab_bytes(2, 2) == plan.slab_bytes(2, 32)
    # Rows not contiguous within a block (HND view): no block rows.
    hnd, _ = _layout("vllm_hnd_view", torch.int8, num_heads=2, head_size=66)
    assert _plan(hnd).groups[0].block_rows is None
    # Already at width 16: nothing to gain.
    wide, _ = _layout("vllm_nhd", num_heads=2, head_size=64)
    assert _plan(wide).groups[0].block_rows is None


def test_auto_path_uses_dma_only_for_long_contiguous_runs() -> None:
    small, _ = _layout("vllm_nhd")
    assert choose_path(small) == "staging"  # 16 tokens x 32 bytes: runs far too short
    medium, _ = _layout("vllm_nhd", num_heads=8, head_size=256, block_size=32, num_layers=1)
    assert choose_path(medium) == "staging"  # 128 KiB runs: DMA measured slower than staging
    big, _ = _layout(
        "vllm_nhd", num_heads=8, head_size=256, block_size=1024, num_layers=1, num_blocks=3
    )
    assert choose_path(big) == "dma"  # 1024 x 4 KiB contiguous per block
    hnd, _ = _layout("vllm_hnd_view", num_heads=8, head_size=256, block_size=32, num_layers=1)
    assert choose_path(hnd) == "staging"
    assert choose_path(hnd, "mapped") == "mapped"
    with pytest.raises(ValueError, match="path"):
        MoverOptions(path="fastest")
    with pytest.raises(ValueError, match="mapped_front_layers"):
        MoverOptions(mapped_front_layers=-1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("skip", [0, 5, 16])
def test_dma_runs_cover_exactly_the_rows(fmt: str, skip: int) -> None:
    layout, _ = _layout(fmt, num_blocks=12)
    plan = _plan(layout)
    arena = HostArena(1 << 20, pin=False)
    obj = arena.allocate_obj(layout.layout_desc, 27)  # partial chunk
    assert obj is not None
    block_ids = [7, 8, 3, 11, 0]  # 7, 8 consecutive: their runs may merge
    transfer = ChunkTransfer(obj, token_start=32, skip_tokens=skip)
    try:
        for group in plan.groups:
            chunk_runs = runs(group, layout.block_size, block_ids, transfer, skip)
            expected: dict[int, int] = {}  # host byte offset → paged byte offset, byte by byte
            for t in range(skip, obj.num_tokens):
                pos = 32 + t
                paged_row = (
                    block_ids[pos // 16] * group.block_stride + (pos % 16) * group.pos_stride
                )
                for h in range(group.num_heads):
                    for b in range(group.head_bytes):
                        host = t * group.row_bytes + h * group.head_bytes + b
                        expected[host] = paged_row + h * group.head_stride + b
            got: dict[int, int] = {}
            for paged, host, nbytes in chunk_runs:
                for b in range(nbytes):
                    assert host + b not in got, "overlapping runs"
                    got[host + b] = paged + b
            assert got == expected
            if group.head_stride == group.head_bytes and group.pos_stride == group.row_bytes:
                # one run per block segment at most, fewer where blocks are adjacent
                assert len(chunk_runs) <= math.ceil((obj.num_tokens - skip) / 16) + 1
    finally:
        obj.unref()
        assert arena.close() == 0


@pytest.mark.parametrize("layers", [None, (4, 0, 2)])
def test_a_repeated_call_shape_reuses_its_packing_with_its_own_chunks(
    layers: tuple[int, ...] | None,
) -> None:
    layout, _ = _layout("vllm_nhd", num_layers=5)
    plan = _plan(layout)
    arena = HostArena(4 << 20, pin=False)
    objs = [arena.allocate_obj(layout.layout_desc, n) for n in [32, 32, 7] * 2 + [32]]
    assert all(o is not None for o in objs)
    first = [ChunkTransfer(o, 32 * i) for i, o in enumerate(objs[:3]) if o is not None]
    again = [ChunkTransfer(o, 32 * i) for i, o in enumerate(objs[3:6]) if o is not None]
    other = [ChunkTransfer(o, 32 * i) for i, o in enumerate(objs[4:]) if o is not None]

    def packed(fills: Iterable[Fill]) -> list[tuple[object, ...]]:
        return [
            (f.group, [(id(t), a, b) for t, a, b in f.pieces], f.completes, f.nbytes) for f in fills
        ]

    try:
        for ramp_up in (True, False):
            for transfers in (first, again, other):
                cached = slot_fills(plan, transfers, 3 << 10, ramp_up=ramp_up, layers=layers)
                fresh = pack_fills(plan, transfers, 3 << 10, ramp_up=ramp_up, layers=layers)
                assert packed(cached) == packed(fresh)
        assert len(plan.fill_shapes) == 4  # (first, again) share a shape; other differs
    finally:
        for o in objs:
            if o is not None:
                o.unref()
        assert arena.close() == 0


@pytest.mark.parametrize("ramp_up", [True, False])
@pytest.mark.parametrize("slot_kib", [2, 5, 64])
def test_staging_fills_cover_every_layer_once_within_a_slot(slot_kib: int, ramp_up: bool) -> None:
    layout, _ = _layout("vllm_nhd", num_layers=5)
    plan = _plan(layout)
    arena = HostArena(4 << 20, pin=False)
    objs = [arena.allocate_obj(layout.layout_desc, n) for n in [32] * 40 + [7]]
    transfers = [ChunkTransfer(o, 32 * i) for i, o in enumerate(objs) if o is not None]
    slot = slot_kib * 1024
    try:
        seen: dict[int, list[int]] = {id(t): [] for t in transfers}
        sizes = []
        for fill in slot_fills(plan, transfers, slot, ramp_up=ramp_up):
            group = fill.group
            assert 1 <= len(fill.pieces) <= MAX_JOBS
            sizes.append(
                sum(group.slab_bytes(l1 - l0, t.obj.num_tokens) for t, l0, l1 in fill.pieces)
            )
            assert sizes[-1] == fill.nbytes <= slot
            assert fill.completes == []  # chunk-major: no per-layer completion
            for transfer, l0, l1 in fill.pieces:
                seen[id(transfer)].extend(range(l0, l1))
        assert all(layers == list(range(5)) for layers in seen.values())
        with pytest.raises(ValueError, match="one layer"):
            list(slot_fills(plan, transfers, 1024, ramp_up=ramp_up))
    finally:
        for t in transfers:
            t.obj.unref()
        assert arena.close() == 0
    if slot_kib == 64:  # layers (1 KiB) small enough for the ramps to show
        ends = sizes[:3] if ramp_up else sizes[-3:]
        assert max(ends) <= slot // 2, sizes
        assert (ends[0] if ramp_up else ends[-1]) <= slot // 8, sizes
        assert max(sizes) > slot // 2  # full-size fills in between


def test_a_freed_object_in_a_call_leaves_no_reference_behind() -> None:
    """The mover holds every object of a call; if one is already freed, the call fails before
    touching anything and the references it had taken are given back."""
    layout, _ = _layout("vllm_nhd")
    arena = HostArena(1 << 20, pin=False)
    objs = [arena.allocate_obj(layout.layout_desc, 32) for _ in range(3)]
    live = [o for o in objs if o is not None]
    assert len(live) == 3
    transfers = [ChunkTransfer(o, 32 * i) for i, o in enumerate(live)]
    live[1].unref()  # freed: its transfer is stale
    with pytest.raises(TieredKVError, match="freed"):
        hold(transfers)
    assert live[0].refcount == 1 and live[2].refcount == 1
    held = hold([transfers[0], transfers[2]])
    assert [o.refcount for o in held] == [2, 2]
    for obj in (*held, live[0], live[2]):
        obj.unref()
    assert arena.close() == 0


def _mixed_layout() -> KVCacheLayout:
    """Three groups interleaved by layer: bf16 NHD, int8 132-byte rows, fp16 MLA-like."""
    nb = 10
    entries = [
        torch.zeros((2, nb, 16, 4, 64), dtype=torch.bfloat16),
        torch.zeros((nb, 16, 132), dtype=torch.int8),
        torch.zeros((2, nb, 16, 4, 64), dtype=torch.bfloat16),
        torch.zeros((nb, 16, 132), dtype=torch.int8),
        torch.zeros((nb, 16, 72), dtype=torch.float16),
    ]
    hints = {"block_size": 16, "kv_layout": "NHD"}
    return build_layout(entries, chunk_size=32, layout_hints=hints)


def test_layer_places_map_model_layers_to_their_groups() -> None:
    layout = _mixed_layout()
    assert len(layout.groups) == 3
    assert layer_places(layout) == ((0, 0), (1, 0), (0, 1), (1, 1), (2, 0))
    assert check_layers(layout, None) == (0, 1, 2, 3, 4)
    assert check_layers(layout, [3, 1]) == (3, 1)
    for bad in ([5], [-1], [1, 1], [1.0], [True]):
        with pytest.raises(ValueError, match="layers"):
            check_layers(layout, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("slot_kib", [32, 48, 256])
@pytest.mark.parametrize("ramp_up", [True, False])
def test_layer_major_fills_complete_layers_in_order(slot_kib: int, ramp_up: bool) -> None:
    """Layerwise: every (chunk, layer) once; a layer's pieces all come before the fill that says
    it completes it; layers complete in model order, each exactly once; no fill mixes groups."""
    layout = _mixed_layout()
    plan = _plan(layout)
    arena = HostArena(4 << 20, pin=False)
    objs = [arena.allocate_obj(layout.layout_desc, n) for n in [32] * 9 + [7]]
    transfers = [ChunkTransfer(o, 32 * i) for i, o in enumerate(objs) if o is not None]
    places = layer_places(layout)
    try:
        seen: list[tuple[int, int]] = []  # (model layer, chunk) in enqueue order
        completed: list[int] = []
        for fill in slot_fills(plan, transfers, slot_kib * 1024, ramp_up=ramp_up, layers=range(5)):
            assert 1 <= len(fill.pieces) <= MAX_JOBS and fill.nbytes <= slot_kib * 1024
            for transfer, l0, l1 in fill.pieces:
                assert l1 == l0 + 1  # one layer per piece
                layer = layout.groups[fill.group.group.index].layer_indices[l0]
                assert places[layer][0] == fill.group.group.index
                assert layer not in completed, "a piece after its layer was completed"
                seen.append((layer, transfers.index(transfer)))
            completed.extend(fill.completes)
        assert completed == [0, 1, 2, 3, 4]
        assert seen == [(layer, c) for layer in range(5) for c in range(len(transfers))]
        subset = [
            (fill.completes, [(t.token_start, l0) for t, l0, _ in fill.pieces])
            for fill in slot_fills(plan, transfers[:2], 1 << 20, ramp_up=False, layers=[3])
        ]
        assert subset == [([3], [(0, 1), (32, 1)])]  # layer 3 is group 1's second layer
    finally:
        for t in transfers:
            t.obj.unref()
        assert arena.close() == 0


def test_a_layerwise_load_ramps_up_by_layers_then_fills_whole_slots() -> None:
    """A layer-major scatter's first fills end after 1, 1, 2, 4, ... layers, so layer 0 lands
    after its own copies and not a slot's; once a fill would hold a slot anyway, fills are
    whole slots (and ramp down at the end as any scatter's). A gather (a layerwise store) and
    a chunk-major scatter keep their byte ramps only."""
    layout, _ = _layout("vllm_nhd", num_layers=24)
    plan = _plan(layout)
    arena = HostArena(8 << 20, pin=False)
    objs = [arena.allocate_obj(layout.layout_desc, 32) for _ in range(2)]
    transfers = [ChunkTransfer(o, 32 * i) for i, o in enumerate(objs) if o is not None]
    per_layer = sum(plan.groups[0].slab_bytes(1, t.obj.num_tokens) for t in transfers)
    try:
        big = 64 * per_layer  # a slot above the whole load: only the layer ramp splits it
        completes = [
            fill.completes
            for fill in slot_fills(plan, transfers, big, ramp_up=False, layers=range(24))
        ]
        assert completes[:5] == [[0], [1], [2, 3], [4, 5, 6, 7], list(range(8, 16))]
        assert [layer for done in completes for layer in done] == list(range(24))
        # A slot of four layers: the ramp stops at the first full fill.
        slot = 4 * per_layer
        fills = list(slot_fills(plan, transfers, slot, ramp_up=False, layers=range(24)))
        assert [f.completes for f in fills[:5]] == [[0], [1], [2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
        sizes = [f.nbytes for f in fills]
        assert sizes[3:7] == [slot] * 4, sizes  # whole slots after the ramp
        assert max(sizes[7:]) <= slot // 2, sizes  # the last slot's worth ramps down
        # Gathers (ramp_up) are not split by layers.
        gather = list(slot_fills(plan, transfers, big, ramp_up=True, layers=range(24)))
        assert len(gather[0].completes) > 1
    finally:
        for t in transfers:
            t.obj.unref()
        assert arena.close() == 0


def test_moved_bytes_of_some_layers() -> None:
    layout = _mixed_layout()
    plan = _plan(layout)
    arena = HostArena(1 << 20, pin=False)
    obj = arena.allocate_obj(layout.layout_desc, 32)
    assert obj is not None
    try:
        transfer = ChunkTransfer(obj, 0, skip_tokens=8)
        every = moved_bytes(plan, [transfer], True, range(5))
        groups = [g.host.nbytes(32) for g in layout.groups]
        assert every == sum(groups)
        assert moved_bytes(plan, [transfer], True, [1]) == groups[1] // 2
        assert moved_bytes(plan, [transfer], False, [4]) == groups[2] * 24 // 32
        assert moved_bytes(plan, [transfer], False) == obj.nbytes * 24 // 32
        # Several transfers: the sum of each one's bytes (the skip counted per transfer).
        whole = ChunkTransfer(obj, 32)
        assert (
            moved_bytes(plan, [transfer, whole], False, [1, 4])
            == (groups[1] // 2 + groups[2]) * (24 + 32) // 32
        )
        assert moved_bytes(plan, [transfer, whole], False) == obj.nbytes * (24 + 32) // 32
        # The small-call test stops counting past its limit but agrees with the sum.
        for to_host in (True, False):
            total = moved_bytes(plan, [transfer, whole], to_host)
            assert moves_at_most([transfer, whole], to_host, total)
            assert not moves_at_most([transfer, whole], to_host, total - 1)
        assert moved_bytes(plan, [], True, range(5)) == 0
    finally:
        obj.unref()
        assert arena.close() == 0


def test_evenly_stepping_runs_become_one_strided_copy() -> None:
    from tiered_kv.gpu.staging import MAX_PITCH, StridedCopy, strided_copies

    mib = 1 << 20
    # A layer-major fill: one layer of 4 evenly spaced chunk objects into a contiguous slot.
    runs = [(9000 + k * mib, 5 * mib + k * 32 * mib, mib) for k in range(4)]
    assert strided_copies(runs) == [StridedCopy(9000, 5 * mib, mib, 4, mib, 32 * mib)]
    # The fifth object is elsewhere: a new copy starts there; a different size too.
    odd = [*runs, (9000 + 4 * mib, 999 * mib, mib), (9000 + 5 * mib, 1000 * mib, 512)]
    assert strided_copies(odd) == [
        StridedCopy(9000, 5 * mib, mib, 4, mib, 32 * mib),
        StridedCopy(9000 + 4 * mib, 999 * mib, mib),
        StridedCopy(9000 + 5 * mib, 1000 * mib, 512),
    ]
    # Descending, overlapping or too widely spaced runs stay plain copies.
    down = [(0, 10 * mib, mib), (mib, 5 * mib, mib)]
    assert [c.rows for c in strided_copies(down)] == [1, 1]
    overlap = [(0, 0, mib), (mib // 2, mib // 2, mib)]
    assert [c.rows for c in strided_copies(overlap)] == [1, 1]
    far = [(0, 0, 64), (64, MAX_PITCH + 64, 64)]
    assert [c.rows for c in strided_copies(far)] == [1, 1]
    # Every byte of every run is covered exactly once by the strided copies.
    covered = sorted(
        (c.dst + k * c.dst_pitch, c.src + k * c.src_pitch, c.width)
        for c in strided_copies(odd)
        for k in range(c.rows)
    )
    assert covered == sorted(odd)
