"""One I/O worker process: moves chunk files' bytes between disk and the shared L1 arena,
hashing each checksum stripe as it passes, so the engine's interpreter never touches them.

Run by path (``python -I worker.py ARENA_FD ARENA_BYTES SOCKET_FD``, `tiered_kv.io.plane` starts
it): it imports the standard library, xxhash and `pagecache.py` beside it, never tiered_kv (whose
package imports torch), so a worker starts in milliseconds and holds no CUDA state. It maps the
arena (a memfd inherited as ``ARENA_FD``), serves jobs from its socket (``SOCK_SEQPACKET``, one
pickled list of jobs per message) in order, answers them as they end, several to a message
(`Outbox`), and exits when the socket closes or its parent dies (``PR_SET_PDEATHSIG``). Judging
the bytes (the header's checks, the checksums) is the engine's, on its loop: a worker only moves
and hashes them.

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
answer message, before it is sent (a group commit). Answer: ``(job_id, status, errno, detail,
free_bytes)``; ``status`` ``"written"`` or ``"error"`` (no file left at either path);
``free_bytes``: the filesystem's free bytes after a ``measure_free`` write or one that failed
for want of space, else None.
"""

from __future__ import annotations

import collections
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
import time
from collections.abc import Callable, Sequence
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
# While jobs remain, answers go back at most this often (`Outbox`).
ANSWER_EVERY_S = 0.002


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (AttributeError, OSError):  # not Linux: the socket's EOF still ends the worker
        pass
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(0)


