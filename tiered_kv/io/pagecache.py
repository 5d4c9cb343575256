"""Whether a file's pages are in the page cache, asked without reading them in (``mincore``).

Standard library only, never tiered_kv: the I/O worker processes (`tiered_kv.io.worker`) load it
by path beside themselves, and the L2 tier's threads (`tiered_kv.tiers.l2`) import it.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable
from typing import cast


def _libc_mincore() -> Callable[..., int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    function.restype = ctypes.c_int
    return cast("Callable[..., int]", function)


_MINCORE = _libc_mincore()


def cached_fraction(fd: int, size: int, offset: int = 0, samples: int = 4) -> float | None:
    """The share of ``samples`` pages, evenly spread over bytes ``[offset, offset + size)`` of
    ``fd`` (the first and the last included), that are in the page cache: ``mincore`` on a
    private mapping, which asks and reads nothing in (``offset`` a multiple of
    `mmap.ALLOCATIONGRANULARITY`). Files are cached or not as a whole far more often than in
    part, so a few pages tell (every page of a 32 MiB file cost 0.8 ms to ask). None where the
    system cannot tell."""
    if _MINCORE is None or size <= 0 or offset % mmap.ALLOCATIONGRANULARITY:
        return None
    page = mmap.PAGESIZE
    last = (size - 1) // page
    picks = sorted({round(index * last / max(samples - 1, 1)) for index in range(samples)})
    vector = ctypes.c_ubyte()
    try:
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_COPY, offset=offset)
    except (OSError, ValueError):
        return None
    cached = 0
    try:
        anchor = ctypes.c_char.from_buffer(mapping)
        try:
            base = ctypes.addressof(anchor)
            for pick in picks:
                if _MINCORE(base + pick * page, page, ctypes.byref(vector)):
                    return None
                cached += vector.value & 1
        finally:
            del anchor  # the mapping cannot close while exported
    finally:
        mapping.close()
    return cached / len(picks)
