"""What a request verb's arguments mean once checked: `Registration`, `Registrations`, `Request`.

Owns the registrations of KV caches (model name → layout and key scope, `Registrations`) and the
preamble every request verb shares (`Request.of`): the registration named by ``model_name``, the
tokens it can cache (whole blocks only for caches moved as whole blocks), their chunk keys and
their count; plus the checks of block ids and integer arguments, each error naming the bad value.
Must not hold running state (tiers, loads, the mover) nor start any I/O: building a request is
pure bookkeeping on the caller's loop.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterator
from typing import Any

from tiered_kv.errors import EngineStateError, LayoutError
from tiered_kv.keys import ChunkKey, KeyMemo, KeySalt, KeyScope, TokenIds
from tiered_kv.layout import KVCacheLayout


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Registration:
    """One model's registered KV caches: their layout and the scope of their chunk keys."""

    model_name: str
    world_size: int
    worker_id: int
    layout: KVCacheLayout
    scope: KeyScope


class Registrations:
    """The registered models by name; `get` picks the one a verb's ``model_name`` names."""

    def __init__(self) -> None:
        self._by_name: dict[str, Registration] = {}

    def get(self, model_name: str | None) -> Registration:
        """The registration of ``model_name``, or of the only model when it is None."""
        if model_name is None:
            if len(self._by_name) == 1:
                return next(iter(self._by_name.values()))
            if not self._by_name:
                raise EngineStateError("no KV caches registered; call register_kv_caches first")
            raise EngineStateError(
                f"several models registered {sorted(self._by_name)}; pass model_name="
            )
        try:
            return self._by_name[model_name]
        except KeyError:
            raise EngineStateError(
                f"model {model_name!r} is not registered; registered: {sorted(self._by_name)}"
            ) from None

    def put(self, registration: Registration) -> Registration | None:
        """Record ``registration``; returns the one it replaces (same model name), if any."""
        previous = self._by_name.get(registration.model_name)
        self._by_name[registration.model_name] = registration
        return previous

    def clear(self) -> None:
        self._by_name.clear()

    def __iter__(self) -> Iterator[Registration]:
        return iter(list(self._by_name.values()))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Request:
    """A request verb's tokens, checked: its registration, the tokens it can cache (`of` cuts a
    partial last block of whole-block caches), their chunk keys (a partial last chunk included)
    and their count."""

    registration: Registration
    token_ids: TokenIds
    keys: list[ChunkKey]
    num_tokens: int
    chunk_size: int

    @classmethod
    def of(
        cls,
        registration: Registration,
        token_ids: TokenIds,
        salt: KeySalt | None,
        *,
        memo: KeyMemo,
        chunk_size: int,
    ) -> Request:
        if salt is not None and not isinstance(salt, KeySalt):
            raise TypeError(f"salt: expected a KeySalt or None, got {type(salt).__name__}")
        token_ids = whole_blocks(registration, token_ids)
        keys = memo.chunk_keys(registration.scope, token_ids, chunk_size, salt)
        return cls(registration, token_ids, keys, len(token_ids), chunk_size)

    @property
    def layout(self) -> KVCacheLayout:
        return self.registration.layout

    def chunk_tokens(self, index: int) -> int:
        """Chunk ``index``'s length (the last may be partial)."""
        return min(self.chunk_size, self.num_tokens - index * self.chunk_size)

    def block_ids(self, block_ids: Any) -> list[int]:
        """``block_ids`` checked against the registration: as many as the tokens need (the
        extra ones dropped), each in range."""
        layout = self.registration.layout
        needed = -(-self.num_tokens // layout.block_size)
        ids = block_id_list(block_ids)
        if len(ids) < needed:
            raise LayoutError(
                f"block_ids: {self.num_tokens} tokens need {needed} blocks of "
                f"{layout.block_size}, got {len(ids)}"
            )
        ids = ids[:needed]
        if ids and not 0 <= min(ids) <= max(ids) < layout.num_blocks:
            bad = [b for b in ids if not 0 <= b < layout.num_blocks]
            raise LayoutError(f"block_ids: {bad[:8]} out of range [0, {layout.num_blocks})")
        return ids


def whole_blocks(registration: Registration, token_ids: TokenIds) -> TokenIds:
    """The tokens a registration can cache: all of them, or for caches moved as whole blocks
    (format 'blocks') the whole blocks only; a partial last block is never stored or loaded."""
    multiple = registration.layout.layout_desc.token_multiple
    if multiple == 1:
        return token_ids
    partial = len(token_ids) % multiple
    return token_ids[:-partial] if partial else token_ids  # no slice (a tensor op) if whole


def int_argument(name: str, value: Any) -> int:
    """``value`` as an int when it is one (Python or NumPy/torch integer scalar), else a
    `LayoutError` naming the argument: 64.0, "64", True and None are refused, not coerced."""
    if isinstance(value, bool):
        raise LayoutError(f"{name}: expected an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise LayoutError(f"{name}: expected an int, got {value!r}") from None


def block_id_list(block_ids: Any) -> list[int]:
    """``block_ids`` (a sequence of ints, or a 1-D integer tensor or array) as a list of ints.
    Floats, strings, bools and None are refused, never truncated or parsed."""
    dtype = getattr(block_ids, "dtype", None)
    if dtype is not None and hasattr(block_ids, "tolist"):
        kind = str(dtype)
        if "int" not in kind or "bool" in kind or getattr(block_ids, "ndim", 1) != 1:
            raise LayoutError(
                f"block_ids: expected a 1-D integer tensor or array, got {kind} with shape "
                f"{tuple(getattr(block_ids, 'shape', ()))}"
            )
        values: list[int] = block_ids.tolist()
        return values
    if type(block_ids) is list and set(map(type, block_ids)) <= {int}:
        return list(block_ids)  # the common case, checked without a call per id
    if block_ids is None or isinstance(block_ids, (str, bytes, bytearray, memoryview)):
        raise LayoutError(
            f"block_ids: expected a sequence of ints or a 1-D integer tensor, got {block_ids!r}"
        )
    try:
        items = list(block_ids)
    except TypeError:
        raise LayoutError(
            f"block_ids: expected a sequence of ints, got {type(block_ids).__name__}"
        ) from None
    return [int_argument(f"block_ids[{i}]", value) for i, value in enumerate(items)]
