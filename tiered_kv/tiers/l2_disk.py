"""`DiskTier` (L2): one checksummed codec frame per chunk, in files under a local directory.

Owns the files under ``root``, their index (key → file, LRU order, bytes used) and the directory
lock. A chunk lives at ``root/<first 2 hex>/<key hex>``; it is written to a temp name in the same
directory, fsynced and renamed, so neither readers nor a restarted process ever see half a chunk.
``root/.lock`` (flock) keeps a second tier out of the directory. `open` rebuilds the index from
the files' headers; torn, corrupt or misnamed files are removed there and whenever a read finds
them.

Recency survives a restart: every write, read hit and `touch` stamps the file's mtime with a
strictly increasing time, and `open` orders the index by it, so hot chunks are evicted last.

A full filesystem: ``capacity`` is an upper bound, not a promise. A write that fails with
``ENOSPC`` or ``EDQUOT`` sets the *effective capacity* to what the filesystem holds for us (the
bytes of our committed chunks plus its free bytes, `os.statvfs`), evicts least recently used chunks
down to it and tries again: at most `_NO_SPACE_RETRIES` times, and only when files were deleted
since the failed attempt began (by its own eviction or another put's). While the effective
capacity is below ``capacity`` every write also measures the free space (in the write's own
thread hop), so the effective capacity follows the filesystem back up when space is freed (and
down, before the next ``ENOSPC``, when something else fills it); a put that would not fit even
in an emptied tier measures once more before it is refused. ``stats()`` (`DiskStats`) reports
``effective_capacity`` and ``no_space_errors``.

A removed directory: every write checks that ``root/.lock`` is still the file it holds the lock
on. When it is gone, the write recreates the directory and takes the lock on a new lock file, and
the index forgets chunks whose files went with the old directory. If another tier took the new
directory first, this tier leaves it alone: it forgets its index and every later put fails.

Must not: keep `MemoryObj`s or change their reference counts, hand out bytes whose checksum was
not verified, or touch a caller's buffers after the call that lent them has returned.

Threads: every method runs on the engine's event loop; file I/O and hashing run on the tier's
own `BlockingPool`s, one hop per put / get: reads on ``io_threads`` threads (sized from the
machine by default), so a request's chunks are read in parallel, each straight into its L1
object; writes, unlinks and recency stamps on a smaller pool of their own (`write_threads`),
so a burst of writes never queues a load behind it. A
cancelled call tells its thread to stop and waits for it before cancellation propagates, so a
released `MemoryObj` is never written. Not aiofiles: its await returns as soon as its task is
cancelled while the thread keeps going, and it leaves the hashing on the loop
(docs/decisions/l2-io-threads.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import errno
import fcntl
import functools
import io
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import xxhash

from tiered_kv.codec import (
    DEFAULT_LIMITS,
    MIN_HEADER_LEN,
    PREFIX_LEN,
    ChunkHeader,
    CodecLimits,
    FrameCheck,
    GroupSpec,
    check_encodable,
    check_frame_header,
    check_payload_checksum,
    decode_header,
    encode_header,
    encoded_header_len,
    header_length,
)
from tiered_kv.errors import (
    CodecError,
    ConfigError,
    EngineStateError,
    L2DirectoryInUseError,
    TieredKVError,
)
from tiered_kv.keys import ChunkKey
from tiered_kv.memory import MemoryObj
from tiered_kv.snapshot import counter_fields
from tiered_kv.threads import BlockingPool, check_abort, default_io_threads, write_threads
from tiered_kv.tiers.base import TIER_OCCUPANCY, LowerTier, TierStats

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_TEMP_SUFFIX = ".tmp"
_HEX_DIGITS = frozenset("0123456789abcdef")
# Reads move the payload in slices and hash each right after reading it, while the copy's
# destination is still in the core's L2 (1 MiB slices measured best on a 1 MiB-L2 EPYC).
# Writes hash each group just before writing it (the kernel's copy then reads it from cache) and
# write it in one call: on the benchmark VM, files written in 1 MiB (4 MiB) calls mostly read
# back from disk up to 4x (2x) slower than files written in one call.
_READ_SLICE_BYTES = 1 << 20
# Errors of a full filesystem or quota: evict and write again instead of failing every put.
_NO_SPACE_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT))
# Retries of one put after no-space errors; each follows deletions, so each meets more room.
_NO_SPACE_RETRIES = 2


@dataclasses.dataclass(frozen=True, slots=True)
class ScannedFile:
    """One file found under an L2 directory, as `scan_directory` read it."""

    path: Path
    size: int
    key: ChunkKey | None
    num_tokens: int | None
    groups: tuple[GroupSpec, ...]
    error: str | None
    mtime_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    """What a read checks before touching the file; the file's own header is checked again."""

    path: Path
    size: int
    num_tokens: int
    groups: tuple[GroupSpec, ...]

    @property
    def payload_len(self) -> int:
        return sum(group.nbytes for group in self.groups)


