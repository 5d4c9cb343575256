"""Chunk keys and prefix-chained chunk hashing.

A `KeyScope` names one model shard's cache (tenant namespace, model, fingerprint, world size,
worker, layout id). A `ChunkKey` is a scope plus `chunk_hash`, where
``h_i = xxh3_128(h_{i-1} || tokens_i)`` and ``h_{-1}`` is derived from the scope's bytes and the
chunk size. Because the chain is seeded by the scope, two tenants, fingerprints or layouts never
produce the same chunk hash, so tiers may index by ``chunk_hash`` alone; the full key bytes travel
in every stored frame and are compared on read.

A request whose KV depends on more than its tokens (a cache salt, a LoRA adapter, an image) gives
a `KeySalt`: marks at token offsets, each folded into the chain value entering the chunk that
holds its offset, so that chunk and every later one hash differently, and earlier ones do not.
"""

from __future__ import annotations

import array
import dataclasses
import struct
import sys
from collections.abc import Sequence
from typing import Any

import xxhash

from tiered_kv.errors import CodecError, LayoutError

KEY_FORMAT_VERSION = 1
HASH_BYTES = 16
_NO_LAYER = 0xFFFFFFFF
_MAX_FIELD = 1024

TokenIds = Sequence[int] | Any  # list/tuple of ints, or a 1-D int tensor / array (buffer fast path)


@dataclasses.dataclass(frozen=True, slots=True)
class KeyScope:
    """Everything a chunk key shares across one model shard's cache."""

    namespace: str
    model: str
    fingerprint: str
    world_size: int
    worker_id: int
    layout_id: str

    def __post_init__(self) -> None:
        for name in ("namespace", "model", "fingerprint", "layout_id"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"KeyScope.{name}: expected str, got {value!r}")
            if len(value.encode()) > _MAX_FIELD:
                raise ValueError(f"KeyScope.{name}: longer than {_MAX_FIELD} bytes")
        if not self.model:
            raise ValueError("KeyScope.model: must not be empty")
        if not 1 <= self.world_size <= 0xFFFFFFFF:
            raise ValueError(f"KeyScope.world_size: must be in [1, 2**32), got {self.world_size}")
        if not 0 <= self.worker_id < self.world_size:
            raise ValueError(
                f"KeyScope.worker_id: must be in [0, world_size={self.world_size}), "
                f"got {self.worker_id}"
            )

    def to_bytes(self) -> bytes:
        parts = [struct.pack("<B", KEY_FORMAT_VERSION)]
        for text in (self.namespace, self.model, self.fingerprint, self.layout_id):
            raw = text.encode()
            parts.append(struct.pack("<H", len(raw)))
            parts.append(raw)
        parts.append(struct.pack("<II", self.world_size, self.worker_id))
        return b"".join(parts)

    def chain_seed(self, chunk_size: int) -> bytes:
        return xxhash.xxh3_128_digest(self.to_bytes() + struct.pack("<I", chunk_size))


@dataclasses.dataclass(frozen=True, slots=True)
class KeySalt:
    """What changes a request's KV beyond its token ids: ``marks`` of (token offset, bytes).

    A mark enters the hash of the chunk holding its offset, and through the chain every later
    chunk: a request-wide salt (a cache salt, a LoRA adapter) is a mark at offset 0; an image
    is a mark at its placeholder's first token, so the text before it shares chunks with other
    requests. Marks are kept sorted; marks past a sequence's end do not change its keys."""

    marks: tuple[tuple[int, bytes], ...]

    def __post_init__(self) -> None:
        marks = []
        for mark in self.marks:
            if not (isinstance(mark, tuple) and len(mark) == 2):
                raise TypeError(f"KeySalt.marks: expected (offset, bytes) pairs, got {mark!r}")
            offset, data = mark
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(f"KeySalt.marks: offset must be an int >= 0, got {offset!r}")
            if not isinstance(data, bytes):
                raise TypeError(f"KeySalt.marks: data must be bytes, got {type(data).__name__}")
            marks.append((offset, data))
        object.__setattr__(self, "marks", tuple(sorted(marks)))

    @classmethod
    def of(cls, *marks: tuple[int, bytes]) -> KeySalt | None:
        """A salt of these marks, or None when there is none (the unsalted keys)."""
        return cls(tuple(marks)) if marks else None

    def to_wire(self) -> list[list[int | str]]:
        """JSON-able form (offsets and hex data), inverse of `from_wire`."""
        return [[offset, data.hex()] for offset, data in self.marks]

    @classmethod
    def from_wire(cls, wire: Any) -> KeySalt | None:
        """Parse `to_wire`'s form (None or [] for no salt); raises ValueError on anything else."""
        if wire is None or wire == []:
            return None
        if not isinstance(wire, list):
            raise ValueError(f"salt: expected a list of [offset, hex], got {type(wire).__name__}")
        try:
            marks = tuple((int(offset), bytes.fromhex(data)) for offset, data in wire)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"salt: malformed mark ({exc})") from None
        return cls(marks)


