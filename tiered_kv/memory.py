"""`HostArena` (one big host region, pinned when CUDA is available) and `MemoryObj` (one chunk).

Owns every host byte the engine uses for KV: aligned first-fit allocation with coalescing free,
statistics, and per-chunk objects with reference counts. Running out of space is a return value
(``None``); the caller evicts and retries or skips the store. Not thread-safe: allocate, free and
change reference counts on the engine's event loop only. Other threads may read and write an
object's bytes while they hold a reference that the loop took for them.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import mmap
import os
from typing import Any

import torch

from tiered_kv.codec import GroupSpec
from tiered_kv.errors import TieredKVError
from tiered_kv.layout import DTYPE_NAMES, MemoryLayoutDesc

ALIGN = 256
_PAGE = 4096


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _cuda_check(status: object, what: str) -> None:
    code = int(getattr(status, "value", status))  # type: ignore[call-overload]
    if code != 0:
        raise TieredKVError(f"HostArena: {what} failed with CUDA error {code} ({status})")


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


@dataclasses.dataclass(frozen=True, slots=True)
class ArenaStats:
    capacity: int
    used: int
    free: int
    largest_free: int
    allocations: int
    failed_allocations: int
    pinned: bool


class HostArena:
    """A single host buffer carved into aligned allocations.

    ``pin``: True pins (needs CUDA), False never pins, None pins when CUDA is available.
    ``shared``: the buffer is a memfd mapping (Linux) that I/O worker processes map too
    (`shared_fd`, `mapped_bytes`); it has no name, so nothing outlives the processes that map it.
    """

    def __init__(
        self, capacity: int, *, pin: bool | None = None, align: int = ALIGN, shared: bool = False
    ) -> None:
        if capacity < align:
            raise ValueError(f"HostArena: capacity must be >= {align} bytes, got {capacity}")
        if align & (align - 1):
            raise ValueError(f"HostArena: align must be a power of two, got {align}")
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise TieredKVError("HostArena: pin=True needs CUDA, and none is available")
        self.align = align
        self.capacity = capacity - capacity % align
        self.pinned = bool(pin)
        # torch aligns CPU memory to 64 bytes only: over-allocate and start on a page boundary.
        # Pinning registers this plain allocation (cudaHostRegister) rather than using
        # pin_memory=True, whose caching allocator rounds sizes up to a power of two: a 40 GiB
        # arena would pin 64 GiB.
        base_align = max(align, _PAGE)
        registered = _round_up(self.capacity, _PAGE)
        self.shared_fd: int | None = None
        self.mapped_bytes = 0
        self._mapping: mmap.mmap | None = None
        if shared:
            if not hasattr(os, "memfd_create"):
                raise TieredKVError("HostArena: shared=True needs memfd_create (Linux)")
            fd = os.memfd_create("tkv-l1", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, registered)
                self._mapping = mmap.mmap(fd, registered)
            except BaseException:
                os.close(fd)
                raise
            self.shared_fd, self.mapped_bytes = fd, registered
            # A page-aligned mapping: no skip needed.
            raw = torch.frombuffer(self._mapping, dtype=torch.uint8)
            skip = 0
        else:
            raw = torch.empty(registered + base_align, dtype=torch.uint8)
            skip = (-raw.data_ptr()) % base_align
        self._tensor: torch.Tensor | None = raw[skip : skip + self.capacity]
        self.base_ptr = self._tensor.data_ptr()
        self._registered = 0
        if self.pinned:
            _cuda_check(
                _cudart().cudaHostRegister(self.base_ptr, registered, 0),
                f"cudaHostRegister of {registered} bytes",
            )
            self._registered = registered
        self._free_starts: list[int] = [0]
        self._free_sizes: dict[int, int] = {0: self.capacity}
        self._allocated: dict[int, int] = {}
        self._used = 0
        self._failed = 0

    # -- allocation -------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> int | None:
        """Offset of a fresh ``nbytes`` region (aligned), or None when no free run is big enough."""
        if nbytes < 1:
            raise ValueError(f"HostArena.allocate: nbytes must be >= 1, got {nbytes}")
        self._check_open()
        size = _round_up(nbytes, self.align)
        for index, start in enumerate(self._free_starts):
            run = self._free_sizes[start]
            if run >= size:
                del self._free_sizes[start]
                if run == size:
                    del self._free_starts[index]
                else:
                    self._free_starts[index] = start + size
                    self._free_sizes[start + size] = run - size
                self._allocated[start] = size
                self._used += size
                return start
        self._failed += 1
        return None

    def free(self, offset: int) -> None:
        size = self._allocated.pop(offset, None)
        if size is None:
            raise TieredKVError(f"HostArena.free: offset {offset} is not allocated (double free?)")
        self._used -= size
        index = bisect.bisect_left(self._free_starts, offset)
        if index < len(self._free_starts) and self._free_starts[index] == offset + size:
            size += self._free_sizes.pop(offset + size)
            del self._free_starts[index]
        if index > 0:
            prev = self._free_starts[index - 1]
            if prev + self._free_sizes[prev] == offset:
                self._free_sizes[prev] += size
                return
        self._free_starts.insert(index, offset)
        self._free_sizes[offset] = size

    def allocate_obj(self, layout: MemoryLayoutDesc, num_tokens: int) -> MemoryObj | None:
        """A `MemoryObj` for ``num_tokens`` tokens with one reference (the caller's), or None."""
        nbytes = layout.nbytes(num_tokens)
        offset = self.allocate(nbytes)
        if offset is None:
            return None
        return MemoryObj(self, offset, nbytes, layout, num_tokens)

    # -- access -----------------------------------------------------------------------------
    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        tensor = self._check_open()
        return tensor[offset : offset + nbytes]

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """A writable memoryview over arena bytes. It does not keep the arena alive: use it only
        while the arena is open and the allocation it points into is referenced."""
        self._check_open()
        array_type = ctypes.c_uint8 * nbytes
        return memoryview(array_type.from_address(self.base_ptr + offset)).cast("B")

    def stats(self) -> ArenaStats:
        free = self.capacity - self._used
        largest = max(self._free_sizes.values(), default=0)
        return ArenaStats(
            self.capacity,
            self._used,
            free,
            largest,
            len(self._allocated),
            self._failed,
            self.pinned,
        )

    @property
    def used(self) -> int:
        return self._used

    @property
    def closed(self) -> bool:
        return self._tensor is None

    def close(self) -> int:
        """Release the buffer. Returns the bytes still allocated (a leak if not 0)."""
        leaked = self._used
        if self._registered and self._tensor is not None:
            self._registered = 0
            _cuda_check(_cudart().cudaHostUnregister(self.base_ptr), "cudaHostUnregister")
        self._tensor = None
        if self.shared_fd is not None:
            os.close(self.shared_fd)
            self.shared_fd = None
            # The mapping goes with its last view (a caller may still hold a tensor of it).
            self._mapping = None
        return leaked

    def _check_open(self) -> torch.Tensor:
        if self._tensor is None:
            raise TieredKVError("HostArena is closed")
        return self._tensor


class MemoryObj:
    """One chunk's KV in host memory: group ``g`` is a ``[L, K, T, D]`` tensor at its offset.

    Created with one reference, owned by whoever allocated it. Each holder calls `unref` once;
    the bytes go back to the arena when the count reaches zero.
    """

    __slots__ = ("arena", "offset", "nbytes", "layout", "num_tokens", "_refs")

    def __init__(
        self, arena: HostArena, offset: int, nbytes: int, layout: MemoryLayoutDesc, num_tokens: int
    ) -> None:
        self.arena = arena
        self.offset = offset
        self.nbytes = nbytes
        self.layout = layout
        self.num_tokens = num_tokens
        self._refs = 1

    @property
    def refcount(self) -> int:
        return self._refs

    def ref(self) -> MemoryObj:
        if self._refs <= 0:
            raise TieredKVError("MemoryObj.ref: object already freed")
        self._refs += 1
        return self

    def unref(self) -> None:
        if self._refs <= 0:
            raise TieredKVError("MemoryObj.unref: reference count already zero")
        self._refs -= 1
        if self._refs == 0:
            self.arena.free(self.offset)

    def raw(self) -> torch.Tensor:
        """The chunk's logical bytes as a uint8 tensor (alignment gaps included)."""
        return self.arena.view(self.offset, self.nbytes)

    def group_bytes(self, group: int) -> torch.Tensor:
        """Group ``group`` as uint8 ``[L, K, T, row_bytes]``."""
        g = self.layout.groups[group]
        start = self.offset + self.layout.group_offsets(self.num_tokens)[group]
        flat = self.arena.view(start, g.nbytes(self.num_tokens))
        return flat.view(g.num_layers, g.kv_count, self.num_tokens, g.row_bytes)

    def group_tensor(self, group: int) -> torch.Tensor:
        """Group ``group`` as ``[L, K, T, D]`` of its dtype."""
        g = self.layout.groups[group]
        return self.group_bytes(group).view(g.dtype).view(g.shape(self.num_tokens))

    def group_buffers(self) -> list[memoryview]:
        """One memoryview per group, logical bytes only (what the codec stores)."""
        offsets = self.layout.group_offsets(self.num_tokens)
        return [
            self.arena.buffer(self.offset + off, g.nbytes(self.num_tokens))
            for off, g in zip(offsets, self.layout.groups, strict=True)
        ]

    def group_runs(self) -> list[tuple[int, int]]:
        """``(arena offset, length)`` of each group, in payload order: what `group_buffers`
        views, as an I/O worker process names it (it maps the arena itself)."""
        offsets = self.layout.group_offsets(self.num_tokens)
        return [
            (self.offset + off, g.nbytes(self.num_tokens))
            for off, g in zip(offsets, self.layout.groups, strict=True)
        ]

    def group_specs(self) -> tuple[GroupSpec, ...]:
        """The codec's view of the groups: one ``[L, K, T, D]`` spec each, as frames store
        them (L2 files and L3 frames)."""
        return tuple(
            GroupSpec(DTYPE_NAMES[group.dtype], group.shape(self.num_tokens))
            for group in self.layout.groups
        )

    def __repr__(self) -> str:
        return (
            f"MemoryObj(offset={self.offset}, nbytes={self.nbytes}, tokens={self.num_tokens}, "
            f"refs={self._refs})"
        )
