"""`RemoteCacheServer`: the built-in remote cache behind ``tkv://`` (``tiered-kv serve``).

Owns an in-memory, capacity-bounded LRU map of key bytes → chunk frame, the listening socket,
its connections and their authentication. Stored frames are the codec frames clients send,
kept as received (one `bytearray` per chunk, filled by ``recv_into``) and sent back as
`memoryview`s, so no payload byte is touched by Python code. The server checks each frame's
header (key, lengths) but not the payload checksum: readers verify it on every GET.

Must not: block the loop, trust a length before `ProtocolLimits` checked it, or let one bad
client disturb others (a malformed frame closes only its own connection).

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
import signal
import sys
import time
import typing

from tiered_kv.codec import DEFAULT_LIMITS as CODEC_LIMITS
from tiered_kv.codec import CodecLimits, decode_header
from tiered_kv.errors import CodecError, ConfigError, ProtocolError
from tiered_kv.tiers.remote.protocol import (
    DEFAULT_LIMITS,
    HEADER_LEN,
    BufferSink,
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
    "bytes_in",
    "bytes_out",
)


@dataclasses.dataclass(frozen=True, slots=True)
class ServerOptions:
    """host / port: where to listen (loopback unless told otherwise; port 0 picks a free one).
    capacity: bytes of chunk frames held before LRU eviction.
    token: shared secret every connection must present first (None: no authentication).
    """

    host: str = "127.0.0.1"
    port: int = 7474
    capacity: int = 64 << 30
    token: bytes | None = None
    limits: ProtocolLimits = DEFAULT_LIMITS
    codec_limits: CodecLimits = CODEC_LIMITS

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int):
            raise ConfigError(f"capacity: expected an int of bytes, got {self.capacity!r}")
        if self.capacity < 1:
            raise ConfigError(f"capacity: must be > 0 bytes, got {self.capacity}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in [0, 65535], got {self.port}")
        if self.token is not None and not self.token:
            raise ConfigError("token: must not be empty (use None to disable authentication)")


def _unshared(frame: bytearray) -> bool:
    """Whether only our caller holds ``frame`` (no transport still sending a view of it).

    CPython counts: the caller's variable, this parameter and getrefcount's own argument.
    """
    return sys.getrefcount(frame) <= 3


class _Store:
    """The LRU map and its byte accounting: stored frames, recycled buffers and bytes reserved
    by PUTs in flight, all within ``capacity``.

    Frame buffers are recycled (a PUT of a size seen before reuses a freed buffer of that size):
    a fresh 32 MiB bytearray costs more in page faults than receiving 32 MiB over loopback. A
    buffer is recycled only when no transport still holds a view of it (see `_unshared`).
    """

    def __init__(self, capacity: int, counters: dict[str, int]) -> None:
        self.capacity = capacity
        self.entries: collections.OrderedDict[bytes, bytearray] = collections.OrderedDict()
        self.used = 0
        self.reserved = 0
        self.pooled = 0
        self.pool_limit = capacity // 4
        self._pool: dict[int, list[bytearray]] = {}
        self._counters = counters

    def reserve(self, nbytes: int) -> bytearray | None:
        """A buffer for a frame of ``nbytes``, evicting LRU frames as needed; None if it
        cannot fit (frames in flight hold the room)."""
        if nbytes + self.reserved > self.capacity:
            return None
        buffers = self._pool.get(nbytes)
        if buffers:
            frame = buffers.pop()
            self.pooled -= nbytes
            self.reserved += nbytes
            return frame
        while self.used + self.pooled + self.reserved + nbytes > self.capacity:
            if self.pooled:
                self._drop_pooled()
                continue
            if not self.entries:
                return None
            _, evicted = self.entries.popitem(last=False)
            self.used -= len(evicted)
            self._counters["evictions"] += 1
            if len(evicted) == nbytes and _unshared(evicted):
                self.reserved += nbytes
                return evicted
        self.reserved += nbytes
        return bytearray(nbytes)

    def _drop_pooled(self) -> None:
        size = max(size for size, buffers in self._pool.items() if buffers)
        self._pool[size].pop()
        self.pooled -= size

    def recycle(self, frame: bytearray) -> None:
        size = len(frame)
        if self.pooled + size <= self.pool_limit and sys.getrefcount(frame) <= 3:
            self._pool.setdefault(size, []).append(frame)
            self.pooled += size

    def release(self, nbytes: int) -> None:
        self.reserved -= nbytes

    def insert(self, key: bytes, frame: bytearray) -> None:
        old = self.entries.pop(key, None)
        self.entries[key] = frame
        self.used += len(frame)
        if old is not None:
            self.used -= len(old)
            self.recycle(old)

    def get(self, key: bytes) -> bytearray | None:
        frame = self.entries.get(key)
        if frame is not None:
            self.entries.move_to_end(key)
        return frame

    def delete(self, key: bytes) -> bool:
        frame = self.entries.pop(key, None)
        if frame is None:
            return False
        self.used -= len(frame)
        self.recycle(frame)
        return True

    def clear(self) -> None:
        self.entries.clear()
        self._pool.clear()
        self.used = self.pooled = 0


class _Connection(asyncio.BufferedProtocol):
    """One client: parses requests with a `FrameReader`, answers each in order."""

    def __init__(self, server: RemoteCacheServer) -> None:
        self.server = server
        self.reader = FrameReader(self, server.options.limits)
        self.transport: asyncio.Transport | None = None
        self.authenticated = server.options.token is None
        self.peer = "?"
        # A PUT's frame buffer and its reservation while its data streams in.
        self._put: tuple[bytes, bytearray, int] | None = None
        self._refusal: tuple[ErrorCode, str] | None = None
        self._paused = False
        self.closed = asyncio.get_running_loop().create_future()

    # -- transport callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)
        self.peer = str(transport.get_extra_info("peername"))
        self.server._connections.add(self)
        self.server._counters["connections_total"] += 1
        if self.server._closing:
            self._fatal(ErrorCode.SHUTTING_DOWN, "server is shutting down", 0)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reader.stopped = True
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

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def pause_writing(self) -> None:
        # The client reads slower than we answer: stop taking requests until it catches up.
        self._paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self.transport is not None and not self.reader.stopped:
            self.transport.resume_reading()

    # -- frames -----------------------------------------------------------------------------
    def frame_started(self, header: FrameHeader, meta: bytes) -> DataSink | None:
        self.server._counters["requests"] += 1
        if header.status != Status.REQUEST:
            raise FrameError(ErrorCode.BAD_FRAME, "a request must carry status 0", 0)
        if not self.authenticated and header.op != Op.AUTH:
            raise FrameError(
                ErrorCode.AUTH_REQUIRED, "this server needs AUTH first", header.request_id
            )
        if header.op != Op.PUT:
            if header.data_len:
                self._refusal = (ErrorCode.BAD_REQUEST, f"op {header.op} carries no data")
            return None
        store = self.server._store
        size = header.data_len
        if size < HEADER_LEN or not 0 < len(meta) <= self.server.options.limits.max_key_bytes:
            self._refusal = (ErrorCode.BAD_REQUEST, "PUT needs a key and a chunk frame")
            return None
        frame = store.reserve(size)
        if frame is None:
            self._refusal = (
                ErrorCode.NO_SPACE,
                f"{size} bytes do not fit: capacity {store.capacity}, {store.reserved} reserved",
            )
            return None
        self._put = (meta, frame, size)
        return BufferSink([memoryview(frame)])

    def frame_done(self, header: FrameHeader, meta: bytes, sink: DataSink | None) -> None:
        refusal, self._refusal = self._refusal, None
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
        key, frame, size = put
        store = self.server._store
        store.release(size)
        try:
            chunk = decode_header(memoryview(frame), self.server.options.codec_limits)
        except CodecError as exc:
            raise ProtocolError(f"PUT data is not a chunk frame: {exc}") from None
        if chunk.total_len != size:
            raise ProtocolError(f"PUT frame says {chunk.total_len} bytes, carried {size}")
        if chunk.key_bytes != key:
            raise ProtocolError("PUT key differs from the key inside its chunk frame")
        # The reservation made room for the frame; turning it into used bytes keeps
        # used + reserved <= capacity.
        store.insert(key, frame)
        self.server._counters["puts"] += 1
        self._reply(header, Status.OK)

    def _release_put(self) -> None:
        put, self._put = self._put, None
        if put is not None:
            self.server._store.release(put[2])

    # -- replies ----------------------------------------------------------------------------
    def _reply(
        self,
        header: FrameHeader,
        status: Status,
        meta: bytes = b"",
        data: bytearray | None = None,
    ) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        data_len = 0 if data is None else len(data)
        head = pack_frame_header(header.op, status, header.request_id, len(meta), data_len)
        if data is None:
            transport.write(head + meta)
        else:
            transport.writelines([head + meta, memoryview(data)])
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
        self._server: asyncio.base_events.Server | None = None
        self._closing = False
        self._started = time.monotonic()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Connection(self), self.options.host, self.options.port, reuse_address=True
        )
        self._server = server
        logger.info("tkv server listening on %s:%d", self.host, self.port)

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
            f"(capacity {options.capacity} bytes, {auth})",
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
