"""The wire protocol of the built-in remote cache (``tkv://``): frames, limits, incremental reading.

Owns the frame layout, its limits and error codes, the encoding of the small "meta" section
(key lists, per-key results, error messages), and `FrameReader`, the incremental parser that
the server's connection threads drive with ``get_buffer`` / ``buffer_updated`` around each
``recv_into`` (the `asyncio.BufferedProtocol` shape); the client reads its answers directly.
Must not know about memory objects, tiers or sockets: payloads are opaque bytes here (a chunk
frame of `tiered_kv.codec`, which carries its own checksums) and land in buffers a `DataSink` names.

Frame, little-endian, the same for requests and responses::

    magic b"TKVP" | version u8 | op u8 | status u8 | flags u8 | request_id u32
    meta_len u32 | data_len u64 | meta (meta_len bytes) | data (data_len bytes)

A request carries ``status == 0``; its response echoes ``op`` and ``request_id``. Requests on
one connection are answered in order, so a client may pipeline as many as it likes. Both lengths
are checked against `ProtocolLimits` as soon as the fixed header has arrived, and buffers then
grow only as bytes arrive, never on a claimed length alone; a frame over a limit, with a bad
magic or another version is answered with an ERROR frame (request id 0 when the id itself cannot
be trusted) and the connection is closed.

Operations (meta / data of the request → of an OK response):

- AUTH: the shared token → nothing. Required first when the server has a token.
- PING: anything → the same bytes.
- EXISTS, DELETE: a key list → one byte per key (1 present / removed, 0 not).
- PUT: one key → nothing; data is the chunk frame to store.
- GET: one key → data is the stored chunk frame; status NOT_FOUND when absent.
- STATS: nothing → UTF-8 JSON object of counters.

A key list is ``count u32`` then per key ``len u16 | key bytes``. An ERROR response's meta is
``code u16 | UTF-8 message``.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Callable, Sequence
from typing import Protocol

from tiered_kv.errors import ProtocolError, RemoteError

MAGIC = b"TKVP"
PROTOCOL_VERSION = 1
FRAME_HEADER = struct.Struct("<4sBBBBIIQ")
HEADER_LEN = FRAME_HEADER.size
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_INITIAL_SCRATCH = 64 * 1024


class Op(enum.IntEnum):
    AUTH = 1
    PING = 2
    EXISTS = 3
    PUT = 4
    GET = 5
    DELETE = 6
    STATS = 7


class Status(enum.IntEnum):
    REQUEST = 0
    OK = 1
    NOT_FOUND = 2
    ERROR = 3


class ErrorCode(enum.IntEnum):
    BAD_FRAME = 1
    FRAME_TOO_LARGE = 2
    UNSUPPORTED_VERSION = 3
    UNKNOWN_OP = 4
    BAD_REQUEST = 5
    AUTH_REQUIRED = 6
    AUTH_FAILED = 7
    NO_SPACE = 8
    SHUTTING_DOWN = 9
    BUSY = 10  # the server has as many connections as it takes
    TIMEOUT = 11  # a request's header or AUTH came too slowly, or the connection sat idle


@dataclasses.dataclass(frozen=True, slots=True)
class ProtocolLimits:
    """Bounds every reader enforces before allocating.

    max_meta_bytes: the meta section (key lists, messages); also bounds the parse buffer.
    max_data_bytes: one frame's data (a whole chunk frame, header included).
    max_keys: keys in one EXISTS / DELETE.
    max_key_bytes: one key.
    """

    max_meta_bytes: int = 4 << 20
    max_data_bytes: int = 4 << 30
    max_keys: int = 65536
    max_key_bytes: int = 4096

    def __post_init__(self) -> None:
        bounds = {
            "max_meta_bytes": (64, 0xFFFFFFFF),
            "max_data_bytes": (0, 1 << 62),
            "max_keys": (1, 1 << 24),
            "max_key_bytes": (1, 0xFFFF),
        }
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ProtocolError(
                    f"ProtocolLimits.{name} must be an int in [{low}, {high}], got {value!r}"
                )


DEFAULT_LIMITS = ProtocolLimits()


@dataclasses.dataclass(frozen=True, slots=True)
class FrameHeader:
    op: int
    status: int
    request_id: int
    meta_len: int
    data_len: int

    def pack(self) -> bytes:
        return FRAME_HEADER.pack(
            MAGIC,
            PROTOCOL_VERSION,
            self.op,
            self.status,
            0,
            self.request_id,
            self.meta_len,
            self.data_len,
        )


class FrameError(ProtocolError):
    """A frame the reader refuses; ``code`` says which `ErrorCode` to answer with."""

    def __init__(self, code: ErrorCode, message: str, request_id: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


def pack_frame_header(
    op: int, status: int, request_id: int, meta_len: int, data_len: int = 0
) -> bytes:
    return FRAME_HEADER.pack(MAGIC, PROTOCOL_VERSION, op, status, 0, request_id, meta_len, data_len)


def decode_frame_header(data: bytes | memoryview, limits: ProtocolLimits) -> FrameHeader:
    """Parse and bound-check a fixed header (``HEADER_LEN`` bytes); raises `FrameError`."""
    if len(data) < HEADER_LEN:
        raise FrameError(ErrorCode.BAD_FRAME, f"frame header needs {HEADER_LEN} bytes")
    magic, version, op, status, flags, request_id, meta_len, data_len = FRAME_HEADER.unpack_from(
        data, 0
    )
    if magic != MAGIC:
        raise FrameError(ErrorCode.BAD_FRAME, f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise FrameError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version} not supported; this side speaks {PROTOCOL_VERSION}",
        )
    if flags:
        raise FrameError(ErrorCode.BAD_FRAME, f"unknown flags {flags:#04x}", request_id)
    if meta_len > limits.max_meta_bytes:
        raise FrameError(
            ErrorCode.FRAME_TOO_LARGE,
            f"meta of {meta_len} bytes exceeds max_meta_bytes={limits.max_meta_bytes}",
            request_id,
        )
    if data_len > limits.max_data_bytes:
        raise FrameError(
            ErrorCode.FRAME_TOO_LARGE,
            f"data of {data_len} bytes exceeds max_data_bytes={limits.max_data_bytes}",
            request_id,
        )
    return FrameHeader(op, status, request_id, meta_len, data_len)


# -- meta encodings -----------------------------------------------------------------------------
def encode_key_list(keys: Sequence[bytes], limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    if len(keys) > limits.max_keys:
        raise ProtocolError(f"{len(keys)} keys in one request, max_keys={limits.max_keys}")
    parts = [_U32.pack(len(keys))]
    for key in keys:
        if not 0 < len(key) <= limits.max_key_bytes:
            raise ProtocolError(f"key of {len(key)} bytes outside [1, {limits.max_key_bytes}]")
        parts.append(_U16.pack(len(key)))
        parts.append(key)
    return b"".join(parts)


def decode_key_list(meta: bytes, limits: ProtocolLimits = DEFAULT_LIMITS) -> list[bytes]:
    """Inverse of `encode_key_list`; raises `ProtocolError` on anything malformed."""
    if len(meta) < _U32.size:
        raise ProtocolError("key list: missing count")
    (count,) = _U32.unpack_from(meta, 0)
    if count > limits.max_keys:
        raise ProtocolError(f"key list: {count} keys, max_keys={limits.max_keys}")
    # Each key needs at least 3 bytes: refuse a count the meta cannot hold before looping.
    if count * 3 > len(meta) - _U32.size:
        raise ProtocolError(f"key list: {count} keys cannot fit in {len(meta)} bytes")
    keys = []
    pos = _U32.size
    for index in range(count):
        if pos + _U16.size > len(meta):
            raise ProtocolError(f"key list: truncated at key {index}")
        (length,) = _U16.unpack_from(meta, pos)
        pos += _U16.size
        if not 0 < length <= limits.max_key_bytes or pos + length > len(meta):
            raise ProtocolError(f"key list: key {index} of {length} bytes is out of bounds")
        keys.append(meta[pos : pos + length])
        pos += length
    if pos != len(meta):
        raise ProtocolError(f"key list: {len(meta) - pos} trailing bytes")
    return keys


def check_key(meta: bytes, limits: ProtocolLimits = DEFAULT_LIMITS) -> bytes:
    if not 0 < len(meta) <= limits.max_key_bytes:
        raise ProtocolError(f"key of {len(meta)} bytes outside [1, {limits.max_key_bytes}]")
    return meta


def encode_error(code: ErrorCode, message: str) -> bytes:
    return _U16.pack(code) + message.encode("utf-8", "replace")[:4000]


def decode_error(meta: bytes) -> RemoteError:
    """The exception an ERROR response stands for (`RemoteAuthError` for auth failures)."""
    from tiered_kv.errors import RemoteAuthError

    if len(meta) < _U16.size:
        return ProtocolError("error frame without a code")
    (code,) = _U16.unpack_from(meta, 0)
    message = meta[_U16.size :].decode("utf-8", "replace")
    try:
        name = ErrorCode(code).name
    except ValueError:
        name = f"code {code}"
    text = f"server error {name}: {message}"
    if code in (ErrorCode.AUTH_FAILED, ErrorCode.AUTH_REQUIRED):
        return RemoteAuthError(text)
    return RemoteError(text)


# -- incremental reading ------------------------------------------------------------------------
class DataSink(Protocol):
    """Where a frame's data goes: consecutive buffers, filled in order."""

    def target(self) -> memoryview:
        """The (non-empty) buffer the next bytes go to; only called while data is still due.

        Neither the reader nor the receiver holds a view from an earlier call by then, so an
        implementation may resize its buffer here.
        """

    def advance(self, nbytes: int) -> None:
        """``nbytes`` were written at the start of the last `target`."""


