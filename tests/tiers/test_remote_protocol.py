"""tkv protocol framing: round trips through `FrameReader` at any split, limits, key lists."""

from __future__ import annotations

import contextlib
import os
import random

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.errors import ProtocolError
from tiered_kv.tiers.remote.protocol import (
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
    decode_error,
    decode_frame_header,
    decode_key_list,
    encode_error,
    encode_key_list,
    pack_frame_header,
)

LIMITS = ProtocolLimits(max_meta_bytes=4096, max_data_bytes=1 << 20, max_keys=64, max_key_bytes=64)


class Collector:
    """A FrameHandler that keeps every frame; data goes into buffers of the sizes it is told."""

    def __init__(self, split_data: int = 1) -> None:
        self.frames: list[tuple[FrameHeader, bytes, bytes]] = []
        self.split_data = split_data
        self._buffers: list[bytearray] = []

    def frame_started(self, header: FrameHeader, meta: bytes) -> DataSink | None:
        if not header.data_len or header.op == Op.DELETE:  # DELETE data: discarded
            self._buffers = []
            return None
        cut = header.data_len // self.split_data
        sizes = [cut] * (self.split_data - 1) + [header.data_len - cut * (self.split_data - 1)]
        self._buffers = [bytearray(size) for size in sizes]
        return BufferSink([memoryview(b) for b in self._buffers])

    def frame_done(self, header: FrameHeader, meta: bytes, sink: DataSink | None) -> None:
        data = b"".join(self._buffers) if sink is not None else b""
        self.frames.append((header, meta, data))


def feed(reader: FrameReader, stream: bytes, cuts: list[int]) -> None:
    """Deliver ``stream`` the way a transport does: at most len(get_buffer()) bytes a time."""
    position = 0
    cut_iter = iter(cuts)
    while position < len(stream):
        buffer = reader.get_buffer(-1)
        assert len(buffer) > 0
        want = next(cut_iter, len(stream))
        count = max(1, min(len(buffer), want, len(stream) - position))
        buffer[:count] = stream[position : position + count]
        reader.buffer_updated(count)
        position += count


frame_strategy = st.tuples(
    st.sampled_from(list(Op)),
    st.integers(0, 0xFFFFFFFF),
    st.binary(max_size=200),
    st.binary(max_size=3000),
)


@settings(max_examples=200, deadline=None)
@given(
    frames=st.lists(frame_strategy, min_size=1, max_size=8),
    cuts=st.lists(st.integers(1, 5000), max_size=50),
    split_data=st.integers(1, 3),
)
def test_frames_survive_any_split(
    frames: list[tuple[Op, int, bytes, bytes]], cuts: list[int], split_data: int
) -> None:
    stream = b"".join(
        pack_frame_header(op, Status.REQUEST, rid, len(meta), len(data)) + meta + data
        for op, rid, meta, data in frames
    )
    collector = Collector(split_data)
    feed(FrameReader(collector, LIMITS), stream, cuts)
    assert len(collector.frames) == len(frames)
    for (op, rid, meta, data), (header, got_meta, got_data) in zip(
        frames, collector.frames, strict=True
    ):
        assert (header.op, header.request_id, header.status) == (op, rid, Status.REQUEST)
        assert got_meta == meta
        assert got_data == (b"" if op == Op.DELETE else data)


def test_meta_larger_than_the_initial_scratch_buffer() -> None:
    limits = ProtocolLimits(max_meta_bytes=300_000)
    meta = os.urandom(200_000)
    stream = pack_frame_header(Op.PING, 0, 5, len(meta)) + meta
    collector = Collector()
    feed(FrameReader(collector, limits), stream, [70_000] * 5)
    assert collector.frames[0][1] == meta


@settings(max_examples=100, deadline=None)
@given(
    payload=st.binary(min_size=0, max_size=5000),
    sizes=st.lists(st.integers(0, 2000), min_size=1, max_size=4),
    hash_from=st.integers(0, 3000),
    cuts=st.lists(st.integers(1, 700), max_size=40),
)
def test_buffer_sink_hashes_exactly_the_bytes_from_hash_from(
    payload: bytes, sizes: list[int], hash_from: int, cuts: list[int]
) -> None:
    sizes[-1] = max(0, len(payload) - sum(sizes[:-1]))
    if sum(sizes) != len(payload):
        return
    buffers = [bytearray(size) for size in sizes]
    hasher = xxhash.xxh3_64()
    sink = BufferSink([memoryview(b) for b in buffers], hash_from=hash_from, hasher=hasher)
    position = 0
    for cut in [*cuts, len(payload)]:
        while position < len(payload) and cut > 0:
            target = sink.target()
            count = min(len(target), cut, len(payload) - position)
            target[:count] = payload[position : position + count]
            sink.advance(count)
            position += count
            cut -= count
    assert sink.complete
    assert b"".join(buffers) == payload
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(payload[hash_from:])


