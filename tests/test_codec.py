"""The chunk frame codec: round trips, limits, and hostile or damaged input (CodecError only)."""

from __future__ import annotations

import ast
import itertools
import random
import struct
import sys
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tiered_kv import codec
from tiered_kv.codec import (
    DEFAULT_LIMITS,
    DTYPE_CODES,
    DTYPE_ITEMSIZES,
    FORMAT_VERSION,
    MAGIC,
    MIN_HEADER_LEN,
    PAYLOAD_ALIGN,
    PREFIX_LEN,
    STRIPE_BYTES,
    BytesLike,
    ChunkHeader,
    CodecLimits,
    GroupSpec,
    PayloadHasher,
    check_encodable,
    check_payload_checksums,
    decode_chunk,
    decode_header,
    encode_chunk,
    encode_header,
    encoded_header_len,
    header_length,
    payload_checksums,
    stripe_count,
)
from tiered_kv.errors import CodecError
from tiered_kv.layout import DTYPE_NAMES

DTYPES = sorted(DTYPE_CODES)
ALLOCATION_BOUND = 1 << 20
"""Decoding hostile input may allocate error messages and a key, never more than this."""


# -- helpers ------------------------------------------------------------------------------------
def random_buffers(groups: Sequence[GroupSpec], seed: int) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(group.nbytes) for group in groups]


def frame_bytes(
    key: bytes, num_tokens: int, groups: Sequence[GroupSpec], buffers: Sequence[BytesLike]
) -> bytes:
    return b"".join(encode_chunk(key, num_tokens, groups, buffers))


def sample_frame() -> tuple[bytes, ChunkHeader]:
    groups = [GroupSpec("bfloat16", (2, 2, 3, 4)), GroupSpec("int8", (1, 1, 3, 132))]
    data = frame_bytes(b"sample-key", 3, groups, random_buffers(groups, 7))
    return data, decode_header(data)


def raw_header(
    *,
    key: bytes = b"k",
    num_tokens: int = 1,
    groups: Sequence[tuple[int, Sequence[int], int, int]] = ((7, (4,), 0, 4),),
    payload_sums: Sequence[int] = (0,),
    stripe_len: int = STRIPE_BYTES,
    magic: bytes = MAGIC,
    version: int = FORMAT_VERSION,
    flags: int = 0,
    key_len: int | None = None,
    group_count: int | None = None,
    header_len: int | None = None,
    extra: bytes = b"",
    pad_len: int | None = None,
    padding: bytes | None = None,
) -> bytes:
    """A header with arbitrary (possibly lying) fields and a correct header checksum.

    Unless given, ``padding`` is the zeros that align the header's end to PAYLOAD_ALIGN, and
    ``pad_len`` and ``header_len`` tell the truth about what was written.
    """
    body = [
        struct.pack("<I", len(key) if key_len is None else key_len),
        key,
        struct.pack("<IH", num_tokens, len(groups) if group_count is None else group_count),
    ]
    for code, dims, offset, length in groups:
        body.append(struct.pack(f"<BB{len(dims)}QQQ", code, len(dims), *dims, offset, length))
    body.append(struct.pack("<I", stripe_len))
    body.append(extra)
    sums = struct.pack(f"<{len(payload_sums)}Q", *payload_sums)
    if padding is None:
        unpadded = PREFIX_LEN + len(b"".join(body)) + 4 + len(sums) + 8
        padding = bytes(-unpadded % PAYLOAD_ALIGN)
    body.append(struct.pack("<I", len(padding) if pad_len is None else pad_len))
    body.append(padding)
    body.append(sums)
    content = b"".join(body)
    length = PREFIX_LEN + len(content) + 8 if header_len is None else header_len
    head = struct.pack("<4sHHI", magic, version, flags, length) + content
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


@contextmanager
def allocation_bound(limit: int = ALLOCATION_BOUND) -> Iterator[None]:
    """Fail when the block's peak Python allocation reaches ``limit`` (raising or not)."""
    tracemalloc.start()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < limit, f"decoder allocated {peak} bytes"


def only_codec_error(fn: Callable[[], object]) -> CodecError | None:
    """Run ``fn``; CodecError is returned, success gives None, anything else fails the test."""
    try:
        with allocation_bound():
            fn()
    except CodecError as exc:
        return exc
    return None