def _salted(prev: bytes, marks: Sequence[tuple[int, bytes]], start: int) -> bytes:
    """The chain value entering a chunk starting at ``start`` that holds ``marks``: a hash of the
    previous value and the marks (offsets relative to the chunk, lengths framed), which no
    unsalted chain value equals short of a 128-bit collision."""
    state = xxhash.xxh3_128(b"tiered-kv salt\0")
    state.update(prev)
    for offset, data in marks:
        state.update(struct.pack("<QQ", offset - start, len(data)))
        state.update(data)
    return state.digest()


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class ChunkKey:
    """The KV of one chunk (``layer is None``) or of one layer of it, for one model shard."""

    scope: KeyScope
    chunk_hash: bytes
    layer: int | None = None
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.chunk_hash) != HASH_BYTES:
            raise ValueError(f"chunk_hash must be {HASH_BYTES} bytes, got {len(self.chunk_hash)}")
        if self.layer is not None and not 0 <= self.layer < _NO_LAYER:
            raise ValueError(f"layer must be in [0, {_NO_LAYER}), got {self.layer}")
        # Keys are hashed on every tier lookup: compute once.
        object.__setattr__(self, "_hash", hash((self.chunk_hash, self.layer)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, ChunkKey):
            return NotImplemented
        return (
            self.chunk_hash == other.chunk_hash
            and self.layer == other.layer
            and (self.scope is other.scope or self.scope == other.scope)
        )

    def with_layer(self, layer: int) -> ChunkKey:
        """The key of one layer of this chunk (layerwise mode)."""
        return ChunkKey(self.scope, self.chunk_hash, layer)

    @property
    def hex(self) -> str:
        """Stable name for files and remote keys: derived from hashes only."""
        text = self.chunk_hash.hex()
        return text if self.layer is None else f"{text}-l{self.layer}"

    def to_bytes(self) -> bytes:
        layer = _NO_LAYER if self.layer is None else self.layer
        return self.scope.to_bytes() + self.chunk_hash + struct.pack("<I", layer)

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> ChunkKey:
        """Inverse of `to_bytes`; raises `CodecError` on anything malformed."""
        data = bytes(data)
        try:
            version = data[0]
            if version != KEY_FORMAT_VERSION:
                raise CodecError(f"key: unsupported key format version {version}")
            pos = 1
            texts = []
            for _ in range(4):
                (length,) = struct.unpack_from("<H", data, pos)
                pos += 2
                if length > _MAX_FIELD or pos + length > len(data):
                    raise CodecError("key: string field runs past the end")
                texts.append(data[pos : pos + length].decode())
                pos += length
            world_size, worker_id = struct.unpack_from("<II", data, pos)
            pos += 8
            chunk_hash = data[pos : pos + HASH_BYTES]
            pos += HASH_BYTES
            (layer,) = struct.unpack_from("<I", data, pos)
            pos += 4
        except (IndexError, struct.error, UnicodeDecodeError) as exc:
            raise CodecError(f"key: truncated or malformed ({exc})") from None
        if pos != len(data) or len(chunk_hash) != HASH_BYTES:
            raise CodecError(f"key: expected {pos} bytes, got {len(data)}")
        try:
            scope = KeyScope(texts[0], texts[1], texts[2], world_size, worker_id, texts[3])
        except (TypeError, ValueError) as exc:
            raise CodecError(f"key: invalid scope ({exc})") from None
        return cls(scope, chunk_hash, None if layer == _NO_LAYER else layer)


def token_bytes(ids: TokenIds) -> memoryview:
    """Token ids as little-endian uint32 bytes (ids must be in [0, 2**32))."""
    token_ids: Any = ids
    if isinstance(token_ids, (bytes, bytearray, memoryview, str)):
        # One id per byte, or packed uint32? Refused rather than guessed.
        raise LayoutError(
            f"token_ids: {type(token_ids).__name__} is ambiguous; pass a list of ints or a 1-D "
            "integer tensor or array (packed uint32: numpy.frombuffer(data, '<u4'))"
        )
    if hasattr(token_ids, "numpy") and hasattr(token_ids, "dim"):  # torch tensor
        if token_ids.dim() != 1:
            raise LayoutError(
                f"token_ids: expected a 1-D tensor, got shape {tuple(token_ids.shape)}"
            )
        try:  # a CPU tensor's own memory (no detach, no copy)
            token_ids = token_ids.numpy()
        except (RuntimeError, TypeError):  # one that needs grad, or on a device
            token_ids = token_ids.detach().cpu().numpy()
    if hasattr(token_ids, "__array_interface__"):  # numpy array
        import numpy as np

        arr = np.asarray(token_ids)
        kind, size = arr.dtype.kind, arr.dtype.itemsize
        if arr.ndim != 1 or kind not in "iu":
            raise LayoutError(f"token_ids: expected 1-D integers, got {arr.dtype} {arr.shape}")
        # Only signed ids can be negative, and only ids wider than 32 bits too large.
        if arr.size and (
            (kind == "i" and int(arr.min()) < 0) or (size > 4 and int(arr.max()) > 0xFFFFFFFF)
        ):
            raise LayoutError("token_ids: ids must be in [0, 2**32)")
        if size == 4 and arr.dtype.byteorder in "<=|" and sys.byteorder == "little":
            return memoryview(arr.view("<u4").tobytes())  # int32 >= 0: the same bits
        return memoryview(np.ascontiguousarray(arr, dtype="<u4").tobytes())
    try:
        packed = array.array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise LayoutError(f"token_ids: expected ints in [0, 2**32) ({exc})") from None
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte 'I'
        packed = array.array("L", token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        packed.byteswap()
    return memoryview(packed).cast("B")


def chunk_hashes(
    token_ids: TokenIds, chunk_size: int, seed: bytes, salt: KeySalt | None = None
) -> list[bytes]:
    """Prefix-chained hashes of every chunk of ``token_ids``, a trailing partial chunk included."""
    return _chained_hashes(token_bytes(token_ids), chunk_size, seed, salt)


def _chained_hashes(
    raw: bytes | memoryview, chunk_size: int, seed: bytes, salt: KeySalt | None = None
) -> list[bytes]:
    step = chunk_size * 4
    hasher = xxhash.xxh3_128
    marks = salt.marks if salt is not None else ()
    next_mark = 0
    hashes = []
    prev = seed
    for start in range(0, len(raw), step):
        if next_mark < len(marks):
            end_token = min(start + step, len(raw)) // 4  # a mark past the end is no part
            first = next_mark
            while next_mark < len(marks) and marks[next_mark][0] < end_token:
                next_mark += 1
            if next_mark > first:
                prev = _salted(prev, marks[first:next_mark], start // 4)
        state = hasher(prev)
        state.update(raw[start : start + step])
        prev = state.digest()
        hashes.append(prev)
    return hashes


def chunk_keys(
    scope: KeyScope, token_ids: TokenIds, chunk_size: int, salt: KeySalt | None = None
) -> list[ChunkKey]:
    """One key per chunk of ``token_ids`` (``ceil(len / chunk_size)`` keys)."""
    return _keys_of(scope, token_bytes(token_ids), chunk_size, salt)


def _keys_of(
    scope: KeyScope, raw: bytes | memoryview, chunk_size: int, salt: KeySalt | None = None
) -> list[ChunkKey]:
    seed = scope.chain_seed(chunk_size)
    return [ChunkKey(scope, h) for h in _chained_hashes(raw, chunk_size, seed, salt)]


class KeyMemo:
    """The chunk keys of the last few token sequences hashed, so that the calls of one request
    (its lookup, then its retrieve; a store, then the lookup) hash its tokens once.

    A sequence is found by its bytes, compared whole with the remembered ones under the same
    scope and chunk size: never by identity (a list mutated in place is hashed again) and never
    by a digest alone (two sequences sharing one never share keys)."""

    def __init__(self, size: int = 8) -> None:
        if size < 1:
            raise ValueError(f"KeyMemo: size must be >= 1, got {size}")
        self.size = size
        self.hits = 0
        # (scope, chunk size, salt, token bytes, keys), most recent last.
        self._entries: list[tuple[KeyScope, int, KeySalt | None, bytes, tuple[ChunkKey, ...]]] = []

    def chunk_keys(
        self,
        scope: KeyScope,
        token_ids: TokenIds,
        chunk_size: int,
        salt: KeySalt | None = None,
    ) -> list[ChunkKey]:
        """`chunk_keys` of ``token_ids``, remembered or computed."""
        raw = bytes(token_bytes(token_ids))
        entries = self._entries
        for i in range(len(entries) - 1, -1, -1):
            known_scope, known_size, known_salt, known_raw, known_keys = entries[i]
            if (
                known_raw == raw
                and known_size == chunk_size
                and known_salt == salt
                and known_scope == scope
            ):
                self.hits += 1
                entries.append(entries.pop(i))  # most recent last
                return list(known_keys)
        keys = tuple(_keys_of(scope, raw, chunk_size, salt))
        entries.append((scope, chunk_size, salt, raw, keys))
        if len(entries) > self.size:
            del entries[0]
        return list(keys)
