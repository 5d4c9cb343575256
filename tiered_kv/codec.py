"""The self-describing, versioned binary format of one chunk (L2 files, L3 frames).

Owns encoding and decoding chunk frames, their limits and their checksums. Must not import torch
or know about memory objects: key bytes are opaque here, and glue from layouts to `GroupSpec`s
lives with the tiers. Decoding never trusts a length: every length is checked against
`CodecLimits` and against the bytes at hand before anything is sized by it, so a hostile or
truncated frame costs nothing. Every malformed input raises `CodecError`, nothing else.

Frame layout, little-endian::

    prefix   magic b"TKVC" | version u16 | flags u16 | header_len u32 (whole header, padding
             included; a multiple of PAYLOAD_ALIGN)
    header   key_len u32 | key bytes | num_tokens u32 | group_count u16
             per group: dtype code u8 | ndim u8 | dims u64 x ndim | offset u64 | length u64
             stripe_len u32 (`STRIPE_BYTES`)
             pad_len u32 | pad_len zero bytes
             stripe checksums u64 x ceil(payload length / stripe_len) (xxh3-64 of each stripe)
             header_checksum u64 (xxh3-64 over every header byte before it, padding included)
    payload  the groups' bytes back to back, logical sizes only, from byte header_len

The padding puts the payload at a multiple of `PAYLOAD_ALIGN` bytes into a file, so reads and
writes of it move whole pages between page-aligned buffers and page-aligned file offsets (a
misaligned page-cache copy is markedly slower). It sits before the checksums so that the header
checksum stays in the header's last 8 bytes and is verified before any field is parsed.
``pad_len`` is the smallest that aligns the payload (``< PAYLOAD_ALIGN``) and every padding
byte is zero: decoders refuse anything else, so a frame has exactly one encoding.

The payload is checksummed in stripes of `STRIPE_BYTES` (the last one shorter), each on its own:
a reader may fetch and verify the stripes of one chunk on several threads at once, in any order.
Stripes start page-aligned in a file (``STRIPE_BYTES`` is a multiple of `PAYLOAD_ALIGN`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import xxhash

from tiered_kv.errors import CodecError

MAGIC = b"TKVC"
FORMAT_VERSION = 2
KNOWN_FLAGS = 0
"""Flag bits this version understands (none yet); any other bit makes a frame unreadable."""

_PREFIX = struct.Struct("<4sHHI")
_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_GROUP_HEAD = struct.Struct("<BB")
_CHECKSUM_LEN = _U64.size

PREFIX_LEN = _PREFIX.size
"""Bytes needed by `header_length` to learn a frame's header length."""

PAYLOAD_ALIGN = 4096
"""The payload starts at a multiple of this many bytes into the frame (the header is padded)."""

_UNPADDED_MIN_LEN = (
    PREFIX_LEN + _U32.size + _U32.size + _U16.size + _U32.size + _U32.size + _CHECKSUM_LEN
)
"""Header bytes besides the key, the groups, the padding and the stripe checksums."""

MIN_HEADER_LEN = PAYLOAD_ALIGN
"""No header is shorter: header lengths are positive multiples of `PAYLOAD_ALIGN`."""

STRIPE_BYTES = 4 << 20
"""Bytes per checksummed stripe of a payload (the last stripe may be shorter)."""