# -- strategies ---------------------------------------------------------------------------------
group_specs = st.builds(
    GroupSpec,
    st.sampled_from(DTYPES),
    st.lists(st.integers(1, 4), min_size=1, max_size=8).map(tuple),
)


# -- round trips --------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    key=st.binary(max_size=300),
    num_tokens=st.integers(0, 2**32 - 1),
    groups=st.lists(group_specs, min_size=1, max_size=6),
    seed=st.integers(0, 2**32),
)
def test_round_trip(key: bytes, num_tokens: int, groups: list[GroupSpec], seed: int) -> None:
    buffers = random_buffers(groups, seed)
    parts = encode_chunk(key, num_tokens, groups, buffers)
    data = b"".join(parts)
    assert len(parts[0]) == encoded_header_len(len(key), groups)
    assert len(parts[0]) % PAYLOAD_ALIGN == 0  # the payload starts page-aligned

    header, payloads = decode_chunk(data)
    assert header.key_bytes == key
    assert header.num_tokens == num_tokens
    assert header.groups == tuple(groups)
    assert header.header_len == len(parts[0])
    assert header.total_len == len(data)
    assert header.payload_len == sum(len(b) for b in buffers)
    assert header.stripe_checksums == payload_checksums(buffers)
    assert len(header.stripe_checksums) == stripe_count(header.payload_len)
    assert [bytes(p) for p in payloads] == buffers
    assert decode_header(data) == header
    assert decode_header(data[: header.header_len]) == header
    assert header_length(data[:PREFIX_LEN]) == header.header_len


def test_group_offsets_are_back_to_back() -> None:
    groups = (GroupSpec("float32", (2, 3)), GroupSpec("uint8", (5,)), GroupSpec("float16", (4,)))
    header = decode_header(frame_bytes(b"", 1, groups, random_buffers(groups, 0)))
    assert header.group_offsets == (0, 24, 29)
    assert header.payload_len == 37


@pytest.mark.parametrize(
    ("key_len", "header_len"),
    [
        (0, PAYLOAD_ALIGN),
        (4024, PAYLOAD_ALIGN),
        (4025, 2 * PAYLOAD_ALIGN),
        (4096, 2 * PAYLOAD_ALIGN),
    ],
)
def test_payload_offset_is_aligned_at_the_padding_boundaries(key_len: int, header_len: int) -> None:
    # 38 fixed header bytes, 8 for one stripe's checksum and 26 for one 1-D group: a 4024-byte
    # key needs no padding at all.
    groups = [GroupSpec("int8", (5,))]
    parts = encode_chunk(b"x" * key_len, 1, groups, [b"12345"])
    assert len(parts[0]) == header_len == encoded_header_len(key_len, groups)
    assert check_encodable(b"x" * key_len, 1, groups) == header_len
    pad_len = header_len - 38 - 8 - 26 - key_len
    assert 0 <= pad_len < PAYLOAD_ALIGN
    assert struct.unpack_from("<I", parts[0], header_len - 20 - pad_len)[0] == pad_len
    assert parts[0][header_len - 16 - pad_len : header_len - 16] == bytes(pad_len)
    header, payloads = decode_chunk(b"".join(parts))
    assert header.header_len == header_len
    assert header.header_len % PAYLOAD_ALIGN == 0
    assert bytes(payloads[0]) == b"12345"


def test_encode_and_decode_are_zero_copy() -> None:
    groups = [GroupSpec("uint8", (16,)), GroupSpec("float32", (2, 2))]
    buffers = [bytearray(16), bytearray(16)]
    parts = encode_chunk(b"key", 1, groups, buffers)
    assert all(
        isinstance(p, memoryview) and p.obj is b for p, b in zip(parts[1:], buffers, strict=True)
    )

    data = bytearray(b"".join(parts))
    header, payloads = decode_chunk(data)
    data[header.header_len] = 0xFF
    assert payloads[0][0] == 0xFF  # a view into ``data``, not a copy


def test_payload_checksums_stream_over_buffers() -> None:
    parts: list[BytesLike] = [b"abc", memoryview(b"defgh"), bytearray(b"ij")]
    assert payload_checksums(parts) == (xxhash.xxh3_64_intdigest(b"abcdefghij"),)
    assert payload_checksums([]) == ()


