"""`RemoteCacheServer`: the built-in remote cache behind ``tkv://`` (``tiered-kv serve``).

Owns the listening socket, its connections and their authentication, over one `FrameStore`
(`tiered_kv.tiers.remote.store`: the capacity-bounded LRU map of key bytes → chunk frame).
Frames are sent back with ``sendmsg`` of `memoryview`s of their segments, so no payload byte is
touched by Python code. The server checks each frame's header (key, lengths) but not the
payload checksum: readers verify it on every GET.

Threads: the event loop that ran `RemoteCacheServer.start` accepts connections (and refuses
the surplus); each admitted connection is served by a thread of its own with blocking socket
calls, so several cores send and receive at once (the GIL is released in ``recv_into`` and
``sendmsg``). Those threads share the store, the counters and the connection set under one
lock; everything else of a connection belongs to its thread.

Must not: block the loop, trust a length before `ProtocolLimits` checked it, allocate, reserve
or evict on a length a client claims rather than on bytes it sent, read more than a small AUTH
from a connection that has not authenticated, or let one bad client disturb others (a malformed
frame closes only its own connection; a slow, idle or surplus one is closed on a deadline or
refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import math
import signal
import socket
import struct
import sys
import threading
import time
import typing

from tiered_kv.codec import DEFAULT_LIMITS as CODEC_LIMITS
from tiered_kv.codec import CodecLimits
from tiered_kv.errors import CodecError, ConfigError, ProtocolError
from tiered_kv.tiers.remote.net import resolve, send_all
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
from tiered_kv.tiers.remote.store import FrameStore, PutSink, decode_frame_header

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
    read_delay_s: seconds every GET waits before its answer, on its connection's thread (a
        slow or distant store, for tests and benchmarks of what clients do then; 0: none).
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
    read_delay_s: float = 0.0

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
        delay = self.read_delay_s
        if isinstance(delay, bool) or not isinstance(delay, int | float) or not 0 <= delay < 3600:
            raise ConfigError(f"read_delay_s: expected seconds in [0, 3600), got {delay!r}")
        if self.token is not None and len(self.token) > self.max_auth_bytes:
            raise ConfigError(
                f"token: {len(self.token)} bytes do not fit in max_auth_bytes={self.max_auth_bytes}"
            )


_DISCARD_BYTES = 64 << 10
_RECEIVE_PIECE = 1 << 20  # a PUT's data is received in pieces of this size (MSG_WAITALL)


class _Gone(Exception):
    """The connection is done for: the peer went away, or we closed it (already counted)."""


class _Connection:
    """One client, served by a thread of its own (`run`): blocking ``recv_into`` feeds a
    `FrameReader`, each request is answered in order with blocking ``sendmsg``.

    Deadlines are socket timeouts (``SO_RCVTIMEO``: the earliest of AUTH due, the current
    header and meta due, idle; ``SO_SNDTIMEO``: idle), so no watcher is needed. The
    server may shut the socket down from the loop (`shutdown`); only the thread closes it.
    """

    def __init__(self, server: RemoteCacheServer, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.reader = FrameReader(
            self,
            server.options.limits,
            check_header=self._check_header,
            on_buffer_change=server._receive_buffers_changed,
        )
        self.authenticated = server.options.token is None
        # A PUT's key and where its data lands while that streams in.
        self._put: tuple[bytes, PutSink] | None = None
        self._refusal: tuple[ErrorCode, str] | None = None
        now = time.monotonic()
        self._connected_at = now
        # The last byte from the peer, or the last time it took some of ours.
        self._active_at = now
        # When the first byte of a still incomplete request header or meta arrived.
        self._header_since: float | None = None
        self._socket_lock = threading.Lock()  # `shutdown` never meets a closed (reused) fd
        self._socket_open = True
        self.thread = threading.Thread(target=self.run, name=f"tkv-server {peer}", daemon=True)

    # -- the thread ---------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._serve()
        except _Gone:
            pass
        except Exception:  # the connection's boundary: only this client loses its connection
            logger.warning("tkv server: closing %s after an error", self.peer, exc_info=True)
        finally:
            self.reader.close()
            self._release_put()
            with self._socket_lock:
                self._socket_open = False
                self.sock.close()
            self.server._connection_closed(self)

    def _serve(self) -> None:
        reader = self.reader
        sock = self.sock
        sock.setblocking(True)
        _set_socket_timeout(sock, socket.SO_SNDTIMEO, self.server.options.idle_timeout_s)
        armed = -1.0  # the receive timeout set on the socket: 0.0 none, -1.0 to be set
        while not reader.stopped:
            buffer = reader.get_buffer(-1)
            deadline = self._deadline()
            wanted = 0.0 if deadline is None else deadline - time.monotonic()
            if deadline is not None and wanted <= 0:
                self._time_out()
                return
            # Setting the timeout is a system call: while data streams in, the bound (the idle
            # timeout from the last byte) barely moves, so it is set again only when it must
            # shrink by over 1% or goes. A bound that grew may fire early: checked below.
            if armed < 0 or (wanted == 0.0) != (armed == 0.0) or wanted < armed * 0.99:
                _set_socket_timeout(sock, socket.SO_RCVTIMEO, wanted or None)
                armed = wanted
            try:
                if reader.receiving_data and len(buffer) > _RECEIVE_PIECE:
                    # A PUT's data: whole pieces, one system call each, not one per packet.
                    count = sock.recv_into(buffer, _RECEIVE_PIECE, socket.MSG_WAITALL)
                else:
                    count = sock.recv_into(buffer)
            except BlockingIOError:  # SO_RCVTIMEO passed
                deadline = self._deadline()
                if deadline is not None and time.monotonic() >= deadline:
                    self._time_out()
                    return
                armed = -1.0  # fired early: set the bound again
                continue
            except OSError:
                return
            if not count:
                return  # the peer closed, or the server shut us down
            self.server._count("bytes_in", count)
            try:
                reader.buffer_updated(count)
            except FrameError as exc:
                self.server._count("protocol_errors")
                logger.info("tkv server: closing %s: %s", self.peer, exc)
                self._fatal(exc.code, str(exc), exc.request_id)
                return
            now = time.monotonic()
            self._active_at = now
            if self._header_since is None and reader.header_pending:
                self._header_since = now

    def _mark_active(self) -> None:
        """The peer took some of our bytes: it is alive (the idle timeout restarts)."""
        self._active_at = time.monotonic()

    # -- deadlines ----------------------------------------------------------------------------
    def _deadline(self) -> float | None:
        """When the next receive must have brought bytes (`ServerOptions.header_timeout_s`,
        ``idle_timeout_s``); None: no bound."""
        options = self.server.options
        deadlines = []
        header_timeout = options.header_timeout_s
        if header_timeout is not None:
            if not self.authenticated:
                deadlines.append(self._connected_at + header_timeout)
            if self._header_since is not None:
                deadlines.append(self._header_since + header_timeout)
        if options.idle_timeout_s is not None:
            deadlines.append(self._active_at + options.idle_timeout_s)
        return min(deadlines, default=None)

    def _time_out(self) -> None:
        options = self.server.options
        header_timeout = options.header_timeout_s
        now = time.monotonic()
        if (
            header_timeout is not None
            and not self.authenticated
            and now - self._connected_at >= header_timeout
        ):
            counter, message = "header_timeouts", f"no AUTH within {header_timeout}s"
        elif (
            header_timeout is not None
            and self._header_since is not None
            and now - self._header_since >= header_timeout
        ):
            counter, message = (
                "header_timeouts",
                f"request header and meta took over {header_timeout}s",
            )
        else:
            counter, message = "idle_timeouts", f"idle for over {options.idle_timeout_s}s"
        self.server._count(counter)
        logger.info("tkv server: closing %s: %s", self.peer, message)
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
        server._count("requests")
        if server._closing:
            return None  # not answered: `frame_done` stops here
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
        sink = PutSink(store, size, server._discard)
        self._put = (meta, sink)
        return sink

    def frame_done(self, header: FrameHeader, meta: bytes, sink: DataSink | None) -> None:
        if self.server._closing:
            # Shutting down: requests read from now on are not answered (aclose's contract).
            self.reader.stopped = True
            self._release_put()
            return
        refusal, self._refusal = self._refusal, None
        put = self._put
        if put is not None and put[1].refusal is not None:
            self._put = None
            refusal = (ErrorCode.NO_SPACE, put[1].refusal)
        if refusal is not None:
            self.server._count("bad_requests")
            if refusal[0] == ErrorCode.NO_SPACE:
                self.server._count("put_refused")
            self._reply_error(header, *refusal)
            return
        try:
            self._dispatch(header, meta)
        except ProtocolError as exc:
            self.server._count("bad_requests")
            self._reply_error(header, ErrorCode.BAD_REQUEST, str(exc))

    def _dispatch(self, header: FrameHeader, meta: bytes) -> None:
        server = self.server
        store = server._store
        limits = server.options.limits
        op = header.op
        if op == Op.AUTH:
            token = server.options.token
            if token is not None and not hmac.compare_digest(meta, token):
                server._count("auth_failures")
                logger.warning("tkv server: wrong token from %s", self.peer)
                self._fatal(ErrorCode.AUTH_FAILED, "wrong token", header.request_id)
                raise _Gone
            self.authenticated = True
            self._reply(header, Status.OK)
        elif op == Op.PING:
            self._reply(header, Status.OK, meta)
        elif op == Op.EXISTS:
            keys = decode_key_list(meta, limits)
            server._count("exists_keys", len(keys))
            self._reply(header, Status.OK, bytes(store.contains_many(keys)))
        elif op == Op.PUT:
            self._finish_put(header)
        elif op == Op.GET:
            if server.options.read_delay_s:
                time.sleep(server.options.read_delay_s)  # this connection's thread only
            views = store.get_views(check_key(meta, limits))
            server._count("gets")
            if views is None:
                server._count("misses")
                self._reply(header, Status.NOT_FOUND)
                return
            server._count("hits")
            self._reply(header, Status.OK, data=views)
        elif op == Op.DELETE:
            keys = decode_key_list(meta, limits)
            removed = bytes([store.delete(key) for key in keys])
            server._count("deletes", sum(removed))
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
            chunk = decode_frame_header(frame, self.server.options.codec_limits)
        except CodecError as exc:
            raise ProtocolError(f"PUT data is not a chunk frame: {exc}") from None
        if chunk.total_len != size:
            raise ProtocolError(f"PUT frame says {chunk.total_len} bytes, carried {size}")
        if chunk.key_bytes != key:
            raise ProtocolError("PUT key differs from the key inside its chunk frame")
        # The reservation made room for the frame; turning it into used bytes keeps
        # used + reserved <= capacity.
        self.server._store.insert(key, frame)
        self.server._count("puts")
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
        data: list[memoryview] | None = None,
    ) -> None:
        """Send one answer, blocking until the peer took it (at most ``idle_timeout_s``
        without progress). Raises `_Gone` when the connection broke or stalled."""
        data = data or []
        data_len = sum(len(view) for view in data)
        head = pack_frame_header(header.op, status, header.request_id, len(meta), data_len)
        parts = [memoryview(head + meta), *data]
        del data  # the views in ``parts`` go as they are sent (segments may then be pooled)
        sock = self.sock
        try:
            send_all(sock, parts, self._mark_active)
        except BlockingIOError:  # SO_SNDTIMEO passed without a byte taken
            self.server._count("idle_timeouts")
            logger.info("tkv server: closing %s: takes none of our answer", self.peer)
            raise _Gone from None
        except OSError:
            raise _Gone from None
        self.server._count("bytes_out", HEADER_LEN + len(meta) + data_len)

    def _reply_error(self, header: FrameHeader, code: ErrorCode, message: str) -> None:
        self._reply(header, Status.ERROR, encode_error(code, message))

    def _fatal(self, code: ErrorCode, message: str, request_id: int) -> None:
        """Try once, without waiting, to send an error frame; the caller then closes."""
        self.reader.stopped = True
        self._release_put()
        _send_error_now(self.sock, code, message, request_id)

    def shutdown(self, how: int) -> None:
        """From the loop: wake the thread (``SHUT_RD``: it stops reading; ``SHUT_RDWR``: any
        send fails too)."""
        with self._socket_lock:
            if self._socket_open:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(how)


def _set_socket_timeout(sock: socket.socket, option: int, seconds: float | None) -> None:
    """``SO_RCVTIMEO`` / ``SO_SNDTIMEO`` of a blocking socket (None: no bound)."""
    whole = 0.0 if seconds is None else max(seconds, 0.001)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("@ll", int(whole), int(whole % 1 * 1e6)))


def _send_error_now(sock: socket.socket, code: ErrorCode, message: str, request_id: int) -> None:
    """An error frame if it fits in the socket's buffer now; nothing more is owed a peer that
    does not read."""
    meta = encode_error(code, message)
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(pack_frame_header(0, Status.ERROR, request_id, len(meta)) + meta)


class RemoteCacheServer:
    """The server; ``async with RemoteCacheServer(options) as server:`` or `start` / `aclose`.

    `start` and `aclose` run on an event loop, which accepts connections; each accepted one is
    served by its own thread (see `_Connection`). `stats` may be called from any thread.
    """

    def __init__(self, options: ServerOptions | None = None) -> None:
        self.options = options or ServerOptions()
        # Guards the store, the counters, the connection set and the buffer accounting.
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._store = FrameStore(self.options.capacity, self._counters, self._lock)
        self._connections: set[_Connection] = set()
        self._receive_buffer_bytes = 0
        # Where the data of refused PUTs goes, unread: shared, as nobody reads it.
        self._discard = memoryview(bytearray(_DISCARD_BYTES))
        self._listener: socket.socket | None = None
        self._accepter: asyncio.Task[None] | None = None
        self._closing = False
        self._started = time.monotonic()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        options = self.options
        infos = await resolve(options.host, options.port, passive=True)
        family, kind, proto, _, address = infos[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
            listener.listen(min(socket.SOMAXCONN, options.max_connections + 64))
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accepter = loop.create_task(self._accept(listener), name="tkv-server-accept")
        logger.info("tkv server listening on %s:%d", self.host, self.port)

    async def _accept(self, listener: socket.socket) -> None:
        """Admit connections until `aclose` cancels this."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as exc:  # out of file descriptors, say: try again shortly
                logger.warning("tkv server: accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            self._admit(sock, str(address))

    def _admit(self, sock: socket.socket, peer: str) -> None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        limit = self.options.max_connections
        connection = _Connection(self, sock, peer)
        with self._lock:
            self._counters["connections_total"] += 1
            open_now = len(self._connections)
            if open_now >= limit:
                self._counters["connections_refused"] += 1
                refusal = (ErrorCode.BUSY, f"{open_now} connections open, max_connections={limit}")
            elif self._closing:
                refusal = (ErrorCode.SHUTTING_DOWN, "server is shutting down")
            else:
                refusal = None
                self._connections.add(connection)
        if refusal is None:
            connection.thread.start()
            return
        if refusal[0] == ErrorCode.BUSY:
            logger.info("tkv server: refusing %s: %d connections open", peer, open_now)
        connection.reader.close()
        _send_error_now(sock, *refusal, 0)
        sock.close()

    def _connection_closed(self, connection: _Connection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counters[name] += amount

    def _receive_buffers_changed(self, nbytes: int) -> None:
        with self._lock:
            self._receive_buffer_bytes += nbytes

    @property
    def store(self) -> FrameStore:
        """The stored frames, for inspection and fault injection (operators' tools, tests):
        read ``store.entries`` under ``store.lock``; the data path does not go through here."""
        return self._store

    @property
    def port(self) -> int:
        if self._listener is None:
            return self.options.port
        return int(self._listener.getsockname()[1])

    @property
    def host(self) -> str:
        if self._listener is None:
            return self.options.host
        return str(self._listener.getsockname()[0])

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
        with self._lock:
            store = self._store
            return {
                "entries": len(store.entries),
                "bytes_used": store.used,
                "bytes_reserved": store.reserved,
                "bytes_pooled": store.pooled,
                "bytes_receive_buffers": self._receive_buffer_bytes,
                "capacity": store.capacity,
                "connections": len(self._connections),
                **self._counters,
                "uptime_s": round(time.monotonic() - self._started, 3),
            }

    async def aclose(self, grace_s: float = 5.0) -> None:
        """Stop listening and reading, let each connection finish the answer it is sending
        (up to ``grace_s``), then drop the rest, join the threads and drop every stored chunk.
        Safe to call twice."""
        if self._closing and self._listener is None:
            return
        self._closing = True
        accepter, self._accepter = self._accepter, None
        if accepter is not None:
            accepter.cancel()
            await asyncio.wait([accepter])  # unlike awaiting it, lets our own cancellation through
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            connection.shutdown(socket.SHUT_RD)
        if not await _joined(connections, grace_s):
            for connection in connections:
                connection.shutdown(socket.SHUT_RDWR)
            if not await _joined(connections, 1.0):
                stuck = sum(connection.thread.is_alive() for connection in connections)
                logger.warning("tkv server: %d connection threads did not stop", stuck)
        self._store.clear()


async def _joined(connections: list[_Connection], timeout_s: float) -> bool:
    """Whether every connection's thread ended within ``timeout_s`` (waited for on the loop)."""
    deadline = time.monotonic() + timeout_s
    while any(connection.thread.is_alive() for connection in connections):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(0.005)
    for connection in connections:
        connection.thread.join()
    return True


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
