"""KV format detection, per-group stride descriptors, and the host-side `MemoryLayoutDesc`.

Owns: turning an engine's per-layer KV tensors into layer groups whose blocks can be addressed as
``base(layer, kv) + block*block_stride + pos*pos_stride + head*head_stride + d`` (element strides,
the ``head_size`` elements contiguous), plus a zero-copy 4-D view ``[NB, BS, NH, HS]`` per
(layer, kv) for the torch reference mover. Reads shapes and strides only; never moves KV bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import torch
import xxhash

from tiered_kv.errors import LayoutError

GROUP_ALIGN = 256
"""Each group's start inside a chunk's host buffer is aligned to this many bytes."""

FORMATS = ("vllm", "flashinfer", "mla", "separate", "fused")
KV_LAYOUTS = ("NHD", "HND")
HINT_KEYS = ("format", "kv_layout", "block_size")

Format = Literal["vllm", "flashinfer", "mla", "separate", "fused"]
KVLayout = Literal["NHD", "HND"]

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
}
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
    """Host layout of one layer group inside a chunk: a ``[L, K, T, D]`` tensor of ``dtype``."""

    dtype: torch.dtype
    num_layers: int
    kv_count: int
    row_elems: int

    def __post_init__(self) -> None:
        dtype_name(self.dtype)
        if self.num_layers < 1 or self.kv_count not in (1, 2) or self.row_elems < 1:
            raise LayoutError(
                f"GroupLayout: need num_layers >= 1, kv_count in (1, 2), row_elems >= 1; got "
                f"{self.num_layers}, {self.kv_count}, {self.row_elems}"
            )

    @property
    def row_bytes(self) -> int:
        return self.row_elems * self.dtype.itemsize

    def shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.num_layers, self.kv_count, num_tokens, self.row_elems)

    def nbytes(self, num_tokens: int) -> int:
        return self.num_layers * self.kv_count * num_tokens * self.row_bytes


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

    def payload_nbytes(self, num_tokens: int) -> int:
        """Bytes of KV without alignment gaps (what the codec stores)."""
        return sum(group.nbytes(num_tokens) for group in self.groups)

    @property
    def layout_id(self) -> str:
        """Short stable hash: a chunk is never read back with another dtype or head layout."""
        text = "tkv-layout-v1|" + "|".join(
            f"{DTYPE_NAMES[g.dtype]}:{g.num_layers}:{g.kv_count}:{g.row_elems}" for g in self.groups
        )
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


def _token_head_order(
    dims: tuple[int, int], hints: _Hints, default: KVLayout, where: str
) -> KVLayout:
    """Which of two dims is (block position, head): NHD = (BS, NH), HND = (NH, BS)."""
    if hints.kv_layout is not None:
        return hints.kv_layout
    if hints.block_size is not None:
        first, second = dims
        if first == hints.block_size and second != hints.block_size:
            return "NHD"
        if second == hints.block_size and first != hints.block_size:
            return "HND"
        if hints.block_size not in dims:
            raise LayoutError(
                f"{where}: layout_hints['block_size']={hints.block_size} matches neither of the "
                f"dims {dims}"
            )
    return default


def _four_d(view: torch.Tensor, order: KVLayout) -> torch.Tensor:
    """``[NB, a, b, HS]`` → ``[NB, BS, NH, HS]`` (a permuted view for HND order)."""
    return view if order == "NHD" else view.permute(0, 2, 1, 3)


def _detect_format(
    entry: torch.Tensor | tuple[torch.Tensor, ...], hints: _Hints, where: str
) -> Format:
    if isinstance(entry, tuple):
        if len(entry) != 2:
            raise LayoutError(f"{where}: a tuple entry must be (K, V), got {len(entry)} tensors")
        if hints.format not in (None, "separate"):
            raise LayoutError(f"{where}: (K, V) tensors given but hint format={hints.format!r}")
        return "separate"
    shape = tuple(entry.shape)
    if hints.format is not None:
        expected_ndim = {"vllm": 5, "flashinfer": 5, "mla": 3, "separate": 4, "fused": 4}
        if hints.format == "separate":
            raise LayoutError(f"{where}: format 'separate' needs a (K, V) tuple per layer")
        if entry.dim() != expected_ndim[hints.format]:
            raise LayoutError(
                f"{where}: format {hints.format!r} expects {expected_ndim[hints.format]} dims, "
                f"got shape {shape}"
            )
        return hints.format
    if entry.dim() == 5:
        if shape[0] == 2 and shape[1] != 2:
            return "vllm"
        if shape[1] == 2 and shape[0] != 2:
            return "flashinfer"
        if shape[0] == 2 and shape[1] == 2:
            raise LayoutError(
                f"{where}: shape {shape} is ambiguous between vLLM [2, NB, BS, NH, HS] and "
                "FlashInfer [NB, 2, BS, NH, HS]; pass layout_hints={'format': 'vllm'} or "
                "{'format': 'flashinfer'}"
            )
        raise LayoutError(
            f"{where}: 5-D shape {shape} has no K/V dimension of size 2 in position 0 (vLLM "
            "[2, NB, BS, NH, HS]) or 1 (FlashInfer [NB, 2, BS, NH, HS])"
        )
    if entry.dim() == 3:
        return "mla"
    if entry.dim() == 4:
        return "fused"
    raise LayoutError(
        f"{where}: cannot detect the KV format of shape {shape}; supported: vLLM "
        "[2, NB, BS, NH, HS], FlashInfer [NB, 2, BS, NH, HS], MLA [NB, BS, D], separate K/V "
        "tuples of [NB, BS, NH, HS], fused [NB, NH, BS, 2*HS]"
    )


def _kv_views(
    entry: torch.Tensor | tuple[torch.Tensor, ...], fmt: Format, hints: _Hints, where: str
) -> tuple[tuple[torch.Tensor, ...], KVLayout]:
    """Per-kv ``[NB, BS, NH, HS]`` views of one layer, plus the head/token order found."""
    if fmt == "separate":
        assert isinstance(entry, tuple)
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
        order = _token_head_order((key.shape[1], key.shape[2]), hints, "NHD", where)
        return (_four_d(key, order), _four_d(value, order)), order
    assert isinstance(entry, torch.Tensor)
    if fmt == "vllm":
        order = _token_head_order((entry.shape[2], entry.shape[3]), hints, "NHD", where)
        return (_four_d(entry[0], order), _four_d(entry[1], order)), order
    if fmt == "flashinfer":
        order = _token_head_order((entry.shape[2], entry.shape[3]), hints, "NHD", where)
        return (_four_d(entry[:, 0], order), _four_d(entry[:, 1], order)), order
    if fmt == "mla":
        return (entry.unsqueeze(2),), "NHD"
    # fused: [NB, NH, BS, 2*HS] by default, K in the first half of the last dim.
    width = entry.shape[3]
    if width % 2:
        raise LayoutError(
            f"{where}: fused K/V shape {tuple(entry.shape)} needs an even last dim (2*HS)"
        )
    half = width // 2
    order = _token_head_order((entry.shape[1], entry.shape[2]), hints, "HND", where)
    return (_four_d(entry[..., :half], order), _four_d(entry[..., half:], order)), order


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
    """Detect every layer's format, group layers, and derive the host `MemoryLayoutDesc`."""
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
            if tensor.dim() and tensor.stride(-1) != 1:
                raise LayoutError(
                    f"{where}: the last dim must be contiguous (stride 1), got strides "
                    f"{tuple(tensor.stride())}"
                )
        fmt = _detect_format(entry, hints, where)
        views, order = _kv_views(entry, fmt, hints, where)
        first = views[0]
        if any(v.shape != first.shape or v.stride() != first.stride() for v in views[1:]):
            raise LayoutError(f"{where}: K and V views have different shapes or strides")
        num_blocks, block_size, num_heads, head_size = first.shape
        if min(first.shape) < 1:
            raise LayoutError(f"{where}: empty dimension in {tuple(first.shape)}")
        s_block, s_pos, s_head, s_elem = first.stride()
        if s_elem != 1:
            raise LayoutError(f"{where}: head_size elements must be contiguous")
        strides = StrideDesc(num_blocks, block_size, num_heads, head_size, s_block, s_pos, s_head)
        signature = (fmt, order, first.dtype, len(views), strides)
        if signature not in group_index:
            group_index[signature] = len(builders)
            builders.append(
                {
                    "format": fmt,
                    "order": order,
                    "strides": strides,
                    "dtype": first.dtype,
                    "kv_count": len(views),
                    "layers": [],
                    "views": [],
                }
            )
        builder = builders[group_index[signature]]
        builder["layers"].append(layer)
        builder["views"].append(tuple(views))
    assert device is not None
    block_sizes = {b["strides"].block_size for b in builders}
    if len(block_sizes) != 1:
        raise LayoutError(
            f"kv_caches: layer groups use different block sizes {sorted(block_sizes)}; one block "
            "table needs one block size"
        )
    if hints.block_size is not None and hints.block_size not in block_sizes:
        raise LayoutError(
            f"layout_hints['block_size']={hints.block_size} but the caches have block size "
            f"{block_sizes.pop()}"
        )
    groups = []
    for index, b in enumerate(builders):
        s: StrideDesc = b["strides"]
        host = GroupLayout(b["dtype"], len(b["layers"]), b["kv_count"], s.num_heads * s.head_size)
        groups.append(
            LayerGroup(
                index, b["format"], b["order"], tuple(b["layers"]), s, host, tuple(b["views"])
            )
        )
    desc = MemoryLayoutDesc(tuple(g.host for g in groups), chunk_size)
    return KVCacheLayout(
        groups=tuple(groups),
        layout_desc=desc,
        block_size=block_sizes.pop(),
        num_blocks=min(g.strides.num_blocks for g in groups),
        device=device,
        layer_names=tuple(name for name, _ in entries),
    )


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)