def _runs(extents: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The arena runs ``(offset, length)`` holding payload bytes ``[start, end)``."""
    runs = []
    position = 0
    for offset, length in extents:
        if position + length > start and position < end:
            lo = max(start - position, 0)
            hi = min(end - position, length)
            runs.append((offset + lo, hi - lo))
        position += length
        if position >= end:
            break
    return runs


def _pieces(
    arena: memoryview, extents: list[tuple[int, int]], start: int, end: int
) -> list[memoryview]:
    """The arena views holding payload bytes ``[start, end)``."""
    return [arena[offset : offset + length] for offset, length in _runs(extents, start, end)]


class _Populate:
    """Map the arena pages a job is about to fill in one call (``MADV_POPULATE_WRITE``, Linux
    5.14) instead of one page fault per 4 KiB as the read or receive first writes them: a
    worker maps the shared arena itself, so every page it has not touched yet faults once.
    Pages already mapped cost a page-table walk. Measured on an H200 host (16 workers, a 32k
    prompt's 128 chunks of 32 MiB from the page cache, `tools/diagnostics/retrieve_timeline.py`,
    two alternating runs each): the read 162 / 159 ms against 183 / 185 without, a whole
    retrieve 182 / 187 against 223 / 195 ms. Off for good after the first refusal (an older
    kernel)."""

    ADVICE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

    def __init__(self) -> None:
        self.mapping: mmap.mmap | None = None

    def __call__(self, extents: list[tuple[int, int]], start: int, end: int) -> None:
        mapping = self.mapping
        if mapping is None:
            return
        for offset, length in _runs(extents, start, end):
            lo = offset - offset % mmap.PAGESIZE
            try:
                mapping.madvise(self.ADVICE, lo, offset + length - lo)
            except (OSError, ValueError):
                self.mapping = None
                return


populate = _Populate()


def _has_room(header: bytearray, checksums_at: int, stripes: int) -> bool:
    """Whether a header template holds ``stripes`` checksums and then its own checksum."""
    return len(header) == checksums_at + 8 * stripes + 8


def _seal(header: bytearray, checksums_at: int, digests: list[int]) -> None:
    """`tiered_kv.codec.seal_header` in place: the stripes' checksums, then the header's."""
    struct.pack_into(f"<{len(digests)}Q", header, checksums_at, *digests)
    checked_end = len(header) - 8
    digest = xxhash.xxh3_64_intdigest(memoryview(header)[:checked_end])
    struct.pack_into("<Q", header, checked_end, digest)


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
        populate(extents, first * stripe_bytes, min(last * stripe_bytes, payload_len))
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
    if not _has_room(header, checksums_at, stripes):
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
            _seal(header, checksums_at, digests)
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


# -- the built-in remote cache (tkv://), its frames as tiered_kv/tiers/remote/protocol.py has
# them (a test checks these constants against that module) ----------------------------------
TKV_MAGIC = b"TKVP"
TKV_VERSION = 1
TKV_HEADER = struct.Struct("<4sBBBBIIQ")  # magic, version, op, status, flags, id, meta, data
TKV_AUTH, TKV_PUT, TKV_GET = 1, 4, 5
TKV_REQUEST, TKV_OK, TKV_NOT_FOUND, TKV_ERROR = 0, 1, 2, 3
TKV_MAX_META = 1 << 20  # an answer's meta is a short message at most
BACKOFF_S = (0.25, 2.0)  # after a failed connect: first wait, longest


class SizeMismatch(Exception):
    """A GET answered with a frame of another length than the layout asked for."""


class RemoteDown(OSError):
    """The endpoint failed to connect recently: not tried again until its backoff ends."""


class Endpoint:
    """One worker's connection to one ``tkv://`` server (opened and authenticated on first use,
    closed after any error; connects that fail back off)."""

    def __init__(self, host: str, port: int, token: bytes) -> None:
        self.host, self.port, self.token = host, port, token
        self.sock: socket.socket | None = None
        self.down_until = 0.0
        self.backoff = BACKOFF_S[0]
        self.next_id = 1
        self.timeout: float | None = None

    def connect(self, timeout: float) -> socket.socket:
        if self.sock is not None:
            self._bound(timeout)
            return self.sock
        if time.monotonic() < self.down_until:
            raise RemoteDown(f"tkv://{self.host}:{self.port} is down (backing off)")
        try:
            sock = socket.create_connection((self.host, self.port), timeout)
        except OSError:
            self.down_until = time.monotonic() + self.backoff
            self.backoff = min(self.backoff * 2, BACKOFF_S[1])
            raise
        self.backoff = BACKOFF_S[0]
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.timeout = None
        self._bound(timeout)
        if self.token:
            try:
                self.send(TKV_AUTH, b"", self.token)
                status, meta, data_len = self.answer(TKV_AUTH)
                if status != TKV_OK or data_len:
                    raise ConnectionError(f"AUTH refused: {meta[2:].decode(errors='replace')}")
            except BaseException:
                self.close()
                raise
        return sock

    def _bound(self, timeout: float) -> None:
        """A blocking socket whose every send and receive the kernel bounds by ``timeout``
        (``SO_RCVTIMEO``/``SO_SNDTIMEO``; past it a call fails with ``EAGAIN``, an `OSError`):
        with Python's own timeout the socket would be non-blocking, and a ``MSG_WAITALL``
        receive would return whatever had arrived."""
        if self.timeout == timeout or self.sock is None:
            return
        self.sock.settimeout(None)
        seconds = int(timeout)
        bound = struct.pack("ll", seconds, int((timeout - seconds) * 1e6))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)
        self.timeout = timeout

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.close()
            self.sock = None

    def send(
        self, op: int, key: bytes, meta_tail: bytes = b"", data: Sequence[memoryview] = ()
    ) -> None:
        """A request frame: meta is ``key`` (+ ``meta_tail``), data the views ``data``."""
        assert self.sock is not None
        meta = key + meta_tail
        data_len = sum(len(piece) for piece in data)
        head = TKV_HEADER.pack(TKV_MAGIC, TKV_VERSION, op, TKV_REQUEST, 0, self.next_id, len(meta),
                               data_len)  # fmt: skip
        self.next_id = (self.next_id + 1) & 0xFFFFFFFF
        self.sock.sendall(head + meta)
        for piece in data:
            self.sock.sendall(piece)

    def recv_into(self, view: memoryview) -> None:
        assert self.sock is not None
        while view:
            # MSG_WAITALL: one call per piece where the kernel can (fewer wake-ups and calls).
            count = self.sock.recv_into(view, 0, socket.MSG_WAITALL)
            if not count:
                raise ConnectionError("connection closed by the server")
            view = view[count:]

    def answer(self, op: int) -> tuple[int, bytes, int]:
        """The next answer's status, meta and data length (its data left to read)."""
        head = bytearray(TKV_HEADER.size)
        self.recv_into(memoryview(head))
        magic, version, got_op, status, _, _, meta_len, data_len = TKV_HEADER.unpack(head)
        if magic != TKV_MAGIC or version != TKV_VERSION or got_op != op:
            raise ConnectionError(f"not an answer to op {op}: {bytes(head[:8])!r}")
        if meta_len > TKV_MAX_META:
            raise ConnectionError(f"answer meta of {meta_len} bytes")
        meta = bytearray(meta_len)
        self.recv_into(memoryview(meta))
        return status, bytes(meta), data_len


