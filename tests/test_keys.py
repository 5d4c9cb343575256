"""Chunk keys: prefix-chained hashing, scope isolation, byte encoding."""

from __future__ import annotations

import dataclasses
import math
import re
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_kv.errors import CodecError, LayoutError, TieredKVError
from tiered_kv.keys import (
    HASH_BYTES,
    KEY_FORMAT_VERSION,
    ChunkKey,
    KeyMemo,
    KeySalt,
    KeyScope,
    chunk_hashes,
    chunk_keys,
    token_bytes,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCOPE = KeyScope(
    namespace="",
    model="llama-3-8b",
    fingerprint="",
    world_size=1,
    worker_id=0,
    layout_id="0123456789abcdef",
)
CS = 4


def tokens(n: int, start: int = 1000) -> list[int]:
    return [(start + 7919 * i) % 128_000 for i in range(n)]


# -- chunking --------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, CS - 1, CS, CS + 1, 2 * CS, 3 * CS - 1, 10 * CS + 3])
def test_one_key_per_chunk_partial_last_chunk_included(n: int) -> None:
    keys = chunk_keys(SCOPE, tokens(n), CS)
    assert len(keys) == math.ceil(n / CS)
    assert len({k.chunk_hash for k in keys}) == len(keys)
    assert all(len(k.chunk_hash) == HASH_BYTES for k in keys)
    assert all(k.scope == SCOPE and k.layer is None for k in keys)


def test_prefix_has_the_same_keys() -> None:
    full = chunk_keys(SCOPE, tokens(5 * CS + 2), CS)
    for n_chunks in range(1, 6):
        assert chunk_keys(SCOPE, tokens(n_chunks * CS), CS) == full[:n_chunks]


def test_partial_chunk_key_depends_on_its_length() -> None:
    shorter = chunk_keys(SCOPE, tokens(CS + 1), CS)
    longer = chunk_keys(SCOPE, tokens(CS + 2), CS)
    full = chunk_keys(SCOPE, tokens(2 * CS), CS)
    assert shorter[0] == longer[0] == full[0]
    assert len({shorter[1], longer[1], full[1]}) == 3


@pytest.mark.parametrize("chunk", [0, 1, 2, 4])
@pytest.mark.parametrize("pos_in_chunk", [0, CS - 1])
def test_chain_changing_a_token_changes_its_chunk_and_every_later_one(
    chunk: int, pos_in_chunk: int
) -> None:
    ids = tokens(5 * CS)
    base = chunk_hashes(ids, CS, SCOPE.chain_seed(CS))
    changed_ids = list(ids)
    changed_ids[chunk * CS + pos_in_chunk] += 1
    changed = chunk_hashes(changed_ids, CS, SCOPE.chain_seed(CS))
    assert changed[:chunk] == base[:chunk]
    for i in range(chunk, len(base)):
        assert changed[i] != base[i], f"chunk {i} kept its hash after chunk {chunk} changed"


@FAST
@given(
    ids=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=40),
    chunk_size=st.integers(1, 8),
    data=st.data(),
)
def test_chain_property(ids: list[int], chunk_size: int, data: st.DataObject) -> None:
    position = data.draw(st.integers(0, len(ids) - 1))
    new_value = data.draw(st.integers(0, 2**32 - 1).filter(lambda v: v != ids[position]))
    seed = SCOPE.chain_seed(chunk_size)
    base = chunk_hashes(ids, chunk_size, seed)
    changed_ids = list(ids)
    changed_ids[position] = new_value
    changed = chunk_hashes(changed_ids, chunk_size, seed)
    chunk = position // chunk_size
    assert len(base) == len(changed) == math.ceil(len(ids) / chunk_size)
    assert changed[:chunk] == base[:chunk]
    assert all(a != b for a, b in zip(changed[chunk:], base[chunk:], strict=True))


def test_hashes_are_stable_across_processes_and_releases() -> None:
    # Files on disk and remote keys are named by these; a change silently drops every cache.
    keys = chunk_keys(SCOPE, list(range(10)), 4)
    assert [k.hex for k in keys] == [
        "96da398da15840985d52b7f390906d97",
        "90e6821df597419fc76a55dd56ef87f1",
        "12c0271f092bc033d27d76f345ebbcaa",
    ]


