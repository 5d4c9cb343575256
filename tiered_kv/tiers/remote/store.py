"""The built-in server's store: chunk frames kept as received, in a capacity-bounded LRU map.

`FrameStore` owns the map of key bytes → `Frame` (a few `bytearray` segments per chunk, each
filled by ``recv_into`` as the data arrived), its byte accounting, the pool of recycled
segments and the room reserved by PUTs in flight; `PutSink` is where one PUT's data lands, a
segment at a time as it arrives. `decode_frame_header` reads a stored frame's chunk header.

Threads: the server's connection threads call every `FrameStore` method at once; each takes
the store's lock. A `PutSink` belongs to its connection's thread.

Must not: allocate, reserve or evict on a length a client claims rather than on bytes it sent;
recycle a segment that a connection still sends a view of; know about sockets or the protocol.
"""

from __future__ import annotations

import collections
import sys
import threading

from tiered_kv.codec import PREFIX_LEN, ChunkHeader, CodecLimits, decode_header, header_length

FIRST_SEGMENT = 64 << 10


class Frame:
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


def unshared(segment: bytearray) -> bool:
    """Whether only its frame holds ``segment`` (no transport still sending a view of it).

    For a caller iterating over ``frame.segments``, CPython counts: the frame's tuple, the
    caller's loop variable, this parameter and getrefcount's own argument.
    """
    return sys.getrefcount(segment) <= 4


class FrameStore:
    """The LRU map and its byte accounting: stored frames, recycled segments and bytes reserved
    by PUTs in flight, all within ``capacity``. Every method takes ``lock`` (connections'
    threads call them at once); ``entries`` itself is for inspection under that lock.

    A PUT asks for its segments one by one as its data arrives (see `PutSink`), so frames are
    evicted for bytes a client sent, never for a length it claims. Segments of freed frames are
    recycled (a fresh 32 MiB buffer costs more in page faults than receiving 32 MiB over
    loopback), evicted ones included as far as the room they leave is not needed at once; a
    PUT of a size seen before then finds every segment it needs in the pool. A segment is
    recycled only when no connection still holds a view of it: `get_views` makes the views
    under the lock, so the reference count `unshared` reads is never stale in the unsafe way.
    """

    def __init__(self, capacity: int, counters: dict[str, int], lock: threading.Lock) -> None:
        self.capacity = capacity
        self.entries: collections.OrderedDict[bytes, Frame] = collections.OrderedDict()
        self.used = 0
        self.reserved = 0
        self.pooled = 0
        self.pool_limit = capacity // 4
        self.lock = lock
        self._pool: dict[int, list[bytearray]] = {}
        self._counters = counters

    def allocate(self, nbytes: int) -> bytearray | None:
        """A segment of ``nbytes`` for a PUT in flight, its room reserved: a pooled one, else
        room made by dropping pooled segments (largest first: the most room per drop), then
        evicting LRU frames, whose segments are pooled as far as they fit (one of them may be
        the answer); None when PUTs in flight already hold that room."""
        with self.lock:
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
                self._recycle(frame)
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

    def _recycle(self, frame: Frame) -> None:
        """Pool the segments of a frame no longer stored, as far as they fit (largest first:
        the small ones are the cheapest to allocate again)."""
        for segment in reversed(frame.segments):
            size = len(segment)
            if (
                self.pooled + size <= self.pool_limit
                and self.used + self.pooled + self.reserved + size <= self.capacity
                and unshared(segment)
            ):
                self._pool.setdefault(size, []).append(segment)
                self.pooled += size

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.reserved -= nbytes

    def insert(self, key: bytes, frame: Frame) -> None:
        with self.lock:
            old = self.entries.pop(key, None)
            self.entries[key] = frame
            self.used += frame.nbytes
            if old is not None:
                self.used -= old.nbytes
                self._recycle(old)

    def get_views(self, key: bytes) -> list[memoryview] | None:
        """Views of ``key``'s segments, to send; its segments stay out of the pool while any
        of these views lives."""
        with self.lock:
            frame = self.entries.get(key)
            if frame is None:
                return None
            self.entries.move_to_end(key)
            return [memoryview(segment) for segment in frame.segments]

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        with self.lock:
            return [key in self.entries for key in keys]

    def delete(self, key: bytes) -> bool:
        with self.lock:
            frame = self.entries.pop(key, None)
            if frame is None:
                return False
            self.used -= frame.nbytes
            self._recycle(frame)
            return True

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self._pool.clear()
            self.used = self.pooled = 0


class PutSink:
    """Where a PUT's data lands: segments added, with the room they reserve, as bytes arrive.

    A header alone reserves and allocates nothing; the first segment is 64 KiB and each next
    one as large as all before it, so a client that claims more than it sends holds memory, and
    evicts frames, in proportion to what it sent, and no byte is ever copied to grow a buffer.
    When the store has no room left the PUT is refused: its segments and reservation are given
    back and the rest of its data lands in a shared scratch buffer, dropped.
    """

    __slots__ = ("size", "segments", "filled", "reserved", "refusal", "_store", "_discard")

    def __init__(self, store: FrameStore, size: int, discard: memoryview) -> None:
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
        nbytes = min(self.size - self.reserved, max(self.reserved, FIRST_SEGMENT))
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

    def take(self) -> Frame:
        """The whole frame, its reservation given back for the caller to store it."""
        frame = Frame(tuple(self.segments))
        self.release()
        return frame

    def release(self) -> None:
        """Give back the reservation and the segments (the PUT is done, refused or abandoned)."""
        self._store.release(self.reserved)
        self.reserved = 0
        self.segments = []


def decode_frame_header(frame: Frame, limits: CodecLimits) -> ChunkHeader:
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
