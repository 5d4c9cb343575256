"""`RemoteClient`: the client of the built-in remote cache (``tkv://``), bytes moved off the loop.

Owns ``ClientOptions.pool_size`` connections, each served by a thread of its own (a daemon
started with its connection's first request, joined by `aclose`), the requests queued and in
flight on each, and the reconnect backoff. Raises `RemoteError` subclasses; turning them into
misses is the tier's job (`tiered_kv.tiers.l3_remote`).

Division of labour:
- The event loop connects and authenticates (``sock_connect``, then AUTH), picks the least
  loaded connection for each request, applies timeouts and handles cancellation. Every method
  must be called from the loop the client first ran on.
- A connection's thread owns its socket once connected: it sends the requests queued on it
  (several at once, so responses stream back without an idle round trip between them), then
  receives each response with blocking ``recv_into`` straight into the caller's buffers (the
  GIL is released while bytes arrive) and feeds the hasher right there. PUT data goes out with
  ``sendmsg`` of the caller's memoryviews. Results come back with ``call_soon_threadsafe``.
  A request whose frame is large (a PUT, a big key list) waits until no GET sent before it is
  still being answered: the server answers in order, so sending megabytes while megabytes of an
  earlier answer wait to be read could stall both ends.

Buffers: `put` and `get_into` lend the caller's buffers to a connection's thread and take them
back before returning, whatever the outcome. A request abandoned after its thread took it
(timeout, cancellation) shuts its connection down (``shutdown(SHUT_RDWR)`` wakes a blocked
``recv_into`` / ``sendmsg``) and waits, shielded, until the thread has let go; the other
requests on that connection fail with `RemoteUnavailable` and the connection reopens on its next
request. A request still queued is just dropped. See docs/remote.md.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

from tiered_kv.errors import (
    ProtocolError,
    RemoteError,
    RemoteTimeout,
    RemoteUnavailable,
)
from tiered_kv.keys import ChunkKey
from tiered_kv.tiers.remote.connector import (
    BytesLike,
    FetchStatus,
    FrameSink,
    RemoteConnector,
    default_pool_size,
)
from tiered_kv.tiers.remote.net import resolve, send_all
from tiered_kv.tiers.remote.protocol import (
    DEFAULT_LIMITS,
    HEADER_LEN,
    BufferSink,
    FrameHeader,
    Hasher,
    Op,
    ProtocolLimits,
    Status,
    decode_error,
    decode_frame_header,
    encode_key_list,
    pack_frame_header,
)

logger = logging.getLogger(__name__)

# A request frame up to this size may be sent while GET answers are still due on its
# connection; a larger one waits until they are in (see the module docstring). Far below
# socket buffers.
_PIPELINE_BYTES = 64 << 10
# Requests sent and not yet answered on one connection, at most.
_MAX_IN_FLIGHT = 256
_DISCARD_BYTES = 1 << 20
# Payload is received in 1 MiB pieces (MSG_WAITALL), each hashed while in cache: the socket
# keeps filling meanwhile, where a whole chunk's hash would stall the sender (docs/benchmarks.md).
_RECEIVE_PIECE = 1 << 20


@dataclasses.dataclass(frozen=True, slots=True)
class ClientOptions:
    """pool_size: connections (each with its own thread); None sizes it from the machine,
    `default_pool_size`. timeout_s: per request (connecting included).
    backoff_*: after a failed connect, requests fail fast for a delay that doubles up to the max.
    """

    pool_size: int | None = None
    timeout_s: float = 5.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    limits: ProtocolLimits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        size = self.pool_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int)):
            raise RemoteError(f"pool_size: expected int or None, got {size!r}")
        if size is not None and size < 1:
            raise RemoteError(
                f"pool_size: must be >= 1 (or None: sized from the machine), got {size}"
            )
        for name in ("timeout_s", "backoff_initial_s", "backoff_max_s"):
            if not getattr(self, name) > 0:
                raise RemoteError(f"{name}: must be > 0, got {getattr(self, name)!r}")

    @property
    def connections(self) -> int:
        return default_pool_size() if self.pool_size is None else self.pool_size


class _State(enum.Enum):
    QUEUED = "queued"  # on the connection's queue; its thread has not seen it
    SENT = "sent"  # its thread took it: it may be using the request's buffers
    DONE = "done"  # its thread let go of it (answered, failed or dropped)


@dataclasses.dataclass(slots=True)
class _Answer:
    header: FrameHeader
    meta: bytes
    size_mismatch: bool = False
    collected: bytearray | None = None


@dataclasses.dataclass(slots=True, eq=False)
class _Request:
    """One request on a connection. ``state`` changes under the connection's lock."""

    op: Op
    meta: bytes
    future: asyncio.Future[_Answer]
    data: Sequence[memoryview] = ()  # PUT: sent from the caller's buffers
    sink: BufferSink | None = None  # GET into the caller's buffers
    collect: bool = False  # GET into a fresh buffer of the answer's size
    state: _State = _State.QUEUED
    request_id: int = 0

    @property
    def lends_buffers(self) -> bool:
        return bool(self.data) or self.sink is not None

    @property
    def frame_len(self) -> int:
        return HEADER_LEN + len(self.meta) + sum(len(part) for part in self.data)