# -- token id inputs ---------------------------------------------------------------------------
def test_list_tuple_tensor_and_array_hash_identically() -> None:
    ids = [*tokens(3 * CS + 1), 0, 2**32 - 1]
    expected = chunk_keys(SCOPE, ids, CS)
    inputs = [
        tuple(ids),
        torch.tensor(ids, dtype=torch.int64),
        np.array(ids, dtype=np.int64),
        np.array(ids, dtype=np.uint32),
        np.array(ids, dtype=np.uint64),
        np.array(ids, dtype=">u4"),  # big-endian storage: still the same token values
        [np.int64(i) for i in ids],
    ]
    for value in inputs:
        assert chunk_keys(SCOPE, value, CS) == expected, type(value)


def test_int32_inputs_hash_like_lists() -> None:
    ids = tokens(2 * CS + 3)
    expected = chunk_keys(SCOPE, ids, CS)
    assert chunk_keys(SCOPE, torch.tensor(ids, dtype=torch.int32), CS) == expected
    assert chunk_keys(SCOPE, np.array(ids, dtype=np.int32), CS) == expected
    assert chunk_keys(SCOPE, np.array(ids, dtype=">i4"), CS) == expected  # byte-swapped
    # Strided 32-bit views (reinterpreted as uint32 without a copy) read every other id.
    every_other = chunk_keys(SCOPE, ids[::2], CS)
    assert chunk_keys(SCOPE, torch.tensor(ids, dtype=torch.int32)[::2], CS) == every_other
    assert chunk_keys(SCOPE, np.array(ids, dtype=np.uint32)[::2], CS) == every_other


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64])
def test_negative_ids_are_refused_at_every_signed_width(dtype: type) -> None:
    ids = np.array([*(t % 100 for t in tokens(CS - 1)), -1], dtype=dtype)
    with pytest.raises(LayoutError, match="ids must be in"):
        chunk_keys(SCOPE, ids, CS)
    with pytest.raises(LayoutError, match="ids must be in"):
        chunk_keys(SCOPE, torch.from_numpy(ids), CS)


def test_non_contiguous_tensor_and_array_hash_like_lists() -> None:
    ids = tokens(6 * CS)
    expected = chunk_keys(SCOPE, ids[::2], CS)
    assert chunk_keys(SCOPE, torch.tensor(ids)[::2], CS) == expected
    assert chunk_keys(SCOPE, np.array(ids)[::2], CS) == expected


def test_token_bytes_is_little_endian_uint32() -> None:
    raw = token_bytes([1, 2**32 - 1, 256])
    assert bytes(raw) == struct.pack("<III", 1, 2**32 - 1, 256)
    assert bytes(token_bytes(torch.tensor([1, 2**32 - 1, 256]))) == bytes(raw)
    assert bytes(token_bytes(np.array([1, 2**32 - 1, 256]))) == bytes(raw)


def test_empty_token_ids_give_no_keys() -> None:
    assert chunk_keys(SCOPE, [], CS) == []
    assert chunk_keys(SCOPE, torch.tensor([], dtype=torch.int64), CS) == []
    assert chunk_keys(SCOPE, np.array([], dtype=np.int64), CS) == []


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40, -(2**31)])
def test_token_ids_out_of_range(bad: int) -> None:
    ids = [*tokens(CS), bad]
    for value in (ids, tuple(ids), np.array(ids, dtype=np.int64), torch.tensor(ids)):
        with pytest.raises(LayoutError):
            chunk_keys(SCOPE, value, CS)


def test_token_ids_at_the_range_edges_are_accepted() -> None:
    low = chunk_keys(SCOPE, [0], CS)
    high = chunk_keys(SCOPE, [2**32 - 1], CS)
    assert low != high


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2.5],
        ["1", "2"],
        [None],
        np.array([1.0, 2.0]),
        np.array([True, False]),
        np.zeros((2, 2), dtype=np.int64),
        torch.zeros((2, 2), dtype=torch.int64),
        torch.tensor([1.0, 2.0]),
    ],
)
def test_token_ids_of_wrong_type_or_shape(bad: object) -> None:
    with pytest.raises(LayoutError):
        chunk_keys(SCOPE, bad, CS)


