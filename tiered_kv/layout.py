"""KV format detection, per-group stride descriptors, and the host-side `MemoryLayoutDesc`.

Owns: turning an engine's per-layer KV tensors into layer groups whose blocks can be addressed as
``base(layer, kv) + block*block_stride + pos*pos_stride + head*head_stride + d`` (element strides,
the ``head_size`` elements contiguous), plus a zero-copy 4-D view ``[NB, BS, NH, HS]`` per
(layer, kv) for the torch reference mover. Reads shapes and strides only; never moves KV bytes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, cast

import torch
import xxhash

from tiered_kv.codec import DTYPES
from tiered_kv.errors import LayoutError

logger = logging.getLogger(__name__)

GROUP_ALIGN = 256
"""Each group's start inside a chunk's host buffer is aligned to this many bytes."""

FORMATS = ("vllm", "flashinfer", "mla", "separate", "fused", "blocks")
KV_LAYOUTS = ("NHD", "HND")
HINT_KEYS = ("format", "kv_layout", "block_size")

Format = Literal["vllm", "flashinfer", "mla", "separate", "fused", "blocks"]
KVLayout = Literal["NHD", "HND"]

# The codec's dtype table, as torch dtypes: one table for what KV may be and how frames store it.
DTYPE_NAMES: dict[torch.dtype, str] = {getattr(torch, name): name for name in DTYPES}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise LayoutError(
            f"unsupported KV dtype {dtype}; supported: {', '.join(DTYPE_NAMES.values())}"
        ) from None


def _align(value: int) -> int:
    return (value + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN


@dataclasses.dataclass(frozen=True, slots=True)
class GroupLayout:
    """Host layout of one layer group inside a chunk: a ``[L, K, T, D]`` tensor of ``dtype``.

    ``block_size`` 0: one row of D elements per token. Otherwise the group holds whole blocks of
    ``block_size`` tokens, each block's bytes in the engine's own order (``block_shape``: the
    block's dims in memory order), seen as ``block_size`` rows of D so the host layout stays
    ``[L, 1, T, D]``.
    """

    dtype: torch.dtype
    num_layers: int
    kv_count: int
    row_elems: int
    block_size: int = 0
    block_shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        if self.num_layers < 1 or self.kv_count not in (1, 2) or self.row_elems < 1:
            raise LayoutError(
                f"GroupLayout: need num_layers >= 1, kv_count in (1, 2), row_elems >= 1; got "
                f"{self.num_layers}, {self.kv_count}, {self.row_elems}"
            )
        if self.block_size < 0 or (self.block_size == 0) != (not self.block_shape):
            raise LayoutError(
                f"GroupLayout: block_size {self.block_size} and block_shape {self.block_shape} "
                "must be both set (whole blocks) or both unset (token rows)"
            )
        if self.block_size and math.prod(self.block_shape) != self.block_size * self.row_elems:
            raise LayoutError(
                f"GroupLayout: block_shape {self.block_shape} holds "
                f"{math.prod(self.block_shape)} elements, not block_size {self.block_size} x "
                f"row_elems {self.row_elems}"
            )
        if self.block_size and self.kv_count != 1:
            raise LayoutError("GroupLayout: whole-block groups have kv_count 1")

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.dtype.itemsize

    def shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.num_layers, self.kv_count, num_tokens, self.row_elems)

    def nbytes(self, num_tokens: int) -> int:
        return self.num_layers * self.kv_count * num_tokens * self.row_bytes

    def id_text(self) -> str:
        text = f"{DTYPE_NAMES[self.dtype]}:{self.num_layers}:{self.kv_count}:{self.row_elems}"
        if self.block_size:
            text += f":blocks{self.block_size}:" + "x".join(map(str, self.block_shape))
        return text


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryLayoutDesc:
    """How one chunk of T tokens lies in host memory: groups back to back, 256-byte aligned."""

    groups: tuple[GroupLayout, ...]
    chunk_size: int
    _offsets: dict[int, tuple[int, ...]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if not self.groups:
            raise LayoutError("MemoryLayoutDesc: needs at least one group")
        if self.chunk_size < 1:
            raise LayoutError(f"MemoryLayoutDesc: chunk_size must be >= 1, got {self.chunk_size}")

    def _check_tokens(self, num_tokens: int) -> None:
        if not 1 <= num_tokens <= self.chunk_size:
            raise LayoutError(
                f"num_tokens must be in [1, chunk_size={self.chunk_size}], got {num_tokens}"
            )

    def group_offsets(self, num_tokens: int) -> tuple[int, ...]:
        cached = self._offsets.get(num_tokens)
        if cached is not None:
            return cached
        self._check_tokens(num_tokens)
        offsets = []
        pos = 0
        for group in self.groups:
            pos = _align(pos)
            offsets.append(pos)
            pos += group.nbytes(num_tokens)
        self._offsets[num_tokens] = result = tuple(offsets)
        return result

    def nbytes(self, num_tokens: int) -> int:
        """Logical size of a chunk of ``num_tokens`` tokens (end of the last group)."""
        offsets = self.group_offsets(num_tokens)
        return offsets[-1] + self.groups[-1].nbytes(num_tokens)

    @property
    def token_multiple(self) -> int:
        """Chunks hold a multiple of this many tokens: the block size when a group holds whole
        blocks (a partial block is never stored), else 1."""
        return max((g.block_size for g in self.groups), default=0) or 1

    def payload_nbytes(self, num_tokens: int) -> int:
        """Bytes of KV without alignment gaps (what the codec stores)."""
        return sum(group.nbytes(num_tokens) for group in self.groups)

    @property
    def layout_id(self) -> str:
        """Short stable hash: a chunk is never read back with another dtype or head layout."""
        text = "tkv-layout-v1|" + "|".join(g.id_text() for g in self.groups)
        return xxhash.xxh3_64_hexdigest(text.encode())


@dataclasses.dataclass(frozen=True, slots=True)
class StrideDesc:
    """Element strides of one group's paged cache; ``head_size`` elements are contiguous."""

    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    block_stride: int
    pos_stride: int
    head_stride: int


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LayerGroup:
    """Layers sharing (format, per-layer shape, dtype, strides): moved by one kernel launch.

    ``kv_views[i][k]`` is a zero-copy ``[NB, BS, NH, HS]`` view of layer ``layer_indices[i]``'s
    K (k=0) or V (k=1) cache, or of its latent cache for MLA (K=1).
    """

    index: int
    format: Format
    kv_layout: KVLayout
    layer_indices: tuple[int, ...]
    strides: StrideDesc
    host: GroupLayout
    kv_views: tuple[tuple[torch.Tensor, ...], ...]

    def kv_pointers(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(view.data_ptr() for view in layer) for layer in self.kv_views)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class KVCacheLayout:
    """Every group of one registered set of KV caches plus the derived host layout."""

    groups: tuple[LayerGroup, ...]
    layout_desc: MemoryLayoutDesc
    block_size: int
    num_blocks: int
    device: torch.device
    layer_names: tuple[str, ...]

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)