@pytest.mark.parametrize("cuts", [(), (1,), (STRIPE_BYTES,), (STRIPE_BYTES - 1, STRIPE_BYTES + 5)])
@pytest.mark.parametrize("length", [STRIPE_BYTES, 2 * STRIPE_BYTES + 3])
def test_payload_checksums_are_per_stripe_wherever_the_pieces_end(
    length: int, cuts: tuple[int, ...]
) -> None:
    """Each stripe hashes on its own, whatever pieces the bytes arrive in."""
    payload = random.Random(length).randbytes(length)
    stripes = [payload[at : at + STRIPE_BYTES] for at in range(0, length, STRIPE_BYTES)]
    expected = tuple(xxhash.xxh3_64_intdigest(stripe) for stripe in stripes)
    bounds = [0, *(cut for cut in cuts if cut < length), length]
    hasher = PayloadHasher()
    for start, end in itertools.pairwise(bounds):
        hasher.update(memoryview(payload)[start:end])
    assert hasher.digests() == expected == payload_checksums([payload])
    assert len(expected) == stripe_count(length)


def test_a_flip_names_its_stripe() -> None:
    groups = [GroupSpec("uint8", (STRIPE_BYTES + 10,))]
    frame = bytearray(frame_bytes(b"k", 1, groups, random_buffers(groups, 3)))
    header = decode_header(frame)
    assert len(header.stripe_checksums) == 2
    frame[header.header_len + STRIPE_BYTES + 4] ^= 0x10
    with pytest.raises(CodecError, match="mismatch in stripe 1 "):
        decode_chunk(bytes(frame))
    lost = check_payload_checksums(header, [header.stripe_checksums[0], None])
    assert lost == "stripe 1 was not read in full"
    assert check_payload_checksums(header, list(header.stripe_checksums)) is None
    assert check_payload_checksums(header, [0]) == "payload of 1 stripes, the header vouches for 2"


