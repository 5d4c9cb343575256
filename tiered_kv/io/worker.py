"""One I/O worker process: moves chunk files' bytes between disk and the shared L1 arena,
hashing each checksum stripe as it passes, so the engine's interpreter never touches them.

Run by path (``python -I worker.py ARENA_FD ARENA_BYTES SOCKET_FD``, `tiered_kv.io.plane` starts
it): it imports the standard library, xxhash and `pagecache.py` beside it, never tiered_kv (whose
package imports torch), so a worker starts in milliseconds and holds no CUDA state. It maps the
arena (a memfd inherited as ``ARENA_FD``), serves jobs from its socket (``SOCK_SEQPACKET``, one
pickled list of jobs per message; every job waiting is taken and answered together, in one message),
and exits when the socket closes or its parent dies (``PR_SET_PDEATHSIG``). Judging the bytes (the
header's checks, the checksums) is the engine's, on its loop: a worker only moves and hashes them.

Read job: ``("read", job_id, path, header_len, payload_len, extents, stripe_bytes, stamp_ns,
first, last)``: stripes ``first`` to ``last - 1`` of the payload, where ``extents`` are the
``(arena offset, length)`` runs that hold the whole payload in order (a chunk's stripes may go
to several workers at once, one run of them each); the job with ``first == 0`` also reads the
header and stamps the file. Answer: ``(job_id, status, header, digests, file_size, cached,
detail)``; ``status`` is ``"read"`` (``digests``: one per stripe read, None from a short
file's end on; ``header`` empty and ``cached`` None unless ``first == 0``; ``cached``: whether
the payload's first pages were in the page cache before the read, None where the system cannot
tell), ``"missing"`` or ``"error"``.

Write job: ``("write", job_id, temp_path, final_path, header, checksums_at, extents,
stripe_bytes, stamp_ns, fsync, measure_free)``: the payload from ``extents`` goes to
``temp_path`` after the header, hashed per stripe; the digests go into ``header`` (a
`tiered_kv.codec.HeaderTemplate`'s bytes) at ``checksums_at``, then the header checksum into its
last 8 bytes (`tiered_kv.codec.seal_header`: the two must agree, a test checks it); the header
is written at offset 0, the file stamped with ``stamp_ns`` (and fsynced when ``fsync``) and
renamed to ``final_path``. With ``fsync`` the directories renamed into are fsynced once per
message, before the answer (a group commit). Answer: ``(job_id, status, errno, detail,
free_bytes)``; ``status`` ``"written"`` or ``"error"`` (no file left at either path);
``free_bytes``: the filesystem's free bytes after a ``measure_free`` write or one that failed
for want of space, else None.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import mmap
import os
import pickle
import signal
import socket
import struct
import sys
from typing import Any

import xxhash


def _load_pagecache() -> Any:
    """`pagecache.py` beside this file, by path (stdlib only; never the tiered_kv package)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pagecache.py")
    spec = importlib.util.spec_from_file_location("tkv_pagecache", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pagecache = _load_pagecache()

PR_SET_PDEATHSIG = 1
MAX_MESSAGE = 1 << 20
# Bytes per read or write call, hashed right after (or before) it while in the CPU's cache.
READ_PIECE = 1 << 20


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (AttributeError, OSError):  # not Linux: the socket's EOF still ends the worker
        pass
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(0)


def _pieces(
    arena: memoryview, extents: list[tuple[int, int]], start: int, end: int
) -> list[memoryview]:
    """The arena views holding payload bytes ``[start, end)``."""
    pieces = []
    position = 0
    for offset, length in extents:
        if position + length > start and position < end:
            lo = max(start - position, 0)
            hi = min(end - position, length)
            pieces.append(arena[offset + lo : offset + hi])
        position += length
        if position >= end:
            break
    return pieces


def read_chunk(arena: memoryview, job: tuple[Any, ...]) -> tuple[object, ...]:
    _, job_id, path, header_len, payload_len, extents, stripe_bytes, stamp_ns, first, last = job
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return (job_id, "missing", b"", [], 0, None, "")
    try:
        size = os.fstat(fd).st_size
        header, cached = b"", None
        if first == 0:
            # Before reading: whether the payload's first pages were in the page cache already.
            share = pagecache.cached_fraction(fd, min(2 * stripe_bytes, payload_len), header_len)
            cached = None if share is None else share >= 0.5
            header = os.pread(fd, header_len, 0)
        digests: list[int | None] = [None] * (last - first)
        for index in range(first, last):
            start = index * stripe_bytes
            end = min(start + stripe_bytes, payload_len)
            state = xxhash.xxh3_64()
            # In pieces: each is hashed while it is still in the CPU's cache.
            for piece_start in range(start, end, READ_PIECE):
                piece_end = min(piece_start + READ_PIECE, end)
                pieces = _pieces(arena, extents, piece_start, piece_end)
                if os.preadv(fd, pieces, header_len + piece_start) < piece_end - piece_start:
                    break  # a short file: this stripe and the rest stay unread
                for piece in pieces:
                    state.update(piece)
            else:
                digests[index - first] = state.intdigest()
                continue
            break
        if first == 0:
            with contextlib.suppress(OSError):  # recency survives a restart (the index's order)
                os.utime(fd, ns=(stamp_ns, stamp_ns))
        return (job_id, "read", header, digests, size, cached, "")
    except OSError as exc:
        return (job_id, "error", b"", [], 0, None, f"{type(exc).__name__}: {exc}")
    finally:
        os.close(fd)


NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(directory: str) -> int | None:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _create(path: str, fsync: bool) -> int:
    """The temp file; its shard directory too on the shard's first chunk."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o666)
    except FileNotFoundError:
        pass
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    if fsync:
        fsync_directory(os.path.dirname(directory))
    return os.open(path, flags, 0o666)


def _write_all(fd: int, pieces: list[memoryview], offset: int) -> None:
    got = os.pwritev(fd, pieces, offset)
    total = sum(len(piece) for piece in pieces)
    while got < total:  # a short write: the rest, piece by piece
        skip = got
        rest = []
        for piece in pieces:
            if skip >= len(piece):
                skip -= len(piece)
                continue
            rest.append(piece[skip:])
            skip = 0
        pieces, offset, total = rest, offset + got, total - got
        got = os.pwritev(fd, pieces, offset)


def write_chunk(arena: memoryview, job: tuple[Any, ...]) -> tuple[object, ...]:
    (_, job_id, temp, final, template, checksums_at, extents, stripe_bytes, stamp_ns, fsync,
     measure_free) = job  # fmt: skip
    header = bytearray(template)
    payload_len = sum(length for _, length in extents)
    stripes = -(-payload_len // stripe_bytes)
    if len(header) != checksums_at + 8 * stripes + 8:
        return (job_id, "error", 0, f"the header has no room for {stripes} stripe checksums", None)
    try:
        fd = _create(temp, fsync)
        try:
            digests = []
            for start in range(0, payload_len, stripe_bytes):
                end = min(start + stripe_bytes, payload_len)
                state = xxhash.xxh3_64()
                for piece_start in range(start, end, READ_PIECE):  # hashed, then written
                    pieces = _pieces(
                        arena, extents, piece_start, min(piece_start + READ_PIECE, end)
                    )
                    for piece in pieces:
                        state.update(piece)
                    _write_all(fd, pieces, len(header) + piece_start)
                digests.append(state.intdigest())
            struct.pack_into(f"<{len(digests)}Q", header, checksums_at, *digests)
            checked_end = len(header) - 8
            digest = xxhash.xxh3_64_intdigest(memoryview(header)[:checked_end])
            struct.pack_into("<Q", header, checked_end, digest)
            _write_all(fd, [memoryview(header)], 0)
            os.utime(fd, ns=(stamp_ns, stamp_ns))
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, final)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        space = None
        if exc.errno in NO_SPACE_ERRNOS:
            space = free_bytes(os.path.dirname(os.path.dirname(temp)))
        return (job_id, "error", exc.errno or 0, f"{type(exc).__name__}: {exc}", space)
    space = free_bytes(os.path.dirname(os.path.dirname(final))) if measure_free else None
    return (job_id, "written", 0, "", space)


def serve(arena: memoryview, jobs: list[tuple[Any, ...]]) -> list[tuple[object, ...]]:
    """Every job of a message, in order; then one fsync per directory renamed into by an
    ``fsync`` write (a failed one fails those writes and removes their files)."""
    answers = []
    for job in jobs:
        try:
            answers.append(read_chunk(arena, job) if job[0] == "read" else write_chunk(arena, job))
        except Exception as exc:  # a malformed job: its answer says so, the worker lives on
            detail = f"{type(exc).__name__}: {exc}"
            if job[0] == "read":
                answers.append((job[1], "error", b"", [], 0, None, detail))
            else:
                answers.append((job[1], "error", 0, detail, None))
    synced: dict[str, list[int]] = {}
    for index, (job, answer) in enumerate(zip(jobs, answers, strict=True)):
        if job[0] == "write" and job[9] and answer[1] == "written":
            synced.setdefault(os.path.dirname(job[3]), []).append(index)
    for directory, indices in synced.items():
        try:
            fsync_directory(directory)
        except OSError as exc:
            for index in indices:
                job = jobs[index]
                with contextlib.suppress(OSError):
                    os.unlink(job[3])  # its rename may not survive a crash: not stored
                answers[index] = (job[1], "error", exc.errno or 0, f"fsync of {directory}: {exc}",
                                  None)  # fmt: skip
    return answers


def main() -> None:
    arena_fd, arena_bytes, socket_fd = (int(value) for value in sys.argv[1:4])
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops its workers itself
    # Not MAP_POPULATE: measured, it bought nothing once warm (H200 host, development VM) and
    # cost up to a second at each start (page tables of the whole arena in every worker).
    mapping = mmap.mmap(arena_fd, arena_bytes)
    arena = memoryview(mapping)
    channel = socket.socket(fileno=socket_fd)
    while True:
        # Every batch already sent is taken at once and answered in one message: the engine's
        # loop then wakes once for all of them (each wake-up beside a busy Python thread can
        # wait a switch interval for the interpreter lock).
        jobs: list[tuple[Any, ...]] = []
        flags = 0
        while True:
            try:
                message = channel.recv(MAX_MESSAGE, flags)
            except BlockingIOError:
                break
            except OSError:
                return
            if not message:
                return
            jobs.extend(pickle.loads(message))
            flags = socket.MSG_DONTWAIT
        channel.sendall(pickle.dumps(serve(arena, jobs)))


if __name__ == "__main__":
    main()