# -- blocking helpers (run on the tier's I/O threads) -------------------------------------------


class FileOps:
    """The system calls through which `DiskTier` moves chunk files: the one seam for I/O faults.

    Tests pass a subclass to `DiskTier` (``file_ops=``) to fail or slow writes, reads and
    directory syncs the way a failing or full disk does (see
    `tiered_kv.tiers.testing.FullDiskFileOps`). Called from executor threads, several at once:
    implementations must be thread-safe.
    """

    read_slice_bytes: int = _READ_SLICE_BYTES
    """Reads move a payload in slices of this many bytes, each hashed right after it lands."""

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

    def free_bytes(self, directory: Path) -> int | None:
        """Bytes still free for us on ``directory``'s filesystem; None when that is unknown."""
        try:
            stat = os.statvfs(directory)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize


DEFAULT_FILE_OPS = FileOps()


def _write_all_at(
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


def _slices(buffer: memoryview, size: int) -> Iterator[memoryview]:
    for start in range(0, len(buffer), size):
        yield buffer[start : start + size]


def _read_exact(file: io.FileIO, size: int) -> bytes:
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


def _readinto_exact(file: io.FileIO, buffer: memoryview, file_ops: FileOps) -> bool:
    """Fill ``buffer`` from ``file``; False when the file ends first."""
    filled = 0
    while filled < len(buffer):
        count = file_ops.readinto(file, buffer[filled:])
        if not count:
            return False
        filled += count
    return True


def _read_header(file: io.FileIO, limits: CodecLimits) -> ChunkHeader:
    """The header at the start of ``file``; `CodecError` when torn or malformed.

    Leaves ``file`` at the payload's first byte.
    """
    # One read covers the usual header: none is shorter than MIN_HEADER_LEN.
    head = _read_exact(file, MIN_HEADER_LEN)
    header_len = header_length(head[:PREFIX_LEN], limits)
    if header_len > len(head):
        head += _read_exact(file, header_len - len(head))
    return decode_header(head, limits)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning("L2: could not remove %s", path, exc_info=True)


def _unlink_paths(paths: Sequence[Path]) -> None:
    for path in paths:
        _unlink_quietly(path)


def _vanished(paths: Sequence[Path]) -> list[bool]:
    """Which of ``paths`` no longer exist."""
    return [not os.path.lexists(path) for path in paths]


def _set_mtimes(stamps: Sequence[tuple[Path, int]]) -> int:
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


@dataclasses.dataclass(slots=True)
class _WriteJob:
    directory: Path
    temp_path: Path
    final_path: Path
    key_bytes: bytes
    num_tokens: int
    specs: tuple[GroupSpec, ...]
    buffers: list[memoryview]
    fsync: bool
    limits: CodecLimits
    file_ops: FileOps
    lock: _DirectoryLock
    stamp_ns: int  # the file's mtime: its recency for the index rebuilt at open
    measure_free_space: bool  # after the write, too (a no-space failure always measures)
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)
    committed: bool = False
    # Results, read on the loop once the thread is done:
    free_bytes: int | None = None
    lock_retaken: bool = False


def _create_temp_file(job: _WriteJob) -> io.FileIO:
    """Create the temp file; the shard directory too on its first chunk, made durable then."""
    try:
        return open(job.temp_path, "xb", buffering=0)
    except FileNotFoundError:
        pass  # once per shard; trying first spares every other put a mkdir call
    job.directory.mkdir(exist_ok=True)
    if job.fsync:
        try:
            job.file_ops.fsync_directory(job.directory.parent)
        except BaseException:
            with contextlib.suppress(OSError):
                job.directory.rmdir()  # so that the next put creates and fsyncs it again
            raise
    return open(job.temp_path, "xb", buffering=0)


