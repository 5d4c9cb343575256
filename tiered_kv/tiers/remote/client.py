"""`RemoteClient`: a pooled, pipelining client of the built-in remote cache (``tkv://``).

Owns its connections (at most ``pool_size``, opened lazily, authenticated on open), the requests
in flight on each, per-request timeouts and the reconnect backoff. Raises `RemoteError`
subclasses; turning them into misses is the tier's job (`tiered_kv.tiers.l3_remote`).

Buffers: `put` writes the caller's memoryviews to the socket without copying them and `get_into`
receives straight into the caller's buffers. Neither touches them after it returns, whatever
the outcome: a request that lent buffers and is abandoned mid-flight (timeout, cancellation)
aborts its connection, which discards unsent data and stops any further receive into them.
Other requests pipelined on that connection then fail with `RemoteUnavailable`.

Loop-only: every method must be called from the loop the client first ran on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import time
import typing
from collections.abc import Sequence

from tiered_kv.errors import (
    ProtocolError,
    RemoteError,
    RemoteTimeout,
    RemoteUnavailable,
)
from tiered_kv.keys import ChunkKey
from tiered_kv.tiers.remote.connector import BytesLike, FetchStatus, FrameSink, RemoteConnector
from tiered_kv.tiers.remote.protocol import (
    DEFAULT_LIMITS,
    BufferSink,
    DataSink,
    FrameError,
    FrameHeader,
    FrameReader,
    Hasher,
    Op,
    ProtocolLimits,
    Status,
    decode_error,
    encode_key_list,
    pack_frame_header,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ClientOptions:
    """pool_size: connections at most. timeout_s: per request (connecting included).
    backoff_*: after a failed connect, requests fail fast for a delay that doubles up to the max.
    """

    pool_size: int = 4
    timeout_s: float = 5.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 2.0
    limits: ProtocolLimits = DEFAULT_LIMITS

    def __post_init__(self) -> None:
        if isinstance(self.pool_size, bool) or not isinstance(self.pool_size, int):
            raise RemoteError(f"pool_size: expected int, got {self.pool_size!r}")
        if self.pool_size < 1:
            raise RemoteError(f"pool_size: must be >= 1, got {self.pool_size}")
        for name in ("timeout_s", "backoff_initial_s", "backoff_max_s"):
            if not getattr(self, name) > 0:
                raise RemoteError(f"{name}: must be > 0, got {getattr(self, name)!r}")


@dataclasses.dataclass(slots=True, eq=False)
class _Pending:
    op: int
    future: asyncio.Future[tuple[FrameHeader, bytes]]
    sink: BufferSink | None = None  # where a GET's frame goes
    lends_buffers: bool = False
    size_mismatch: bool = False
    collect: bool = False  # allocate a buffer of the answer's size (bounded by the limits)
    collected: bytearray | None = None


class _Connection(asyncio.BufferedProtocol):
    def __init__(self, limits: ProtocolLimits) -> None:
        self.reader = FrameReader(self, limits)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._lost: BaseException | None = None
        self._drained: asyncio.Event | None = None

    # -- transport callbacks ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reader.stopped = True
        self.transport = None
        self._fail_all(RemoteUnavailable(f"connection lost: {exc or 'closed by the server'}"))
        if self._drained is not None:
            self._drained.set()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            self.reader.buffer_updated(nbytes)
        except FrameError as exc:
            self._fail_all(ProtocolError(f"bad frame from the server: {exc}"))
            self.abort()

    def eof_received(self) -> bool | None:
        return None

    def pause_writing(self) -> None:
        self._drained = asyncio.Event()

    def resume_writing(self) -> None:
        if self._drained is not None:
            self._drained.set()
            self._drained = None

    # -- frames -----------------------------------------------------------------------------
    def frame_started(self, header: FrameHeader, meta: bytes) -> DataSink | None:
        pending = self.pending.get(header.request_id)
        if pending is None or header.status != Status.OK or not header.data_len:
            return None
        if pending.collect:
            pending.collected = bytearray(header.data_len)
            return BufferSink([memoryview(pending.collected)])
        if pending.sink is None or pending.sink.total != header.data_len:
            pending.size_mismatch = True
            return None
        return pending.sink

    def frame_done(self, header: FrameHeader, meta: bytes, sink: DataSink | None) -> None:
        if header.request_id == 0 and header.status == Status.ERROR:
            # A connection-level error (bad frame, auth): the server closes after it.
            self._fail_all(decode_error(meta))
            return
        pending = self.pending.pop(header.request_id, None)
        if pending is None:
            return  # an abandoned request's answer
        if pending.future.done():
            return
        if header.status == Status.ERROR:  # fatal errors carry op 0: check status first
            pending.future.set_exception(decode_error(meta))
        elif header.op != pending.op:
            pending.future.set_exception(
                ProtocolError(f"answer to op {pending.op} came back as op {header.op}")
            )
        else:
            pending.future.set_result((header, meta))

    # -- requests ---------------------------------------------------------------------------
    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    @property
    def load(self) -> int:
        return len(self.pending)

    def _fail_all(self, exc: BaseException) -> None:
        self._lost = exc
        pending, self.pending = self.pending, {}
        for item in pending.values():
            if not item.future.done():
                item.future.set_exception(exc)
                item.future.exception()  # retrieved here; awaiting callers still see it

    def send(
        self,
        op: Op,
        meta: bytes,
        data: Sequence[BytesLike] = (),
        *,
        sink: BufferSink | None = None,
        collect: bool = False,
    ) -> _Pending:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise RemoteUnavailable(f"connection closed: {self._lost or 'not open'}")
        request_id = next(self._ids) & 0xFFFFFFFF or next(self._ids)
        data_len = sum(len(part) for part in data)
        future: asyncio.Future[tuple[FrameHeader, bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        pending = _Pending(
            op, future, sink, lends_buffers=bool(data) or sink is not None, collect=collect
        )
        self.pending[request_id] = pending
        head = pack_frame_header(op, Status.REQUEST, request_id, len(meta), data_len)
        if data:
            transport.writelines([head + meta, *data])
        else:
            transport.write(head + meta)
        return pending

    async def drained(self) -> None:
        while self._drained is not None and self.is_open:
            await self._drained.wait()

    def forget(self, pending: _Pending) -> bool:
        """The caller is done with ``pending``; if it is still unanswered and lent buffers,
        drop the connection (True), the only way to keep the socket off those buffers."""
        for request_id, item in list(self.pending.items()):
            if item is pending:
                del self.pending[request_id]
                break
        else:
            return False  # answered (or failed with the connection)
        if pending.lends_buffers and self.transport is not None:
            # Unsent bytes may still point into the caller's buffers, or the answer may still
            # be on its way into them: only dropping the connection stops both.
            self.abort()
            return True
        return False

    def abort(self) -> None:
        self.reader.stopped = True
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


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
        self._connections: list[_Connection] = []
        self._connects: set[asyncio.Future[None]] = set()
        self._retry_at = 0.0
        self._backoff_s = self.options.backoff_initial_s
        self._closed = False
        self.connects = 0
        self.connect_failures = 0
        self.aborted_connections = 0

    async def __aenter__(self) -> RemoteClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- connections ------------------------------------------------------------------------
    async def _acquire(self) -> _Connection:
        """The least loaded connection; a new one while the pool has room and all are busy."""
        while True:
            if self._closed:
                raise RemoteUnavailable("client is closed")
            self._connections = [c for c in self._connections if c.is_open]
            best = min(self._connections, key=lambda c: c.load, default=None)
            full = len(self._connections) + len(self._connects) >= self.options.pool_size
            if best is not None and (best.load == 0 or full):
                return best
            if full:  # no live connection yet, but connects in flight: wait for one
                await asyncio.wait(list(self._connects), return_when=asyncio.FIRST_COMPLETED)
                continue
            if time.monotonic() < self._retry_at:
                if best is not None:
                    return best
                raise RemoteUnavailable(
                    f"{self.host}:{self.port} unreachable; retrying in "
                    f"{self._retry_at - time.monotonic():.2f}s"
                )
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._connects.add(done)
            try:
                connection = await self._connect()
            finally:
                self._connects.discard(done)
                done.set_result(None)
            if self._closed:
                connection.abort()
                raise RemoteUnavailable("client is closed")
            self._connections.append(connection)
            return connection

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        limits = self.options.limits
        try:
            _, protocol = await loop.create_connection(
                lambda: _Connection(limits), self.host, self.port
            )
        except OSError as exc:
            self._backoff(exc)
            raise RemoteUnavailable(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        connection = protocol
        if self._token is not None:
            try:
                await connection.send(Op.AUTH, self._token).future
            except BaseException as exc:
                connection.abort()
                if isinstance(exc, RemoteError | OSError):
                    self._backoff(exc)
                raise
        self.connects += 1
        self._backoff_s = self.options.backoff_initial_s
        self._retry_at = 0.0
        return connection

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
        timeout_s: float | None = None,
    ) -> tuple[FrameHeader, bytes, _Pending]:
        connection: _Connection | None = None
        pending: _Pending | None = None
        try:
            async with asyncio.timeout(timeout_s or self.options.timeout_s):
                connection = await self._acquire()
                pending = connection.send(op, meta, data, sink=sink, collect=collect)
                header, answer = await pending.future
                return header, answer, pending
        except TimeoutError:
            raise RemoteTimeout(
                f"{op.name} to {self.host}:{self.port} took over "
                f"{timeout_s or self.options.timeout_s}s"
            ) from None
        finally:
            # Not ``pending.future.done()``: cancelling our await cancels the future too.
            if connection is not None and pending is not None and connection.forget(pending):
                self.aborted_connections += 1

    # -- operations -------------------------------------------------------------------------
    async def ping(self, payload: bytes = b"") -> float:
        """Round-trip seconds."""
        started = time.perf_counter()
        _, answer, _ = await self._request(Op.PING, payload)
        if answer != payload:
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
        _, answer, _ = await self._request(op, encode_key_list(keys, self.options.limits))
        if len(answer) != len(keys):
            raise ProtocolError(f"{op.name} of {len(keys)} keys answered {len(answer)} flags")
        return [bool(flag) for flag in answer]

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

        ``hasher`` is fed every byte from offset ``hash_from`` on, as it arrives. A frame of
        another size is discarded (SIZE_MISMATCH) and the buffers' contents are unspecified.
        """
        sink = BufferSink(buffers, hash_from=hash_from, hasher=hasher)
        header, _, pending = await self._request(Op.GET, key, sink=sink)
        if header.status == Status.NOT_FOUND:
            return FetchStatus.MISSING
        if pending.size_mismatch or not sink.complete:
            return FetchStatus.SIZE_MISMATCH
        return FetchStatus.HIT

    async def get(self, key: bytes) -> bytes | None:
        """The whole stored frame as bytes (tools and tests; the tier uses `get_into`)."""
        header, _, pending = await self._request(Op.GET, key, collect=True)
        if header.status == Status.NOT_FOUND:
            return None
        return bytes(pending.collected or b"")

    async def stats(self) -> dict[str, int | float]:
        _, answer, _ = await self._request(Op.STATS, b"")
        try:
            decoded = json.loads(answer)
        except ValueError as exc:
            raise ProtocolError(f"STATS answer is not JSON: {exc}") from None
        if not isinstance(decoded, dict):
            raise ProtocolError("STATS answer is not a JSON object")
        return {str(k): v for k, v in decoded.items() if isinstance(v, int | float)}

    def client_stats(self) -> dict[str, int]:
        return {
            "connections": sum(c.is_open for c in self._connections),
            "connects": self.connects,
            "connect_failures": self.connect_failures,
            "aborted_connections": self.aborted_connections,
            "in_flight": sum(c.load for c in self._connections),
        }

    async def aclose(self) -> None:
        """Close every connection; requests in flight fail with `RemoteUnavailable`."""
        self._closed = True
        connections, self._connections = self._connections, []
        for connection in connections:
            connection.abort()
        if connections:
            await asyncio.sleep(0)  # let the transports run connection_lost


class TkvConnector(RemoteConnector):
    """`RemoteConnector` over a `RemoteClient`: keys travel as `ChunkKey.to_bytes`."""

    def __init__(self, client: RemoteClient) -> None:
        self.client = client
        self.description = f"tkv://{client.host}:{client.port}"

    async def open(self) -> None:
        return None  # connections open lazily, so a server that is down only costs misses

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
