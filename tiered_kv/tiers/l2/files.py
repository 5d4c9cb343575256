"""The L2 directory's files: names, the `FileOps` seam and the blocking helpers.

Owns the naming of an L2 directory (``root/<2 hex>/<key hex>``, temp names, ``root/.lock``) and
the system calls every other part of `tiered_kv.tiers.l2` goes through (`FileOps`, the one seam
for I/O faults). Functions here block: they run on the tier's I/O threads, never on the loop.
Must not know about the index, the lock or the tier's policies.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import io
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import cast

from tiered_kv.codec import (
    MIN_HEADER_LEN,
    PREFIX_LEN,
    ChunkHeader,
    CodecLimits,
    decode_header,
    header_length,
)

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
TEMP_SUFFIX = ".tmp"
HEX_DIGITS = frozenset("0123456789abcdef")
# A chunk's read is split into parts of this many payload bytes (whole checksum stripes), which
# the tier's read threads run at once; each stripe is read in one call, then hashed. Writes hash
# each group just before writing it and write it in one call (files written in pieces read back
# slower). Measurements: docs/benchmarks.md, "L2 warm".
READ_SLICE_BYTES = 8 << 20
# Errors of a full filesystem or quota: evict and write again instead of failing every put.
NO_SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT))


def _load_syncfs() -> Callable[[int], int] | None:
    """libc's ``syncfs`` (Linux; ctypes drops the GIL around the call), or None."""
    try:
        function = ctypes.CDLL(None, use_errno=True).syncfs
    except (AttributeError, OSError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return cast("Callable[[int], int]", function)


_syncfs = _load_syncfs()


class FileOps:
    """The system calls through which `DiskTier` moves chunk files: the one seam for I/O faults.

    Tests pass a subclass to `DiskTier` (``file_ops=``) to fail or slow writes, reads and
    directory syncs the way a failing or full disk does (see
    `tiered_kv.tiers.testing.FullDiskFileOps`). Called from the tier's I/O threads, several at once:
    implementations must be thread-safe.
    """

    read_slice_bytes: int = READ_SLICE_BYTES
    """A chunk's read is split into parts of this many payload bytes (rounded down to whole
    checksum stripes, at least one), each on any free read thread."""

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        """`os.pwrite`: may write fewer bytes than given, raises `OSError` (e.g. ``ENOSPC``)."""
        return os.pwrite(fd, data, offset)

    def readinto(self, file: io.FileIO, buffer: memoryview) -> int:
        """`io.FileIO.readinto`: may read fewer bytes than asked (0 at end of file), raises
        `OSError` (e.g. ``EIO``)."""
        return file.readinto(buffer) or 0

    def fsync_directory(self, directory: Path) -> None:
        """Make ``directory``'s entries durable (a new file's name, a rename)."""
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def sync_filesystem(self, directory: Path) -> None:
        """Write back every dirty page and inode of ``directory``'s filesystem: ``syncfs`` on
        Linux (that filesystem alone), ``sync`` elsewhere."""
        if _syncfs is None:
            os.sync()
            return
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            if _syncfs(fd) != 0:
                code = ctypes.get_errno()
                raise OSError(code, f"syncfs of {directory}: {os.strerror(code)}")
        finally:
            os.close(fd)

    def free_bytes(self, directory: Path) -> int | None:
        """Bytes still free for us on ``directory``'s filesystem; None when that is unknown."""
        try:
            stat = os.statvfs(directory)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize


DEFAULT_FILE_OPS = FileOps()


@dataclasses.dataclass(slots=True)
class _SyncBatch:
    """Callers sharing one fsync of a directory; ``done`` once it returned or raised."""

    done: bool = False
    error: BaseException | None = None


@dataclasses.dataclass(slots=True)
class _DirectorySyncs:
    running: _SyncBatch | None = None
    pending: _SyncBatch | None = None  # joined by every caller until it starts
    members: int = 0  # callers of this directory inside `sync`


class DirectorySyncer:
    """Group commit of directory fsyncs: writers that renamed into one directory while an fsync
    of it was running share the next one, instead of each paying its own.

    `sync` returns once an fsync of the directory that began after the call returned: every
    rename the caller made before calling is durable then. At most one fsync of a directory
    runs at a time; callers arriving meanwhile join the batch that runs next (its first caller
    runs it once the current one ends). When that fsync raises, every caller of its batch gets
    the error. Thread-safe; blocks (the tier's write threads call it).
    """

    def __init__(self, file_ops: FileOps) -> None:
        self._file_ops = file_ops
        self._changed = threading.Condition()
        self._directories: dict[Path, _DirectorySyncs] = {}
        self.calls = 0  # fsyncs run (the batches), for stats and tests

    @property
    def busy_directories(self) -> int:
        """Directories with a caller inside `sync` now: state is kept for those only, so this
        returns to 0 once the writers are done (a gauge, and a leak check)."""
        with self._changed:
            return len(self._directories)

    def sync(self, directory: Path) -> None:
        with self._changed:
            state = self._directories.setdefault(directory, _DirectorySyncs())
            state.members += 1
            batch = state.pending
            if batch is None:
                batch = state.pending = _SyncBatch()
            try:
                while not batch.done:
                    if state.running is None and state.pending is batch:
                        state.pending, state.running = None, batch
                        self._run(directory, batch)
                        state.running = None
                        self._changed.notify_all()
                    else:
                        self._changed.wait()
            finally:
                state.members -= 1
                if not state.members:
                    del self._directories[directory]
        error = batch.error
        if isinstance(error, OSError):
            # A copy per caller: one exception object raised in several threads shares a traceback.
            raise OSError(error.errno, error.strerror, error.filename) from error
        if error is not None:
            raise error

    def _run(self, directory: Path, batch: _SyncBatch) -> None:
        """The batch's fsync, outside the condition's lock (called holding it)."""
        self._changed.release()
        try:
            self._file_ops.fsync_directory(directory)
        except BaseException as exc:
            batch.error = exc
        finally:
            self._changed.acquire()
            batch.done = True
            self.calls += 1


def write_all_at(
    file: io.FileIO, data: bytes | memoryview, offset: int, file_ops: FileOps = DEFAULT_FILE_OPS
) -> None:
    """Write every byte of ``data`` at ``offset`` (raw writes may be short)."""
    view = memoryview(data)
    fd = file.fileno()
    while view:
        written = file_ops.pwrite(fd, view, offset)
        if not written:
            raise OSError(f"write to {file.name!r} made no progress")
        view = view[written:]
        offset += written


def slices(buffer: memoryview, size: int) -> Iterator[memoryview]:
    for start in range(0, len(buffer), size):
        yield buffer[start : start + size]


def read_exact(file: io.FileIO, size: int) -> bytes:
    """Up to ``size`` bytes; fewer only at end of file."""
    parts = []
    remaining = size
    while remaining:
        part = file.read(remaining)
        if not part:
            break
        parts.append(part)
        remaining -= len(part)
    return b"".join(parts)


def readinto_exact(file: io.FileIO, buffer: memoryview, file_ops: FileOps) -> bool:
    """Fill ``buffer`` from ``file``; False when the file ends first."""
    filled = 0
    while filled < len(buffer):
        count = file_ops.readinto(file, buffer[filled:])
        if not count:
            return False
        filled += count
    return True


def read_header(file: io.FileIO, limits: CodecLimits) -> ChunkHeader:
    """The header at the start of ``file``; `CodecError` when torn or malformed.

    Leaves ``file`` at the payload's first byte.
    """
    # One read covers the usual header: none is shorter than MIN_HEADER_LEN.
    head = read_exact(file, MIN_HEADER_LEN)
    header_len = header_length(head[:PREFIX_LEN], limits)
    if header_len > len(head):
        head += read_exact(file, header_len - len(head))
    return decode_header(head, limits)


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning("L2: could not remove %s", path, exc_info=True)


def unlink_paths(paths: Sequence[Path]) -> None:
    for path in paths:
        unlink_quietly(path)


def vanished(paths: Sequence[Path]) -> list[bool]:
    """Which of ``paths`` no longer exist."""
    return [not os.path.lexists(path) for path in paths]


def set_mtimes(stamps: Sequence[tuple[Path, int]]) -> int:
    """Stamp each file's access and modification time; returns how many failed.

    A file that vanished is skipped: the read that finds it missing drops its entry.
    """
    failures = 0
    for path, stamp_ns in stamps:
        try:
            os.utime(path, ns=(stamp_ns, stamp_ns), follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError:
            failures += 1
            logger.debug("L2: could not stamp %s", path, exc_info=True)
    return failures


def is_shard_name(name: str) -> bool:
    return len(name) == 2 and set(name) <= HEX_DIGITS


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)