@given(st.lists(st.binary(min_size=1, max_size=64), max_size=64))
def test_key_list_round_trip(keys: list[bytes]) -> None:
    assert decode_key_list(encode_key_list(keys, LIMITS), LIMITS) == keys


@given(st.binary(max_size=400))
def test_garbage_key_lists_raise_protocol_error_only(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_key_list(data, LIMITS)


def test_key_list_count_is_checked_before_looping() -> None:
    with pytest.raises(ProtocolError, match="cannot fit"):
        decode_key_list(b"\x40\x00\x00\x00", LIMITS)  # 64 keys announced, none there
    with pytest.raises(ProtocolError, match="max_keys"):
        decode_key_list(b"\xff\xff\xff\x00", LIMITS)


@given(st.binary(min_size=HEADER_LEN, max_size=HEADER_LEN))
def test_garbage_headers_raise_frame_error_only(data: bytes) -> None:
    try:
        header = decode_frame_header(data, LIMITS)
    except FrameError as exc:
        assert exc.code in set(ErrorCode)
    else:
        assert header.meta_len <= LIMITS.max_meta_bytes
        assert header.data_len <= LIMITS.max_data_bytes


def test_limits_are_checked_on_the_header_alone() -> None:
    too_big = pack_frame_header(Op.PUT, 0, 9, 10, LIMITS.max_data_bytes + 1)
    with pytest.raises(FrameError) as info:
        decode_frame_header(too_big, LIMITS)
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE
    assert info.value.request_id == 9
    meta_big = pack_frame_header(Op.PING, 0, 1, LIMITS.max_meta_bytes + 1)
    with pytest.raises(FrameError, match="max_meta_bytes"):
        decode_frame_header(meta_big, LIMITS)
    wrong_version = bytearray(pack_frame_header(Op.PING, 0, 1, 0))
    wrong_version[4] = 99
    with pytest.raises(FrameError) as info:
        decode_frame_header(bytes(wrong_version), LIMITS)
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION
    with pytest.raises(FrameError, match="bad magic"):
        decode_frame_header(b"GET / HTTP/1.1\r\nHost: x\r\n", LIMITS)


def test_reader_stops_after_a_bad_frame() -> None:
    collector = Collector()
    reader = FrameReader(collector, LIMITS)
    good = pack_frame_header(Op.PING, 0, 1, 2) + b"hi"
    with pytest.raises(FrameError):
        feed(reader, good + b"X" * HEADER_LEN + good, [10_000])
    assert len(collector.frames) == 1
    assert reader.stopped


def test_error_meta_round_trip() -> None:
    error = decode_error(encode_error(ErrorCode.NO_SPACE, "full"))
    assert "NO_SPACE" in str(error)
    assert "full" in str(error)


def test_limits_validate() -> None:
    with pytest.raises(ProtocolError, match="max_keys"):
        ProtocolLimits(max_keys=0)


def test_meta_buffer_grows_only_as_bytes_arrive_and_shrinks_after() -> None:
    changes: list[int] = []
    collector = Collector()
    reader = FrameReader(collector, ProtocolLimits(), on_buffer_change=changes.append)
    initial = sum(changes)
    assert 0 < initial <= 64 << 10
    meta = os.urandom(4 << 20)  # the largest meta the default limits allow
    stream = pack_frame_header(Op.PING, 0, 1, len(meta)) + meta
    feed(reader, stream[:HEADER_LEN], [])
    assert sum(changes) == initial, "a header alone must not grow the buffer"
    sent = HEADER_LEN
    while sent < len(stream):
        step = min(300_000, len(stream) - sent)
        feed(reader, stream[sent : sent + step], [])
        sent += step
        if sent < len(stream):
            assert sum(changes) <= max(initial, 2 * sent), f"{sum(changes)} held for {sent} sent"
    assert collector.frames[0][1] == meta
    assert sum(changes) == initial, "the buffer shrinks back once the big meta is parsed"
    reader.close()
    assert sum(changes) == 0
    assert reader.stopped


def test_header_check_refuses_a_frame_before_its_meta_is_buffered() -> None:
    changes: list[int] = []

    def auth_only(header: FrameHeader) -> None:
        if header.op != Op.AUTH:
            raise FrameError(ErrorCode.AUTH_REQUIRED, "AUTH first", header.request_id)

    collector = Collector()
    reader = FrameReader(collector, LIMITS, check_header=auth_only, on_buffer_change=changes.append)
    initial = sum(changes)
    feed(reader, pack_frame_header(Op.AUTH, 0, 1, 3) + b"tok", [])
    with pytest.raises(FrameError) as info:
        feed(reader, pack_frame_header(Op.EXISTS, 0, 2, LIMITS.max_meta_bytes), [])
    assert info.value.code == ErrorCode.AUTH_REQUIRED
    assert info.value.request_id == 2
    assert reader.stopped
    assert [header.op for header, _, _ in collector.frames] == [Op.AUTH]
    assert sum(changes) == initial


class GrowingSink:
    """A sink whose one buffer grows in place (as the server's PUT buffers do) when full."""

    def __init__(self, total: int) -> None:
        self.buffer = bytearray()
        self.total = total
        self.filled = 0

    def target(self) -> memoryview:
        if self.filled == len(self.buffer):
            self.buffer += bytes(min(self.total, max(16, 2 * len(self.buffer))) - self.filled)
        return memoryview(self.buffer)[self.filled :]

    def advance(self, nbytes: int) -> None:
        self.filled += nbytes


def test_data_that_arrives_with_its_header_can_go_to_a_sink_that_grows() -> None:
    data = os.urandom(5000)
    sinks: list[GrowingSink] = []

    class Handler:
        def frame_started(self, header: FrameHeader, meta: bytes) -> DataSink | None:
            sinks.append(GrowingSink(header.data_len))
            return sinks[-1]

        def frame_done(self, header: FrameHeader, meta: bytes, sink: DataSink | None) -> None:
            pass

    stream = pack_frame_header(Op.PUT, 0, 1, 1, len(data)) + b"k" + data
    # One piece: the whole frame sits in the scratch buffer and is copied into the sink.
    feed(FrameReader(Handler(), LIMITS), stream, [len(stream)])
    assert bytes(sinks[0].buffer) == data


def test_reader_header_pending_tracks_an_incomplete_header_or_meta() -> None:
    reader = FrameReader(Collector(), LIMITS)
    assert not reader.header_pending
    stream = pack_frame_header(Op.PING, 0, 1, 100) + b"m" * 100
    feed(reader, stream[:10], [])
    assert reader.header_pending
    feed(reader, stream[10:60], [])
    assert reader.header_pending
    feed(reader, stream[60:], [])
    assert not reader.header_pending


@settings(max_examples=20, deadline=None)
@given(
    meta_sizes=st.lists(st.integers(0, 200_000), min_size=1, max_size=12),
    cut_seed=st.integers(0, 2**32 - 1),
)
def test_frames_with_big_metas_survive_any_split_and_the_buffer_shrinks_back(
    meta_sizes: list[int], cut_seed: int
) -> None:
    # Metas larger than the initial buffer and many small frames: the buffer compacts, grows
    # and shrinks under every split.
    rng = random.Random(cut_seed)
    frames = [(Op.PING, index, rng.randbytes(size)) for index, size in enumerate(meta_sizes)]
    frames += [(Op.EXISTS, 100 + index, b"k" * 30) for index in range(3000)]
    rng.shuffle(frames)
    stream = b"".join(pack_frame_header(op, 0, rid, len(meta)) + meta for op, rid, meta in frames)
    cuts = [rng.choice((1, 23, 4096, 70_000, 300_000)) for _ in range(len(stream) // 1000)]
    changes: list[int] = []
    collector = Collector()
    reader = FrameReader(
        collector, ProtocolLimits(max_meta_bytes=300_000), on_buffer_change=changes.append
    )
    initial = sum(changes)
    feed(reader, stream, cuts)
    assert [(h.op, h.request_id, meta) for h, meta, _ in collector.frames] == frames
    assert sum(changes) == initial