class Hasher(Protocol):
    def update(self, data: memoryview, /) -> None: ...


class BufferSink:
    """Fills ``buffers`` one after another; optionally hashes the bytes from ``hash_from`` on.

    The hash is updated right after each piece lands, while it is still in cache, so a reader
    verifies a checksum without a second pass over the payload.
    """

    __slots__ = ("_buffers", "_index", "_filled", "_position", "_hash_from", "hasher", "total")

    def __init__(
        self,
        buffers: Sequence[memoryview],
        *,
        hash_from: int | None = None,
        hasher: Hasher | None = None,
    ) -> None:
        self._buffers = [b if b.format == "B" and b.ndim == 1 else b.cast("B") for b in buffers]
        self._index = 0
        self._filled = 0
        self._position = 0
        self._hash_from = hash_from
        self.hasher = hasher
        self.total = sum(len(b) for b in self._buffers)
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self._index < len(self._buffers) and self._filled == len(self._buffers[self._index]):
            self._index += 1
            self._filled = 0

    def target(self) -> memoryview:
        return self._buffers[self._index][self._filled :]

    def advance(self, nbytes: int) -> None:
        buffer = self._buffers[self._index]
        if self.hasher is not None and self._hash_from is not None:
            end = self._position + nbytes
            if end > self._hash_from:
                start = max(self._filled, self._filled + self._hash_from - self._position)
                self.hasher.update(buffer[start : self._filled + nbytes])
        self._filled += nbytes
        self._position += nbytes
        self._skip_empty()

    @property
    def complete(self) -> bool:
        return self._index == len(self._buffers)