@dataclasses.dataclass(frozen=True, slots=True)
class _Hints:
    format: Format | None
    kv_layout: KVLayout | None
    block_size: int | None

    def text(self) -> str:
        given = {k: getattr(self, k) for k in HINT_KEYS if getattr(self, k) is not None}
        return f"layout_hints={given}" if given else "no layout_hints"


_NO_HINTS = _Hints(None, None, None)


def _parse_hints(hints: Mapping[str, Any] | None) -> _Hints:
    hints = dict(hints or {})
    unknown = sorted(set(hints) - set(HINT_KEYS))
    if unknown:
        raise LayoutError(f"layout_hints: unknown keys {unknown}; allowed: {list(HINT_KEYS)}")
    fmt = hints.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise LayoutError(f"layout_hints['format']={fmt!r}; allowed: {list(FORMATS)}")
    kv_layout = hints.get("kv_layout")
    if isinstance(kv_layout, str):
        kv_layout = kv_layout.upper()
    if kv_layout is not None and kv_layout not in KV_LAYOUTS:
        raise LayoutError(f"layout_hints['kv_layout']={kv_layout!r}; allowed: {list(KV_LAYOUTS)}")
    block_size = hints.get("block_size")
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
    ):
        raise LayoutError(f"layout_hints['block_size'] must be a positive int, got {block_size!r}")
    return _Hints(fmt, cast("KVLayout | None", kv_layout), block_size)


