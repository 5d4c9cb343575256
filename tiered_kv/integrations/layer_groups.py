"""A host's layer groups: `LayerGroups`, the registrations one lookup spans (hybrid models).

Owns the groups a host registered (one per vLLM KV cache group: its model name in chunk keys
and, for sliding-window attention, its window), the serving stack's block size, what a
sliding-window group still reads (`window_start`), the prefetches of one lookup over every group
(a stored partial chunk extending a single group's hit) and the prefix they all hold ready.
Must not keep requests or count anything: `HostLookups` holds the prefetches it starts, counts
and remembers their tokens. Registration runs on the host's caller thread, before lookups are
served; prefetches and readiness on the host's loop.
"""

from __future__ import annotations

import dataclasses

from tiered_kv.engine import TieredKVEngine
from tiered_kv.keys import KeySalt
from tiered_kv.prefetch import PrefetchHandle


@dataclasses.dataclass(frozen=True, slots=True)
class LayerGroup:
    """One registration of a hybrid model's layers (a vLLM KV cache group): its model name in
    chunk keys and, for sliding-window attention, the window in tokens (None: full
    attention, every token before a position is read)."""

    model_name: str
    sliding_window: int | None = None


def window_start(end: int, sliding_window: int, block_size: int) -> int:
    """The first token whose KV a sliding-window group still reads after ``end`` tokens,
    rounded down to a block: vLLM drops the blocks wholly before ``end - window + 1``."""
    return max(0, end - sliding_window + 1) // block_size * block_size


@dataclasses.dataclass(frozen=True, slots=True)
class GroupPrefetch:
    """One lookup's prefetches, one per group in registration order; ``partial_tokens``: the
    prefix a stored partial chunk extended a single group's hit to (None: none did)."""

    handles: list[PrefetchHandle]
    partial_tokens: int | None = None


class LayerGroups:
    """The layer groups registered on one engine, and lookups' prefetches across them."""

    def __init__(self, engine: TieredKVEngine) -> None:
        self._engine = engine
        self._model_name: str | None = None  # the last registered
        self._groups: list[LayerGroup] = []
        self.block_size = 0

    def register(self, model_name: str, sliding_window: int | None, block_size: int) -> None:
        """A registration (again, for a model name registered before) of a group whose
        serving stack uses ``block_size``-token blocks."""
        self._model_name = model_name
        self._groups = [g for g in self._groups if g.model_name != model_name]
        self._groups.append(LayerGroup(model_name, sliding_window))
        self.block_size = block_size

    def current(self) -> list[LayerGroup]:
        """The groups a lookup spans now (one unnamed group before any registration)."""
        return self._groups or [LayerGroup(self._model_name or "")]

    def index_of(self, model_name: str | None) -> int | None:
        """The position in `current` of the group ``model_name`` (None: the last registered),
        or None when no such group is registered."""
        names = [group.model_name for group in self.current()]
        name = model_name if model_name is not None else (self._model_name or "")
        return names.index(name) if name in names else None

    async def prefetch(
        self,
        groups: list[LayerGroup],
        token_ids: list[int],
        salt: KeySalt | None,
        limit: int | None,
    ) -> GroupPrefetch:
        """One prefetch per group: full-attention groups from the start; sliding-window groups
        over the window before the longest prefix every full group has located (shorter
        answers whose window starts earlier are misses there)."""
        if len(groups) == 1:
            return await self._prefetch_with_partial(groups[0].model_name, token_ids, salt)
        engine = self._engine
        handles: dict[str, PrefetchHandle] = {}
        located = len(token_ids) if limit is None else min(limit, len(token_ids))
        for group in groups:
            if group.sliding_window is None:
                handle = await engine.prefetch(
                    token_ids, model_name=group.model_name, salt=salt, worth_loading=True
                )
                handles[group.model_name] = handle
                located = min(located, handle.hit_tokens)
        block = max(self.block_size, 1)
        located = located // block * block
        for group in groups:
            if group.sliding_window is not None:
                start = window_start(located, group.sliding_window, block)
                handles[group.model_name] = await engine.prefetch(
                    token_ids, model_name=group.model_name, salt=salt, from_token=start
                )
        return GroupPrefetch([handles[group.model_name] for group in groups])

    async def _prefetch_with_partial(
        self, model_name: str, token_ids: list[int], salt: KeySalt | None
    ) -> GroupPrefetch:
        """The prefetch of the cached prefix, extended into the first chunk it misses by the
        longest stored partial chunk there (a prompt stored with a partial last chunk, which a
        longer follow-up extends): its key is that of the prefix cut at a whole block. Partial
        chunks are looked for in the tiers' indexes (no I/O per candidate: a remote tier knows
        the keys it has seen)."""
        engine = self._engine
        handle = await engine.prefetch(
            token_ids, model_name=model_name, salt=salt, worth_loading=True
        )
        hit, chunk, block = handle.hit_tokens, engine.config.chunk_size, max(self.block_size, 1)
        if hit >= len(token_ids) or hit % chunk:
            return GroupPrefetch([handle])
        for length in range(min(chunk - block, len(token_ids) - hit) // block * block, 0, -block):
            keys = engine.chunk_keys(token_ids[: hit + length], model_name=model_name, salt=salt)
            if engine.tier_of(keys[-1]) is None:
                continue
            partial = await engine.prefetch(
                token_ids[: hit + length], model_name=model_name, salt=salt, worth_loading=True
            )
            if partial.hit_tokens == hit + length:
                handle.close()
                return GroupPrefetch([partial], partial_tokens=hit + length)
            partial.close()
        return GroupPrefetch([handle])

    def ready_tokens(
        self,
        groups: list[LayerGroup],
        handles: list[PrefetchHandle],
        num_tokens: int,
        limit: int | None,
    ) -> int:
        """Tokens ready to load now: a single group's ready prefix; for a hybrid model the
        longest whole-block prefix, at most ``limit``, that every full-attention group holds
        from its start and every sliding-window group holds over the window before its end."""
        if len(groups) == 1:
            return handles[0].ready_tokens()
        block, chunk = self.block_size, self._engine.config.chunk_size
        end = num_tokens if limit is None else min(limit, num_tokens)
        windows: list[tuple[int, int, list[bool]]] = []  # window, first chunk, ready per chunk
        for group, handle in zip(groups, handles, strict=True):
            if group.sliding_window is None:
                end = min(end, handle.ready_tokens())
            else:
                windows.append((group.sliding_window, handle.first_chunk, handle.ready_chunks()))
        end = end // block * block
        while end > 0:
            if all(
                all(
                    0 <= index - first < len(ready) and ready[index - first]
                    for index in range(
                        window_start(end, window, block) // chunk, (end - 1) // chunk + 1
                    )
                )
                for window, first, ready in windows
            ):
                return end
            end -= block
        return 0
