"""`RemoteCacheServer`: the built-in remote cache behind ``tkv://`` (``tiered-kv serve``).

Owns an in-memory, capacity-bounded LRU map of key bytes → chunk frame, the listening socket,
its connections and their authentication. Stored frames are the codec frames clients send,
kept as received (a few `bytearray` segments per chunk, each filled by ``recv_into`` as the
data arrived) and sent back as `memoryview`s of them, so no payload byte is touched by Python
code. The server checks each frame's
header (key, lengths) but not the payload checksum: readers verify it on every GET.

Must not: block the loop, trust a length before `ProtocolLimits` checked it, allocate, reserve
or evict on a length a client claims rather than on bytes it sent, read more than a small AUTH
from a connection that has not authenticated, or let one bad client disturb others (a malformed
frame closes only its own connection; a slow, idle or surplus one is closed on a deadline or
refused).

Runs on one event loop (uvloop under the CLI); every callback below runs on it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import signal
import sys
import time
import typing

from tiered_kv.codec import DEFAULT_LIMITS as CODEC_LIMITS
from tiered_kv.codec import PREFIX_LEN, ChunkHeader, CodecLimits, decode_header, header_length
from tiered_kv.errors import CodecError, ConfigError, ProtocolError
from tiered_kv.tiers.remote.protocol import (
    DEFAULT_LIMITS,
    HEADER_LEN,
    DataSink,
    ErrorCode,
    FrameError,
    FrameHeader,
    FrameReader,
    Op,
    ProtocolLimits,
    Status,
    check_key,
    decode_key_list,
    encode_error,
    pack_frame_header,
)

logger = logging.getLogger(__name__)

_COUNTERS = (
    "connections_total",
    "requests",
    "puts",
    "put_refused",
    "gets",
    "hits",
    "misses",
    "exists_keys",
    "deletes",
    "evictions",
    "bad_requests",
    "protocol_errors",
    "auth_failures",
    "connections_refused",
    "header_timeouts",
    "idle_timeouts",
    "bytes_in",
    "bytes_out",
)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerOptions:
    """host / port: where to listen (loopback unless told otherwise; port 0 picks a free one).
    capacity: bytes of chunk frames held before LRU eviction.
    token: shared secret every connection must present first (None: no authentication).
    max_connections: connections served at once; one more is answered BUSY and closed.
    header_timeout_s: how long a request may take from its first byte to the end of its meta,
        and a connection from its start to a good AUTH when there is a token (None: no bound).
    idle_timeout_s: how long a connection may go without sending a byte or taking one of ours,
        a PUT whose data stalls included (None: no bound).
    max_auth_bytes: the largest AUTH meta read before authentication (the token must fit).
    """

    host: str = "127.0.0.1"
    port: int = 7474
    capacity: int = 64 << 30
    token: bytes | None = None
    limits: ProtocolLimits = DEFAULT_LIMITS
    codec_limits: CodecLimits = CODEC_LIMITS
    max_connections: int = 1024
    header_timeout_s: float | None = 10.0
    idle_timeout_s: float | None = 300.0
    max_auth_bytes: int = 4096

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int):
            raise ConfigError(f"capacity: expected an int of bytes, got {self.capacity!r}")
        if self.capacity < 1:
            raise ConfigError(f"capacity: must be > 0 bytes, got {self.capacity}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
        if self.token is not None and not self.token:
            raise ConfigError("token: must not be empty (use None to disable authentication)")
        for name in ("max_connections", "max_auth_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: expected an int >= 1, got {value!r}")
        for name in ("header_timeout_s", "idle_timeout_s"):
            value = getattr(self, name)
            if value is None:
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not 0 < value < math.inf
            ):
                raise ConfigError(f"{name}: expected seconds > 0 or None (no bound), got {value!r}")
        if self.token is not None and len(self.token) > self.max_auth_bytes:
            raise ConfigError(
                f"token: {len(self.token)} bytes do not fit in max_auth_bytes={self.max_auth_bytes}"
            )


_FIRST_SEGMENT = 64 << 10
_DISCARD_BYTES = 64 << 10


class _Frame:
    """A stored chunk frame: its segments in order, each filled by ``recv_into`` as it arrived.

    Byte access (`bytes`, indexing) is for inspection and fault injection, not the data path.
    """

    __slots__ = ("segments", "nbytes")

    def __init__(self, segments: tuple[bytearray, ...]) -> None:
        self.segments = segments
        self.nbytes = sum(len(segment) for segment in segments)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.segments)

    def _locate(self, index: int) -> tuple[bytearray, int]:
        position = index + self.nbytes if index < 0 else index
        if 0 <= position < self.nbytes:
            for segment in self.segments:
                if position < len(segment):
                    return segment, position
                position -= len(segment)
        raise IndexError(f"frame index {index} out of range for {self.nbytes} bytes")

    def __getitem__(self, index: int) -> int:
        segment, offset = self._locate(index)
        return segment[offset]

    def __setitem__(self, index: int, value: int) -> None:
        segment, offset = self._locate(index)
        segment[offset] = value


def _unshared(segment: bytearray) -> bool:
    """Whether only its frame holds ``segment`` (no transport still sending a view of it).

    For a caller iterating over ``frame.segments``, CPython counts: the frame's tuple, the
    caller's loop variable, this parameter and getrefcount's own argument.
    """
    return sys.getrefcount(segment) <= 4


class _Store:
    """The LRU map and its byte accounting: stored frames, recycled segments and bytes reserved
    by PUTs in flight, all within ``capacity``.

    A PUT asks for its segments one by one as its data arrives (see `_PutSink`), so frames are
    evicted for bytes a client sent, never for a length it claims. Segments of freed frames are
    recycled (a fresh 32 MiB buffer costs more in page faults than receiving 32 MiB over
    loopback), evicted ones included as far as the room they leave is not needed at once; a
    PUT of a size seen before then finds every segment it needs in the pool. A segment is
    recycled only when no transport still holds a view of it.
    """

    def __init__(self, capacity: int, counters: dict[str, int]) -> None:
        self.capacity = capacity
        self.entries: collections.OrderedDict[bytes, _Frame] = collections.OrderedDict()
        self.used = 0
        self.reserved = 0
        self.pooled = 0
        self.pool_limit = capacity // 4
        self._pool: dict[int, list[bytearray]] = {}
        self._counters = counters

    def allocate(self, nbytes: int) -> bytearray | None:
        """A segment of ``nbytes`` for a PUT in flight, its room reserved: a pooled one, else
        room made by dropping pooled segments (largest first: the most room per drop), then
        evicting LRU frames, whose segments are pooled as far as they fit (one of them may be
        the answer); None when PUTs in flight already hold that room."""
        segment = self._take_pooled(nbytes)
        if segment is not None:
            self.reserved += nbytes
            return segment
        if self.reserved + nbytes > self.capacity:
            return None
        evicted = []
        while self.used + self.pooled + self.reserved + nbytes > self.capacity:
            if self.pooled:
                self._drop_pooled()
                continue
            # Not empty: here used > capacity - reserved - nbytes >= 0.
            _, frame = self.entries.popitem(last=False)
            self.used -= frame.nbytes
            self._counters["evictions"] += 1
            evicted.append(frame)
        self.reserved += nbytes
        for frame in evicted:
            self.recycle(frame)
        segment = self._take_pooled(nbytes)
        return bytearray(nbytes) if segment is None else segment

    def _take_pooled(self, nbytes: int) -> bytearray | None:
        segments = self._pool.get(nbytes)
        if not segments:
            return None
        self.pooled -= nbytes
        return segments.pop()

    def _drop_pooled(self) -> None:
        size = max(size for size, segments in self._pool.items() if segments)
        self._pool[size].pop()
        self.pooled -= size

    def recycle(self, frame: _Frame) -> None:
        """Pool the segments of a frame no longer stored, as far as they fit (largest first:
        the small ones are the cheapest to allocate again)."""
        for segment in reversed(frame.segments):
            size = len(segment)
            if (
                self.pooled + size <= self.pool_limit
                and self.used + self.pooled + self.reserved + size <= self.capacity
                and _unshared(segment)
            ):
                self._pool.setdefault(size, []).append(segment)
                self.pooled += size

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def insert(self, key: bytes, frame: _Frame) -> None:
        old = self.entries.pop(key, None)
        self.entries[key] = frame
        self.used += frame.nbytes
        if old is not None:
            self.used -= old.nbytes
            self.recycle(old)

    def get(self, key: bytes) -> _Frame | None:
        frame = self.entries.get(key)
        if frame is not None:
            self.entries.move_to_end(key)
        return frame

    def delete(self, key: bytes) -> bool:
        frame = self.entries.pop(key, None)
        if frame is None:
            return False
        self.used -= frame.nbytes
        self.recycle(frame)
        return True

    def clear(self) -> None:
        self.entries.clear()
        self._pool.clear()
        self.used = self.pooled = 0


class _PutSink:
    """Where a PUT's data lands: segments added, with the room they reserve, as bytes arrive.

    A header alone reserves and allocates nothing; the first segment is 64 KiB and each next
    one as large as all before it, so a client that claims more than it sends holds memory, and
    evicts frames, in proportion to what it sent, and no byte is ever copied to grow a buffer.
    When the store has no room left the PUT is refused: its segments and reservation are given
    back and the rest of its data lands in a shared scratch buffer, dropped.
    """

    __slots__ = ("size", "segments", "filled", "reserved", "refusal", "_store", "_discard")

    def __init__(self, store: _Store, size: int, discard: memoryview) -> None:
        self._store = store
        self._discard = discard
        self.size = size
        self.segments: list[bytearray] = []
        self.filled = 0  # bytes received
        self.reserved = 0  # bytes of the segments so far
        self.refusal: str | None = None

    def target(self) -> memoryview:
        if self.filled == self.reserved and self.refusal is None:
            self._add_segment()
        if self.refusal is not None:
            return self._discard[: self.size - self.filled]
        last = self.segments[-1]
        return memoryview(last)[len(last) - (self.reserved - self.filled) :]

    def advance(self, nbytes: int) -> None:
        self.filled += nbytes

    def _add_segment(self) -> None:
        nbytes = min(self.size - self.reserved, max(self.reserved, _FIRST_SEGMENT))
        store = self._store
        segment = store.allocate(nbytes)
        if segment is None:
            self.refusal = (
                f"{self.size} bytes do not fit: capacity {store.capacity}, "
                f"{store.reserved} reserved by PUTs in flight"
            )
            self.release()
            return
        self.segments.append(segment)
        self.reserved += nbytes

    def take(self) -> _Frame:
        """The whole frame, its reservation given back for the caller to store it."""
        frame = _Frame(tuple(self.segments))
        self.release()
        return frame

    def release(self) -> None:
        """Give back the reservation and the segments (the PUT is done, refused or abandoned)."""
        self._store.release(self.reserved)
        self.reserved = 0
        self.segments = []


def _decode_frame_header(frame: _Frame, limits: CodecLimits) -> ChunkHeader:
    """The chunk header at the start of ``frame``; copied out only if it spans segments (with
    codec limits that allow headers longer than the first segment)."""
    first = memoryview(frame.segments[0])
    if len(frame.segments) > 1 and len(first) >= PREFIX_LEN:
        header_len = header_length(first[:PREFIX_LEN], limits)
        if header_len > len(first):
            parts, missing = [], header_len
            for segment in frame.segments:
                parts.append(bytes(segment[:missing]))
                missing -= len(parts[-1])
                if not missing:
                    break
            return decode_header(b"".join(parts), limits)
    return decode_header(first, limits)


class _Connection(asyncio.BufferedProtocol):
    """One client: parses requests with a `FrameReader`, answers each in order.

    Deadlines (`check_deadlines`, called by the server's watcher) are kept as timestamps that
    the callbacks below only write, so receiving costs no timer calls.
    """

    def __init__(self, server: RemoteCacheServer) -> None:
        self.server = server
        self.reader = FrameReader(
            self,
            server.options.limits,
            check_header=self._check_header,
            on_buffer_change=server._receive_buffers_changed,
        )
        self.transport: asyncio.Transport | None = None
        self.authenticated = server.options.token is None
        self.peer = "?"
        # A PUT's key and where its data lands while that streams in.
        self._put: tuple[bytes, _PutSink] | None = None
        self._refusal: tuple[ErrorCode, str] | None = None
        self._paused = False
        self._loop = asyncio.get_running_loop()
        now = self._loop.time()
        self._connected_at = now
        # The last byte from the peer, or the last time it took some of ours.
        self._active_at = now
        # When the first byte of a still incomplete request header or meta arrived.
        self._header_since: float | None = None
        self._unsent = 0  # our bytes the transport still held at the last check
        self.closed = self._loop.create_future()

    # -- transport callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)
        self.peer = str(transport.get_extra_info("peername"))
        server = self.server
        server._counters["connections_total"] += 1
        open_now = len(server._connections)
        if open_now >= server.options.max_connections:
            server._counters["connections_refused"] += 1
            logger.info("tkv server: refusing %s: %d connections open", self.peer, open_now)
            limit = server.options.max_connections
            self._fatal(ErrorCode.BUSY, f"{open_now} connections open, max_connections={limit}", 0)
            return
        server._connections.add(self)
        if server._closing:
            self._fatal(ErrorCode.SHUTTING_DOWN, "server is shutting down", 0)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reader.close()
        self._release_put()
        self.server._connections.discard(self)
        self.transport = None
        if not self.closed.done():
            self.closed.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.server._counters["bytes_in"] += nbytes
        try:
            self.reader.buffer_updated(nbytes)
        except FrameError as exc:
            self.server._counters["protocol_errors"] += 1
            logger.info("tkv server: closing %s: %s", self.peer, exc)
            self._fatal(exc.code, str(exc), exc.request_id)
        now = self._loop.time()
        self._active_at = now
        if self._header_since is None and self.reader.header_pending:
            self._header_since = now

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def pause_writing(self) -> None:
        # The client reads slower than we answer: stop taking requests until it catches up.
        self._paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        now = self._loop.time()
        self._active_at = now
        if self._header_since is not None:
            self._header_since = now  # we were not reading it meanwhile
        if self.transport is not None and not self.reader.stopped:
            self.transport.resume_reading()

    # -- deadlines --------------------------------------------------------------------------
    def check_deadlines(self, now: float) -> None:
        """Close this connection if its AUTH, a request's header and meta, or the peer itself
        is overdue (`ServerOptions.header_timeout_s`, ``idle_timeout_s``)."""
        transport = self.transport
        if transport is None:
            return
        unsent = transport.get_write_buffer_size()
        if transport.is_closing() and not unsent:
            return  # closes by itself
        if unsent != self._unsent:  # the peer took some of our answers
            self._unsent = unsent
            self._active_at = now
        options = self.server.options
        header_timeout = options.header_timeout_s
        if header_timeout is not None:
            if not self.authenticated and now - self._connected_at > header_timeout:
                self._time_out("header_timeouts", f"no AUTH within {header_timeout}s")
                return
            since = self._header_since
            if since is not None and not self._paused and now - since > header_timeout:
                message = f"request header and meta took over {header_timeout}s"
                self._time_out("header_timeouts", message)
                return
        idle_timeout = options.idle_timeout_s
        if idle_timeout is not None and now - self._active_at > idle_timeout:
            self._time_out("idle_timeouts", f"idle for over {idle_timeout}s")

    def _time_out(self, counter: str, message: str) -> None:
        self.server._counters[counter] += 1
        logger.info("tkv server: closing %s: %s", self.peer, message)
        transport = self.transport
        if transport is not None and (transport.is_closing() or transport.get_write_buffer_size()):
            self.abort()  # it does not take what we send: an error frame would not get through
        else:
            self._fatal(ErrorCode.TIMEOUT, message, 0)

    # -- frames -----------------------------------------------------------------------------
    def _check_header(self, header: FrameHeader) -> None:
        """What can be refused on a fixed header alone, before any of its meta is kept."""
        if header.status != Status.REQUEST:
            raise FrameError(ErrorCode.BAD_FRAME, "a request must carry status 0", 0)
        if self.authenticated:
            return
        if header.op != Op.AUTH:
            raise FrameError(
                ErrorCode.AUTH_REQUIRED, "this server needs AUTH first", header.request_id
            )
        max_auth_bytes = self.server.options.max_auth_bytes
        if header.meta_len > max_auth_bytes:
            raise FrameError(
                ErrorCode.FRAME_TOO_LARGE,
                f"AUTH of {header.meta_len} bytes exceeds max_auth_bytes={max_auth_bytes}",
                header.request_id,
            )
        if header.data_len:
            raise FrameError(ErrorCode.BAD_FRAME, "AUTH carries no data", header.request_id)

    def frame_started(self, header: FrameHeader, meta: bytes) -> DataSink | None:
        self._header_since = None
        server = self.server
        server._counters["requests"] += 1
        if header.op != Op.PUT:
            if header.data_len:
                self._refusal = (ErrorCode.BAD_REQUEST, f"op {header.op} carries no data")
            return None
        store = server._store
        size = header.data_len
        if size < HEADER_LEN or not 0 < len(meta) <= server.options.limits.max_key_bytes:
            self._refusal = (ErrorCode.BAD_REQUEST, "PUT needs a key and a chunk frame")
            return None
        if size > store.capacity:
            self._refusal = (
                ErrorCode.NO_SPACE,
                f"{size} bytes do not fit: capacity {store.capacity}",
            )
            return None
        sink = _PutSink(store, size, server._discard)
        self._put = (meta, sink)
        return sink

    def frame_done(self, header: FrameHeader, meta: bytes, sink: DataSink | None) -> None:
        refusal, self._refusal = self._refusal, None
        put = self._put
        if put is not None and put[1].refusal is not None:
            self._put = None
            refusal = (ErrorCode.NO_SPACE, put[1].refusal)
        if refusal is not None:
            self.server._counters["bad_requests"] += 1
            if refusal[0] == ErrorCode.NO_SPACE:
                self.server._counters["put_refused"] += 1
            self._reply_error(header, *refusal)
            return
        try:
            self._dispatch(header, meta)
        except ProtocolError as exc:
            self.server._counters["bad_requests"] += 1
            self._reply_error(header, ErrorCode.BAD_REQUEST, str(exc))

    def _dispatch(self, header: FrameHeader, meta: bytes) -> None:
        server = self.server
        store = server._store
        limits = server.options.limits
        op = header.op
        if op == Op.AUTH:
            token = server.options.token
            if token is not None and not hmac.compare_digest(meta, token):
                server._counters["auth_failures"] += 1
                logger.warning("tkv server: wrong token from %s", self.peer)
                self._fatal(ErrorCode.AUTH_FAILED, "wrong token", header.request_id)
                return
            self.authenticated = True
            self._reply(header, Status.OK)
        elif op == Op.PING:
            self._reply(header, Status.OK, meta)
        elif op == Op.EXISTS:
            keys = decode_key_list(meta, limits)
            server._counters["exists_keys"] += len(keys)
            entries = store.entries
            self._reply(header, Status.OK, bytes([key in entries for key in keys]))
        elif op == Op.PUT:
            self._finish_put(header)
        elif op == Op.GET:
            frame = store.get(check_key(meta, limits))
            server._counters["gets"] += 1
            if frame is None:
                server._counters["misses"] += 1
                self._reply(header, Status.NOT_FOUND)
                return
            server._counters["hits"] += 1
            self._reply(header, Status.OK, data=frame)
        elif op == Op.DELETE:
            keys = decode_key_list(meta, limits)
            removed = bytes([store.delete(key) for key in keys])
            server._counters["deletes"] += sum(removed)
            self._reply(header, Status.OK, removed)
        elif op == Op.STATS:
            self._reply(header, Status.OK, json.dumps(server.stats()).encode())
        else:
            self._reply_error(header, ErrorCode.UNKNOWN_OP, f"unknown op {op}")

    def _finish_put(self, header: FrameHeader) -> None:
        put, self._put = self._put, None
        if put is None:  # frame_started refused it; unreachable, kept for safety
            self._reply_error(header, ErrorCode.BAD_REQUEST, "no PUT in progress")
            return
        key, sink = put
        size = sink.size
        frame = sink.take()
        try:
            chunk = _decode_frame_header(frame, self.server.options.codec_limits)
        except CodecError as exc:
            raise ProtocolError(f"PUT data is not a chunk frame: {exc}") from None
        if chunk.total_len != size:
            raise ProtocolError(f"PUT frame says {chunk.total_len} bytes, carried {size}")
        if chunk.key_bytes != key:
            raise ProtocolError("PUT key differs from the key inside its chunk frame")
        # The reservation made room for the frame; turning it into used bytes keeps
        # used + reserved <= capacity.
        self.server._store.insert(key, frame)
        self.server._counters["puts"] += 1
        self._reply(header, Status.OK)

    def _release_put(self) -> None:
        put, self._put = self._put, None
        if put is not None:
            put[1].release()

    # -- replies ----------------------------------------------------------------------------
    def _reply(
        self,
        header: FrameHeader,
        status: Status,
        meta: bytes = b"",
        data: _Frame | None = None,
    ) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        data_len = 0 if data is None else data.nbytes
        head = pack_frame_header(header.op, status, header.request_id, len(meta), data_len)
        if data is None:
            transport.write(head + meta)
        else:
            transport.writelines([head + meta, *(memoryview(segment) for segment in data.segments)])
        self.server._counters["bytes_out"] += HEADER_LEN + len(meta) + data_len

    def _reply_error(self, header: FrameHeader, code: ErrorCode, message: str) -> None:
        self._reply(header, Status.ERROR, encode_error(code, message))

    def _fatal(self, code: ErrorCode, message: str, request_id: int) -> None:
        """Answer with an error frame, then close after it is sent."""
        self.reader.stopped = True
        self._release_put()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        meta = encode_error(code, message)
        transport.write(pack_frame_header(0, Status.ERROR, request_id, len(meta)) + meta)
        transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class RemoteCacheServer:
    """The server; ``async with RemoteCacheServer(options) as server:`` or `start` / `aclose`."""

    def __init__(self, options: ServerOptions | None = None) -> None:
        self.options = options or ServerOptions()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._store = _Store(self.options.capacity, self._counters)
        self._connections: set[_Connection] = set()
        self._receive_buffer_bytes = 0
        # Where the data of refused PUTs goes, unread: shared, as nobody reads it.
        self._discard = memoryview(bytearray(_DISCARD_BYTES))
        self._server: asyncio.base_events.Server | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False
        self._started = time.monotonic()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Connection(self), self.options.host, self.options.port, reuse_address=True
        )
        self._server = server
        options = self.options
        timeouts = [t for t in (options.header_timeout_s, options.idle_timeout_s) if t is not None]
        if timeouts:
            # A quarter of the shortest timeout (within [10 ms, 1 s]): deadlines are kept
            # to within that.
            interval = min(1.0, max(0.01, min(timeouts) / 4))
            self._watcher = loop.create_task(
                self._watch_deadlines(interval), name="tkv-server-deadlines"
            )
        logger.info("tkv server listening on %s:%d", self.host, self.port)

    async def _watch_deadlines(self, interval: float) -> None:
        """Every ``interval``, close the connections past a deadline; until `aclose` cancels."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(interval)
            now = loop.time()
            for connection in list(self._connections):
                connection.check_deadlines(now)

    def _receive_buffers_changed(self, nbytes: int) -> None:
        self._receive_buffer_bytes += nbytes

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            return self.options.port
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def host(self) -> str:
        if self._server is None or not self._server.sockets:
            return self.options.host
        return str(self._server.sockets[0].getsockname()[0])

    @property
    def url(self) -> str:
        host = self.host
        return f"tkv://[{host}]:{self.port}" if ":" in host else f"tkv://{host}:{self.port}"

    async def __aenter__(self) -> RemoteCacheServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def stats(self) -> dict[str, int | float]:
        return {
            "entries": len(self._store.entries),
            "bytes_used": self._store.used,
            "bytes_reserved": self._store.reserved,
            "bytes_pooled": self._store.pooled,
            "bytes_receive_buffers": self._receive_buffer_bytes,
            "capacity": self._store.capacity,
            "connections": len(self._connections),
            **self._counters,
            "uptime_s": round(time.monotonic() - self._started, 3),
        }

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Stop listening, let each connection send what it has queued (up to ``grace_s``),
        then drop the rest and every stored chunk. Safe to call twice."""
        if self._closing and self._server is None:
            return
        self._closing = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        connections = list(self._connections)
        for connection in connections:
            connection.close()
        # Only now the first await: no request is read once aclose was called.
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            await asyncio.wait([watcher])  # unlike awaiting it, lets our own cancellation through
        waiters = [connection.closed for connection in connections]
        if waiters:
            _, still_open = await asyncio.wait(waiters, timeout=grace_s)
            for connection in connections:
                if not connection.closed.done():
                    connection.abort()
            if still_open:
                await asyncio.wait(still_open, timeout=1.0)
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), timeout=1.0)
        self._store.clear()


async def serve(options: ServerOptions, *, announce: typing.TextIO | None = None) -> None:
    """Run a server until SIGTERM or SIGINT, then shut down gracefully (``tiered-kv serve``).

    Prints one line with the URL once listening (to ``announce``, stderr by default), so
    scripts and tests can wait for it, and one line of stats on the way out.
    """
    stream = announce if announce is not None else sys.stderr
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    server = RemoteCacheServer(options)
    await server.start()
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, stop.set)
    try:
        auth = "token auth" if options.token is not None else "no auth"
        print(
            f"tiered-kv serve: listening on {server.url} "
            f"(capacity {options.capacity} bytes, {auth}, "
            f"at most {options.max_connections} connections)",
            file=stream,
            flush=True,
        )
        await stop.wait()
        print("tiered-kv serve: shutting down", file=stream, flush=True)
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
        stats = server.stats()
        await server.aclose()
    print(
        f"tiered-kv serve: stopped after {stats['requests']} requests "
        f"({stats['puts']} puts, {stats['hits']} hits, {stats['misses']} misses)",
        file=stream,
        flush=True,
    )
