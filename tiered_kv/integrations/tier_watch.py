"""Tier events with their chunks' tokens: `TierWatch` and the `ResolvedTierEvent`s it drains.

Owns, once a host watches its tiers (`EngineHost.watch_tiers`), the engine's `TierEventLog` and
the token ids of the chunks the host last stored or looked up (a bounded LRU by chunk hash, each
with its parent's hash in the prefix chain), so that a drained event says which tokens its chunk
holds. Must not reach the engine or the tiers: the host hands it the log and each request's
chunk keys. `watch`, `remember` and `drain` run on the host's loop; `pending`, `emitted` and
`dropped` may be read from any thread (the log's own counters).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tiered_kv.keys import ChunkKey, KeySalt
from tiered_kv.tiers.base import TierEvent, TierEventLog

# What a host's parts call to have a request's chunks remembered (a no-op while nobody watches):
# (token ids, model name in chunk keys, salt).
RememberTokens = Callable[[Sequence[int], str | None, KeySalt | None], None]


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedTierEvent:
    """A `TierEvent` with what the host knows of its chunk: the previous chunk's hash in the
    prefix chain (None for a prefix's first chunk) and the chunk's token ids; both None when the
    host never saw the chunk's tokens (a chunk found on disk at start-up and evicted unseen)."""

    event: TierEvent
    parent_hash: bytes | None
    token_ids: tuple[int, ...] | None


_NO_TOKENS = (None, None)


class TierWatch:
    """The tier event log a host drains, and the tokens of the chunks it has seen."""

    def __init__(self, chunk_size: int) -> None:
        self._chunk_size = chunk_size
        self._log: TierEventLog | None = None  # None: nobody watches
        # chunk hash -> (the previous chunk's hash, the chunk's tokens), most recent last
        self._tokens: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()
        self._max_chunks = 0

    @property
    def watching(self) -> bool:
        return self._log is not None

    def watch(self, log: TierEventLog, remembered_chunks: int) -> None:
        """Drain ``log`` from now on (it replaces an earlier one) and remember the tokens of the
        last ``remembered_chunks`` (>= 1) chunks (the ones remembered so far are kept)."""
        self._max_chunks = remembered_chunks
        self._log = log

    def remember(self, keys: Sequence[ChunkKey], token_ids: Sequence[int], block_size: int) -> None:
        """Keep the tokens of ``keys``'s chunks: ``token_ids`` cut at a whole block of
        ``block_size`` tokens, as the keys cover them."""
        chunk, remembered = self._chunk_size, self._tokens
        block = max(block_size, 1)
        token_ids = token_ids[: len(token_ids) // block * block]
        parent: bytes | None = None
        for index, key in enumerate(keys):
            chunk_hash = key.chunk_hash
            if chunk_hash in remembered:
                remembered.move_to_end(chunk_hash)
            else:
                tokens = tuple(token_ids[index * chunk : (index + 1) * chunk])
                remembered[chunk_hash] = (parent, tokens)
            parent = chunk_hash
        while len(remembered) > self._max_chunks:
            remembered.popitem(last=False)

    def pending(self) -> bool:
        """Whether events wait to be drained."""
        log = self._log
        return log is not None and len(log) > 0

    def drain(self) -> list[ResolvedTierEvent]:
        """The events since the last drain, oldest first, with their chunks' tokens where
        known."""
        log = self._log
        if log is None:
            return []
        tokens = self._tokens
        return [
            ResolvedTierEvent(event, *tokens.get(event.key.chunk_hash, _NO_TOKENS))
            for event in log.drain()
        ]

    def emitted(self) -> int:
        return 0 if self._log is None else self._log.emitted

    def dropped(self) -> int:
        return 0 if self._log is None else self._log.dropped
