"""SGLang host-pool pages as chunks our lower tiers read and write, with no second host copy.

Owns `PageGeometry` (what one page of a host pool is: read from the pool's own page view,
``get_data_page(index, flat=False)``, never from layout names) and `PageObj`, the `MemoryObj`
the tiers are handed for one page. A page's bytes are stored in SGLang's flat-page order (the
order of ``get_data_page(index, flat=True)``, which the generic verbs move), cut into groups
where the pool's view is contiguous, so the zero-copy verbs and the generic verbs write the
same frames. When the view has more contiguous runs than a frame holds groups (layer-first
pools of many layers) the groups are coarser and each is staged through a bounce buffer.

Must not import SGLang (the pool is consumed through `HostPool`) or keep a page after the call
that lent it. Threads: a `PageObj` is built and finished on the caller's thread; the tiers read
and write its buffers on the backend's loop while that caller waits.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, cast

import torch

from tiered_kv.codec import DEFAULT_LIMITS, GroupSpec
from tiered_kv.errors import LayoutError, TieredKVError
from tiered_kv.layout import DTYPE_NAMES
from tiered_kv.memory import HostArena, MemoryObj


class HostPool(Protocol):
    """What we consume of SGLang's ``HostKVCache`` (MHA and MLA host pools)."""

    page_size: int
    dtype: torch.dtype
    layout: str
    size: int

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor: ...

    def get_dummy_flat_data_page(self) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True, slots=True)
class PoolRegion:
    """The host pool's buffer, as a tier's connector may ask for it (``arena.base_ptr``,
    ``arena.capacity``: `RemoteConnector.use_host_memory`). Not an arena: it allocates nothing."""

    base_ptr: int
    capacity: int


@dataclasses.dataclass(frozen=True, slots=True)
class PageGeometry:
    """One page of a host pool: its view's shape, the leading dims that split it into groups,
    and the groups' specs. ``zero_copy``: every group is contiguous in the pool."""

    layout: str
    page_size: int
    dtype_name: str
    page_shape: tuple[int, ...]
    split_dims: int
    specs: tuple[GroupSpec, ...]
    zero_copy: bool

    @property
    def nbytes(self) -> int:
        return sum(spec.nbytes for spec in self.specs)

    @property
    def layout_id(self) -> str:
        """The page format, for chunk keys: pages of two formats never share a key."""
        shape = "x".join(map(str, self.page_shape))
        return f"sglang:{self.layout}:{self.dtype_name}:{shape}:split{self.split_dims}"

    @classmethod
    def read(cls, pool: HostPool, *, max_groups: int = DEFAULT_LIMITS.max_groups) -> PageGeometry:
        """The geometry of ``pool``'s pages, from its first page's view; `LayoutError` when
        the pool's pages are not views of one CPU buffer we can name."""
        layout = getattr(pool, "layout", None)
        page_size = getattr(pool, "page_size", None)
        if not isinstance(layout, str) or not isinstance(page_size, int) or page_size < 1:
            raise LayoutError(
                f"SGLang host pool {type(pool).__name__}: no readable 'layout' / 'page_size' "
                f"(got layout={layout!r}, page_size={page_size!r})"
            )
        dtype = getattr(pool, "dtype", None)
        if dtype not in DTYPE_NAMES:
            raise LayoutError(
                f"SGLang host pool {type(pool).__name__}: KV dtype {dtype} is not one we store; "
                f"supported: {sorted(DTYPE_NAMES.values())}"
            )
        try:
            view = pool.get_data_page(0, flat=False)
        except Exception as exc:  # the pool's own refusal, e.g. "Unsupported layout"
            raise LayoutError(
                f"SGLang host pool {type(pool).__name__} (layout {layout!r}): cannot take a page "
                f"view ({type(exc).__name__}: {exc})"
            ) from exc
        check_page_view(pool, view, 0)
        shape = tuple(view.shape)
        split = _contiguous_split(view)
        zero_copy = math.prod(shape[:split]) <= max_groups
        if not zero_copy:
            # Coarser groups (each staged): the most leading dims whose count still fits.
            split = max(k for k in range(split) if math.prod(shape[:k]) <= max_groups)
        group_shape = shape[split:] or (1,)
        count = math.prod(shape[:split])
        spec = GroupSpec(DTYPE_NAMES[dtype], tuple(group_shape))
        return cls(layout, page_size, spec.dtype, shape, split, (spec,) * count, zero_copy)

    def page_view(self, pool: HostPool, region: PoolRegion, index: int) -> torch.Tensor:
        """The pool's view of the page starting at token ``index``, checked against this
        geometry (a pool that changed its page shape is refused, not misread) and against the
        pool's buffer ``region`` (`pool_region`)."""
        view = pool.get_data_page(index, flat=False)
        if tuple(view.shape) != self.page_shape:
            raise LayoutError(
                f"SGLang host pool: page at {index} has shape {tuple(view.shape)}, expected "
                f"{self.page_shape}"
            )
        check_page_view(pool, view, index, region)
        return view

    def groups_of_view(self, view: torch.Tensor) -> list[torch.Tensor]:
        """``view`` cut into this geometry's groups, in flat order (views, no copy)."""
        return _split_leading(view, self.split_dims)

    def groups_of_flat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat page tensor (SGLang's generic verbs) cut into this geometry's groups."""
        if flat.device.type != "cpu" or not flat.is_contiguous():
            raise LayoutError("SGLang flat page: expected a contiguous CPU tensor")
        if flat.dtype != torch.uint8 and DTYPE_NAMES.get(flat.dtype) != self.dtype_name:
            raise LayoutError(f"SGLang flat page: dtype {flat.dtype}, expected {self.dtype_name}")
        raw = flat.reshape(-1).view(torch.uint8)
        if raw.numel() != self.nbytes:
            raise LayoutError(
                f"SGLang flat page: {raw.numel()} bytes, expected {self.nbytes} (one page)"
            )
        size = self.specs[0].nbytes
        return [raw[i * size : (i + 1) * size] for i in range(len(self.specs))]


def check_page_view(
    pool: HostPool, view: torch.Tensor, index: int, region: PoolRegion | None = None
) -> None:
    """Refuse a page view that is not a CPU view into the pool's own buffer (``region``:
    `pool_region` of ``pool``, read here when not given)."""
    if not isinstance(view, torch.Tensor) or view.device.type != "cpu":
        raise LayoutError(
            f"SGLang host pool {type(pool).__name__}: page {index} is not a CPU tensor view"
        )
    region = pool_region(pool) if region is None else region
    start = view.data_ptr()
    span = (
        sum((size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True)) + 1
    ) * view.element_size()
    if not (region.base_ptr <= start and start + span <= region.base_ptr + region.capacity):
        raise LayoutError(
            f"SGLang host pool {type(pool).__name__}: page {index}'s view lies outside its "
            "kv_buffer (a copy, not a view): cannot move it without a second copy"
        )


def pool_region(pool: HostPool) -> PoolRegion:
    """The pool's one host buffer (``kv_buffer``), or `LayoutError` when it has no single one."""
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
        raise LayoutError(
            f"SGLang host pool {type(pool).__name__}: expected one CPU tensor 'kv_buffer', got "
            f"{type(buffer).__name__} (a pool with several buffers is not supported yet)"
        )
    return PoolRegion(buffer.data_ptr(), buffer.numel() * buffer.element_size())