# -- scope isolation -----------------------------------------------------------------------------
SCOPE_VARIANTS = {
    "namespace": dataclasses.replace(SCOPE, namespace="tenant-b"),
    "fingerprint": dataclasses.replace(SCOPE, fingerprint="weights-v2"),
    "model": dataclasses.replace(SCOPE, model="llama-3-70b"),
    "world_size": dataclasses.replace(SCOPE, world_size=2),
    "worker_id": dataclasses.replace(SCOPE, world_size=2, worker_id=1),
    "layout_id": dataclasses.replace(SCOPE, layout_id="fedcba9876543210"),
}


@pytest.mark.parametrize("field", sorted(SCOPE_VARIANTS))
def test_every_scope_field_changes_every_hash(field: str) -> None:
    ids = tokens(4 * CS + 1)
    ours = chunk_keys(SCOPE, ids, CS)
    theirs = chunk_keys(SCOPE_VARIANTS[field], ids, CS)
    assert not {k.chunk_hash for k in ours} & {k.chunk_hash for k in theirs}
    assert not set(ours) & set(theirs)
    assert not {k.hex for k in ours} & {k.hex for k in theirs}


def test_all_scope_variants_are_pairwise_disjoint() -> None:
    ids = tokens(2 * CS)
    scopes = [SCOPE, *SCOPE_VARIANTS.values()]
    seen: set[bytes] = set()
    for scope in scopes:
        hashes = {k.chunk_hash for k in chunk_keys(scope, ids, CS)}
        assert not hashes & seen
        seen |= hashes


def test_chunk_size_changes_every_hash() -> None:
    ids = tokens(24)
    by_4 = {k.chunk_hash for k in chunk_keys(SCOPE, ids, 4)}
    by_8 = {k.chunk_hash for k in chunk_keys(SCOPE, ids, 8)}
    assert not by_4 & by_8
    # Even when the first chunk holds the very same tokens (a prompt shorter than both sizes).
    assert (
        chunk_keys(SCOPE, ids[:3], 4)[0].chunk_hash != chunk_keys(SCOPE, ids[:3], 8)[0].chunk_hash
    )


def test_field_boundaries_are_unambiguous() -> None:
    # Length-prefixed fields: moving characters between namespace and model changes the hash.
    a = dataclasses.replace(SCOPE, namespace="ab", model="c")
    b = dataclasses.replace(SCOPE, namespace="a", model="bc")
    assert a.to_bytes() != b.to_bytes()
    assert chunk_keys(a, [1], CS)[0].chunk_hash != chunk_keys(b, [1], CS)[0].chunk_hash


def test_keys_with_equal_hashes_but_other_scopes_are_not_equal() -> None:
    key = chunk_keys(SCOPE, [1, 2, 3], CS)[0]
    impostor = ChunkKey(SCOPE_VARIANTS["namespace"], key.chunk_hash)
    assert key != impostor
    assert key == ChunkKey(dataclasses.replace(SCOPE), key.chunk_hash)