def _endpoint(endpoints: dict[tuple[str, int], Endpoint], job: tuple[Any, ...]) -> Endpoint:
    host, port, token = job[2], job[3], job[4]
    endpoint = endpoints.get((host, port))
    if endpoint is None or endpoint.token != token:
        if endpoint is not None:
            endpoint.close()
        endpoint = endpoints[(host, port)] = Endpoint(host, port, token)
    return endpoint


def _by_endpoint(
    jobs: list[tuple[Any, ...]], endpoints: dict[tuple[str, int], Endpoint]
) -> list[tuple[Endpoint, list[tuple[Any, ...]]]]:
    """``jobs`` grouped by the server they go to, in order."""
    groups: dict[int, tuple[Endpoint, list[tuple[Any, ...]]]] = {}
    for job in jobs:
        endpoint = _endpoint(endpoints, job)
        groups.setdefault(id(endpoint), (endpoint, []))[1].append(job)
    return list(groups.values())


Answered = Callable[[tuple[Any, ...], tuple[object, ...]], None]


def remote_gets(
    arena: memoryview,
    jobs: list[tuple[Any, ...]],
    endpoints: dict[tuple[str, int], Endpoint],
    answered: Answered,
) -> None:
    """GET jobs ``("get", job_id, host, port, token, key, header_len, payload_len, extents,
    stripe_bytes, timeout)``: all of one endpoint sent at once (the server answers in order),
    then each answer read: the chunk frame's header back, its payload into the arena runs,
    hashed per stripe, and passed to ``answered`` as a read's (``file_size``: the frame's
    length; status ``"mismatch"`` for a frame of another length, left unread); any connection
    error fails that endpoint's jobs still unanswered and closes the connection."""
    for endpoint, group in _by_endpoint(jobs, endpoints):
        done = 0
        try:
            endpoint.connect(group[0][10])
            for job in group:
                endpoint.send(TKV_GET, job[5])
            for job in group:
                answer = _get_answer(arena, endpoint, job)
                done += 1
                answered(job, answer)
        except (OSError, ConnectionError, SizeMismatch) as exc:
            endpoint.close()
            for job in group[done:]:
                if isinstance(exc, SizeMismatch) and job is group[done]:
                    answered(job, (job[1], "mismatch", b"", [], 0, None, str(exc)))
                else:
                    answer = (job[1], "error", b"", [], 0, None, f"{type(exc).__name__}: {exc}")
                    answered(job, answer)


def _get_answer(arena: memoryview, endpoint: Endpoint, job: tuple[Any, ...]) -> tuple[object, ...]:
    (_, job_id, _, _, _, _, header_len, payload_len, extents, stripe_bytes, _) = job
    status, meta, data_len = endpoint.answer(TKV_GET)
    if status == TKV_NOT_FOUND:
        return (job_id, "missing", b"", [], 0, None, "")
    if status != TKV_OK:
        detail = meta[2:].decode(errors="replace") if status == TKV_ERROR else f"status {status}"
        if data_len:
            raise ConnectionError(f"an error answer with {data_len} data bytes")
        return (job_id, "error", b"", [], 0, None, detail)
    if data_len != header_len + payload_len:
        # Another layout under this key (or a bad server): not read; the connection is left
        # behind rather than drained by a length the server claims.
        raise SizeMismatch(f"{data_len} bytes, expected {header_len + payload_len}")
    header = bytearray(header_len)
    endpoint.recv_into(memoryview(header))
    populate(extents, 0, payload_len)
    digests: list[int | None] = []
    for start in range(0, payload_len, stripe_bytes):
        end = min(start + stripe_bytes, payload_len)
        state = xxhash.xxh3_64()
        for piece_start in range(start, end, READ_PIECE):
            for piece in _pieces(arena, extents, piece_start, min(piece_start + READ_PIECE, end)):
                endpoint.recv_into(piece)
                state.update(piece)
        digests.append(state.intdigest())
    return (job_id, "read", bytes(header), digests, data_len, None, "")