def _write_chunk_file(job: _WriteJob) -> None:
    """Temp file, write, fsync, rename, fsync the directory. Leaves no temp file behind.

    The payload is written first, at its offset after the header, one hashed group at a time;
    the header, which holds the hash, goes last at offset 0.
    """
    check_abort(job.abort)
    header_len = check_encodable(job.key_bytes, job.num_tokens, job.specs, job.limits)
    job.lock_retaken = job.lock.ensure_held(job.fsync)
    try:
        with _create_temp_file(job) as file:
            state = xxhash.xxh3_64()
            position = header_len
            for buffer in job.buffers:
                check_abort(job.abort)
                state.update(buffer)
                _write_all_at(file, buffer, position, job.file_ops)
                position += len(buffer)
            header = encode_header(
                job.key_bytes, job.num_tokens, job.specs, state.intdigest(), limits=job.limits
            )
            check_abort(job.abort)
            _write_all_at(file, header, 0, job.file_ops)
            os.utime(file.fileno(), ns=(job.stamp_ns, job.stamp_ns))
            if job.fsync:
                os.fsync(file.fileno())
        check_abort(job.abort)
        os.replace(job.temp_path, job.final_path)
    except BaseException:
        _unlink_quietly(job.temp_path)
        raise
    job.committed = True
    if job.fsync:
        try:
            job.file_ops.fsync_directory(job.directory)
        except BaseException:
            # The rename may not survive a crash; do not report a chunk as stored.
            job.committed = False
            _unlink_quietly(job.final_path)
            raise


def _store_chunk(job: _WriteJob) -> None:
    """`_write_chunk_file`, then the filesystem's free bytes when the tier needs them."""
    try:
        _write_chunk_file(job)
    except OSError as exc:
        if exc.errno in _NO_SPACE_ERRNOS:
            job.free_bytes = job.file_ops.free_bytes(job.directory.parent)
        raise
    if job.measure_free_space:
        job.free_bytes = job.file_ops.free_bytes(job.directory.parent)


class _ReadOutcome(enum.Enum):
    HIT = "hit"
    MISSING = "missing"
    KEY_MISMATCH = "key mismatch"
    LAYOUT_MISMATCH = "layout mismatch"
    CORRUPT = "corrupt"


_OUTCOMES = {
    FrameCheck.OTHER_KEY: _ReadOutcome.KEY_MISMATCH,
    FrameCheck.OTHER_LAYOUT: _ReadOutcome.LAYOUT_MISMATCH,
    FrameCheck.CORRUPT: _ReadOutcome.CORRUPT,
}


def _read_chunk_file(
    path: Path,
    key_bytes: bytes,
    num_tokens: int,
    specs: tuple[GroupSpec, ...],
    buffers: list[memoryview],
    limits: CodecLimits,
    abort: threading.Event,
    stamp_ns: int,
    file_ops: FileOps,
) -> tuple[_ReadOutcome, str]:
    """Verify the header, read the payload straight into ``buffers``, verify the checksum."""
    check_abort(abort)
    try:
        file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
    except FileNotFoundError:
        return _ReadOutcome.MISSING, ""
    with file:
        size = os.fstat(file.fileno()).st_size
        try:
            header = _read_header(file, limits)
        except CodecError as exc:
            return _ReadOutcome.CORRUPT, f"bad header: {exc}"
        check, detail = check_frame_header(
            header, key_bytes=key_bytes, num_tokens=num_tokens, groups=specs, frame_len=size
        )
        if check is not FrameCheck.OK:
            return _OUTCOMES[check], detail
        state = xxhash.xxh3_64()
        for index, buffer in enumerate(buffers):
            for piece in _slices(buffer, file_ops.read_slice_bytes):
                check_abort(abort)
                if not _readinto_exact(file, piece, file_ops):
                    return _ReadOutcome.CORRUPT, f"short read in group {index}"
                state.update(piece)
        problem = check_payload_checksum(header, state.intdigest())
        if problem is not None:
            return _ReadOutcome.CORRUPT, problem
        # Recency survives a restart: the index is rebuilt in mtime order.
        with contextlib.suppress(OSError):
            os.utime(file.fileno(), ns=(stamp_ns, stamp_ns))
    return _ReadOutcome.HIT, ""


def _is_shard_name(name: str) -> bool:
    return len(name) == 2 and set(name) <= _HEX_DIGITS


def _is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(_TEMP_SUFFIX)