def test_decode_accepts_typed_and_multidimensional_views() -> None:
    data, header = sample_frame()
    assert decode_chunk(memoryview(bytearray(data)))[0] == header
    even = bytearray(data + b"\0" * (len(data) % 2))
    assert decode_header(memoryview(even).cast("H")) == header
    assert decode_header(memoryview(even).cast("B", (2, len(even) // 2))) == header


# -- the dtype table ----------------------------------------------------------------------------
def test_dtype_table_matches_layout() -> None:
    assert set(DTYPE_CODES) == set(DTYPE_NAMES.values())
    for dtype, name in DTYPE_NAMES.items():
        assert DTYPE_ITEMSIZES[name] == dtype.itemsize
    assert len(set(DTYPE_CODES.values())) == len(DTYPE_CODES)
    assert 0 not in DTYPE_CODES.values()  # zeroed bytes never decode as a dtype


def test_codec_imports_no_torch() -> None:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(Path(codec.__file__).read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
    own = {name for name in modules if name.startswith("tiered_kv")}
    third_party = {name.split(".")[0] for name in modules - own} - set(sys.stdlib_module_names)
    assert own == {"tiered_kv.errors"}
    assert third_party <= {"xxhash", "__future__"}


# -- specs and limits ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        ("float64", (1,)),
        ("int8", ()),
        ("int8", (0,)),
        ("int8", (-1,)),
        ("int8", (True,)),
        ("int8", (2**64,)),
        ("int8", [1, 2]),
    ],
)
def test_group_spec_rejects(dtype: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(CodecError, match="GroupSpec"):
        GroupSpec(dtype, shape)


def test_group_spec_nbytes() -> None:
    assert GroupSpec("bfloat16", (2, 1, 3, 128)).nbytes == 2 * 3 * 128 * 2
    assert GroupSpec("int8", (1, 1, 5, 132)).nbytes == 5 * 132


@pytest.mark.parametrize(
    "fields",
    [
        {"max_header_bytes": MIN_HEADER_LEN - 1},
        {"max_header_bytes": 2**32},
        {"max_groups": 0},
        {"max_groups": 2**16},
        {"max_ndim": 256},
        {"max_key_bytes": -1},
        {"max_payload_bytes": 2**64},
        {"max_ndim": True},
    ],
)
def test_limits_reject(fields: dict[str, int]) -> None:
    with pytest.raises(CodecError, match="CodecLimits"):
        CodecLimits(**fields)


def test_encoder_refuses_what_the_decoder_would_refuse() -> None:
    small = CodecLimits(max_key_bytes=4, max_groups=2, max_ndim=2, max_payload_bytes=100)
    one = [GroupSpec("uint8", (4,))]
    with pytest.raises(CodecError, match="max_key_bytes"):
        encode_header(b"12345", 1, one, [0], limits=small)
    with pytest.raises(CodecError, match="max_groups"):
        encode_header(b"", 1, one * 3, [0], limits=small)
    with pytest.raises(CodecError, match="group count"):
        encode_header(b"", 1, [], [])
    with pytest.raises(CodecError, match="max_ndim"):
        encode_header(b"", 1, [GroupSpec("uint8", (1, 1, 1))], [0], limits=small)
    with pytest.raises(CodecError, match="max_payload_bytes"):
        encode_header(b"", 1, [GroupSpec("uint8", (101,))], [0], limits=small)
    with pytest.raises(CodecError, match="max_header_bytes"):
        # 4029 key bytes make the header 4097 bytes before padding, 8192 after
        encode_header(b"k" * 4029, 1, one, [0], limits=CodecLimits(max_header_bytes=MIN_HEADER_LEN))
    with pytest.raises(CodecError, match="num_tokens"):
        encode_header(b"", 2**32, one, [0])
    with pytest.raises(CodecError, match="stripe_checksums must be in"):
        encode_header(b"", 1, one, [2**64])
    with pytest.raises(CodecError, match="2 given, the payload has 1 stripes"):
        encode_header(b"", 1, one, [0, 0])


def test_encode_chunk_checks_buffers() -> None:
    groups = [GroupSpec("float16", (4,))]
    with pytest.raises(CodecError, match="1 groups"):
        encode_chunk(b"", 1, groups, [b"\0" * 8, b""])
    with pytest.raises(CodecError, match="needs 8"):
        encode_chunk(b"", 1, groups, [b"\0" * 7])
    strided = memoryview(bytearray(16))[::2]
    with pytest.raises(CodecError, match="C-contiguous"):
        encode_chunk(b"", 1, groups, [strided])


# -- hostile frames: refused before anything is sized by them -------------------------------
def test_huge_header_len_in_prefix_is_refused() -> None:
    prefix = struct.pack("<4sHHI", MAGIC, FORMAT_VERSION, 0, 2**32 - 1)
    with allocation_bound(), pytest.raises(CodecError, match="header_len"):
        header_length(prefix)
    with allocation_bound(), pytest.raises(CodecError, match="header_len"):
        decode_header(prefix + b"\0" * 100)


def test_huge_payload_claim_is_refused_before_allocation() -> None:
    header = raw_header(groups=[(7, (2**60,), 0, 2**60)])
    with allocation_bound(), pytest.raises(CodecError, match="max_payload_bytes"):
        decode_chunk(header)
    # Even with limits that allow it, a header too short for its stripes' checksums is refused.
    roomy = CodecLimits(max_payload_bytes=2**62)
    with allocation_bound(), pytest.raises(CodecError, match="cannot hold the 274877906944 stripe"):
        decode_header(header, roomy)
    # A claim the header can vouch for is only a short read.
    claim = raw_header(
        groups=[(7, (3 * STRIPE_BYTES,), 0, 3 * STRIPE_BYTES)], payload_sums=(1, 2, 3)
    )
    assert decode_header(claim).stripe_checksums == (1, 2, 3)
    with allocation_bound(), pytest.raises(CodecError, match="truncated payload"):
        decode_chunk(claim + b"\0" * 64)


def test_dims_overflowing_u64_product_are_refused() -> None:
    dims = (2**63, 2**63, 2**63, 2**63, 2**63, 2**63, 2**63, 2**63)
    header = raw_header(groups=[(3, dims, 0, 0)])
    with allocation_bound(), pytest.raises(CodecError, match="payload length"):
        decode_header(header)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"magic": b"TKVX"}, "bad magic"),
        ({"version": 1}, "unsupported format version 1; this build reads version 2"),
        ({"flags": 1}, "unknown flag bits"),
        ({"flags": 0x8000}, "unknown flag bits"),
        ({"header_len": MIN_HEADER_LEN - 1}, "header_len"),
        ({"key_len": 2**32 - 1}, "max_key_bytes"),
        ({"key_len": 4090}, "needs 4090 bytes"),
        ({"group_count": 0, "groups": ()}, "group_count 0"),
        ({"group_count": 65}, "group_count 65"),
        ({"group_count": 2}, "group 1"),
        ({"groups": [(0, (4,), 0, 4)]}, "unknown dtype code 0"),
        ({"groups": [(99, (4,), 0, 4)]}, "unknown dtype code 99"),
        ({"groups": [(7, (), 0, 0)]}, "ndim 0"),
        ({"groups": [(7, (1,) * 9, 0, 1)]}, "ndim 9"),
        ({"groups": [(7, (4, 0), 0, 0)]}, "zero dimension"),
        ({"groups": [(7, (4,), 1, 4)]}, "payload offset 1, expected 0"),
        ({"groups": [(7, (4,), 0, 4), (7, (4,), 5, 4)]}, "payload offset 5, expected 4"),
        ({"groups": [(1, (4,), 0, 4)]}, "payload length 4 but shape"),
        ({"extra": b"\0" * 3}, "pad_len .* disagrees with header_len"),
        ({"stripe_len": 1 << 20}, "stripe_len 1048576; this build reads stripes of 4194304"),
        ({"payload_sums": (0, 0)}, "disagrees with header_len .* the 1 stripe checksums"),
        ({"header_len": PAYLOAD_ALIGN + 1}, "not a multiple of PAYLOAD_ALIGN"),
        ({"pad_len": 0}, "pad_len 0 disagrees"),
        ({"pad_len": 4022}, "pad_len 4022 disagrees .* leaves 4023 bytes"),
        ({"pad_len": 2**32 - 1}, "disagrees with header_len"),
        ({"padding": bytes(4023 + PAYLOAD_ALIGN)}, "at most 4095 are ever needed"),
        ({"padding": b"\1" + bytes(4022)}, "padding byte 0 of 4023 is 0x01, must be zero"),
        ({"padding": bytes(4022) + b"\x80"}, "padding byte 4022 of 4023 is 0x80"),
    ],
)
def test_malformed_headers(fields: dict[str, object], message: str) -> None:
    data = raw_header(**fields)  # type: ignore[arg-type]
    with allocation_bound(), pytest.raises(CodecError, match=message):
        decode_header(data + b"\0" * 64)