def sink_write(sink: DataSink, data: memoryview) -> None:
    """Copy ``data`` into ``sink`` (bytes that arrived together with a frame's header)."""
    while data:
        count = _copy_into(sink.target(), data)
        sink.advance(count)
        data = data[count:]


def _copy_into(target: memoryview, data: memoryview) -> int:
    # A function of its own so that the target view is gone before `sink_write` asks for the
    # next one: a sink may grow its buffer in `DataSink.target`.
    count = min(len(target), len(data))
    target[:count] = data[:count]
    return count


class FrameHandler(Protocol):
    def frame_started(self, header: FrameHeader, meta: bytes) -> DataSink | None:
        """A frame's header and meta arrived; return where its data goes (None: discard it).

        A returned sink must hold exactly ``header.data_len`` bytes. May raise `FrameError`.
        """

    def frame_done(self, header: FrameHeader, meta: bytes, sink: DataSink | None) -> None:
        """The whole frame arrived (its data is in ``sink``)."""


class FrameReader:
    """Turns received bytes into frames for a `FrameHandler`: the caller receives into
    `get_buffer` and reports the count to `buffer_updated` (`BufferedProtocol`'s shape).

    Headers and metas are parsed from a scratch buffer that grows only as bytes arrive: when an
    incomplete header and meta fill it, it at most doubles, never past that frame's
    ``HEADER_LEN + meta_len`` (checked against the limits first), and it shrinks back once the
    frame is parsed. A header claiming a big meta therefore costs nothing until the meta comes.
    A frame's data beyond what arrived with its header is received straight into the handler's
    sink (``recv_into`` its buffers), so payloads are never copied by Python.

    check_header: called once per frame with its fixed header, before any of its meta is kept;
        may raise `FrameError` (a server refuses there what an unauthenticated peer may not send).
    on_buffer_change: called with the change in bytes of the scratch buffer whenever it is
        allocated, grown, shrunk or given back, for the owner's accounting.

    Any `FrameError` propagates out of `buffer_updated` and leaves the reader stopped: the
    connection must be closed. `close` gives the buffer back once the connection is gone.
    """

    __slots__ = (
        "_handler",
        "_limits",
        "_check_header",
        "_on_buffer_change",
        "_scratch",
        "_view",
        "_start",
        "_end",
        "_header",
        "_frame",
        "stopped",
    )

    def __init__(
        self,
        handler: FrameHandler,
        limits: ProtocolLimits = DEFAULT_LIMITS,
        *,
        check_header: Callable[[FrameHeader], None] | None = None,
        on_buffer_change: Callable[[int], None] | None = None,
    ) -> None:
        self._handler = handler
        self._limits = limits
        self._check_header = check_header
        self._on_buffer_change = on_buffer_change
        self._scratch = bytearray()
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        # The checked header of the frame whose meta is still arriving.
        self._header: FrameHeader | None = None
        # (header, meta, sink or None, data bytes still due) while a frame's data is streaming.
        self._frame: tuple[FrameHeader, bytes, DataSink | None, int] | None = None
        self.stopped = False
        self._resize(_INITIAL_SCRATCH)

    @property
    def receiving_data(self) -> bool:
        return self._frame is not None

    @property
    def header_pending(self) -> bool:
        """Part of a frame's header or meta arrived, not all of it."""
        return self._frame is None and self._end > self._start

    def discard_current(self) -> None:
        """Send the rest of the current frame's data to scratch instead of its sink."""
        if self._frame is not None:
            header, meta, _, due = self._frame
            self._frame = (header, meta, None, due)

    def get_buffer(self, sizehint: int) -> memoryview:
        frame = self._frame
        if frame is not None:
            _, _, sink, due = frame
            if sink is not None:
                return sink.target()
            return self._view[: min(len(self._view), due)]
        # `_parse` always leaves room at the end (until `close`).
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.stopped:
            return
        frame = self._frame
        if frame is not None:
            header, meta, sink, due = frame
            if sink is not None:
                sink.advance(nbytes)
            due -= nbytes
            if due:
                self._frame = (header, meta, sink, due)
                return
            self._frame = None
            self._handler.frame_done(header, meta, sink)
            return
        self._end += nbytes
        try:
            self._parse()
        except BaseException:
            self.stopped = True
            raise

    def close(self) -> None:
        """Stop and give the scratch buffer back; nothing may be fed after this."""
        self.stopped = True
        self._frame = None
        self._header = None
        self._start = self._end = 0
        self._resize(0)

    def _resize(self, size: int) -> None:
        """Move the unparsed bytes to the start of a fresh scratch buffer of ``size`` bytes.

        A fresh buffer, not a resize in place: the receiver may still hold a view of the old
        one while `buffer_updated` runs.
        """
        pending = self._end - self._start
        fresh = bytearray(size)
        fresh[:pending] = self._view[self._start : self._end]
        change = size - len(self._scratch)
        self._scratch = fresh
        self._view = memoryview(fresh)
        self._start, self._end = 0, pending
        if change and self._on_buffer_change is not None:
            self._on_buffer_change(change)

    def _make_room(self) -> None:
        """Leave free room at the end of the scratch buffer for the next bytes."""
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._scratch) > _INITIAL_SCRATCH:
                self._resize(_INITIAL_SCRATCH)  # give back what a big meta needed
            return
        if self._end < len(self._scratch) or self.stopped:
            return
        # An incomplete meta fills the buffer (never smaller than a header: that one is decoded).
        header = self._header
        needed = HEADER_LEN if header is None else HEADER_LEN + header.meta_len
        pending = self._end - self._start
        if needed <= len(self._scratch):
            self._view[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        else:
            # At most twice what arrived of this frame: memory follows the bytes, not the claim.
            self._resize(min(needed, max(2 * pending, len(self._scratch))))

    def _parse(self) -> None:
        view = self._view
        while not self.stopped and self._frame is None:
            available = self._end - self._start
            if available < HEADER_LEN:
                break
            header = self._header
            if header is None:
                header = decode_frame_header(
                    view[self._start : self._start + HEADER_LEN], self._limits
                )
                if self._check_header is not None:
                    self._check_header(header)
                self._header = header
            needed = HEADER_LEN + header.meta_len
            if available < needed:
                break
            self._header = None
            meta = bytes(view[self._start + HEADER_LEN : self._start + needed])
            self._start += needed
            sink = self._handler.frame_started(header, meta)
            here = min(self._end - self._start, header.data_len)
            if sink is not None and here:
                sink_write(sink, view[self._start : self._start + here])
            self._start += here
            if here == header.data_len:
                self._handler.frame_done(header, meta, sink)
                continue
            self._frame = (header, meta, sink, header.data_len - here)
        self._make_room()