# -- reading a tensor: every dim order the strides allow, then the hints ----------------------
# A template is a physical layout: the roles of the dims in memory order, outermost first
# (kv: the K/V pair, block, pos: position in block, head, elem: head_size, or D for MLA, or
# 2*HS for fused K/V). The last dim is always elem and contiguous. A reading assigns the other
# roles to the tensor's dims so that, among dims of size > 1, strides strictly decrease in the
# template's order: the tensor is a (possibly permuted) view of that physical layout. The dim
# order a tensor is *presented* in carries no information of its own; only `format` names which
# presented dims are K/V and blocks (the engine's shape convention, e.g. vLLM's [2, NB, ...]).


@dataclasses.dataclass(frozen=True, slots=True)
class _Template:
    format: Format
    kv_layout: KVLayout
    roles: tuple[str, ...]


def _pair_templates(fmt: Format, lead: tuple[str, ...]) -> tuple[_Template, ...]:
    return (
        _Template(fmt, "NHD", (*lead, "pos", "head", "elem")),
        _Template(fmt, "HND", (*lead, "head", "pos", "elem")),
    )


_FAMILIES: dict[str, tuple[_Template, ...]] = {
    "paged": (
        *_pair_templates("vllm", ("kv", "block")),
        *_pair_templates("flashinfer", ("block", "kv")),
    ),
    "mla": (_Template("mla", "NHD", ("block", "pos", "elem")),),
    "separate": _pair_templates("separate", ("block",)),
    "fused": _pair_templates("fused", ("block",)),
}
_FAMILY_OF: dict[str, str] = {
    "vllm": "paged",
    "flashinfer": "paged",
    "mla": "mla",
    "separate": "separate",
    "fused": "fused",
}
# `format` hints name where the engine's shape puts K/V and blocks (presented dims).
_PRESENTED = {"vllm": {"kv": 0, "block": 1}, "flashinfer": {"block": 0, "kv": 1}}
_SHAPES = {
    "paged": "vLLM [2, NB, BS, NH, HS] / FlashInfer [NB, 2, BS, NH, HS] (or HND)",
    "mla": "MLA [NB, BS, D]",
    "separate": "separate K/V, each [NB, BS, NH, HS] (or HND)",
    "fused": "fused [NB, NH, BS, 2*HS] (or NHD)",
}


