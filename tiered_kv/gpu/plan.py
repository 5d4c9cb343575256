"""Copy plans for `CudaMover`: what to move, in what order, with which vector width.

Owns: each layer group's byte strides, copy width and device table of layer pointers
(`GroupPlan`), the path chosen per layout (`choose_path`), how a call's chunks and layers are
packed into staging fills (`slot_fills`: chunk-major for whole calls, layer-major for layerwise
ones), which local layers of each group a call moves (`layer_ranges`) and the contiguous runs
of the DMA-only path (`runs`). Pure planning: it enqueues nothing and, but for the pointer
table it uploads, touches no GPU state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch

from tiered_kv.errors import LayoutError
from tiered_kv.gpu.base import ChunkTransfer, layer_places
from tiered_kv.gpu.kernels import COPY_WIDTHS
from tiered_kv.layout import KVCacheLayout, LayerGroup
from tiered_kv.memory import MemoryObj

MoverPath = Literal["staging", "mapped", "dma"]
PathChoice = Literal["auto", "staging", "mapped", "dma"]  # what a user asks for
CallDirection = Literal["gather", "scatter"]  # GPU → host, host → GPU
PATHS: tuple[MoverPath, ...] = ("staging", "mapped", "dma")
MAX_JOBS = 32  # TKV_MAX_JOBS in cuda_src/tkv_copy.cu
JOB_MAX_BYTES = 1 << 30
RAMP_STEPS = 3  # staging fills ramp from (or down to) slot/8: see `slot_fills`
LAYER_RAMP = 6  # a layerwise load's first fills end after 1, 1, 2, 4, 8, 16 layers
# `auto` uses the DMA-only path when a chunk's contiguous runs average at least this many bytes:
# below it the copy engines spend their time on descriptors (docs/benchmarks.md, "GPU transfers").
DMA_MIN_RUN_BYTES = 4 << 20


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class GroupPlan:
    """How to move one layer group: strides in bytes, vector width, device pointer table."""

    group: LayerGroup
    width: int
    host_ptrs: tuple[int, ...]  # [L * K] paged base addresses, layer-major
    layer_ptrs: torch.Tensor  # the same, int64 on the device (the kernel's table)
    block_stride: int
    pos_stride: int
    head_stride: int
    head_bytes: int
    row_bytes: int
    num_heads: int
    kv_count: int
    num_layers: int
    # Where a block's rows are contiguous (NHD-like) and that allows a wider vector: the same
    # group seen with one row per block (block_size x row_bytes bytes), for jobs whose token
    # ranges fall on block boundaries. 132-byte int8 rows copy at 16 bytes instead of 4.
    block_rows: GroupPlan | None = None

    def slab_bytes(self, num_layers: int, num_tokens: int) -> int:
        return num_layers * self.kv_count * num_tokens * self.row_bytes


def group_plan(group: LayerGroup, device: torch.device) -> GroupPlan:
    """Byte strides, copy width and pointer table of one layer group."""
    s = group.strides
    item = group.host.dtype.itemsize
    ptrs = tuple(p for layer in group.kv_pointers() for p in layer)
    head_bytes = s.head_size * item
    row_bytes = group.host.row_bytes
    strides = (s.block_stride * item, s.pos_stride * item, s.head_stride * item)
    plan = GroupPlan(
        group=group,
        width=copy_width(head_bytes, *strides, *ptrs),
        host_ptrs=ptrs,
        layer_ptrs=torch.tensor(ptrs, dtype=torch.int64, device=device),
        block_stride=strides[0],
        pos_stride=strides[1],
        head_stride=strides[2],
        head_bytes=head_bytes,
        row_bytes=row_bytes,
        num_heads=s.num_heads,
        kv_count=group.host.kv_count,
        num_layers=group.host.num_layers,
    )
    block_row = s.block_size * row_bytes
    if (s.num_heads == 1 or strides[2] == head_bytes) and strides[1] == row_bytes:
        width = copy_width(block_row, strides[0], *ptrs)
        if width > plan.width:
            block_rows = dataclasses.replace(
                plan,
                width=width,
                pos_stride=strides[0],
                head_stride=block_row,
                head_bytes=block_row,
                row_bytes=block_row,
                num_heads=1,
            )
            plan = dataclasses.replace(plan, block_rows=block_rows)
    return plan


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LayoutPlan:
    layout: KVCacheLayout  # keeps the layout (and its tensors) alive while the plan is cached
    groups: tuple[GroupPlan, ...]
    path: MoverPath
    # Bytes of the largest one-layer slab of a chunk: no staging slot may be smaller.
    largest_layer: int = dataclasses.field(init=False)
    # `layer_places` of the layout: model layer → (group index, index inside the group).
    places: tuple[tuple[int, int], ...] = dataclasses.field(init=False)
    # Per set of model layers, how many fall in each group (`layer_counts`).
    _counts: dict[tuple[int, ...], tuple[int, ...]] = dataclasses.field(
        init=False, default_factory=dict
    )
    # `slot_fills`' packings by call shape: a serving engine repeats a few shapes.
    fill_shapes: dict[tuple[Any, ...], list[FillShape]] = dataclasses.field(
        init=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        chunk = self.layout.layout_desc.chunk_size
        object.__setattr__(self, "largest_layer", max(g.slab_bytes(1, chunk) for g in self.groups))
        object.__setattr__(self, "places", layer_places(self.layout))

    def layer_counts(self, layers: Sequence[int]) -> tuple[int, ...]:
        """How many of the model ``layers`` each group holds (remembered per set of layers:
        a call asks once per chunk)."""
        key = tuple(layers)
        counts = self._counts.get(key)
        if counts is None:
            tally = [0] * len(self.groups)
            for layer in key:
                tally[self.places[layer][0]] += 1
            if len(self._counts) >= 4 * len(self.places) + 8:  # callers' arbitrary subsets
                self._counts.clear()
            counts = self._counts[key] = tuple(tally)
        return counts


def copy_width(*values: int) -> int:
    """The widest copy width in `COPY_WIDTHS` dividing every value (sizes, strides, addresses)."""
    for width in COPY_WIDTHS:
        if all(value % width == 0 for value in values):
            return width
    return 1


def path_choice(value: str) -> PathChoice:
    """``value`` as a path choice (an env var or CLI string); a clear error otherwise."""
    choices: tuple[PathChoice, ...] = ("auto", *PATHS)
    for choice in choices:
        if value == choice:
            return choice
    raise ValueError(f"mover path: expected 'auto' or one of {PATHS}, got {value!r}")


def choose_path(layout: KVCacheLayout, requested: PathChoice = "auto") -> MoverPath:
    """``auto``: DMA only when every group's rows are contiguous over a whole block (NHD-like), so
    a chunk is a few long runs; otherwise staging, which reaches the DMA ceiling for any layout
    while using few SMs. The mapped path is never a layout's default: with enough CTAs to reach
    PCIe speed it competes with the model for SMs for the whole transfer (bench/transfer.py
    measures the matmul slowdown); only small calls use it, with few CTAs (`CudaMover`)."""
    if requested != "auto":
        return requested
    for group in layout.groups:
        s = group.strides
        item = group.host.dtype.itemsize
        row = s.num_heads * s.head_size * item
        block_run = s.block_size * row
        contiguous = s.head_stride == s.head_size and s.pos_stride * item == row
        if not contiguous or block_run < DMA_MIN_RUN_BYTES:
            return "staging"
    return "dma"


def moved_bytes(
    plan: LayoutPlan,
    transfers: Sequence[ChunkTransfer],
    to_host: bool,
    layers: Sequence[int] | None = None,
) -> int:
    """Bytes ``transfers`` move together: a scatter skips each one's first ``skip_tokens``;
    ``layers`` (model layer indexes) restricts them to those layers (a slab's bytes are linear
    in its tokens: one sum of tokens, not one slab per chunk)."""
    if layers is None:
        return sum(_chunk_bytes(transfer, to_host) for transfer in transfers)
    counts = plan.layer_counts(layers)
    per_token = sum(
        n * group.slab_bytes(1, 1) for group, n in zip(plan.groups, counts, strict=True)
    )
    tokens = sum(
        t.obj.num_tokens if to_host else t.obj.num_tokens - t.skip_tokens for t in transfers
    )
    return per_token * tokens


def moves_at_most(transfers: Sequence[ChunkTransfer], to_host: bool, limit: int) -> bool:
    """Whether a whole call of ``transfers`` moves at most ``limit`` bytes (`moved_bytes`,
    counting no further than the limit: a many-chunk call is decided in a few steps)."""
    total = 0
    for transfer in transfers:
        total += _chunk_bytes(transfer, to_host)
        if total > limit:
            return False
    return True


def _chunk_bytes(transfer: ChunkTransfer, to_host: bool) -> int:
    obj = transfer.obj
    tokens = obj.num_tokens if to_host else obj.num_tokens - transfer.skip_tokens
    return obj.nbytes * tokens // obj.num_tokens


def block_span(
    block_size: int, transfers: Sequence[ChunkTransfer], table_len: int
) -> tuple[int, int]:
    """The request blocks [first, end) that ``transfers`` touch (their kernels' block ids),
    checked against a block table of ``table_len`` ids."""
    first = min(t.token_start for t in transfers)
    end = -(-max(t.token_start + t.obj.num_tokens for t in transfers) // block_size)
    if end > table_len:
        raise LayoutError(
            f"the block table has {table_len} ids, but the chunks reach block {end - 1}"
        )
    return first // block_size, end


def group_offset(obj: MemoryObj, group: GroupPlan) -> int:
    return obj.layout.group_offsets(obj.num_tokens)[group.group.index]


def batches(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@dataclasses.dataclass(slots=True, eq=False)
class Fill:
    """One staging slot's worth of one group: (chunk, layer range) pieces, one launch plus its
    DMAs. ``completes``: model layers whose last piece is in this fill (layer-major order)."""

    group: GroupPlan
    pieces: list[tuple[ChunkTransfer, int, int]] = dataclasses.field(default_factory=list)
    completes: list[int] = dataclasses.field(default_factory=list)
    nbytes: int = 0


# A packed fill with its chunks as indexes into the call's transfers: group, pieces
# (transfer index, first layer, end layer), completed model layers, bytes.
FillShape = tuple[GroupPlan, tuple[tuple[int, int, int], ...], tuple[int, ...], int]
FILL_SHAPES_KEPT = 256


def slot_fills(
    plan: LayoutPlan,
    transfers: Sequence[ChunkTransfer],
    slot_bytes: int,
    *,
    ramp_up: bool,
    layers: Sequence[int] | None = None,
) -> Iterator[Fill]:
    """`pack_fills`' fills, the packing remembered per call shape (slot, direction, layers,
    each chunk's tokens) in ``plan``: a repeated shape costs one lookup, not a packing."""
    key = (
        slot_bytes,
        ramp_up,
        None if layers is None else tuple(layers),
        tuple([t.obj.num_tokens for t in transfers]),
    )
    shapes = plan.fill_shapes.get(key)
    if shapes is None:
        where = {id(t): i for i, t in enumerate(transfers)}
        shapes = [
            (
                fill.group,
                tuple((where[id(t)], l0, l1) for t, l0, l1 in fill.pieces),
                tuple(fill.completes),
                fill.nbytes,
            )
            for fill in pack_fills(plan, transfers, slot_bytes, ramp_up=ramp_up, layers=layers)
        ]
        if len(plan.fill_shapes) >= FILL_SHAPES_KEPT:
            plan.fill_shapes.clear()
        plan.fill_shapes[key] = shapes
    return (
        Fill(group, [(transfers[i], l0, l1) for i, l0, l1 in pieces], list(completes), nbytes)
        for group, pieces, completes, nbytes in shapes
    )


def pack_fills(
    plan: LayoutPlan,
    transfers: Sequence[ChunkTransfer],
    slot_bytes: int,
    *,
    ramp_up: bool,
    layers: Sequence[int] | None = None,
) -> Iterator[Fill]:
    """Pack (chunk, layer range) pieces of one group at a time into staging slots: each fill is
    at most ``slot_bytes`` and `MAX_JOBS` pieces. Without ``layers`` the order is chunk-major
    per group (every layer of chunk 0, then of chunk 1, ...); with ``layers`` (model layer
    indexes) it is layer-major: that layer of every chunk, then the next layer, each fill
    saying which layers it completes. The part of a call that nothing overlaps is kept short:
    a gather (kernel, then DMA) ramps up, its first fills 1/8, 1/4 and 1/2 of a slot, so the
    first DMA starts early; a scatter (DMA, then kernel) ramps down, each fill of the last
    slot's worth taking half of what is left (down to 1/8 of a slot), so the last kernel is
    short. A layer-major scatter (a layerwise load, which the model waits for layer by layer)
    also ramps up by layers: its first fills end after 1, 1, 2, 4, ... layers (`LAYER_RAMP`),
    so layer 0 lands after its own copies rather than a slot's, and each next layer lands
    before a model computing at up to half the copy rate needs it."""
    fills = 0
    remaining = 0
    if not ramp_up:  # the bytes of every piece, without planning them
        counts = (
            [group.num_layers for group in plan.groups]
            if layers is None
            else plan.layer_counts(layers)
        )
        tokens = sum(t.obj.num_tokens for t in transfers)  # slab bytes are linear in tokens
        remaining = sum(
            n * group.slab_bytes(1, tokens) for group, n in zip(plan.groups, counts, strict=True)
        )
    cap = 0
    # Layers the current fill may complete while a layer-major scatter ramps up (0: no limit),
    # and how many fills that limit has ended.
    quota = 1 if layers is not None and not ramp_up else 0
    ramped = 0

    def capacity() -> int:
        if ramp_up:
            return slot_bytes >> max(0, RAMP_STEPS - fills)
        if remaining > slot_bytes:
            return slot_bytes
        return max(slot_bytes >> RAMP_STEPS, remaining // 2)

    fill: Fill | None = None
    for group, transfer, l0, l1, per_layer, completes in _pieces(plan, transfers, layers):
        if per_layer > slot_bytes:
            raise ValueError(f"staging slot of {slot_bytes} bytes < one layer's {per_layer}")
        if fill is not None and fill.group is not group:
            yield fill
            fills += 1
            remaining -= fill.nbytes
            fill = None
        layer = l0
        while layer < l1:
            if fill is None:
                fill = Fill(group)
                cap = capacity()
            room = (max(cap, per_layer) - fill.nbytes) // per_layer
            if room <= 0 or len(fill.pieces) == MAX_JOBS:
                yield fill
                fills += 1
                remaining -= fill.nbytes
                fill = None
                continue
            end = min(l1, layer + room)
            fill.pieces.append((transfer, layer, end))
            fill.nbytes += (end - layer) * per_layer
            layer = end
        if completes is not None and fill is not None:
            fill.completes.append(completes)
            if quota and len(fill.completes) >= quota:
                full = fill.nbytes >= cap
                yield fill
                fills += 1
                ramped += 1
                remaining -= fill.nbytes
                fill = None
                # 1, 1, 2, 4, ... layers, until a fill holds a slot's worth anyway.
                quota = 0 if full or ramped >= LAYER_RAMP else 1 << max(0, ramped - 1)
    if fill is not None:
        yield fill


def _pieces(
    plan: LayoutPlan, transfers: Sequence[ChunkTransfer], layers: Sequence[int] | None
) -> Iterator[tuple[GroupPlan, ChunkTransfer, int, int, int, int | None]]:
    """(group, chunk, first layer, end layer, bytes of one layer of the chunk, model layer
    completed by this piece or None)."""
    if layers is None:
        for group in plan.groups:
            for transfer in transfers:
                per_layer = group.slab_bytes(1, transfer.obj.num_tokens)
                yield group, transfer, 0, group.num_layers, per_layer, None
        return
    places = plan.places
    # Per group, each chunk's one-layer bytes: the same for every layer of the group.
    sizes = {
        index: [group.slab_bytes(1, t.obj.num_tokens) for t in transfers]
        for index, group in enumerate(plan.groups)
    }
    last = len(transfers) - 1
    for layer in layers:
        index, local = places[layer]
        group = plan.groups[index]
        for i, (transfer, per_layer) in enumerate(zip(transfers, sizes[index], strict=True)):
            yield group, transfer, local, local + 1, per_layer, layer if i == last else None


def layer_ranges(
    plan: LayoutPlan, layers: Sequence[int] | None
) -> list[tuple[GroupPlan, list[tuple[int, int]]]]:
    """Per group, the [first, end) ranges of its local layers to move: all, or those of model
    ``layers`` (groups without any are left out)."""
    if layers is None:
        return [(group, [(0, group.num_layers)]) for group in plan.groups]
    places = plan.places
    local: dict[int, list[int]] = {}
    for layer in layers:
        index, position = places[layer]
        local.setdefault(index, []).append(position)
    out = []
    for index, positions in sorted(local.items()):
        ranges: list[tuple[int, int]] = []
        for position in sorted(positions):
            if ranges and ranges[-1][1] == position:
                ranges[-1] = (ranges[-1][0], position + 1)
            else:
                ranges.append((position, position + 1))
        out.append((plan.groups[index], ranges))
    return out


def runs(
    group: GroupPlan,
    block_size: int,
    block_ids: Sequence[int],
    transfer: ChunkTransfer,
    t_begin: int,
) -> list[tuple[int, int, int]]:
    """Maximal (paged offset, host offset, bytes) runs contiguous on both sides, for one
    (layer, K/V) of one chunk; the same for every layer of the group. Walks block segments, so
    NHD costs one step per block, not per token."""
    head_bytes, row = group.head_bytes, group.row_bytes
    rows_contiguous = group.head_stride == head_bytes
    tokens_contiguous = rows_contiguous and group.pos_stride == row
    runs: list[list[int]] = []

    def add(paged: int, host: int, nbytes: int) -> None:
        if runs:
            last = runs[-1]
            if last[0] + last[2] == paged and last[1] + last[2] == host:
                last[2] += nbytes
                return
        runs.append([paged, host, nbytes])

    t = t_begin
    end = transfer.obj.num_tokens
    while t < end:
        pos = transfer.token_start + t
        in_block = pos % block_size
        count = min(block_size - in_block, end - t)
        base = int(block_ids[pos // block_size]) * group.block_stride
        if tokens_contiguous:
            add(base + in_block * group.pos_stride, t * row, count * row)
        else:
            for i in range(count):
                paged = base + (in_block + i) * group.pos_stride
                if rows_contiguous:
                    add(paged, (t + i) * row, row)
                else:
                    for h in range(group.num_heads):
                        add(
                            paged + h * group.head_stride,
                            (t + i) * row + h * head_bytes,
                            head_bytes,
                        )
        t += count
    return [(run[0], run[1], run[2]) for run in runs]