def _inspect_file(path: Path, limits: CodecLimits) -> tuple[ScannedFile, bool] | None:
    """Read one file's header. Returns (result, removable) or None when the file vanished.

    ``removable`` is True when the file is certainly not a valid chunk (torn, corrupt, misnamed,
    a leftover temp file); False when it is valid or could not be read (then it is left alone).
    """
    try:
        stat = path.stat(follow_symlinks=False)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return ScannedFile(path, 0, None, None, (), f"unreadable: {exc}", 0), False

    def result(
        error: str | None, key: ChunkKey | None = None, header: ChunkHeader | None = None
    ) -> ScannedFile:
        num_tokens = None if header is None else header.num_tokens
        groups = () if header is None else header.groups
        return ScannedFile(path, stat.st_size, key, num_tokens, groups, error, stat.st_mtime_ns)

    if _is_temp_name(path.name):
        return result("temporary file of an unfinished write"), True
    try:
        with open(path, "rb", buffering=0) as file:
            header = _read_header(file, limits)
    except FileNotFoundError:
        return None
    except CodecError as exc:
        return result(f"bad header: {exc}"), True
    except OSError as exc:
        return result(f"unreadable: {exc}"), False
    try:
        key = ChunkKey.from_bytes(header.key_bytes)
    except CodecError as exc:
        return result(f"bad key in header: {exc}", None, header), True
    if stat.st_size != header.total_len:
        error = f"file is {stat.st_size} bytes, header says {header.total_len}"
        return result(error, key, header), True
    if path.name != key.hex or path.parent.name != key.hex[:2]:
        error = f"misnamed: the header's key belongs at {key.hex[:2]}/{key.hex}"
        return result(error, key, header), True
    return result(None, key, header), False


def _iter_files(root: Path, limits: CodecLimits) -> Iterator[tuple[ScannedFile, bool]]:
    """Every regular file in ``root``'s shard directories, with its removability."""
    with os.scandir(root) as top:
        shards = sorted(
            entry.name
            for entry in top
            if _is_shard_name(entry.name) and entry.is_dir(follow_symlinks=False)
        )
    for shard in shards:
        try:
            with os.scandir(root / shard) as listing:
                names = sorted(
                    entry.name for entry in listing if entry.is_file(follow_symlinks=False)
                )
        except FileNotFoundError:
            continue
        for name in names:
            found = _inspect_file(root / shard / name, limits)
            if found is not None:
                yield found


def scan_directory(
    root: str | os.PathLike[str], limits: CodecLimits = DEFAULT_LIMITS
) -> list[ScannedFile]:
    """Read the header of every file under an L2 directory (for ``tiered-kv inspect``).

    Takes no lock and removes nothing, so it is safe next to a running tier (files may vanish
    or appear meanwhile). Only shard directories (two hex digits) are looked at.
    """
    return [scanned for scanned, _ in _iter_files(Path(root), limits)]


@dataclasses.dataclass(slots=True)
class _Rebuilt:
    entries: list[tuple[ChunkKey, _Entry, int]]
    corrupt_removed: int
    temp_removed: int


def _rebuild_index(root: Path, limits: CodecLimits) -> _Rebuilt:
    rebuilt = _Rebuilt([], 0, 0)
    for scanned, removable in _iter_files(root, limits):
        if scanned.error is None and scanned.key is not None and scanned.num_tokens is not None:
            entry = _Entry(scanned.path, scanned.size, scanned.num_tokens, scanned.groups)
            rebuilt.entries.append((scanned.key, entry, scanned.mtime_ns))
            continue
        if not removable:
            logger.warning("L2: skipping %s: %s", scanned.path, scanned.error)
            continue
        if _is_temp_name(scanned.path.name):
            rebuilt.temp_removed += 1
        else:
            logger.warning("L2: removing %s: %s", scanned.path, scanned.error)
            rebuilt.corrupt_removed += 1
        _unlink_quietly(scanned.path)
    rebuilt.entries.sort(key=lambda item: item[2])
    return rebuilt