def stripe_count(payload_len: int) -> int:
    """Stripes of a payload of ``payload_len`` bytes."""
    return -(-payload_len // STRIPE_BYTES)


@dataclasses.dataclass(frozen=True, slots=True)
class DTypeInfo:
    """A KV dtype as frames store it: its code in the header and its size in bytes."""

    code: int
    itemsize: int


DTYPES: Mapping[str, DTypeInfo] = MappingProxyType(
    {
        "bfloat16": DTypeInfo(1, 2),
        "float16": DTypeInfo(2, 2),
        "float32": DTypeInfo(3, 4),
        "float8_e4m3fn": DTypeInfo(4, 1),
        "float8_e5m2": DTypeInfo(5, 1),
        "int8": DTypeInfo(6, 1),
        "uint8": DTypeInfo(7, 1),
    }
)
"""The one table of KV dtypes (names as torch spells them): a new dtype is one entry here;
`tiered_kv.layout` accepts exactly these. Codes are never reused or 0."""
DTYPE_CODES: Mapping[str, int] = MappingProxyType({n: d.code for n, d in DTYPES.items()})
DTYPE_ITEMSIZES: Mapping[str, int] = MappingProxyType({n: d.itemsize for n, d in DTYPES.items()})
_DTYPES_BY_CODE = {code: name for name, code in DTYPE_CODES.items()}

BytesLike = bytes | bytearray | memoryview
"""What the codec reads from: any C-contiguous buffer of these types (never copied)."""

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1


@dataclasses.dataclass(frozen=True, slots=True)
class CodecLimits:
    """Upper bounds a decoder enforces before it sizes anything by a length read from a frame."""

    max_header_bytes: int = 65536
    max_key_bytes: int = 4096
    max_groups: int = 64
    max_ndim: int = 8
    max_payload_bytes: int = 1 << 34

    def __post_init__(self) -> None:
        bounds = {
            "max_header_bytes": (MIN_HEADER_LEN, _U32_MAX),
            "max_key_bytes": (0, _U32_MAX),
            "max_groups": (1, 0xFFFF),
            "max_ndim": (1, 0xFF),
            "max_payload_bytes": (0, _U64_MAX),
        }
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise CodecError(
                    f"CodecLimits.{name} must be an int in [{low}, {high}], got {value!r}"
                )


DEFAULT_LIMITS = CodecLimits()


@dataclasses.dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group of a chunk: a dense C-order array of ``dtype`` with ``shape``."""

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise CodecError(
                f"GroupSpec.dtype {self.dtype!r} is not supported; supported: "
                f"{', '.join(DTYPE_CODES)}"
            )
        if not isinstance(self.shape, tuple) or not self.shape:
            raise CodecError(f"GroupSpec.shape must be a non-empty tuple, got {self.shape!r}")
        for dim in self.shape:
            if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= _U64_MAX:
                raise CodecError(
                    f"GroupSpec.shape dims must be ints in [1, 2**64), got {self.shape}"
                )

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZES[self.dtype]


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkHeader:
    """A decoded header: what the frame holds and how long it is.

    ``header_len`` counts the padding: the payload starts there, a multiple of `PAYLOAD_ALIGN`.
    """

    key_bytes: bytes
    num_tokens: int
    groups: tuple[GroupSpec, ...]
    stripe_checksums: tuple[int, ...]  # xxh3-64 of each `STRIPE_BYTES` stripe of the payload
    header_len: int

    @property
    def payload_len(self) -> int:
        return sum(group.nbytes for group in self.groups)

    @property
    def total_len(self) -> int:
        """Bytes of the whole frame: header plus payload."""
        return self.header_len + self.payload_len

    @property
    def group_offsets(self) -> tuple[int, ...]:
        """Where each group starts, relative to the payload start."""
        offsets = []
        position = 0
        for group in self.groups:
            offsets.append(position)
            position += group.nbytes
        return tuple(offsets)


def _byte_view(data: BytesLike, what: str = "data") -> memoryview:
    """A flat unsigned-byte view of ``data`` without copying."""
    try:
        view = memoryview(data)
    except TypeError:
        raise CodecError(
            f"{what}: expected a bytes-like object, got {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise CodecError(f"{what}: buffer must be C-contiguous")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


class _Reader:
    """Bounds-checked little-endian reads from a header view (no struct.error escapes)."""

    __slots__ = ("_view", "pos", "_end")

    def __init__(self, view: memoryview, pos: int, end: int) -> None:
        self._view = view
        self.pos = pos
        self._end = end

    def _need(self, size: int, field: str) -> None:
        if size > self._end - self.pos:
            raise CodecError(
                f"header: field {field} at byte {self.pos} needs {size} bytes but the header "
                f"ends at byte {self._end}"
            )

    def unpack(self, fmt: struct.Struct, field: str) -> int:
        self._need(fmt.size, field)
        (value,) = fmt.unpack_from(self._view, self.pos)
        self.pos += fmt.size
        return int(value)

    def take(self, size: int, field: str) -> memoryview:
        self._need(size, field)
        chunk = self._view[self.pos : self.pos + size]
        self.pos += size
        return chunk


def header_length(prefix: BytesLike, limits: CodecLimits = DEFAULT_LIMITS) -> int:
    """The whole header's length, from a frame's first `PREFIX_LEN` bytes (checked, not trusted)."""
    view = _byte_view(prefix, "prefix")
    if len(view) < PREFIX_LEN:
        raise CodecError(f"truncated prefix: need {PREFIX_LEN} bytes, got {len(view)}")
    magic, version, flags, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CodecError(
            f"unsupported format version {version}; this build reads version {FORMAT_VERSION}"
        )
    if flags & ~KNOWN_FLAGS:
        raise CodecError(f"unknown flag bits {flags & ~KNOWN_FLAGS:#06x} in flags {flags:#06x}")
    if not MIN_HEADER_LEN <= header_len <= limits.max_header_bytes:
        raise CodecError(
            f"header_len {header_len} outside [{MIN_HEADER_LEN}, "
            f"max_header_bytes={limits.max_header_bytes}]"
        )
    if header_len % PAYLOAD_ALIGN:
        raise CodecError(
            f"header_len {header_len} is not a multiple of PAYLOAD_ALIGN={PAYLOAD_ALIGN}"
        )
    return int(header_len)


def _unpadded_header_len(key_len: int, groups: Sequence[GroupSpec]) -> int:
    per_group = sum(_GROUP_HEAD.size + _U64.size * (len(g.shape) + 2) for g in groups)
    stripes = stripe_count(sum(g.nbytes for g in groups))
    return _UNPADDED_MIN_LEN + key_len + per_group + _CHECKSUM_LEN * stripes


def encoded_header_len(key_len: int, groups: Sequence[GroupSpec]) -> int:
    """Length `encode_header` will produce for a key of ``key_len`` bytes and ``groups``.

    It is where the payload starts, a multiple of `PAYLOAD_ALIGN`.
    """
    unpadded = _unpadded_header_len(key_len, groups)
    return -(-unpadded // PAYLOAD_ALIGN) * PAYLOAD_ALIGN


def check_encodable(
    key_bytes: bytes,
    num_tokens: int,
    groups: Sequence[GroupSpec],
    limits: CodecLimits = DEFAULT_LIMITS,
) -> int:
    """Refuse to write what `decode_header` with the same limits would refuse to read.

    Returns the header's length. For writers that stream the payload before they know its
    checksums: check first, write the payload at this offset, then `encode_header`.
    """
    if len(key_bytes) > limits.max_key_bytes:
        raise CodecError(f"key is {len(key_bytes)} bytes, max_key_bytes={limits.max_key_bytes}")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise CodecError(f"num_tokens must be an int, got {num_tokens!r}")
    if not 0 <= num_tokens <= _U32_MAX:
        raise CodecError(f"num_tokens must be in [0, 2**32), got {num_tokens}")
    if not 1 <= len(groups) <= limits.max_groups:
        raise CodecError(f"group count {len(groups)} outside [1, max_groups={limits.max_groups}]")
    for index, group in enumerate(groups):
        if not isinstance(group, GroupSpec):
            raise CodecError(f"group {index}: expected a GroupSpec, got {type(group).__name__}")
        if len(group.shape) > limits.max_ndim:
            raise CodecError(
                f"group {index}: ndim {len(group.shape)} exceeds max_ndim={limits.max_ndim}"
            )
    payload_len = sum(g.nbytes for g in groups)
    if payload_len > limits.max_payload_bytes:
        raise CodecError(
            f"payload of {payload_len} bytes exceeds max_payload_bytes={limits.max_payload_bytes}"
        )
    header_len = encoded_header_len(len(key_bytes), groups)
    if header_len > limits.max_header_bytes:
        raise CodecError(
            f"header of {header_len} bytes exceeds max_header_bytes={limits.max_header_bytes}"
        )
    return header_len


def encode_header(
    key_bytes: bytes,
    num_tokens: int,
    groups: Sequence[GroupSpec],
    stripe_checksums: Sequence[int],
    *,
    limits: CodecLimits = DEFAULT_LIMITS,
) -> bytes:
    """The header of a frame holding ``groups`` (payload bytes not included), whose payload
    hashes to ``stripe_checksums`` (`payload_checksums`, or a `PayloadHasher`'s digests)."""
    template = header_template(key_bytes, num_tokens, groups, limits=limits)
    if len(stripe_checksums) != template.stripes:
        raise CodecError(
            f"stripe_checksums: {len(stripe_checksums)} given, the payload has "
            f"{template.stripes} stripes"
        )
    for checksum in stripe_checksums:
        if isinstance(checksum, bool) or not isinstance(checksum, int):
            raise CodecError(f"stripe_checksums must be ints, got {checksum!r}")
        if not 0 <= checksum <= _U64_MAX:
            raise CodecError(f"stripe_checksums must be in [0, 2**64), got {checksum}")
    return seal_header(template, stripe_checksums)


@dataclasses.dataclass(frozen=True, slots=True)
class HeaderTemplate:
    """A header whose stripe checksums are not known yet: ``data`` with zeros where the
    ``stripes`` checksums go (u64 each, from ``checksums_at``) and where the header checksum
    goes (its last 8 bytes). `seal_header` fills both; a writer outside this process (an I/O
    worker, `tiered_kv.io.worker`) does the same with the same two steps."""

    data: bytes
    checksums_at: int
    stripes: int


def header_template(
    key_bytes: bytes,
    num_tokens: int,
    groups: Sequence[GroupSpec],
    *,
    limits: CodecLimits = DEFAULT_LIMITS,
) -> HeaderTemplate:
    """The header of a frame holding ``groups``, all but its checksums (`HeaderTemplate`);
    refuses what `check_encodable` refuses."""
    key_bytes = bytes(key_bytes)
    header_len = check_encodable(key_bytes, num_tokens, groups, limits)
    stripes = stripe_count(sum(g.nbytes for g in groups))
    pad_len = header_len - _unpadded_header_len(len(key_bytes), groups)
    parts = [
        _PREFIX.pack(MAGIC, FORMAT_VERSION, KNOWN_FLAGS, header_len),
        _U32.pack(len(key_bytes)),
        key_bytes,
        _U32.pack(num_tokens),
        _U16.pack(len(groups)),
    ]
    offset = 0
    for group in groups:
        parts.append(_GROUP_HEAD.pack(DTYPE_CODES[group.dtype], len(group.shape)))
        parts.append(struct.pack(f"<{len(group.shape)}Q", *group.shape))
        parts.append(struct.pack("<QQ", offset, group.nbytes))
        offset += group.nbytes
    parts.append(_U32.pack(STRIPE_BYTES))
    parts.append(_U32.pack(pad_len))
    parts.append(bytes(pad_len))
    checksums_at = sum(len(part) for part in parts)
    parts.append(bytes(_U64.size * stripes + _CHECKSUM_LEN))
    return HeaderTemplate(b"".join(parts), checksums_at, stripes)


def seal_header(template: HeaderTemplate, stripe_checksums: Sequence[int]) -> bytes:
    """``template`` with its stripe checksums and then its header checksum filled in."""
    header = bytearray(template.data)
    struct.pack_into(f"<{template.stripes}Q", header, template.checksums_at, *stripe_checksums)
    checked_end = len(header) - _CHECKSUM_LEN
    _U64.pack_into(header, checked_end, xxhash.xxh3_64_intdigest(memoryview(header)[:checked_end]))
    return bytes(header)


def decode_header(data: BytesLike, limits: CodecLimits = DEFAULT_LIMITS) -> ChunkHeader:
    """Parse and verify the header at the start of ``data`` (which may hold more than it)."""
    view = _byte_view(data)
    header_len = header_length(view[:PREFIX_LEN], limits)
    if len(view) < header_len:
        raise CodecError(f"truncated header: header_len is {header_len}, got {len(view)} bytes")
    checked_end = header_len - _CHECKSUM_LEN
    header = view[:header_len]
    (stored,) = _U64.unpack_from(header, checked_end)
    computed = xxhash.xxh3_64_intdigest(header[:checked_end])
    if stored != computed:
        raise CodecError(
            f"header checksum mismatch: stored {stored:#018x}, computed {computed:#018x}"
        )

    reader = _Reader(header, PREFIX_LEN, checked_end)
    key_len = reader.unpack(_U32, "key_len")
    if key_len > limits.max_key_bytes:
        raise CodecError(f"key_len {key_len} exceeds max_key_bytes={limits.max_key_bytes}")
    key_bytes = bytes(reader.take(key_len, "key"))
    num_tokens = reader.unpack(_U32, "num_tokens")
    group_count = reader.unpack(_U16, "group_count")
    if not 1 <= group_count <= limits.max_groups:
        raise CodecError(f"group_count {group_count} outside [1, max_groups={limits.max_groups}]")
    groups = []
    expected_offset = 0
    for index in range(group_count):
        code = reader.unpack(_U8, f"group {index} dtype")
        dtype = _DTYPES_BY_CODE.get(code)
        if dtype is None:
            raise CodecError(
                f"group {index}: unknown dtype code {code}; known: {sorted(_DTYPES_BY_CODE)}"
            )
        ndim = reader.unpack(_U8, f"group {index} ndim")
        if not 1 <= ndim <= limits.max_ndim:
            raise CodecError(f"group {index}: ndim {ndim} outside [1, max_ndim={limits.max_ndim}]")
        shape = tuple(reader.unpack(_U64, f"group {index} dim {axis}") for axis in range(ndim))
        if 0 in shape:
            raise CodecError(f"group {index}: zero dimension in shape {shape}")
        offset = reader.unpack(_U64, f"group {index} offset")
        length = reader.unpack(_U64, f"group {index} length")
        if offset != expected_offset:
            raise CodecError(
                f"group {index}: payload offset {offset}, expected {expected_offset} (groups "
                "must be back to back)"
            )
        nbytes = math.prod(shape) * DTYPE_ITEMSIZES[dtype]
        if length != nbytes:
            raise CodecError(
                f"group {index}: payload length {length} but shape {shape} of {dtype} is "
                f"{nbytes} bytes"
            )
        expected_offset += length
        if expected_offset > limits.max_payload_bytes:
            raise CodecError(
                f"payload of at least {expected_offset} bytes exceeds "
                f"max_payload_bytes={limits.max_payload_bytes}"
            )
        groups.append(GroupSpec(dtype, shape))
    stripe_len = reader.unpack(_U32, "stripe_len")
    if stripe_len != STRIPE_BYTES:
        raise CodecError(
            f"header: stripe_len {stripe_len}; this build reads stripes of {STRIPE_BYTES} bytes"
        )
    stripes = stripe_count(expected_offset)
    pad_len = reader.unpack(_U32, "pad_len")
    room = checked_end - _CHECKSUM_LEN * stripes - reader.pos
    if room < 0:
        raise CodecError(
            f"header: header_len {header_len} cannot hold the {stripes} stripe checksums of a "
            f"{expected_offset}-byte payload"
        )
    if pad_len != room:
        raise CodecError(
            f"header: pad_len {pad_len} disagrees with header_len {header_len}, which leaves "
            f"{room} bytes between the pad_len field and the {stripes} stripe checksums"
        )
    if pad_len >= PAYLOAD_ALIGN:
        raise CodecError(
            f"header: {pad_len} bytes of padding, but at most {PAYLOAD_ALIGN - 1} are ever "
            "needed to align the payload"
        )
    padding = bytes(reader.take(pad_len, "padding"))
    if padding != bytes(pad_len):
        first = next(index for index, value in enumerate(padding) if value)
        raise CodecError(
            f"header: padding byte {first} of {pad_len} is {padding[first]:#04x}, must be zero"
        )
    checksums = tuple(reader.unpack(_U64, f"stripe {index} checksum") for index in range(stripes))
    return ChunkHeader(key_bytes, num_tokens, tuple(groups), checksums, header_len)


class FrameCheck(enum.Enum):
    """What a reader makes of a frame it fetched for a key (see `check_frame_header`)."""

    OK = "ok"
    OTHER_KEY = "the frame holds another key"
    OTHER_LAYOUT = "the frame holds another layout or token count"
    CORRUPT = "corrupt"


def check_frame_header(
    header: ChunkHeader,
    *,
    key_bytes: bytes,
    num_tokens: int,
    groups: Sequence[GroupSpec],
    frame_len: int,
) -> tuple[FrameCheck, str]:
    """Whether a decoded header is the frame a reader asked for, before any payload byte is
    trusted: its length (``frame_len``, the bytes stored) first, then the key, then the layout.
    Returns the verdict and a message for logs ("" when OK). Shared by L2 and L3."""
    if frame_len != header.total_len:
        return FrameCheck.CORRUPT, f"frame is {frame_len} bytes, header says {header.total_len}"
    if header.key_bytes != key_bytes:
        return FrameCheck.OTHER_KEY, FrameCheck.OTHER_KEY.value
    if header.num_tokens != num_tokens or header.groups != tuple(groups):
        return FrameCheck.OTHER_LAYOUT, (
            f"frame has {header.num_tokens} tokens {header.groups}, wanted {num_tokens} tokens "
            f"{tuple(groups)}"
        )
    return FrameCheck.OK, ""


def check_payload_checksums(header: ChunkHeader, computed: Sequence[int | None]) -> str | None:
    """None when the payload whose stripes hashed to ``computed`` is the one the header vouches
    for; else what is wrong (the frame is corrupt). A None stripe was never read in full."""
    if len(computed) != len(header.stripe_checksums):
        return (
            f"payload of {len(computed)} stripes, the header vouches for "
            f"{len(header.stripe_checksums)}"
        )
    for index, (stored, got) in enumerate(zip(header.stripe_checksums, computed, strict=True)):
        if got is None:
            return f"stripe {index} was not read in full"
        if got != stored:
            return (
                f"payload checksum mismatch in stripe {index} (bytes {index * STRIPE_BYTES} to "
                f"{min((index + 1) * STRIPE_BYTES, header.payload_len)}): header {stored:#018x}, "
                f"data {got:#018x}"
            )
    return None


class PayloadHasher:
    """Streams a payload's bytes, in order and in pieces of any size, into its stripe checksums
    (`digests`); nothing is copied or concatenated."""

    __slots__ = ("_state", "_room", "_digests")

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()
        self._room = STRIPE_BYTES  # bytes left in the current stripe
        self._digests: list[int] = []

    def update(self, data: BytesLike, /) -> None:
        view = _byte_view(data, "data")
        while len(view) >= self._room:
            self._state.update(view[: self._room])
            view = view[self._room :]
            self._digests.append(self._state.intdigest())
            self._state.reset()
            self._room = STRIPE_BYTES
        if view:
            self._state.update(view)
            self._room -= len(view)

    def digests(self) -> tuple[int, ...]:
        """The checksums of the stripes seen so far, the last (shorter) one included."""
        if self._room == STRIPE_BYTES:
            return tuple(self._digests)
        return (*self._digests, self._state.intdigest())


def payload_checksums(buffers: Iterable[BytesLike]) -> tuple[int, ...]:
    """The stripe checksums of the buffers' bytes in order, streamed (nothing concatenated)."""
    hasher = PayloadHasher()
    for index, buffer in enumerate(buffers):
        hasher.update(_byte_view(buffer, f"buffer {index}"))
    return hasher.digests()


def encode_chunk(
    key_bytes: bytes,
    num_tokens: int,
    groups: Sequence[GroupSpec],
    buffers: Sequence[BytesLike],
    *,
    limits: CodecLimits = DEFAULT_LIMITS,
) -> list[bytes | memoryview]:
    """A whole frame as parts to write in order: the header, then each buffer (not copied)."""
    if len(buffers) != len(groups):
        raise CodecError(f"{len(buffers)} buffers for {len(groups)} groups")
    views = [_byte_view(buffer, f"buffer {i}") for i, buffer in enumerate(buffers)]
    for index, (group, view) in enumerate(zip(groups, views, strict=True)):
        if not isinstance(group, GroupSpec):
            raise CodecError(f"group {index}: expected a GroupSpec, got {type(group).__name__}")
        if view.nbytes != group.nbytes:
            raise CodecError(
                f"buffer {index} has {view.nbytes} bytes, group {group} needs {group.nbytes}"
            )
    header = encode_header(key_bytes, num_tokens, groups, payload_checksums(views), limits=limits)
    return [header, *views]


def decode_chunk(
    data: BytesLike, limits: CodecLimits = DEFAULT_LIMITS
) -> tuple[ChunkHeader, list[memoryview]]:
    """Verify a whole frame; returns its header and zero-copy views of each group's payload."""
    view = _byte_view(data)
    header = decode_header(view, limits)
    if len(view) != header.total_len:
        problem = "truncated payload" if len(view) < header.total_len else "trailing bytes"
        raise CodecError(f"{problem}: frame is {len(view)} bytes, header says {header.total_len}")
    start = header.header_len
    payloads = [
        view[start + offset : start + offset + group.nbytes]
        for offset, group in zip(header.group_offsets, header.groups, strict=True)
    ]
    mismatch = check_payload_checksums(header, payload_checksums(payloads))
    if mismatch is not None:
        raise CodecError(mismatch)
    return header, payloads
