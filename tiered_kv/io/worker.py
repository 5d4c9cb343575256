"""One I/O worker process: reads chunk files straight into the shared L1 arena, hashing each
checksum stripe as it lands, and answers with the header's bytes and the stripes' digests.

Run by path (``python -I worker.py ARENA_FD ARENA_BYTES SOCKET_FD``, `tiered_kv.io.plane` starts
it): it imports the standard library, xxhash and `pagecache.py` beside it, never tiered_kv (whose
package imports torch), so a worker starts in milliseconds and holds no CUDA state. It maps the
arena (a memfd inherited as ``ARENA_FD``), serves jobs from its socket (``SOCK_SEQPACKET``, one
pickled list of jobs per message; every job waiting is taken and answered together, in one message),
and exits when the socket closes or its parent dies (``PR_SET_PDEATHSIG``). Judging the bytes (the
header's checks, the checksums) is the engine's, on its loop: a worker only moves and hashes them.

Job: ``(job_id, path, header_len, payload_len, extents, stripe_bytes, stamp_ns)`` where
``extents`` are the ``(arena offset, length)`` runs that hold the payload in order. Answer:
``(job_id, status, header, digests, file_size, cached, detail)``; ``status`` is ``"read"``
(``digests`` has one entry per stripe, None past a short file's end; ``cached``: whether the
payload's first pages were in the page cache before the read, None where the system cannot
tell), ``"missing"`` or ``"error"``.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import mmap
import os
import pickle
import signal
import socket
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


Job = tuple[int, str, int, int, list[tuple[int, int]], int, int]


def read_chunk(arena: memoryview, job: Job) -> tuple[object, ...]:
    job_id, path, header_len, payload_len, extents, stripe_bytes, stamp_ns = job
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return (job_id, "missing", b"", [], 0, None, "")
    try:
        size = os.fstat(fd).st_size
        # Before reading: whether the payload's first pages were in the page cache already.
        share = pagecache.cached_fraction(fd, min(2 * stripe_bytes, payload_len), header_len)
        cached = None if share is None else share >= 0.5
        header = os.pread(fd, header_len, 0)
        stripes = -(-payload_len // stripe_bytes) if payload_len else 0
        digests: list[int | None] = [None] * stripes
        offset = header_len
        for index in range(stripes):
            start = index * stripe_bytes
            end = min(start + stripe_bytes, payload_len)
            pieces = _pieces(arena, extents, start, end)
            got = os.preadv(fd, pieces, offset)
            if got < end - start:
                break  # a short file: this stripe and the rest stay unread
            state = xxhash.xxh3_64()
            for piece in pieces:
                state.update(piece)
            digests[index] = state.intdigest()
            offset += end - start
        with contextlib.suppress(OSError):  # recency survives a restart (the index's order)
            os.utime(fd, ns=(stamp_ns, stamp_ns))
        return (job_id, "read", header, digests, size, cached, "")
    except OSError as exc:
        return (job_id, "error", b"", [], 0, None, f"{type(exc).__name__}: {exc}")
    finally:
        os.close(fd)


def main() -> None:
    arena_fd, arena_bytes, socket_fd = (int(value) for value in sys.argv[1:4])
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops its workers itself
    mapping = mmap.mmap(arena_fd, arena_bytes)
    arena = memoryview(mapping)
    channel = socket.socket(fileno=socket_fd)
    while True:
        # Every batch already sent is taken at once and answered in one message: the engine's
        # loop then wakes once for all of them (each wake-up beside a busy Python thread can
        # wait a switch interval for the interpreter lock).
        jobs: list[Job] = []
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
        channel.sendall(pickle.dumps([read_chunk(arena, job) for job in jobs]))


if __name__ == "__main__":
    main()