class _Closed(Exception):
    """The connection's socket is gone (closed by either side or shut down)."""


class _DataConnection:
    """One connection and the thread that owns its socket.

    Loop side: `submit`, `abandon`, `resolve`, `install`, `dead_while_idle`, `stop`, and the
    counts ``load`` and ``submitted``. Thread side: `_run`. Both sides
    take ``_lock`` to change the queue, the socket or a request's state.
    """

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop, limits: ProtocolLimits) -> None:
        self.name = name
        self.limits = limits
        self.load = 0  # requests that picked this connection and are not resolved yet
        self.submitted = 0  # those of them handed to the thread
        self.connect_lock = asyncio.Lock()
        self._loop = loop
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Request] = collections.deque()
        self._sock: socket.socket | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._exited: asyncio.Future[None] = loop.create_future()

    # -- loop side ----------------------------------------------------------------------------
    @property
    def connected(self) -> bool:
        return self._sock is not None

    def install(self, sock: socket.socket) -> None:
        """Hand a connected, authenticated socket to the thread (started the first time)."""
        sock.setblocking(True)
        with self._lock:
            self._sock = sock
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def dead_while_idle(self) -> bool:
        """Whether the socket of an idle connection was closed or spoken on by the server (an
        idle timeout: its error frame, then EOF); such a socket is closed here. Only while
        nothing is in flight, so the thread is not using the socket."""
        with self._lock:
            sock = self._sock
            if sock is None or self._queue:
                return sock is None
            try:
                sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return False  # nothing to read: alive
            except OSError:
                pass
            self._sock = None
        sock.close()
        return True

    def submit(self, request: _Request) -> None:
        with self._lock:
            if self._sock is None:
                raise RemoteUnavailable(f"{self.name}: connection closed")
            self._queue.append(request)
            self._wake.notify()
        self.submitted += 1

    def abandon(self, request: _Request) -> bool:
        """The caller gives up on ``request``. Returns whether the caller must wait for its
        future: its thread may be using the request's buffers, and the connection was shut
        down so that it lets go soon."""
        with self._lock:
            if request.state is _State.QUEUED:
                self._queue.remove(request)
                request.state = _State.DONE
                self.load -= 1
                self.submitted -= 1
                return False
            if request.state is _State.DONE or not request.lends_buffers:
                return False  # an answer to nobody is read and dropped
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            return True

    def resolve(self, request: _Request, outcome: _Answer | BaseException) -> None:
        """On the loop: the thread is done with ``request``."""
        self.load -= 1
        self.submitted -= 1
        if request.future.done():
            return
        if isinstance(outcome, BaseException):
            request.future.set_exception(outcome)
            request.future.exception()  # retrieved here; awaiting callers still see it
        else:
            request.future.set_result(outcome)

    def stop(self) -> None:
        """Shut the socket down and tell the thread to exit once its requests failed."""
        with self._lock:
            self._stopping = True
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
            self._wake.notify()

    async def exited(self) -> None:
        if self._thread is not None:
            await asyncio.shield(self._exited)
            self._thread.join()

    # -- thread side --------------------------------------------------------------------------
    def _run(self) -> None:
        in_flight: collections.deque[_Request] = collections.deque()
        head = bytearray(HEADER_LEN)
        discard = memoryview(bytearray(_DISCARD_BYTES))
        next_id = 0
        try:
            while True:
                with self._wake:
                    while not self._stopping and not self._queue and not in_flight:
                        self._wake.wait()
                    if self._stopping and not in_flight:
                        self._fail_queued(RemoteUnavailable(f"{self.name}: client is closed"))
                        return
                    sock = self._sock
                    batch = self._take_batch(in_flight)
                if sock is None:  # the socket died after these were queued
                    self._finish(batch, RemoteUnavailable(f"{self.name}: connection closed"))
                    continue
                try:
                    for request in batch:
                        next_id = next_id % 0xFFFFFFFF + 1
                        request.request_id = next_id
                    self._send(sock, batch)
                    in_flight.extend(batch)
                    batch = []
                    if in_flight:
                        request = in_flight[0]
                        answer = self._receive(sock, request, head, discard)
                        in_flight.popleft()
                        self._finish([request], answer)
                except Exception as exc:  # the thread's boundary: the socket is not usable
                    if not isinstance(exc, OSError | _Closed | RemoteError):
                        logger.warning("%s: unexpected failure", self.name, exc_info=True)
                    self._drop(sock, [*in_flight, *batch], exc)
                    in_flight.clear()
        finally:
            self._call(self._set_exited)

    def _set_exited(self) -> None:
        if not self._exited.done():
            self._exited.set_result(None)

    def _take_batch(self, in_flight: collections.deque[_Request]) -> list[_Request]:
        """Under the lock: the queued requests to send now (marked SENT)."""
        batch: list[_Request] = []
        queue = self._queue
        answers_with_data = any(request.op is Op.GET for request in in_flight)
        while queue and len(in_flight) + len(batch) < _MAX_IN_FLIGHT:
            request = queue[0]
            if answers_with_data and request.frame_len > _PIPELINE_BYTES:
                break
            queue.popleft()
            request.state = _State.SENT
            batch.append(request)
            answers_with_data = answers_with_data or request.op is Op.GET
        return batch

    def _send(self, sock: socket.socket, batch: list[_Request]) -> None:
        parts: list[memoryview] = []
        for request in batch:
            data_len = sum(len(part) for part in request.data)
            head = pack_frame_header(
                request.op, Status.REQUEST, request.request_id, len(request.meta), data_len
            )
            parts.append(memoryview(head + request.meta))
            parts.extend(part for part in request.data if len(part))
        send_all(sock, parts)

    def _receive(
        self, sock: socket.socket, request: _Request, head: bytearray, discard: memoryview
    ) -> _Answer | RemoteError:
        """Read the answer to ``request`` (the oldest in flight); an ERROR answer to it is
        returned, a broken stream raises."""
        _recv_exactly(sock, memoryview(head))
        header = decode_frame_header(memoryview(head), self.limits)
        meta = bytearray(header.meta_len)
        _recv_exactly(sock, memoryview(meta))
        if header.status == Status.ERROR and header.request_id == 0:
            raise decode_error(bytes(meta))  # about the connection; the server closes it
        if header.request_id != request.request_id or header.status == Status.REQUEST:
            raise ProtocolError(
                f"answer {header.request_id} (status {header.status}) came for request "
                f"{request.request_id}"
            )
        answer = _Answer(header, bytes(meta))
        sink: BufferSink | None = None
        if header.status == Status.OK and header.data_len:
            if request.collect:
                answer.collected = bytearray(header.data_len)
                sink = BufferSink([memoryview(answer.collected)])
            elif request.sink is not None and request.sink.total == header.data_len:
                sink = request.sink
            else:
                answer.size_mismatch = True
        if sink is not None:
            while not sink.complete:
                target = sink.target()
                # Whole pieces: one system call and one hash update per piece, not per packet.
                piece = min(len(target), _RECEIVE_PIECE)
                count = sock.recv_into(target, piece, socket.MSG_WAITALL)
                del target
                if not count:
                    raise _Closed("closed by the server mid-answer")
                sink.advance(count)
        else:
            due = header.data_len
            while due:
                count = sock.recv_into(discard[: min(due, len(discard))])
                if not count:
                    raise _Closed("closed by the server mid-answer")
                due -= count
        if header.status == Status.ERROR:
            return decode_error(answer.meta)
        if header.op != request.op:
            return ProtocolError(f"answer to op {request.op} came back as op {header.op}")
        return answer

    def _drop(self, sock: socket.socket, requests: list[_Request], exc: BaseException) -> None:
        """The socket is broken: close it, fail what was sent on it and what is queued."""
        failure = exc if isinstance(exc, RemoteError) else RemoteUnavailable(f"{self.name}: {exc}")
        with self._lock:
            if self._sock is sock:
                self._sock = None
            sock.close()
            queued = list(self._queue)
            self._queue.clear()
            for request in (*requests, *queued):
                request.state = _State.DONE
        for request in (*requests, *queued):
            self._call(self.resolve, request, failure)

    def _fail_queued(self, exc: RemoteError) -> None:
        """Under the lock: fail every queued request (the client is closing)."""
        queued = list(self._queue)
        self._queue.clear()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        for request in queued:
            request.state = _State.DONE
            self._call(self.resolve, request, exc)

    def _finish(self, requests: list[_Request], outcome: _Answer | BaseException) -> None:
        with self._lock:
            for request in requests:
                request.state = _State.DONE
        for request in requests:
            self._call(self.resolve, request, outcome)

    def _call(self, callback: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(callback, *args)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    while view:
        count = sock.recv_into(view)
        if not count:
            raise _Closed("closed by the server")
        view = view[count:]


class RemoteClient:
    """A client of one ``tkv://host:port`` server. Use ``async with`` or call `aclose`."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: bytes | None = None,
        options: ClientOptions | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.options = options or ClientOptions()
        self._token = token
        self._connections: list[_DataConnection] = []
        self._retry_at = 0.0
        self._backoff_s = self.options.backoff_initial_s
        self._closed = False
        self.connects = 0
        self.connect_failures = 0
        self.aborted_connections = 0

    @property
    def token(self) -> bytes | None:
        """The shared token sent at AUTH (None: the server has none)."""
        return self._token

    async def __aenter__(self) -> RemoteClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- connections ------------------------------------------------------------------------
    def _pick(self) -> _DataConnection:
        """The least loaded connection, a connected one first among equals."""
        if not self._connections:
            loop = asyncio.get_running_loop()
            self._connections = [
                _DataConnection(
                    f"tkv-client {self.host}:{self.port}#{index}", loop, self.options.limits
                )
                for index in range(self.options.connections)
            ]
        return min(self._connections, key=lambda c: (c.load, not c.connected))

    async def _ready(self, connection: _DataConnection) -> None:
        """Connect ``connection`` if it is not (or its idle socket died)."""
        if connection.connected and (connection.submitted or not connection.dead_while_idle()):
            return
        async with connection.connect_lock:
            if connection.connected:
                return
            if self._closed:
                raise RemoteUnavailable("client is closed")
            remaining = self._retry_at - time.monotonic()
            if remaining > 0:
                raise RemoteUnavailable(
                    f"{self.host}:{self.port} unreachable; retrying in {remaining:.2f}s"
                )
            sock = await self._connect()
            if self._closed:
                sock.close()
                raise RemoteUnavailable("client is closed")
            connection.install(sock)

    async def _connect(self) -> socket.socket:
        try:
            sock = await self._open_socket()
        except OSError as exc:
            self._backoff(exc)
            raise RemoteUnavailable(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        try:
            if self._token is not None:
                await self._authenticate(sock, self._token)
        except BaseException as exc:
            sock.close()
            if isinstance(exc, RemoteError | OSError):
                self._backoff(exc)
            if isinstance(exc, OSError):
                raise RemoteUnavailable(f"AUTH to {self.host}:{self.port}: {exc}") from exc
            raise
        self.connects += 1
        self._backoff_s = self.options.backoff_initial_s
        self._retry_at = 0.0
        return sock

    async def _open_socket(self) -> socket.socket:
        """A non-blocking socket connected to the first of the host's addresses that answers."""
        loop = asyncio.get_running_loop()
        infos = await resolve(self.host, self.port)
        error = OSError(f"no address for {self.host}")
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, address)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            except BaseException:
                sock.close()
                raise
            return sock
        raise error

    async def _authenticate(self, sock: socket.socket, token: bytes) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(
            sock, pack_frame_header(Op.AUTH, Status.REQUEST, 1, len(token)) + token
        )
        head = await _sock_read(sock, HEADER_LEN)
        header = decode_frame_header(head, self.options.limits)
        meta = await _sock_read(sock, header.meta_len)
        if header.status == Status.ERROR:
            raise decode_error(meta)
        if header.op != Op.AUTH or header.status != Status.OK or header.data_len:
            raise ProtocolError(f"AUTH answered with op {header.op}, status {header.status}")

    def _backoff(self, exc: BaseException) -> None:
        self.connect_failures += 1
        self._retry_at = time.monotonic() + self._backoff_s
        logger.info(
            "tkv client: %s:%d failed (%s); next attempt in %.2fs",
            self.host,
            self.port,
            exc,
            self._backoff_s,
        )
        self._backoff_s = min(self._backoff_s * 2, self.options.backoff_max_s)

    async def _request(
        self,
        op: Op,
        meta: bytes,
        data: Sequence[BytesLike] = (),
        *,
        sink: BufferSink | None = None,
        collect: bool = False,
    ) -> _Answer:
        if self._closed:
            raise RemoteUnavailable("client is closed")
        timeout_s = self.options.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                connection = self._pick()
                connection.load += 1  # counted from here, so concurrent picks spread out
                try:
                    await self._ready(connection)
                    request = _Request(
                        op,
                        meta,
                        asyncio.get_running_loop().create_future(),
                        data=[_bytes_view(part) for part in data],
                        sink=sink,
                        collect=collect,
                    )
                    connection.submit(request)
                except BaseException:
                    connection.load -= 1
                    raise
                return await self._wait(connection, request)
        except TimeoutError:
            raise RemoteTimeout(
                f"{op.name} to {self.host}:{self.port} took over {timeout_s}s"
            ) from None

    async def _wait(self, connection: _DataConnection, request: _Request) -> _Answer:
        """``request``'s answer; if cancelled, returns (raises) only once its thread let go."""
        try:
            return await asyncio.shield(request.future)
        except asyncio.CancelledError:
            if connection.abandon(request):
                self.aborted_connections += 1
                while not request.future.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait((request.future,))
            if request.future.done() and not request.future.cancelled():
                request.future.exception()  # the cancellation is what the caller sees
            raise

    # -- operations -------------------------------------------------------------------------
    async def ping(self, payload: bytes = b"") -> float:
        """Round-trip seconds."""
        started = time.perf_counter()
        answer = await self._request(Op.PING, payload)
        if answer.meta != payload:
            raise ProtocolError("PING answer differs from the request")
        return time.perf_counter() - started

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Which keys the server holds, in one round trip."""
        return await self._key_flags(Op.EXISTS, keys)

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._key_flags(Op.DELETE, keys)

    async def _key_flags(self, op: Op, keys: Sequence[bytes]) -> list[bool]:
        """One batched request over ``keys``, answered with one flag byte per key."""
        if not keys:
            return []
        answer = await self._request(op, encode_key_list(keys, self.options.limits))
        if len(answer.meta) != len(keys):
            raise ProtocolError(f"{op.name} of {len(keys)} keys answered {len(answer.meta)} flags")
        return [bool(flag) for flag in answer.meta]

    async def put(self, key: bytes, frame: Sequence[BytesLike]) -> None:
        """Store the chunk frame given as parts (header, then payload buffers; not copied)."""
        await self._request(Op.PUT, key, frame)

    async def get_into(
        self,
        key: bytes,
        buffers: Sequence[memoryview],
        *,
        hash_from: int | None = None,
        hasher: Hasher | None = None,
    ) -> FetchStatus:
        """Receive ``key``'s frame straight into ``buffers`` (exactly the frame's size).

        ``hasher`` is fed every byte from offset ``hash_from`` on, as it arrives, in the
        connection's thread. A frame of another size is discarded (SIZE_MISMATCH) and the
        buffers' contents are unspecified.
        """
        sink = BufferSink(buffers, hash_from=hash_from, hasher=hasher)
        answer = await self._request(Op.GET, key, sink=sink)
        if answer.header.status == Status.NOT_FOUND:
            return FetchStatus.MISSING
        if answer.size_mismatch or not sink.complete:
            return FetchStatus.SIZE_MISMATCH
        return FetchStatus.HIT

    async def get(self, key: bytes) -> bytes | None:
        """The whole stored frame as bytes (tools and tests; the tier uses `get_into`)."""
        answer = await self._request(Op.GET, key, collect=True)
        if answer.header.status == Status.NOT_FOUND:
            return None
        return bytes(answer.collected or b"")

    async def stats(self) -> dict[str, int | float]:
        answer = await self._request(Op.STATS, b"")
        try:
            decoded = json.loads(answer.meta)
        except ValueError as exc:
            raise ProtocolError(f"STATS answer is not JSON: {exc}") from None
        if not isinstance(decoded, dict):
            raise ProtocolError("STATS answer is not a JSON object")
        return {str(k): v for k, v in decoded.items() if isinstance(v, int | float)}

    def client_stats(self) -> dict[str, int]:
        return {
            "connections": sum(c.connected for c in self._connections),
            "pool_size": self.options.connections,
            "connects": self.connects,
            "connect_failures": self.connect_failures,
            "aborted_connections": self.aborted_connections,
            "in_flight": sum(c.load for c in self._connections),
        }

    async def aclose(self) -> None:
        """Close every connection and join its thread; requests in flight fail with
        `RemoteUnavailable`. Safe to call twice."""
        self._closed = True
        connections, self._connections = self._connections, []
        for connection in connections:
            connection.stop()
        for connection in connections:
            await connection.exited()


async def _sock_read(sock: socket.socket, nbytes: int) -> bytes:
    """Exactly ``nbytes`` from a non-blocking socket, on the loop."""
    loop = asyncio.get_running_loop()
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    while view:
        count = await loop.sock_recv_into(sock, view)
        if not count:
            raise RemoteUnavailable("connection closed by the server")
        view = view[count:]
    return bytes(buffer)


def _bytes_view(part: BytesLike) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class TkvConnector(RemoteConnector):
    """`RemoteConnector` over a `RemoteClient`: keys travel as `ChunkKey.to_bytes`."""

    def __init__(self, client: RemoteClient) -> None:
        self.client = client
        self.description = f"tkv://{client.host}:{client.port}"

    # Two GETs queued per connection: its thread sends both, and the server's next answer
    # follows the last one's bytes at once (no round trip per chunk).
    pipeline_depth = 2

    @property
    def connections(self) -> int:
        return self.client.options.connections

    async def open(self) -> None:
        return None  # connections open lazily, so a server that is down only costs misses

    def plane_endpoint(self) -> tuple[str, int, bytes] | None:
        return (self.client.host, self.client.port, self.client.token or b"")

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self.client.exists([key.to_bytes() for key in keys])

    async def put(self, key: ChunkKey, frame: Sequence[BytesLike], frame_len: int) -> None:
        await self.client.put(key.to_bytes(), frame)

    async def get_into(self, key: ChunkKey, sink: FrameSink) -> FetchStatus:
        return await self.client.get_into(
            key.to_bytes(), sink.buffers(), hash_from=len(sink.header), hasher=sink.hasher
        )

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return await self.client.delete([key.to_bytes() for key in keys])

    async def remote_stats(self) -> dict[str, int | float]:
        return await self.client.stats()

    def stats(self) -> dict[str, int]:
        return self.client.client_stats()

    async def aclose(self) -> None:
        await self.client.aclose()