def remote_puts(
    arena: memoryview,
    jobs: list[tuple[Any, ...]],
    endpoints: dict[tuple[str, int], Endpoint],
    answered: Answered,
) -> None:
    """PUT jobs ``("put", job_id, host, port, token, key, header, checksums_at, extents,
    stripe_bytes, timeout)``: each payload hashed, its header sealed (as `write_chunk` does),
    the frame sent; all of one endpoint sent, then the answers read, each passed to
    ``answered`` as a write's."""
    for endpoint, group in _by_endpoint(jobs, endpoints):
        done: set[int] = set()
        try:
            endpoint.connect(group[0][10])
            sent = []
            for job in group:
                (_, job_id, _, _, _, key, template, checksums_at, extents, stripe_bytes, _) = job
                header = _sealed(arena, template, checksums_at, extents, stripe_bytes)
                if header is None:
                    done.add(job_id)
                    answered(job, (job_id, "error", 0, "the header has no room for its stripes",
                                   None))  # fmt: skip
                    continue
                pieces = _pieces(arena, extents, 0, sum(length for _, length in extents))
                endpoint.send(TKV_PUT, key, data=[memoryview(header), *pieces])
                sent.append(job)
            for job in sent:
                status, meta, data_len = endpoint.answer(TKV_PUT)
                if data_len:
                    raise ConnectionError(f"a PUT answer with {data_len} data bytes")
                done.add(job[1])
                if status == TKV_OK:
                    answered(job, (job[1], "written", 0, "", None))
                else:
                    detail = meta[2:].decode(errors="replace") or f"status {status}"
                    answered(job, (job[1], "error", 0, detail, None))
        except (OSError, ConnectionError) as exc:
            endpoint.close()
            for job in group:
                if job[1] not in done:
                    answered(job, (job[1], "error", 0, f"{type(exc).__name__}: {exc}", None))