@dataclasses.dataclass(frozen=True, slots=True)
class _Reading:
    template: _Template
    dims: tuple[int, ...]  # presented dim of each template role

    def dim(self, role: str) -> int:
        return self.dims[self.template.roles.index(role)]

    def size(self, shape: tuple[int, ...], role: str) -> int | None:
        return shape[self.dim(role)] if role in self.template.roles else None

    def presented_format(self) -> str | None:
        roles = self.template.roles
        if "kv" not in roles:
            return None
        for fmt, where in _PRESENTED.items():
            if all(self.dim(role) == dim for role, dim in where.items()):
                return fmt
        return None

    def views(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``[NB, BS, NH, HS]`` views, one per K/V (one for MLA)."""
        roles = self.template.roles
        if "head" not in roles:  # MLA: one head of D
            return (
                tensor.permute(self.dim("block"), self.dim("pos"), self.dim("elem")).unsqueeze(2),
            )
        order = [self.dim(r) for r in ("block", "pos", "head", "elem")]
        if "kv" in roles:
            kv = self.dim("kv")
            order = [d - (d > kv) for d in order]
            return tuple(tensor.select(kv, k).permute(order) for k in range(2))
        base = tensor.permute(order)
        if self.template.format == "fused":
            half = base.shape[3] // 2
            return (base[..., :half], base[..., half:])
        return (base,)

    def describe(self, shape: tuple[int, ...]) -> str:
        fmt = self.presented_format() or self.template.format
        sizes = {r: shape[d] for r, d in zip(self.template.roles, self.dims, strict=True)}
        heads = f", kv_heads={sizes['head']}" if "head" in sizes else ""
        layout = f" {self.template.kv_layout}" if "head" in sizes else ""
        return f"{fmt}{layout} (num_blocks={sizes['block']}, block_size={sizes['pos']}{heads})"


def _candidate_readings(
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    family: str,
    hints: _Hints,
    *,
    place_unit_dims: bool = False,
) -> list[_Reading]:
    """Every reading of a tensor the strides allow and the hints do not exclude."""
    out = []
    ndim = len(shape)
    for template in _FAMILIES[family]:
        if len(template.roles) != ndim:
            continue
        if (
            hints.kv_layout is not None
            and "head" in template.roles
            and template.kv_layout != hints.kv_layout
        ):
            continue
        for lead in itertools.permutations(range(ndim - 1)):
            reading = _Reading(template, (*lead, ndim - 1))
            if _strides_fit(reading, shape, strides, place_unit_dims) and _hints_fit(
                reading, shape, hints
            ):
                out.append(reading)
    return out


def _strides_fit(
    reading: _Reading, shape: tuple[int, ...], strides: tuple[int, ...], place_unit_dims: bool
) -> bool:
    """Each dim's stride covers the extent of the next one inward in the template's order (a
    non-overlapping nesting, padding allowed). A size-1 dim's stride is arbitrary in torch, so
    it is skipped, unless ``place_unit_dims``: then its stride as given places it too."""
    if "kv" in reading.template.roles and shape[reading.dim("kv")] != 2:
        return False
    inner_extent = 1  # elements spanned by the dims inside the current one
    for dim in reversed(reading.dims):
        if shape[dim] == 1 and not place_unit_dims:
            continue
        if strides[dim] < inner_extent:
            return False
        inner_extent = strides[dim] * shape[dim]
    return True


def _hints_fit(reading: _Reading, shape: tuple[int, ...], hints: _Hints) -> bool:
    if hints.block_size is not None and shape[reading.dim("pos")] != hints.block_size:
        return False
    where = _PRESENTED.get(hints.format or "")
    return where is None or all(reading.dim(role) == dim for role, dim in where.items())


def _addressing(views: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
    """What a reading addresses: equal for two readings that move the same bytes the same way."""
    return tuple(
        (
            v.storage_offset(),
            tuple(v.shape),
            tuple(
                0 if size == 1 else stride for size, stride in zip(v.shape, v.stride(), strict=True)
            ),
        )
        for v in views
    )


_reconciled_logged: set[tuple[Any, ...]] = set()


def _read_tensor(
    tensor: torch.Tensor, family: str, hints: _Hints, where: str
) -> tuple[_Reading, tuple[torch.Tensor, ...]]:
    """The one reading of ``tensor`` (its views), or a `LayoutError` naming the hint to pass.

    Size-1 dims are placed by their strides only when the other dims leave more than one
    reading: torch gives them the stride their place implies, but an engine may not."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    found = _distinct(tensor, _candidate_readings(shape, strides, family, hints))
    if len(found) > 1:
        placed = _distinct(
            tensor, _candidate_readings(shape, strides, family, hints, place_unit_dims=True)
        )
        if len(placed) == 1:
            found = placed
    if len(found) == 1:
        reading, views = next(iter(found.values()))
        _log_reconciled(reading, shape, strides, hints, where)
        return reading, views
    seen = f"{where}: shape {shape} with strides {strides}"
    if not found:
        unhinted = _distinct(tensor, _candidate_readings(shape, strides, family, _NO_HINTS))
        if unhinted and hints != _NO_HINTS:
            described = "; ".join(r.describe(shape) for r, _ in unhinted.values())
            raise LayoutError(
                f"{seen} cannot be read with {hints.text()}: without the hints it reads as "
                f"{described}"
            )
        raise LayoutError(
            f"{seen} fits no physical layout of {_SHAPES[family]} (dims in memory order by "
            "stride, the last contiguous)"
        )
    readings = [r for r, _ in found.values()]
    raise LayoutError(
        f"{seen} has {len(readings)} readings with {hints.text()}: "
        + "; ".join(r.describe(shape) for r in readings)
        + f". Pass {_settling_hints(readings, shape)} to say which"
    )


def _distinct(
    tensor: torch.Tensor, readings: list[_Reading]
) -> dict[tuple[Any, ...], tuple[_Reading, tuple[torch.Tensor, ...]]]:
    found: dict[tuple[Any, ...], tuple[_Reading, tuple[torch.Tensor, ...]]] = {}
    for reading in readings:
        views = reading.views(tensor)
        found.setdefault(_addressing(views), (reading, views))
    return found


def _settling_hints(readings: list[_Reading], shape: tuple[int, ...]) -> str:
    """The hints that tell these readings apart, as the user would write them."""
    values: dict[str, Callable[[_Reading], object]] = {
        "block_size": lambda r: r.size(shape, "pos"),
        "kv_layout": lambda r: r.template.kv_layout if "head" in r.template.roles else None,
        "format": _Reading.presented_format,
    }
    settling = []
    for key, value in values.items():
        seen = [value(r) for r in readings]
        if None not in seen and len(set(seen)) == len(seen):
            examples = " or ".join(repr(v) for v in dict.fromkeys(seen))
            settling.append(f"layout_hints={{'{key}': {examples}}}")
    if not settling:
        return "layout_hints with 'block_size' and 'kv_layout' (and 'format' for NB == 2)"
    return " or ".join(settling)


def _log_reconciled(
    reading: _Reading,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    hints: _Hints,
    where: str,
) -> None:
    """A kv_layout hint names the memory order; say so once when the shape is in the other."""
    roles = reading.template.roles
    if hints.kv_layout is None or "head" not in roles:
        return
    presented: KVLayout = "NHD" if reading.dim("pos") < reading.dim("head") else "HND"
    if presented == hints.kv_layout or min(shape[reading.dim(r)] for r in ("pos", "head")) == 1:
        return
    key = (shape, strides, hints)
    if key in _reconciled_logged:
        return
    _reconciled_logged.add(key)
    logger.info(
        "tiered_kv: %s: kv_layout=%r names the memory order; the shape %s is a %s-ordered view "
        "of it, read as %s",
        where,
        hints.kv_layout,
        shape,
        presented,
        reading.describe(shape),
    )


def _read_blocks(
    tensor: torch.Tensor, hints: _Hints, where: str
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Whole-block format: ``[NB, ...]`` whose every block is one contiguous range of elements
    in an order only the engine knows. Returns a ``[NB, BS, 1, D]`` view (rows of D = the block's
    elements / BS, in memory order) and the block's dims in memory order."""
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    seen = f"{where}: shape {shape} with strides {strides}"
    if hints.block_size is None:
        raise LayoutError(
            f"{where}: format 'blocks' needs layout_hints['block_size'] (tokens per block)"
        )
    if tensor.dim() < 2:
        raise LayoutError(f"{seen}: format 'blocks' needs [NB, ...] with at least 2 dims")
    inner = sorted(
        ((s, st) for s, st in zip(shape[1:], strides[1:], strict=True) if s > 1),
        key=lambda item: -item[1],
    )
    expected = 1
    for size, stride in reversed(inner):
        if stride != expected:
            raise LayoutError(
                f"{seen}: format 'blocks' needs each block (all dims after the first) to be one "
                "contiguous range of elements"
            )
        expected *= size
    block_elems = expected
    num_blocks, block_stride = shape[0], strides[0]
    if num_blocks > 1 and block_stride < block_elems:
        raise LayoutError(
            f"{seen}: blocks of {block_elems} elements overlap (stride {block_stride})"
        )
    if block_elems % hints.block_size:
        raise LayoutError(
            f"{seen}: a block of {block_elems} elements does not split into "
            f"block_size={hints.block_size} equal rows"
        )
    row = block_elems // hints.block_size
    view = tensor.as_strided(
        (num_blocks, hints.block_size, 1, row), (block_stride, row, row, 1), tensor.storage_offset()
    )
    return view, tuple(size for size, _ in inner)


def _family(entry: torch.Tensor | tuple[torch.Tensor, ...], hints: _Hints, where: str) -> str:
    if isinstance(entry, tuple):
        if len(entry) != 2:
            raise LayoutError(f"{where}: a tuple entry must be (K, V), got {len(entry)} tensors")
        if hints.format not in (None, "separate"):
            raise LayoutError(f"{where}: (K, V) tensors given but hint format={hints.format!r}")
        return "separate"
    shape = tuple(entry.shape)
    if hints.format is not None:
        if hints.format == "blocks":
            return "blocks"
        if hints.format == "separate":
            raise LayoutError(f"{where}: format 'separate' needs a (K, V) tuple per layer")
        family = _FAMILY_OF[hints.format]
        ndim = len(_FAMILIES[family][0].roles)
        if entry.dim() != ndim:
            raise LayoutError(
                f"{where}: format {hints.format!r} expects {ndim} dims, got shape {shape}"
            )
        return family
    by_ndim = {5: "paged", 3: "mla", 4: "fused"}
    if entry.dim() in by_ndim:
        return by_ndim[entry.dim()]
    raise LayoutError(
        f"{where}: cannot detect the KV format of shape {shape}; supported: vLLM "
        "[2, NB, BS, NH, HS], FlashInfer [NB, 2, BS, NH, HS], MLA [NB, BS, D], separate K/V "
        "tuples of [NB, BS, NH, HS], fused [NB, NH, BS, 2*HS], and with "
        "layout_hints={'format': 'blocks'} any [NB, ...] moved as whole blocks"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class _LayerRead:
    format: Format
    kv_layout: KVLayout
    views: tuple[torch.Tensor, ...]
    block_shape: tuple[int, ...] = ()


def _read_layer(
    entry: torch.Tensor | tuple[torch.Tensor, ...], hints: _Hints, where: str
) -> _LayerRead:
    family = _family(entry, hints, where)
    if family == "blocks":
        assert isinstance(entry, torch.Tensor)
        view, block_shape = _read_blocks(entry, hints, where)
        return _LayerRead("blocks", "NHD", (view,), block_shape)
    tensor = entry[0] if isinstance(entry, tuple) else entry
    if isinstance(entry, tuple):
        key, value = entry
        if key.shape != value.shape or key.dtype != value.dtype or key.device != value.device:
            raise LayoutError(
                f"{where}: K and V differ: {tuple(key.shape)} {key.dtype} {key.device} vs "
                f"{tuple(value.shape)} {value.dtype} {value.device}"
            )
        if key.dim() != 4:
            raise LayoutError(
                f"{where}: separate K/V tensors must be [NB, BS, NH, HS], got {tuple(key.shape)}"
            )
        if key.stride() != value.stride():
            raise LayoutError(
                f"{where}: K and V have different strides {key.stride()} and {value.stride()}"
            )
    if family == "fused" and tensor.shape[-1] % 2:
        raise LayoutError(
            f"{where}: fused K/V shape {tuple(tensor.shape)} needs an even last dim (2*HS)"
        )
    reading, views = _read_tensor(tensor, family, hints, where)
    if isinstance(entry, tuple):
        views = (views[0], reading.views(entry[1])[0])
    fmt = hints.format if hints.format is not None else reading.template.format
    return _LayerRead(fmt, reading.template.kv_layout, views)


def _normalize_entries(
    kv_caches: Sequence[Any] | Mapping[str, Any],
) -> list[tuple[str, torch.Tensor | tuple[torch.Tensor, ...]]]:
    items = (
        list(kv_caches.items())
        if isinstance(kv_caches, Mapping)
        else [(f"layer{i}", entry) for i, entry in enumerate(kv_caches)]
    )
    if not items:
        raise LayoutError("kv_caches: no layers given")
    out: list[tuple[str, torch.Tensor | tuple[torch.Tensor, ...]]] = []
    for name, entry in items:
        if isinstance(entry, torch.Tensor):
            out.append((str(name), entry))
        elif isinstance(entry, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in entry):
            out.append((str(name), tuple(entry)))
        else:
            raise LayoutError(
                f"kv_caches[{name!r}]: expected a tensor or a (K, V) pair of tensors, got "
                f"{type(entry).__name__}"
            )
    return out


def build_layout(
    kv_caches: Sequence[Any] | Mapping[str, Any],
    *,
    chunk_size: int,
    layout_hints: Mapping[str, Any] | None = None,
) -> KVCacheLayout:
    """Read every layer's format from its strides and the hints, group layers, and derive the
    host `MemoryLayoutDesc`. A layer with more than one reading raises, naming the hint that
    settles it (docs/layouts.md)."""
    hints = _parse_hints(layout_hints)
    entries = _normalize_entries(kv_caches)
    device: torch.device | None = None
    group_index: dict[tuple[Any, ...], int] = {}
    builders: list[dict[str, Any]] = []
    for layer, (name, entry) in enumerate(entries):
        where = f"kv_caches[{name!r}]"
        tensors = entry if isinstance(entry, tuple) else (entry,)
        for tensor in tensors:
            dtype_name(tensor.dtype)
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                raise LayoutError(f"{where}: on {tensor.device}, other layers on {device}")
            if min(tensor.shape, default=1) < 1:
                raise LayoutError(f"{where}: empty dimension in {tuple(tensor.shape)}")
            if hints.format != "blocks" and tensor.dim() and tensor.stride(-1) != 1:
                raise LayoutError(
                    f"{where}: the last dim must be contiguous (stride 1), got strides "
                    f"{tuple(tensor.stride())}"
                )
        read = _read_layer(entry, hints, where)
        first = read.views[0]
        num_blocks, block_size, num_heads, head_size = first.shape
        s_block, s_pos, s_head, _ = first.stride()
        strides = StrideDesc(num_blocks, block_size, num_heads, head_size, s_block, s_pos, s_head)
        signature = (
            read.format,
            read.kv_layout,
            first.dtype,
            len(read.views),
            strides,
            read.block_shape,
        )
        if signature not in group_index:
            group_index[signature] = len(builders)
            builders.append({"read": read, "strides": strides, "layers": [], "views": []})
        builder = builders[group_index[signature]]
        builder["layers"].append(layer)
        builder["views"].append(read.views)
    assert device is not None
    block_sizes = {b["strides"].block_size for b in builders}
    if len(block_sizes) != 1:
        raise LayoutError(
            f"kv_caches: layer groups use different block sizes {sorted(block_sizes)}; one block "
            "table needs one block size"
        )
    block_size = block_sizes.pop()
    if hints.block_size is not None and hints.block_size != block_size:
        raise LayoutError(
            f"layout_hints['block_size']={hints.block_size} but the caches have block size "
            f"{block_size}"
        )
    groups = []
    for index, b in enumerate(builders):
        s: StrideDesc = b["strides"]
        first_read: _LayerRead = b["read"]
        whole = first_read.format == "blocks"
        host = GroupLayout(
            first_read.views[0].dtype,
            len(b["layers"]),
            len(first_read.views),
            s.num_heads * s.head_size,
            block_size=block_size if whole else 0,
            block_shape=first_read.block_shape,
        )
        groups.append(
            LayerGroup(
                index,
                first_read.format,
                first_read.kv_layout,
                tuple(b["layers"]),
                s,
                host,
                tuple(b["views"]),
            )
        )
    desc = MemoryLayoutDesc(tuple(g.host for g in groups), chunk_size)
    if chunk_size % desc.token_multiple:
        raise LayoutError(
            f"chunk_size {chunk_size} is not a whole number of blocks of {block_size}: caches "
            "in format 'blocks' are stored as whole blocks"
        )
    return KVCacheLayout(
        groups=tuple(groups),
        layout_desc=desc,
        block_size=block_size,
        num_blocks=min(g.strides.num_blocks for g in groups),
        device=device,
        layer_names=tuple(name for name, _ in entries),
    )


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