class _DirectoryLock:
    """An exclusive, non-blocking flock on ``root/.lock``, held from acquire to release.

    `ensure_held` runs in write threads, several at once; the other methods on the loop.
    """

    def __init__(self, root: Path, file_ops: FileOps) -> None:
        self.path = root / LOCK_NAME
        self._file_ops = file_ops
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the locked file
        self._mutex = threading.Lock()
        # Set for good when another tier took the directory after ours was removed.
        self.lost = False

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, identity = self._lock_new_file()
        with self._mutex:
            self._fd, self._identity = fd, identity

    def _lock_new_file(self) -> tuple[int, tuple[int, int]]:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            stat = os.fstat(fd)
            # A directory we may lock but not write to would fail every put; say so at open.
            if not os.access(self.path.parent, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable", str(self.path.parent))
        except BlockingIOError:
            holder = "unknown"
            with contextlib.suppress(OSError):
                holder = os.read(fd, 64).decode(errors="replace").strip() or holder
            os.close(fd)
            raise L2DirectoryInUseError(
                f"L2 directory {self.path.parent} is in use: {self.path} is locked "
                f"(holder pid {holder}); give each process its own l2 directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        # Best effort: name the holder for the error message above.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd, (stat.st_dev, stat.st_ino)

    def ensure_held(self, fsync: bool) -> bool:
        """Check that ``root/.lock`` is still the file we lock; True when it had to be retaken.

        When the lock file is gone (the directory was removed), recreate the directory and lock
        a new file. If another tier holds that one, raise `L2DirectoryInUseError`, now and on
        every later call: the directory is theirs.
        """
        with self._mutex:
            if self.lost:
                raise L2DirectoryInUseError(
                    f"L2 directory {self.path.parent} was removed and is now another tier's"
                )
            if self._fd is None:
                raise EngineStateError(f"L2 directory {self.path.parent}: the tier is closed")
            try:
                stat = os.stat(self.path)
            except FileNotFoundError:
                pass
            else:
                if (stat.st_dev, stat.st_ino) == self._identity:
                    return False
            root = self.path.parent
            if not root.is_dir():
                root.mkdir(parents=True, exist_ok=True)
                if fsync:
                    self._file_ops.fsync_directory(root.parent)
            try:
                fd, identity = self._lock_new_file()
            except L2DirectoryInUseError:
                self.lost = True
                raise
            os.close(self._fd)  # the old file is unlinked; its lock protects nothing now
            self._fd, self._identity = fd, identity
            logger.warning("L2: %s was removed; recreated it and locked it again", root)
            return True

    def release(self) -> None:
        with self._mutex:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor drops the flock


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DiskStats(TierStats):
    """`DiskTier.stats()`: occupancy, the effective capacity on a full disk, and counters."""

    bytes_reserved: int = 0  # by writes in flight
    effective_capacity: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    put_refused: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0
    corrupt_removed: int = 0
    layout_mismatch: int = 0
    read_failures: int = 0
    no_space_errors: int = 0  # writes that failed with ENOSPC or EDQUOT
    no_space_retries: int = 0  # writes tried again after evicting for room
    directory_recreated: int = 0  # the directory or its lock file was removed and made again
    touches: int = 0
    touch_failures: int = 0
    write_seconds: float = 0.0  # sum of per-write latencies
    read_seconds: float = 0.0


# What the tier counts as events (the rest of DiskStats is measured when asked).
_COUNTERS = counter_fields(
    DiskStats,
    measured=(
        *TIER_OCCUPANCY,
        "bytes_reserved",
        "effective_capacity",
        "write_seconds",
        "read_seconds",
    ),
)


class DiskTier(LowerTier):
    """L2 on a local directory, bounded by ``capacity`` bytes of files, LRU.

    ``fsync=False`` skips the file and directory fsyncs (faster, but a power loss may lose
    recent chunks; the checksums still keep torn files from being served). ``io_threads``: the
    tier's blocking threads (reads and writes in parallel); None sizes them from the machine
    (`default_io_threads`). ``file_ops`` is the seam for fault tests (a full disk); leave the
    default otherwise.
    """

    name = "L2"

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity: int,
        *,
        fsync: bool = True,
        limits: CodecLimits = DEFAULT_LIMITS,
        file_ops: FileOps = DEFAULT_FILE_OPS,
        io_threads: int | None = None,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ConfigError(
                f"DiskTier: capacity must be a positive number of bytes, got {capacity!r}"
            )
        self.root = Path(root)
        self.capacity = capacity
        self.fsync = fsync
        self.limits = limits
        self.file_ops = file_ops
        threads = default_io_threads() if io_threads is None else io_threads
        # Reads have threads of their own: a burst of writes never queues a load behind it.
        self._read_pool = BlockingPool("tkv-l2-read", threads)
        self._pool = BlockingPool("tkv-l2-write", write_threads(threads))
        self._lock = _DirectoryLock(self.root, file_ops)
        self._state = "new"
        self._index: collections.OrderedDict[ChunkKey, _Entry] = collections.OrderedDict()
        self._bytes_used = 0
        self._reserved = 0
        # At most capacity; lower while the filesystem holds less (see the module docstring).
        self._effective_capacity = capacity
        self._last_stamp_ns = 0
        self._bytes_deleted = 0  # grows when files are handed to a thread for unlinking
        # Keys with a put or an unlink in flight; never in the index at an await point.
        self._busy: dict[ChunkKey, asyncio.Event] = {}
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._write_seconds = 0.0
        self._read_seconds = 0.0

    # -- lifetime ---------------------------------------------------------------------------
    async def open(self) -> None:
        """Lock the directory, drop stale temp files, and rebuild the index from headers."""
        if self._state != "new":
            raise EngineStateError(f"DiskTier.open: already {self._state}; open is called once")
        try:
            try:
                await self._pool.run(self._lock.acquire)
                rebuilt = await self._pool.run(
                    functools.partial(_rebuild_index, self.root, self.limits)
                )
            except OSError as exc:
                raise TieredKVError(f"L2 directory {self.root} is not usable: {exc}") from exc
            for key, entry, mtime_ns in rebuilt.entries:
                self._index[key] = entry
                self._bytes_used += entry.size
                self._last_stamp_ns = max(self._last_stamp_ns, mtime_ns)
            self._counters["corrupt_removed"] += rebuilt.corrupt_removed
            victims = self._evict_until(lambda: self._bytes_used <= self.capacity)
            if victims:
                await self._unlink_entries(victims)
        except BaseException:
            self._lock.release()
            self._index.clear()
            self._bytes_used = 0
            # A failed open may be tried again: its threads end, a new pool serves the retry.
            await self._pool.aclose()
            await self._read_pool.aclose()
            self._pool = BlockingPool(self._pool.name, self._pool.size)
            self._read_pool = BlockingPool(self._read_pool.name, self._read_pool.size)
            raise
        self._state = "open"
        logger.info(
            "L2 %s: %d chunks, %d bytes; removed %d corrupt and %d temp files",
            self.root,
            len(self._index),
            self._bytes_used,
            rebuilt.corrupt_removed,
            rebuilt.temp_removed,
        )

    @property
    def read_parallelism(self) -> int:
        return self._read_pool.size

    async def aclose(self) -> None:
        """Release the directory lock and join the I/O threads. Await or cancel this tier's
        operations first."""
        if self._state == "closed":
            return
        self._state = "closed"
        self._lock.release()
        self._index.clear()
        self._bytes_used = 0
        await self._pool.aclose()
        await self._read_pool.aclose()

    def _check_open(self, verb: str) -> None:
        if self._state != "open":
            raise EngineStateError(
                f"DiskTier.{verb}: the tier is {self._state}; call open() first, not after aclose()"
            )

    # -- index ------------------------------------------------------------------------------
    def contains(self, key: ChunkKey) -> bool:
        return key in self._index

    def entries(self) -> list[tuple[ChunkKey, int, int]]:
        """(key, num_tokens, file size) of every chunk, least recently used first."""
        return [(key, e.num_tokens, e.size) for key, e in self._index.items()]

    def stats(self) -> DiskStats:
        return DiskStats(
            entries=len(self._index),
            bytes_used=self._bytes_used,
            capacity=self.capacity,
            bytes_reserved=self._reserved,
            effective_capacity=self._effective_capacity,
            write_seconds=self._write_seconds,
            read_seconds=self._read_seconds,
            **self._counters,
        )

    def _stamp(self) -> int:
        """A file time for a chunk used now, later than every earlier one (ties would lose the
        order at the next open: file times have the clock tick's granularity)."""
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _fit_to_filesystem(self, free_bytes: int | None) -> None:
        """Effective capacity: our committed chunks plus the filesystem's free bytes.

        Writes in flight are not counted: whatever part of them is on disk already is missing
        from ``free_bytes``, so the estimate errs low by at most what they wrote; counting their
        whole size would err high, and the next write would meet ``ENOSPC`` again.
        """
        if free_bytes is not None:
            self._effective_capacity = max(0, min(self.capacity, self._bytes_used + free_bytes))

    def _path_for(self, key: ChunkKey) -> Path:
        name = key.hex
        return self.root / name[:2] / name

    def _evict_until(self, fits: Callable[[], bool]) -> list[tuple[ChunkKey, _Entry]]:
        """Pop least recently used entries until ``fits()``; the caller unlinks them."""
        victims = []
        while self._index and not fits():
            key, entry = self._index.popitem(last=False)
            self._bytes_used -= entry.size
            victims.append((key, entry))
        self._counters["evictions"] += len(victims)
        return victims

    def _drop(self, key: ChunkKey, entry: _Entry) -> bool:
        """Remove ``entry`` from the index if it is still ``key``'s entry."""
        if self._index.get(key) is not entry:
            return False
        del self._index[key]
        self._bytes_used -= entry.size
        return True

    async def _wait_idle(self, key: ChunkKey) -> None:
        while (event := self._busy.get(key)) is not None:
            await event.wait()

    async def _unlink_entries(self, victims: Sequence[tuple[ChunkKey, _Entry]]) -> None:
        """Delete files already dropped from the index; their keys stay busy meanwhile."""
        events = [(key, asyncio.Event()) for key, _ in victims]
        self._busy.update(events)
        self._bytes_deleted += sum(entry.size for _, entry in victims)
        try:
            await self._pool.run(functools.partial(_unlink_paths, [e.path for _, e in victims]))
        finally:
            for key, event in events:
                del self._busy[key]
                event.set()

    # -- data -------------------------------------------------------------------------------
    async def put(self, key: ChunkKey, obj: MemoryObj) -> bool:
        self._check_open("put")
        await self._wait_idle(key)
        if key in self._index:
            self._index.move_to_end(key)
            return True
        if self._lock.lost:
            self._counters["put_failures"] += 1
            return False
        specs = obj.group_specs()
        key_bytes = key.to_bytes()
        size = encoded_header_len(len(key_bytes), specs) + sum(spec.nbytes for spec in specs)
        if size + self._reserved > self.capacity:
            self._refuse(key, size)
            return False
        done = asyncio.Event()
        self._busy[key] = done
        try:
            if size + self._reserved > self._effective_capacity:
                # Even an empty tier would not hold it on this filesystem: has space come back?
                free_bytes = await self._pool.run(
                    functools.partial(self.file_ops.free_bytes, self.root)
                )
                self._fit_to_filesystem(free_bytes)
                if size + self._reserved > self._effective_capacity:
                    self._refuse(key, size)
                    return False
            victims = self._evict_until(
                lambda: self._bytes_used + self._reserved + size <= self._effective_capacity
            )
            self._reserved += size
            try:
                if victims:
                    await self._unlink_entries(victims)
                return await self._write(key, key_bytes, obj, specs, size)
            finally:
                self._reserved -= size
        finally:
            del self._busy[key]
            done.set()

    def _refuse(self, key: ChunkKey, size: int) -> None:
        self._counters["put_refused"] += 1
        logger.debug(
            "L2 put of %s refused: %d bytes, capacity %d (effective %d), %d reserved by writes "
            "in flight",
            key.hex,
            size,
            self.capacity,
            self._effective_capacity,
            self._reserved,
        )

    async def _write(
        self,
        key: ChunkKey,
        key_bytes: bytes,
        obj: MemoryObj,
        specs: tuple[GroupSpec, ...],
        size: int,
    ) -> bool:
        """Write the file, evicting and trying again after no-space errors; ``size`` is reserved."""
        final_path = self._path_for(key)
        entry = _Entry(final_path, size, obj.num_tokens, specs)
        attempt = 0
        while True:
            temp_name = f".{final_path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TEMP_SUFFIX}"
            job = _WriteJob(
                directory=final_path.parent,
                temp_path=final_path.parent / temp_name,
                final_path=final_path,
                key_bytes=key_bytes,
                num_tokens=obj.num_tokens,
                specs=specs,
                buffers=obj.group_buffers(),
                fsync=self.fsync,
                limits=self.limits,
                file_ops=self.file_ops,
                lock=self._lock,
                stamp_ns=self._stamp(),
                measure_free_space=self._effective_capacity < self.capacity,
            )
            deleted_before = self._bytes_deleted
            started = time.perf_counter()
            try:
                await self._pool.run(functools.partial(_store_chunk, job), job.abort)
            except asyncio.CancelledError:
                # Cancelled after the rename: the chunk is complete, so keep it indexed.
                if job.committed:
                    self._insert(key, entry)
                raise
            except Exception as exc:
                if self._lock.lost:
                    self._forget_lost_directory()
                elif job.lock_retaken:
                    await self._forget_vanished_files()
                if isinstance(exc, OSError) and exc.errno in _NO_SPACE_ERRNOS:
                    await self._make_room_after_no_space(key, job, size)
                    # Again only if files went (ours or other puts' victims) since this try began.
                    if self._bytes_deleted > deleted_before and attempt < _NO_SPACE_RETRIES:
                        attempt += 1
                        self._counters["no_space_retries"] += 1
                        continue
                self._counters["put_failures"] += 1
                logger.warning("L2 put of %s failed", key.hex, exc_info=True)
                return False
            finally:
                self._write_seconds += time.perf_counter() - started
            self._insert(key, entry)
            if job.measure_free_space:
                self._fit_to_filesystem(job.free_bytes)
            self._counters["puts"] += 1
            self._counters["bytes_written"] += size
            if job.lock_retaken:
                await self._forget_vanished_files()  # after the insert: a cancel keeps the chunk
            return True

    async def _make_room_after_no_space(self, key: ChunkKey, job: _WriteJob, size: int) -> None:
        """Lower the effective capacity to what the filesystem holds and evict down to it."""
        self._counters["no_space_errors"] += 1
        self._fit_to_filesystem(job.free_bytes)
        if job.free_bytes is None:  # unknown: assume the disk holds what we hold now
            self._effective_capacity = min(self._effective_capacity, self._bytes_used)
        victims = self._evict_until(
            lambda: self._bytes_used + self._reserved <= self._effective_capacity
        )
        logger.info(
            "L2: no space for %s (%d bytes): effective capacity now %d of %d, evicting %d chunks",
            key.hex,
            size,
            self._effective_capacity,
            self.capacity,
            len(victims),
        )
        if victims:
            await self._unlink_entries(victims)

    def _forget_lost_directory(self) -> None:
        """Another tier owns the directory now: none of its files are ours to read or delete."""
        if self._index:
            logger.warning(
                "L2 %s: another tier took the directory; forgetting %d chunks",
                self.root,
                len(self._index),
            )
        self._index.clear()
        self._bytes_used = 0

    async def _forget_vanished_files(self) -> None:
        """The directory was recreated: drop the entries whose files went with the old one."""
        self._counters["directory_recreated"] += 1
        snapshot = list(self._index.items())
        vanished = await self._pool.run(
            functools.partial(_vanished, [entry.path for _, entry in snapshot])
        )
        for (key, entry), gone in zip(snapshot, vanished, strict=True):
            if gone:
                self._drop(key, entry)

    def _insert(self, key: ChunkKey, entry: _Entry) -> None:
        self._index[key] = entry
        self._bytes_used += entry.size

    async def get_into(self, key: ChunkKey, obj: MemoryObj) -> bool:
        self._check_open("get_into")
        entry = self._index.get(key)
        if entry is None:
            self._counters["misses"] += 1
            return False
        specs = obj.group_specs()
        if entry.num_tokens != obj.num_tokens or entry.groups != specs:
            self._counters["layout_mismatch"] += 1
            self._counters["misses"] += 1
            return False
        abort = threading.Event()
        read = functools.partial(
            _read_chunk_file,
            entry.path,
            key.to_bytes(),
            obj.num_tokens,
            specs,
            obj.group_buffers(),
            self.limits,
            abort,
            self._stamp(),
            self.file_ops,
        )
        started = time.perf_counter()
        try:
            outcome, detail = await self._read_pool.run(read, abort)
        except Exception:
            self._counters["read_failures"] += 1
            self._counters["misses"] += 1
            logger.warning("L2 read of %s failed", key.hex, exc_info=True)
            return False
        finally:
            self._read_seconds += time.perf_counter() - started

        if outcome is _ReadOutcome.HIT:
            if self._index.get(key) is entry:
                self._index.move_to_end(key)
            self._counters["hits"] += 1
            self._counters["bytes_read"] += entry.payload_len
            return True
        self._counters["misses"] += 1
        if outcome is _ReadOutcome.MISSING:
            self._drop(key, entry)
        elif outcome is _ReadOutcome.LAYOUT_MISMATCH:
            self._counters["layout_mismatch"] += 1
        elif outcome is _ReadOutcome.CORRUPT:
            logger.warning("L2: removing corrupt %s: %s", entry.path, detail)
            if self._drop(key, entry):
                self._counters["corrupt_removed"] += 1
                await self._unlink_entries([(key, entry)])
        else:
            logger.warning("L2: %s: %s", entry.path, detail)
        return False

    async def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Move ``keys`` to the recent end of the LRU and stamp their files' mtimes (one thread
        hop for the batch), so that the order survives a restart. After close: a no-op."""
        if self._state != "open":
            return
        stamps = []
        for key in keys:
            entry = self._index.get(key)
            if entry is None:
                continue
            self._index.move_to_end(key)
            stamps.append((entry.path, self._stamp()))
        if not stamps:
            return
        try:
            failures = await self._pool.run(functools.partial(_set_mtimes, stamps))
        except Exception:  # recency is a hint: the in-memory order stands
            logger.warning("L2: stamping %d touched files failed", len(stamps), exc_info=True)
            failures = len(stamps)
        self._counters["touches"] += len(stamps) - failures
        self._counters["touch_failures"] += failures

    async def remove(self, key: ChunkKey) -> bool:
        self._check_open("remove")
        await self._wait_idle(key)
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        self._bytes_used -= entry.size
        await self._unlink_entries([(key, entry)])
        return True
