"""One chunk file, written or read on I/O threads: temp file, payload hashed as it is written,
header last, fsync, rename (`write_chunk_file`); a read (`ChunkRead`) split into parts that any
of the tier's read threads run at once: the header's checks, and the payload's stripes, each
read straight into the caller's buffers and hashed as it lands. The loop compares the stripes'
checksums with the header's once every part has ended.

Every part checks its job's abort event between steps (`tiered_kv.threads.check_abort`), so a
cancelled caller's buffers are let go before its threads end. Must not touch the tier's index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import threading
from collections.abc import Callable
from pathlib import Path

import xxhash

from tiered_kv.codec import (
    STRIPE_BYTES,
    ChunkHeader,
    CodecLimits,
    FrameCheck,
    GroupSpec,
    PayloadHasher,
    check_encodable,
    check_frame_header,
    check_payload_checksums,
    encode_header,
    stripe_count,
)
from tiered_kv.errors import CodecError
from tiered_kv.io.pagecache import cached_fraction
from tiered_kv.threads import check_abort
from tiered_kv.tiers.l2.files import (
    NO_SPACE_ERRNOS,
    DirectorySyncer,
    FileOps,
    read_header,
    readinto_exact,
    unlink_quietly,
    write_all_at,
)
from tiered_kv.tiers.l2.lock import DirectoryLock


@dataclasses.dataclass(slots=True)
class WriteJob:
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
    directory_sync: DirectorySyncer  # the rename's directory fsync, shared with other writers
    lock: DirectoryLock
    stamp_ns: int  # the file's mtime: its recency for the index rebuilt at open
    measure_free_space: bool  # after the write, too (a no-space failure always measures)
    abort: threading.Event = dataclasses.field(default_factory=threading.Event)
    committed: bool = False
    # Results, read on the loop once the thread is done:
    free_bytes: int | None = None
    lock_retaken: bool = False


def create_temp_file(job: WriteJob) -> io.FileIO:
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


def write_chunk_file(job: WriteJob) -> None:
    """Temp file, write, fsync, rename, fsync the directory. Leaves no temp file behind.

    The payload is written first, at its offset after the header, one hashed group at a time;
    the header, which holds the hash, goes last at offset 0.
    """
    check_abort(job.abort)
    header_len = check_encodable(job.key_bytes, job.num_tokens, job.specs, job.limits)
    job.lock_retaken = job.lock.ensure_held(job.fsync)
    try:
        with create_temp_file(job) as file:
            hasher = PayloadHasher()
            position = header_len
            for buffer in job.buffers:
                check_abort(job.abort)
                hasher.update(buffer)
                write_all_at(file, buffer, position, job.file_ops)
                position += len(buffer)
            header = encode_header(
                job.key_bytes, job.num_tokens, job.specs, hasher.digests(), limits=job.limits
            )
            check_abort(job.abort)
            write_all_at(file, header, 0, job.file_ops)
            os.utime(file.fileno(), ns=(job.stamp_ns, job.stamp_ns))
            if job.fsync:
                os.fsync(file.fileno())
        check_abort(job.abort)
        os.replace(job.temp_path, job.final_path)
    except BaseException:
        unlink_quietly(job.temp_path)
        raise
    job.committed = True
    if job.fsync:
        try:
            job.directory_sync.sync(job.directory)
        except BaseException:
            # The rename may not survive a crash; do not report a chunk as stored.
            job.committed = False
            unlink_quietly(job.final_path)
            raise


def store_chunk(job: WriteJob) -> None:
    """`write_chunk_file`, then the filesystem's free bytes when the tier needs them."""
    try:
        write_chunk_file(job)
    except OSError as exc:
        if exc.errno in NO_SPACE_ERRNOS:
            job.free_bytes = job.file_ops.free_bytes(job.directory.parent)
        raise
    if job.measure_free_space:
        job.free_bytes = job.file_ops.free_bytes(job.directory.parent)


class ReadOutcome(enum.Enum):
    HIT = "hit"
    MISSING = "missing"
    KEY_MISMATCH = "key mismatch"
    LAYOUT_MISMATCH = "layout mismatch"
    CORRUPT = "corrupt"


_OUTCOMES = {
    FrameCheck.OTHER_KEY: ReadOutcome.KEY_MISMATCH,
    FrameCheck.OTHER_LAYOUT: ReadOutcome.LAYOUT_MISMATCH,
    FrameCheck.CORRUPT: ReadOutcome.CORRUPT,
}