def _contiguous_split(view: torch.Tensor) -> int:
    """The fewest leading dims whose every index selects a contiguous block of ``view``."""
    for split in range(view.dim() + 1):
        sub = view[(0,) * split] if split else view
        if sub.is_contiguous():
            return split
    return view.dim()  # pragma: no cover - a 0-d tensor is contiguous


def _split_leading(view: torch.Tensor, dims: int) -> list[torch.Tensor]:
    if dims == 0:
        return [view]
    groups: list[torch.Tensor] = []
    for index in range(view.shape[0]):
        groups.extend(_split_leading(view[index], dims - 1))
    return groups


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a contiguous CPU tensor's bytes (no copy)."""
    raw = tensor.reshape(-1).view(torch.uint8)
    return raw.numpy().data.cast("B")


class PageObj(MemoryObj):
    """One page lent to the tiers for one call: its groups' buffers are the pool's own memory
    (or bounce buffers where the geometry is not zero-copy). Not reference-counted: the backend
    holds it for the call; the tiers never keep it (their contract). Only the verbs the lower
    tiers use are offered; the L1-arena ones raise."""

    __slots__ = ("_groups", "_bounces", "_specs")

    def __init__(
        self, geometry: PageGeometry, groups: list[torch.Tensor], region: PoolRegion
    ) -> None:
        if len(groups) != len(geometry.specs):
            raise TieredKVError(f"PageObj: {len(groups)} groups for {len(geometry.specs)} specs")
        # The tiers read `arena.base_ptr` / `arena.capacity` only (a connector's
        # use_host_memory); the I/O plane is never offered to these tiers.
        self.arena = cast(HostArena, region)
        self.offset = 0
        self.nbytes = geometry.nbytes
        self.num_tokens = geometry.page_size
        self._refs = 1
        self._specs = geometry.specs
        self._groups = groups
        self._bounces: list[torch.Tensor | None] = [
            None
            if group.is_contiguous()
            else torch.empty_like(group, memory_format=torch.contiguous_format)
            for group in groups
        ]

    def stage_for_write(self) -> None:
        """Copy non-contiguous groups into their bounce buffers (before a put)."""
        for group, bounce in zip(self._groups, self._bounces, strict=True):
            if bounce is not None:
                bounce.copy_(group)

    def finish_read(self) -> None:
        """Copy bounce buffers back into the pool (after a successful get)."""
        for group, bounce in zip(self._groups, self._bounces, strict=True):
            if bounce is not None:
                group.copy_(bounce)

    def group_specs(self) -> tuple[GroupSpec, ...]:
        return self._specs

    def group_buffers(self) -> list[memoryview]:
        return [
            _byte_view(group if bounce is None else bounce)
            for group, bounce in zip(self._groups, self._bounces, strict=True)
        ]

    def group_runs(self) -> list[tuple[int, int]]:
        raise TieredKVError("PageObj: not in an I/O-plane arena (the plane is not offered)")

    def raw(self) -> torch.Tensor:
        raise TieredKVError("PageObj: a page is not one arena range")

    def group_bytes(self, group: int) -> torch.Tensor:
        raise TieredKVError("PageObj: a page is not one arena range")

    def group_tensor(self, group: int) -> torch.Tensor:
        return self._groups[group]

    def __repr__(self) -> str:
        return f"PageObj(groups={len(self._groups)}, nbytes={self.nbytes})"
