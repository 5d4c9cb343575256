"""One chunk file, written or read on an I/O thread: temp file, payload hashed as it is written,
header last, fsync, rename (`write_chunk_file`); header checks, payload read straight into the
caller's buffers in slices, each hashed as it lands, checksum verified (`read_chunk_file`).

Both check their job's abort event between steps (`tiered_kv.threads.check_abort`), so a
cancelled caller's buffers are let go before its thread ends. Must not touch the tier's index.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import os
import threading
from pathlib import Path

import xxhash

from tiered_kv.codec import (
    CodecLimits,
    FrameCheck,
    GroupSpec,
    check_encodable,
    check_frame_header,
    check_payload_checksum,
    encode_header,
)
from tiered_kv.errors import CodecError
from tiered_kv.threads import check_abort
from tiered_kv.tiers.l2.files import (
    NO_SPACE_ERRNOS,
    DirectorySyncer,
    FileOps,
    read_header,
    readinto_exact,
    slices,
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
            state = xxhash.xxh3_64()
            position = header_len
            for buffer in job.buffers:
                check_abort(job.abort)
                state.update(buffer)
                write_all_at(file, buffer, position, job.file_ops)
                position += len(buffer)
            header = encode_header(
                job.key_bytes, job.num_tokens, job.specs, state.intdigest(), limits=job.limits
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


def read_chunk_file(
    path: Path,
    key_bytes: bytes,
    num_tokens: int,
    specs: tuple[GroupSpec, ...],
    buffers: list[memoryview],
    limits: CodecLimits,
    abort: threading.Event,
    stamp_ns: int,
    file_ops: FileOps,
) -> tuple[ReadOutcome, str]:
    """Verify the header, read the payload straight into ``buffers``, verify the checksum."""
    check_abort(abort)
    try:
        file = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
    except FileNotFoundError:
        return ReadOutcome.MISSING, ""
    with file:
        size = os.fstat(file.fileno()).st_size
        try:
            header = read_header(file, limits)
        except CodecError as exc:
            return ReadOutcome.CORRUPT, f"bad header: {exc}"
        check, detail = check_frame_header(
            header, key_bytes=key_bytes, num_tokens=num_tokens, groups=specs, frame_len=size
        )
        if check is not FrameCheck.OK:
            return _OUTCOMES[check], detail
        state = xxhash.xxh3_64()
        for index, buffer in enumerate(buffers):
            for piece in slices(buffer, file_ops.read_slice_bytes):
                check_abort(abort)
                if not readinto_exact(file, piece, file_ops):
                    return ReadOutcome.CORRUPT, f"short read in group {index}"
                state.update(piece)
        problem = check_payload_checksum(header, state.intdigest())
        if problem is not None:
            return ReadOutcome.CORRUPT, problem
        # Recency survives a restart: the index is rebuilt in mtime order.
        with contextlib.suppress(OSError):
            os.utime(file.fileno(), ns=(stamp_ns, stamp_ns))
    return ReadOutcome.HIT, ""