# -- KeyScope validation ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"model": ""}, ValueError),
        ({"world_size": 0}, ValueError),
        ({"worker_id": 1}, ValueError),
        ({"worker_id": -1}, ValueError),
        ({"namespace": "x" * 1025}, ValueError),
        ({"namespace": 3}, TypeError),
    ],
)
def test_key_scope_validation(changes: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        dataclasses.replace(SCOPE, **changes)


# -- layers, hex, byte encoding -----------------------------------------------------------------
def test_with_layer() -> None:
    key = chunk_keys(SCOPE, tokens(CS), CS)[0]
    layer3 = key.with_layer(3)
    assert layer3.layer == 3
    assert layer3.chunk_hash == key.chunk_hash
    assert layer3.scope == key.scope
    assert layer3 != key
    assert layer3 == key.with_layer(3)
    assert len({key, key.with_layer(0), key.with_layer(1), key.with_layer(0)}) == 3
    with pytest.raises(ValueError):
        key.with_layer(-1)


def test_hex_is_stable_and_filename_safe() -> None:
    key = chunk_keys(SCOPE, tokens(CS), CS)[0]
    assert key.hex == key.chunk_hash.hex()
    assert key.hex == chunk_keys(SCOPE, tokens(CS), CS)[0].hex
    assert re.fullmatch(r"[0-9a-f]{32}", key.hex)
    assert key.with_layer(12).hex == f"{key.hex}-l12"
    names = {key.hex, *(key.with_layer(i).hex for i in range(40))}
    assert len(names) == 41
    for name in names:
        assert re.fullmatch(r"[0-9a-f]{32}(-l[0-9]+)?", name)


def test_to_bytes_layout() -> None:
    key = chunk_keys(SCOPE, tokens(CS), CS)[0]
    raw = key.to_bytes()
    assert raw[0] == KEY_FORMAT_VERSION
    assert raw.startswith(SCOPE.to_bytes())
    assert raw[len(SCOPE.to_bytes()) : -4] == key.chunk_hash
    assert raw[-4:] == b"\xff\xff\xff\xff"  # no layer
    assert key.with_layer(5).to_bytes()[-4:] == struct.pack("<I", 5)


@pytest.mark.parametrize("layer", [None, 0, 1, 79, 2**31])
def test_round_trip(layer: int | None) -> None:
    scope = KeyScope("tenant-é", "mödel/with:odd chars", "fp✓", 8, 7, "abc")
    key = chunk_keys(scope, tokens(3 * CS), CS)[-1]
    if layer is not None:
        key = key.with_layer(layer)
    raw = key.to_bytes()
    decoded = ChunkKey.from_bytes(raw)
    assert decoded == key
    assert decoded.layer == layer
    assert decoded.scope == scope
    assert decoded.hex == key.hex
    assert hash(decoded) == hash(key)
    assert ChunkKey.from_bytes(memoryview(raw)) == key
    assert ChunkKey.from_bytes(bytearray(raw)) == key


@pytest.mark.parametrize("layer", [2**32 - 2, 2**32 - 1, 2**32])
def test_every_layer_key_that_can_be_made_round_trips(layer: int) -> None:
    # A layer key must either be refused by with_layer or survive the byte encoding; it must
    # never come back as the whole-chunk key (0xFFFFFFFF is the "no layer" marker) or crash.
    key = chunk_keys(SCOPE, tokens(CS), CS)[0]
    try:
        layer_key = key.with_layer(layer)
    except ValueError:
        return
    assert ChunkKey.from_bytes(layer_key.to_bytes()) == layer_key


text_fields = st.text(max_size=20)


@FAST
@given(
    namespace=text_fields,
    model=st.text(min_size=1, max_size=20),
    fingerprint=text_fields,
    layout_id=text_fields,
    world_and_worker=st.integers(1, 1024).flatmap(
        lambda w: st.tuples(st.just(w), st.integers(0, w - 1))
    ),
    chunk_hash=st.binary(min_size=HASH_BYTES, max_size=HASH_BYTES),
    layer=st.none() | st.integers(0, 2**32 - 2),
)
def test_round_trip_property(
    namespace: str,
    model: str,
    fingerprint: str,
    layout_id: str,
    world_and_worker: tuple[int, int],
    chunk_hash: bytes,
    layer: int | None,
) -> None:
    world_size, worker_id = world_and_worker
    scope = KeyScope(namespace, model, fingerprint, world_size, worker_id, layout_id)
    key = ChunkKey(scope, chunk_hash, layer)
    decoded = ChunkKey.from_bytes(key.to_bytes())
    assert decoded == key
    assert decoded.layer == layer
    assert decoded.to_bytes() == key.to_bytes()


VALID = chunk_keys(SCOPE, tokens(CS), CS)[0].with_layer(2).to_bytes()


@pytest.mark.parametrize("cut", range(len(VALID)))
def test_truncated_bytes_raise_codec_error(cut: int) -> None:
    with pytest.raises(CodecError):
        ChunkKey.from_bytes(VALID[:cut])


def test_trailing_bytes_raise_codec_error() -> None:
    with pytest.raises(CodecError):
        ChunkKey.from_bytes(VALID + b"\x00")


def test_bad_version_raises_codec_error() -> None:
    with pytest.raises(CodecError, match="version"):
        ChunkKey.from_bytes(bytes([KEY_FORMAT_VERSION + 1]) + VALID[1:])


def test_invalid_scope_in_bytes_raises_codec_error() -> None:
    bad_scope = struct.pack("<B", KEY_FORMAT_VERSION) + b"".join(
        struct.pack("<H", len(s)) + s
        for s in (b"", b"", b"", b"")  # empty model
    )
    raw = bad_scope + struct.pack("<II", 1, 0) + bytes(HASH_BYTES) + b"\xff" * 4
    with pytest.raises(CodecError):
        ChunkKey.from_bytes(raw)
    worker_past_world = (
        SCOPE.to_bytes()[:-8] + struct.pack("<II", 2, 2) + bytes(HASH_BYTES) + b"\xff" * 4
    )
    with pytest.raises(CodecError):
        ChunkKey.from_bytes(worker_past_world)


def test_invalid_utf8_raises_codec_error() -> None:
    raw = (
        struct.pack("<B", KEY_FORMAT_VERSION)
        + struct.pack("<H", 2)
        + b"\xff\xfe"
        + b"".join(struct.pack("<H", 1) + b"m" for _ in range(3))
        + struct.pack("<II", 1, 0)
        + bytes(HASH_BYTES)
        + b"\xff" * 4
    )
    with pytest.raises(CodecError):
        ChunkKey.from_bytes(raw)


def _decodes_canonically_or_codec_error(raw: bytes) -> None:
    try:
        key = ChunkKey.from_bytes(raw)
    except CodecError:
        return
    except Exception as exc:  # pragma: no cover - the failure we are looking for
        pytest.fail(f"from_bytes raised {type(exc).__name__}, not CodecError: {exc}")
    assert key.to_bytes() == raw


@FAST
@given(raw=st.binary(max_size=200))
def test_random_bytes_raise_only_codec_error(raw: bytes) -> None:
    _decodes_canonically_or_codec_error(raw)


@FAST
@given(raw=st.binary(max_size=120).map(lambda b: bytes([KEY_FORMAT_VERSION]) + b))
def test_random_bytes_with_valid_version_raise_only_codec_error(raw: bytes) -> None:
    _decodes_canonically_or_codec_error(raw)


@FAST
@given(data=st.data())
def test_mutated_valid_bytes_raise_only_codec_error(data: st.DataObject) -> None:
    raw = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    _decodes_canonically_or_codec_error(bytes(raw))


def test_codec_error_is_a_tiered_kv_error() -> None:
    with pytest.raises(TieredKVError):
        ChunkKey.from_bytes(b"")


def test_key_memo_answers_the_same_tokens_with_the_same_keys_and_anything_else_anew() -> None:
    """A request's lookup and retrieve hash its tokens once; a sequence that differs anywhere
    (even in place, in the last token), or another scope or chunk size, is hashed afresh."""
    memo = KeyMemo(size=2)
    ids = list(range(1000, 1600))
    first = memo.chunk_keys(SCOPE, ids, 256)
    assert first == chunk_keys(SCOPE, ids, 256)
    assert memo.chunk_keys(SCOPE, torch.tensor(ids), 256) == first and memo.hits == 1
    ids[-1] += 1  # mutated in place: the same list object, other tokens
    changed = memo.chunk_keys(SCOPE, ids, 256)
    assert changed == chunk_keys(SCOPE, ids, 256) and changed[-1] != first[-1]
    assert changed[:-1] == first[:-1] and memo.hits == 1
    other = dataclasses.replace(SCOPE, model="another")
    assert memo.chunk_keys(other, ids, 256) == chunk_keys(other, ids, 256) != changed
    assert memo.chunk_keys(SCOPE, ids, 128) == chunk_keys(SCOPE, ids, 128)
    assert memo.hits == 1
    # Two entries: the most recent ones are remembered, the oldest is dropped.
    assert memo.chunk_keys(SCOPE, ids, 128) == chunk_keys(SCOPE, ids, 128) and memo.hits == 2
    memo.chunk_keys(SCOPE, ids[:300], 256)
    memo.chunk_keys(other, ids, 256)  # dropped by now: hashed again
    assert memo.hits == 2
    returned = memo.chunk_keys(SCOPE, ids, 128)
    returned.clear()  # the caller's list, not the memo's
    assert memo.chunk_keys(SCOPE, ids, 128) == chunk_keys(SCOPE, ids, 128) and memo.hits == 3
    with pytest.raises(LayoutError, match="ambiguous"):
        memo.chunk_keys(SCOPE, b"\x00\x01", 256)
    with pytest.raises(ValueError, match="size"):
        KeyMemo(size=0)


# -- salts -----------------------------------------------------------------------------------
def test_a_salt_at_offset_zero_changes_every_key_and_two_salts_never_share() -> None:
    ids = tokens(3 * CS + 1)
    plain = chunk_keys(SCOPE, ids, CS)
    first = chunk_keys(SCOPE, ids, CS, KeySalt.of((0, b"tenant-a")))
    second = chunk_keys(SCOPE, ids, CS, KeySalt.of((0, b"tenant-b")))
    assert not set(plain) & set(first)
    assert not set(first) & set(second)
    assert chunk_keys(SCOPE, ids, CS, KeySalt.of()) == plain  # no marks: no salt
    assert chunk_keys(SCOPE, ids, CS, KeySalt.of((0, b"tenant-a"))) == first


def test_a_mark_changes_its_chunk_and_every_later_one_only() -> None:
    """An image at token 2 * CS + 1: the text before its chunk shares keys with plain text."""
    ids = tokens(5 * CS)
    plain = chunk_keys(SCOPE, ids, CS)
    marked = chunk_keys(SCOPE, ids, CS, KeySalt.of((2 * CS + 1, b"image-hash")))
    assert marked[:2] == plain[:2]
    assert all(a != b for a, b in zip(marked[2:], plain[2:], strict=True))
    # The same mark at another offset inside the same chunk is another KV.
    moved = chunk_keys(SCOPE, ids, CS, KeySalt.of((2 * CS + 2, b"image-hash")))
    assert moved[:2] == plain[:2] and moved[2] != marked[2]
    # A mark past the end of a prefix leaves the prefix's keys alone (its KV cannot see it).
    assert chunk_keys(SCOPE, ids[: 2 * CS + 1], CS, KeySalt.of((2 * CS + 1, b"x"))) == (
        chunk_keys(SCOPE, ids[: 2 * CS + 1], CS)
    )


def test_marks_are_framed_so_their_split_matters() -> None:
    ids = tokens(2 * CS)
    one = chunk_keys(SCOPE, ids, CS, KeySalt.of((0, b"ab"), (0, b"c")))
    other = chunk_keys(SCOPE, ids, CS, KeySalt.of((0, b"a"), (0, b"bc")))
    assert not set(one) & set(other)
    # Order given does not matter (marks are sorted).
    assert chunk_keys(SCOPE, ids, CS, KeySalt.of((1, b"x"), (0, b"y"))) == chunk_keys(
        SCOPE, ids, CS, KeySalt.of((0, b"y"), (1, b"x"))
    )


def test_salt_wire_form_round_trips_and_bad_input_is_refused() -> None:
    salt = KeySalt.of((0, b"salt"), (70, b"\x00\xff"))
    assert salt is not None
    assert KeySalt.from_wire(salt.to_wire()) == salt
    assert KeySalt.from_wire(None) is None and KeySalt.from_wire([]) is None
    with pytest.raises(ValueError, match="expected a list"):
        KeySalt.from_wire("abc")
    with pytest.raises(ValueError, match="malformed mark"):
        KeySalt.from_wire([[0, "zz"]])
    with pytest.raises(ValueError, match="offset must be an int >= 0"):
        KeySalt(((-1, b"x"),))
    with pytest.raises(TypeError, match="data must be bytes"):
        KeySalt(((0, "x"),))  # type: ignore[arg-type]


def test_key_memo_tells_salts_apart() -> None:
    memo = KeyMemo(size=4)
    ids = tokens(2 * CS)
    first = memo.chunk_keys(SCOPE, ids, CS, KeySalt.of((0, b"a")))
    assert memo.chunk_keys(SCOPE, ids, CS, KeySalt.of((0, b"b"))) != first
    assert memo.chunk_keys(SCOPE, ids, CS) == chunk_keys(SCOPE, ids, CS)
    assert memo.chunk_keys(SCOPE, ids, CS, KeySalt.of((0, b"a"))) == first
    assert memo.hits == 1