def test_header_len_past_the_data_is_truncation() -> None:
    data = raw_header(header_len=2 * PAYLOAD_ALIGN)
    assert len(data) == PAYLOAD_ALIGN
    with pytest.raises(CodecError, match="truncated header"):
        decode_header(data)


def test_header_len_inconsistent_with_content_fails_checksum_or_parse() -> None:
    data = raw_header()
    lying = bytearray(data + bytes(PAYLOAD_ALIGN))
    struct.pack_into("<I", lying, 8, len(data) + PAYLOAD_ALIGN)
    with pytest.raises(CodecError, match="header checksum"):
        decode_header(bytes(lying))


def test_raw_header_helper_builds_what_the_encoder_builds() -> None:
    """So the hostile-header tests above start from a faithful frame."""
    groups = [GroupSpec("uint8", (4,))]
    assert raw_header(payload_sums=payload_checksums([b"abcd"])) == encode_header(
        b"k", 1, groups, payload_checksums([b"abcd"])
    )


@pytest.mark.parametrize("cut", [0, 1, PREFIX_LEN - 1, PREFIX_LEN, 40, -1])
def test_truncated_frames(cut: int) -> None:
    data, _ = sample_frame()
    with pytest.raises(CodecError, match="truncated"):
        decode_chunk(data[:cut])


def test_trailing_bytes_are_refused() -> None:
    data, _ = sample_frame()
    with pytest.raises(CodecError, match="trailing bytes"):
        decode_chunk(data + b"\0")


@pytest.mark.parametrize("value", [12345, "text", None, [1, 2]])
def test_non_buffers_are_codec_errors(value: object) -> None:
    with pytest.raises(CodecError, match="bytes-like"):
        decode_chunk(value)  # type: ignore[arg-type]


def test_non_contiguous_view_is_a_codec_error() -> None:
    data, _ = sample_frame()
    with pytest.raises(CodecError, match="C-contiguous"):
        decode_chunk(memoryview(data + data)[::2])


# -- fuzzing: nothing but CodecError, bounded allocation --------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes(data: bytes) -> None:
    assert only_codec_error(lambda: decode_chunk(data)) is not None