class ChunkRead:
    """One chunk file read into ``buffers`` (the groups' payloads, in order) as parts that run
    on any read threads at once (`parts`), then judged on the loop (`outcome`).

    Part 0 opens the file, checks its header against what the caller expects (the key, the
    layout, the file's length) and stamps its recency; each other part reads a run of whole
    stripes at the offsets the expected header implies and hashes each stripe as it lands. The
    first of them notes whether its stripes were in the page cache before it read them
    (`cached`: no other part reads them, so this is the file's state before the read). A file
    that is not the expected one fails part 0's checks, so the bytes the stripe parts put in
    the buffers are never trusted.
    """

    def __init__(
        self,
        path: Path,
        key_bytes: bytes,
        num_tokens: int,
        specs: tuple[GroupSpec, ...],
        buffers: list[memoryview],
        limits: CodecLimits,
        abort: threading.Event,
        stamp_ns: int,
        file_ops: FileOps,
    ) -> None:
        self.path = path
        self.key_bytes = key_bytes
        self.num_tokens = num_tokens
        self.specs = specs
        self.buffers = buffers
        self.limits = limits
        self.abort = abort
        self.stamp_ns = stamp_ns
        self.file_ops = file_ops
        self.header_len = check_encodable(key_bytes, num_tokens, specs, limits)
        self.payload_len = sum(len(buffer) for buffer in buffers)
        self.digests: list[int | None] = [None] * stripe_count(self.payload_len)
        # Part 0's verdict and the header it checked; a failed check stops the stripe parts.
        self.checked: tuple[ReadOutcome, str] = (ReadOutcome.CORRUPT, "header not read")
        self.header: ChunkHeader | None = None
        self.cached: bool | None = None
        self._stop = threading.Event()

    def parts(self) -> list[Callable[[], None]]:
        """The header check, then one part per ``file_ops.read_slice_bytes`` of payload (whole
        stripes, at least one)."""
        per_part = max(1, self.file_ops.read_slice_bytes // STRIPE_BYTES)
        stripes = len(self.digests)
        starts = range(0, stripes, per_part)
        runs = [range(start, min(start + per_part, stripes)) for start in starts]
        return [self._check_header, *(self._reader(run) for run in runs)]

    def outcome(self) -> tuple[ReadOutcome, str]:
        """The read's verdict once every part has ended."""
        if self.checked[0] is not ReadOutcome.HIT or self.header is None:
            return self.checked
        problem = check_payload_checksums(self.header, self.digests)
        if problem is not None:
            return ReadOutcome.CORRUPT, problem
        return ReadOutcome.HIT, ""

    def _check_header(self) -> None:
        check_abort(self.abort)
        try:
            file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            self._fail(ReadOutcome.MISSING, "")
            return
        with file:
            size = os.fstat(file.fileno()).st_size
            if hasattr(os, "posix_fadvise"):
                # No readahead past the header: the payload is the stripe parts' to read (and
                # to find in the page cache or not, for `cached`).
                with contextlib.suppress(OSError):
                    os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
            try:
                header = read_header(file, self.limits)
            except CodecError as exc:
                self._fail(ReadOutcome.CORRUPT, f"bad header: {exc}")
                return
            check, detail = check_frame_header(
                header,
                key_bytes=self.key_bytes,
                num_tokens=self.num_tokens,
                groups=self.specs,
                frame_len=size,
            )
            if check is not FrameCheck.OK:
                self._fail(_OUTCOMES[check], detail)
                return
            # Recency survives a restart: the index is rebuilt in mtime order.
            with contextlib.suppress(OSError):
                os.utime(file.fileno(), ns=(self.stamp_ns, self.stamp_ns))
        self.header = header
        self.checked = ReadOutcome.HIT, ""

    def _fail(self, outcome: ReadOutcome, detail: str) -> None:
        self.checked = outcome, detail
        self._stop.set()  # the stripes are not worth reading

    def _reader(self, stripes: range) -> Callable[[], None]:
        return lambda: self._read_stripes(stripes)

    def _read_stripes(self, stripes: range) -> None:
        check_abort(self.abort)
        try:
            file = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            return  # part 0 finds it missing too, or the stripe stays unread: never a hit
        with file:
            start = stripes.start * STRIPE_BYTES
            if not start:
                length = min(len(stripes) * STRIPE_BYTES, self.payload_len)
                share = cached_fraction(file.fileno(), length, self.header_len)
                self.cached = None if share is None else share >= 0.5
            file.seek(self.header_len + start)
            for index in stripes:
                if self._stop.is_set():
                    return
                end = min(start + STRIPE_BYTES, self.payload_len)
                state = xxhash.xxh3_64()
                for piece in self._pieces(start, end):
                    check_abort(self.abort)
                    if not readinto_exact(file, piece, self.file_ops):
                        return  # the file ends early: this stripe and the rest stay unread
                    state.update(piece)
                self.digests[index] = state.intdigest()
                start = end

    def _pieces(self, start: int, end: int) -> list[memoryview]:
        """The buffers' views holding payload bytes ``[start, end)``, in order."""
        pieces = []
        offset = 0
        for buffer in self.buffers:
            size = len(buffer)
            if offset + size > start and offset < end:
                pieces.append(buffer[max(start - offset, 0) : min(end - offset, size)])
            offset += size
            if offset >= end:
                break
        return pieces