def _sealed(
    arena: memoryview,
    template: bytes,
    checksums_at: int,
    extents: list[tuple[int, int]],
    stripe_bytes: int,
) -> bytearray | None:
    """``template`` with the payload's stripe checksums and the header checksum filled in."""
    header = bytearray(template)
    payload_len = sum(length for _, length in extents)
    stripes = -(-payload_len // stripe_bytes)
    if not _has_room(header, checksums_at, stripes):
        return None
    digests = []
    for start in range(0, payload_len, stripe_bytes):
        state = xxhash.xxh3_64()
        for piece in _pieces(arena, extents, start, min(start + stripe_bytes, payload_len)):
            state.update(piece)
        digests.append(state.intdigest())
    _seal(header, checksums_at, digests)
    return header


def _failed(job: tuple[Any, ...], exc: Exception) -> tuple[object, ...]:
    detail = f"{type(exc).__name__}: {exc}"
    if job[0] in ("read", "get"):
        return (job[1], "error", b"", [], 0, None, detail)
    return (job[1], "error", 0, detail, None)


class Outbox:
    """Answers not yet sent. While jobs remain they go back together at most every
    `ANSWER_EVERY_S`, and at once when none remain: a chunk's read is answered a few
    milliseconds after it ends, not when the worker's whole backlog does, so the engine can
    copy it on (and start the next load) while the rest are still read, and its loop still
    wakes once for many small jobs. Writes with ``fsync`` are answered only after the
    directories they were renamed into are fsynced, once per answer message (a group commit)."""

    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel
        self.items: list[tuple[tuple[Any, ...], tuple[object, ...]]] = []
        self.sent_at = time.monotonic()

    def put(self, job: tuple[Any, ...], answer: tuple[object, ...]) -> None:
        self.items.append((job, answer))
        if time.monotonic() - self.sent_at >= ANSWER_EVERY_S:
            self.send()

    def send(self) -> None:
        if self.items:
            answers = _group_commit(self.items)
            self.items = []
            self.channel.sendall(pickle.dumps(answers))
        self.sent_at = time.monotonic()


def _group_commit(
    items: list[tuple[tuple[Any, ...], tuple[object, ...]]],
) -> list[tuple[object, ...]]:
    """The answers of ``items``, after one fsync per directory renamed into by an ``fsync``
    write (a failed one fails those writes and removes their files)."""
    answers = [answer for _, answer in items]
    synced: dict[str, list[int]] = {}
    for index, (job, answer) in enumerate(items):
        if job[0] == "write" and job[9] and answer[1] == "written":
            synced.setdefault(os.path.dirname(job[3]), []).append(index)
    for directory, indices in synced.items():
        try:
            fsync_directory(directory)
        except OSError as exc:
            for index in indices:
                job = items[index][0]
                with contextlib.suppress(OSError):
                    os.unlink(job[3])  # its rename may not survive a crash: not stored
                answers[index] = (job[1], "error", exc.errno or 0, f"fsync of {directory}: {exc}",
                                  None)  # fmt: skip
    return answers


def step(
    arena: memoryview,
    jobs: collections.deque[tuple[Any, ...]],
    endpoints: dict[tuple[str, int], Endpoint],
    outbox: Outbox,
) -> None:
    """Run the backlog's next jobs into ``outbox``: every GET (or PUT) at its head together,
    pipelined per endpoint, or one read or write."""
    kind = jobs[0][0]
    if kind in ("get", "put"):
        batch = []
        while jobs and jobs[0][0] == kind:
            batch.append(jobs.popleft())
        answered: set[int] = set()

        def put(job: tuple[Any, ...], answer: tuple[object, ...]) -> None:
            answered.add(job[1])
            outbox.put(job, answer)

        try:
            (remote_gets if kind == "get" else remote_puts)(arena, batch, endpoints, put)
        except Exception as exc:  # a malformed job: its answers say so, the worker lives on
            for job in batch:
                if job[1] not in answered:
                    outbox.put(job, _failed(job, exc))
        return
    job = jobs.popleft()
    try:
        answer = read_chunk(arena, job) if kind == "read" else write_chunk(arena, job)
    except Exception as exc:  # a malformed job: its answer says so, the worker lives on
        answer = _failed(job, exc)
    outbox.put(job, answer)


def _take(channel: socket.socket, jobs: collections.deque[tuple[Any, ...]], block: bool) -> bool:
    """Every message waiting (waiting for one when ``block``) onto ``jobs``; False once the
    engine has closed the socket."""
    flags = 0 if block else socket.MSG_DONTWAIT
    while True:
        try:
            message = channel.recv(MAX_MESSAGE, flags)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not message:
            return False
        jobs.extend(pickle.loads(message))
        flags = socket.MSG_DONTWAIT


def main() -> None:
    arena_fd, arena_bytes, socket_fd = (int(value) for value in sys.argv[1:4])
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine stops its workers itself
    # Not MAP_POPULATE: measured, it bought nothing once warm (H200 host, development VM) and
    # cost up to a second at each start (page tables of the whole arena in every worker).
    # Each job maps the pages it fills instead (`_Populate`).
    mapping = mmap.mmap(arena_fd, arena_bytes)
    populate.mapping = mapping
    arena = memoryview(mapping)
    channel = socket.socket(fileno=socket_fd)
    endpoints: dict[tuple[str, int], Endpoint] = {}
    jobs: collections.deque[tuple[Any, ...]] = collections.deque()
    outbox = Outbox(channel)
    # Jobs that arrive while others run join the backlog between two jobs; the worker blocks
    # only with nothing left to run and nothing left to answer.
    while _take(channel, jobs, block=not jobs):
        if jobs:
            step(arena, jobs, endpoints, outbox)
        if not jobs:
            outbox.send()


if __name__ == "__main__":
    main()