@settings(max_examples=300, deadline=None)
@given(header_len=st.integers(0, 2**32 - 1), rest=st.binary(max_size=600))
def test_random_bytes_after_a_valid_prefix(header_len: int, rest: bytes) -> None:
    data = struct.pack("<4sHHI", MAGIC, FORMAT_VERSION, 0, header_len) + rest
    assert only_codec_error(lambda: decode_chunk(data)) is not None


extreme_values = st.sampled_from([0, 1, 255, 2**16 - 1, 2**31, 2**32 - 1, 2**60, 2**64 - 1])
mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 16)),
    st.tuples(st.just("u32"), st.integers(0, 10**6), extreme_values),
    st.tuples(st.just("u64"), st.integers(0, 10**6), extreme_values),
)


def mutate(data: bytearray, kind: str, where: int, value: int) -> None:
    pos = where % (len(data) + 1)
    if kind == "flip" and pos < len(data):
        data[pos] ^= 1 << value
    elif kind == "truncate":
        del data[pos:]
    elif kind == "insert":
        data[pos:pos] = bytes([value])
    elif kind == "delete":
        del data[pos : pos + value]
    elif kind == "u32" and pos + 4 <= len(data):
        struct.pack_into("<I", data, pos, value % 2**32)
    elif kind == "u64" and pos + 8 <= len(data):
        struct.pack_into("<Q", data, pos, value)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutations, min_size=1, max_size=4), st.booleans())
def test_mutated_frames(ops: list[tuple[str, int, int]], fix_checksum: bool) -> None:
    original, header = sample_frame()
    data = bytearray(original)
    for op in ops:
        mutate(data, *op)
    if fix_checksum and len(data) >= header.header_len:
        # Re-seal the header so that the structural checks, not the checksum, must catch lies.
        end = header.header_len - 8
        struct.pack_into("<Q", data, end, xxhash.xxh3_64_intdigest(bytes(data[:end])))
    frame = bytes(data)
    if only_codec_error(lambda: decode_chunk(frame)) is not None:
        return
    if not fix_checksum:
        assert frame == original
    # A re-sealed header may pass; then the frame must be exactly what the encoder writes.
    decoded, payloads = decode_chunk(frame)
    assert frame == frame_bytes(decoded.key_bytes, decoded.num_tokens, decoded.groups, payloads)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_payload_bit_flip_is_caught(data: st.DataObject) -> None:
    frame, header = sample_frame()
    bit = data.draw(st.integers(header.header_len * 8, len(frame) * 8 - 1))
    damaged = bytearray(frame)
    damaged[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CodecError, match="payload checksum mismatch"):
        decode_chunk(bytes(damaged))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_header_bit_flip_is_caught(data: st.DataObject) -> None:
    frame, header = sample_frame()
    bit = data.draw(st.integers(0, header.header_len * 8 - 1))
    damaged = bytearray(frame)
    damaged[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CodecError):
        decode_chunk(bytes(damaged))


@settings(max_examples=100, deadline=None)
@given(groups=st.lists(group_specs, min_size=1, max_size=4), cut=st.integers(1, 10**6))
def test_every_truncation_is_caught(groups: list[GroupSpec], cut: int) -> None:
    frame = frame_bytes(b"key", 9, groups, random_buffers(groups, cut))
    assume(cut % len(frame) != 0)
    with pytest.raises(CodecError, match="truncated"):
        decode_chunk(frame[: cut % len(frame)])


def test_limits_are_enforced_on_decode() -> None:
    groups = [GroupSpec("uint8", (3, 3, 3))] * 3
    frame = frame_bytes(b"key-bytes", 1, groups, random_buffers(groups, 1))
    assert decode_chunk(frame)[0].groups == tuple(groups)
    for limits, message in [
        (CodecLimits(max_key_bytes=8), "max_key_bytes"),
        (CodecLimits(max_groups=2), "max_groups"),
        (CodecLimits(max_ndim=2), "max_ndim"),
        (CodecLimits(max_payload_bytes=80), "max_payload_bytes"),
    ]:
        with pytest.raises(CodecError, match=message):
            decode_chunk(frame, limits)
    long_key = frame_bytes(b"k" * 4029, 1, groups, random_buffers(groups, 1))
    assert decode_header(long_key).header_len == 2 * PAYLOAD_ALIGN
    with pytest.raises(CodecError, match="max_header_bytes"):
        decode_chunk(long_key, CodecLimits(max_header_bytes=2 * PAYLOAD_ALIGN - 1))
    assert CodecLimits() == DEFAULT_LIMITS
