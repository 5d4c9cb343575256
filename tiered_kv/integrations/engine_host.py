"""`EngineHost`: a `TieredKVEngine` on its own event-loop thread, for serving-stack workers.

Owns the engine (whose lookups claim only what ``load_policy`` finds worth loading, from the
prefill times the serving stack reports with `observe_prefill`), its loop thread, the
per-request prefetches that lookups start (keyed by the serving stack's request id, released
when the request is loaded, finished or abandoned; once a lookup has answered, the L1 chunks
of its answer are pinned there until then, within a byte budget and a deadline, so that the
claim holds), the `LookupServer` that answers a scheduler in another thread or process, and,
while someone watches the tiers (`watch_tiers`), the token ids of recently stored or looked-up
chunks, so that tier events can say which tokens a chunk holds (`tier_events`).
Blocking methods are for the worker's own threads; everything touching the engine or the
prefetches runs on the loop.
Must not import a serving stack or touch KV bytes itself (the engine's mover does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tiered_kv.config import EngineConfig
from tiered_kv.integrations.lookup_channel import LookupServer
from tiered_kv.keys import KeySalt, TokenIds
from tiered_kv.layout import MemoryLayoutDesc
from tiered_kv.metrics import EngineStats, StatsDict
from tiered_kv.prefetch import PrefetchHandle
from tiered_kv.retrieval import LayerwiseRetrieve, RetrieveResult
from tiered_kv.sync import SyncLayerwiseRetrieve, SyncLayerwiseStore, SyncTieredKVEngine
from tiered_kv.tiers.base import LowerTier, TierEvent, TierEventLog

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, eq=False)
class _Lookup:
    token_ids: list[int]
    salt: KeySalt | None
    handles: list[PrefetchHandle]  # one per layer group, in registration order
    started: float
    deadline: float | None  # prefetch policy "timeout": answer with what is ready by then
    pinned_at: float | None = None  # loop time the answer's L1 chunks were pinned

    def cancel(self) -> None:
        for handle in self.handles:
            handle.close()

    def released(self) -> bool:
        return any(handle.closed for handle in self.handles)

    def done(self) -> bool:
        return all(handle.done() for handle in self.handles)


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
class ResolvedTierEvent:
    """A `TierEvent` with what the host knows of its chunk: the previous chunk's hash in the
    prefix chain (None for a prefix's first chunk) and the chunk's token ids; both None when the
    host never saw the chunk's tokens (a chunk found on disk at start-up and evicted unseen)."""

    event: TierEvent
    parent_hash: bytes | None
    token_ids: tuple[int, ...] | None


_NO_TOKENS = (None, None)


@dataclasses.dataclass(slots=True)
class HostCounters:
    """What the host did for its serving stack (the engine keeps its own counters)."""

    lookups: int = 0
    lookups_pending: int = 0  # answered "ask again": a load was still in flight
    lookup_hit_tokens: int = 0  # tokens ready when the lookup answered
    lookup_seconds: float = 0.0
    loads: int = 0
    loaded_tokens: int = 0
    load_shortfall_tokens: int = 0  # promised to the scheduler, not delivered (recomputed)
    stores: int = 0
    stored_tokens: int = 0
    prefetches_abandoned: int = 0
    pins_expired: int = 0  # answers whose pins outlived ``pin_timeout_s`` (released)
    pins_over_budget: int = 0  # answers not wholly pinned: ``pin_budget_bytes`` reached
    partial_chunk_hits: int = 0  # lookups extended by a stored partial chunk
    prefills_observed: int = 0  # prefill times reported to the recompute model


@dataclasses.dataclass(frozen=True, slots=True)
class HostStats(EngineStats):
    """`EngineHost.stats`: the engine's snapshot plus the host's own numbers (its ``host``
    section in `as_dict`; Prometheus text has the engine's only)."""

    host: HostCounters = dataclasses.field(kw_only=True)  # a copy
    prefetches_held: int = dataclasses.field(kw_only=True)
    pinned_bytes: int = dataclasses.field(kw_only=True)
    tier_events: int = dataclasses.field(kw_only=True)
    tier_events_dropped: int = dataclasses.field(kw_only=True)

    def as_dict(self) -> StatsDict:
        out = EngineStats.as_dict(self)  # no bare super(): slotted dataclasses are rebuilt
        out["host"] = {
            **dataclasses.asdict(self.host),
            "prefetches_held": self.prefetches_held,
            "pinned_bytes": self.pinned_bytes,
            "tier_events": self.tier_events,
            "tier_events_dropped": self.tier_events_dropped,
        }
        return out


class EngineHost(SyncTieredKVEngine):
    """The blocking engine facade (its own loop thread), plus what a serving stack's worker
    needs: lookups answered on the loop for a scheduler elsewhere, per-request prefetches, and
    counters. ``close()`` (or ``with``) ends all of it.

    Thread-safety: the blocking methods may be called from any thread but the loop's; the
    lookup path runs on the loop. Prefetch handles never leave the loop.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        lower_tiers: Sequence[LowerTier] = (),
        pin_budget_bytes: int | None = None,
        pin_timeout_s: float = 60.0,
    ) -> None:
        """``pin_budget_bytes`` (default: a quarter of L1) bounds the L1 bytes that answered
        lookups keep pinned until their loads; ``pin_timeout_s`` bounds how long (a request the
        serving stack never loads nor ends)."""
        if pin_timeout_s <= 0:
            raise ValueError(f"pin_timeout_s: must be > 0, got {pin_timeout_s}")
        self.counters = HostCounters()
        budget = config.l1_bytes // 4 if pin_budget_bytes is None else pin_budget_bytes
        self.pin_budget_bytes = budget
        self.pin_timeout_s = pin_timeout_s
        self._lookups: OrderedDict[str, _Lookup] = OrderedDict()
        self._server: LookupServer | None = None
        self._model_name: str | None = None
        self._groups: list[LayerGroup] = []  # set by `register_kv_caches` (sliding_window=)
        self._block_size = 0
        self._tier_events: TierEventLog | None = None  # set by `watch_tiers`
        # chunk hash -> (the previous chunk's hash, the chunk's tokens), most recent last
        self._chunk_tokens: OrderedDict[bytes, tuple[bytes | None, tuple[int, ...]]] = OrderedDict()
        self._chunk_tokens_max = 0
        super().__init__(config, lower_tiers=lower_tiers)

    def register_kv_caches(
        self,
        kv_caches: Sequence[Any] | Mapping[str, Any],
        *,
        model_name: str,
        world_size: int = 1,
        worker_id: int = 0,
        layout_hints: Mapping[str, Any] | None = None,
        sliding_window: int | None = None,
        block_size: int | None = None,
    ) -> MemoryLayoutDesc:
        """Register a model's caches, or one layer group of a hybrid model: each group under a
        model name of its own, ``sliding_window`` (tokens) for a sliding-window group, and the
        serving stack's ``block_size`` (default: the layout's token multiple). Lookups answer
        for every group registered (see `answer_lookup`)."""
        desc = super().register_kv_caches(
            kv_caches,
            model_name=model_name,
            world_size=world_size,
            worker_id=worker_id,
            layout_hints=layout_hints,
        )
        self._model_name = model_name
        self._groups = [g for g in self._groups if g.model_name != model_name]
        self._groups.append(LayerGroup(model_name, sliding_window))
        self._block_size = block_size or desc.token_multiple
        return desc

    def serve_lookups(self, path: str) -> None:
        """Answer `lookup` on the Unix socket ``path`` (see `lookup_channel`)."""

        async def start() -> None:
            server = LookupServer(path, self.answer_lookup)
            await server.start()
            self._server = server

        self._call(start())

    def load(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        skip_prefix_tokens: int,
        claimed_tokens: int | None = None,
        salt: KeySalt | None = None,
        model_name: str | None = None,
        request_id: str | None = None,
    ) -> RetrieveResult:
        """Retrieve the cached prefix into ``block_ids``. ``claimed_tokens`` (default: all of
        ``token_ids``) is what the serving stack counts on; the counters measure against it.
        ``request_id``: the request whose lookup prefetched these tokens; the retrieve uses
        that prefetch (and ends it) instead of joining its loads."""
        claimed = len(token_ids) if claimed_tokens is None else claimed_tokens

        async def load() -> RetrieveResult:
            result = await self._engine.retrieve(
                token_ids,
                block_ids,
                skip_prefix_tokens=skip_prefix_tokens,
                salt=salt,
                model_name=model_name,
                prefetch=self._lookup_prefetch(request_id, model_name),
            )
            delivered = min(result.valid_tokens, claimed)
            self.counters.loads += 1
            self.counters.loaded_tokens += max(delivered - skip_prefix_tokens, 0)
            self.counters.load_shortfall_tokens += claimed - delivered
            return result

        return self._call(load())

    def load_layerwise(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        *,
        skip_prefix_tokens: int,
        claimed_tokens: int | None = None,
        salt: KeySalt | None = None,
        request_id: str | None = None,
    ) -> SyncLayerwiseRetrieve:
        """`load`, layer by layer: returns once the delivered prefix is decided (``result``)
        and its copies are enqueued; the model waits per layer (``wait_layer``)."""
        claimed = len(token_ids) if claimed_tokens is None else claimed_tokens

        async def load() -> LayerwiseRetrieve:
            load = await self._engine.retrieve_layerwise(
                token_ids,
                block_ids,
                skip_prefix_tokens=skip_prefix_tokens,
                salt=salt,
                prefetch=self._lookup_prefetch(request_id, None),
            )
            delivered = min(load.result.valid_tokens, claimed)
            self.counters.loads += 1
            self.counters.loaded_tokens += max(delivered - skip_prefix_tokens, 0)
            self.counters.load_shortfall_tokens += claimed - delivered
            return load

        return SyncLayerwiseRetrieve(self, self._call(load()))

    def _lookup_prefetch(
        self, request_id: str | None, model_name: str | None
    ) -> PrefetchHandle | None:
        """The open prefetch the request's lookup started for this layer group (None: no
        lookup, or it has ended); the load's retrieve takes it over."""
        lookup = None if request_id is None else self._lookups.get(request_id)
        if lookup is None:
            return None
        names = [group.model_name for group in self._groups] or [self._model_name or ""]
        name = model_name if model_name is not None else (self._model_name or "")
        if name not in names:
            return None
        handle = lookup.handles[names.index(name)]
        return None if handle.closed else handle

    def commit_store(self, saver: SyncLayerwiseStore) -> int:
        """Commit a layerwise store begun with `store_layerwise` (every layer saved); new
        tokens stored."""
        stored = saver.commit()
        self.counters.stores += 1
        self.counters.stored_tokens += stored
        return stored

    def store(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        model_name: str | None = None,
        salt: KeySalt | None = None,
        skip_prefix_tokens: int = 0,
    ) -> int:
        """Copy the tokens' KV out of ``block_ids`` (done when this returns); new tokens stored."""

        async def store() -> int:
            stored = await self._engine.store(
                token_ids,
                block_ids,
                model_name=model_name,
                salt=salt,
                skip_prefix_tokens=skip_prefix_tokens,
            )
            self.counters.stores += 1
            self.counters.stored_tokens += stored
            if self._tier_events is not None:
                self._remember_tokens(token_ids, model_name, salt)
            return stored

        return self._call(store())

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the prefetches of these requests (loaded, finished or not going to load)."""
        ids = list(request_ids)
        if not ids or self._closed:
            return

        async def release() -> None:
            for request_id in ids:
                lookup = self._lookups.pop(request_id, None)
                if lookup is not None:
                    lookup.cancel()

        self._call(release())

    def stats(self) -> HostStats:
        """The engine's statistics and the host's, taken together on the loop."""

        async def stats() -> HostStats:
            engine = self._engine.stats()
            events = self._tier_events
            return HostStats(
                **{f.name: getattr(engine, f.name) for f in dataclasses.fields(engine)},
                host=dataclasses.replace(self.counters),
                prefetches_held=len(self._lookups),
                pinned_bytes=self._pinned_bytes(),
                tier_events=0 if events is None else events.emitted,
                tier_events_dropped=0 if events is None else events.dropped,
            )

        return self._call(stats())

    def observe_prefill(self, new_tokens: int, prefix_tokens: int, seconds: float) -> None:
        """A prefill the model ran (`TieredKVEngine.observe_prefill`: the recompute model of
        ``load_policy="cost"``). Returns at once: the observation is queued onto the loop."""
        if new_tokens < 1 or prefix_tokens < 0 or not 0 < seconds < float("inf"):
            raise ValueError(
                f"observe_prefill: expected new_tokens >= 1, prefix_tokens >= 0 and seconds > 0, "
                f"got {new_tokens}, {prefix_tokens}, {seconds}"
            )
        if not self._closed:
            self._loop.call_soon_threadsafe(
                self._engine.observe_prefill, new_tokens, prefix_tokens, seconds
            )
        self.counters.prefills_observed += 1

    def watch_tiers(self, capacity: int = 8192, remembered_chunks: int = 8192) -> None:
        """Record chunks entering and leaving every tier from now on (`tier_events` drains
        them): at most ``capacity`` undrained events (the oldest are dropped beyond, counted in
        ``tier_events_dropped``), and the tokens of the last ``remembered_chunks`` chunks stored
        or looked up, for the events' token ids."""
        if remembered_chunks < 1:
            raise ValueError(f"remembered_chunks: expected >= 1, got {remembered_chunks}")

        def watch() -> None:
            self._chunk_tokens_max = remembered_chunks
            self._tier_events = self._engine.watch_tiers(capacity)

        self._run_on_loop(watch)

    def tier_events(self) -> list[ResolvedTierEvent]:
        """The tier events since the last call, oldest first, with their chunks' tokens where
        known; [] at once (no hop to the loop) when there are none or nobody watches."""
        log = self._tier_events
        if log is None or not len(log) or self._closed:
            return []

        def drain() -> list[ResolvedTierEvent]:
            tokens = self._chunk_tokens
            return [
                ResolvedTierEvent(event, *tokens.get(event.key.chunk_hash, _NO_TOKENS))
                for event in log.drain()
            ]

        return self._run_on_loop(drain)

    def close(self) -> None:
        """Stop serving lookups, free every prefetch, close the engine (flushing pending lower-
        tier writes, bounded by ``close_timeout_s``) and stop the loop thread. Idempotent."""
        if self._closed:
            return

        async def stop_serving() -> None:
            server, self._server = self._server, None
            if server is not None:
                await server.aclose()
            for lookup in self._lookups.values():
                lookup.cancel()
            self._lookups.clear()

        try:
            self._call(stop_serving())
        finally:
            super().close()

    # -- on the loop ------------------------------------------------------------------------
    def _remember_tokens(
        self, token_ids: Sequence[int], model_name: str | None, salt: KeySalt | None
    ) -> None:
        """Keep the tokens of ``token_ids``'s chunks (whole blocks) for tier events."""
        keys = self._engine.chunk_keys(token_ids, model_name=model_name, salt=salt)
        chunk, remembered = self.config.chunk_size, self._chunk_tokens
        block = max(self._block_size, 1)
        token_ids = token_ids[: len(token_ids) // block * block]  # as the keys cover them
        parent: bytes | None = None
        for index, key in enumerate(keys):
            chunk_hash = key.chunk_hash
            if chunk_hash in remembered:
                remembered.move_to_end(chunk_hash)
            else:
                tokens = tuple(token_ids[index * chunk : (index + 1) * chunk])
                remembered[chunk_hash] = (parent, tokens)
            parent = chunk_hash
        while len(remembered) > self._chunk_tokens_max:
            remembered.popitem(last=False)

    async def answer_lookup(
        self,
        request_id: str,
        token_ids: list[int],
        salt: KeySalt | None = None,
        limit: int | None = None,
    ) -> int | None:
        """Tokens of ``token_ids``'s cached prefix now in host memory, or None ("ask again")
        while the loads the first lookup started are in flight, per ``prefetch_policy``:
        best_effort answers at once, wait_complete when every load ended, timeout when every
        load ended or its budget ran out. Failed loads (a corrupt chunk) end the prefix.

        A hybrid model (several layer groups) answers the longest whole-block prefix, at most
        ``limit``, that every full-attention group holds from its start and every
        sliding-window group holds over the window before its end."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        clock = time.perf_counter()
        groups = self._groups or [LayerGroup(self._model_name or "")]
        lookup = self._lookups.get(request_id)
        if (
            lookup is None
            or lookup.token_ids != token_ids
            or lookup.salt != salt
            or lookup.released()
        ):
            if lookup is not None:
                lookup.cancel()
            handles = await self._prefetch_groups(groups, token_ids, salt, limit)
            if self._tier_events is not None:  # chunks it promotes into L1 are announced
                for group in groups:
                    self._remember_tokens(token_ids, group.model_name, salt)
            deadline = None
            if self.config.prefetch_policy == "timeout":
                hit = max(handle.hit_tokens for handle in handles)
                deadline = started + (
                    self.config.prefetch_timeout_base_s
                    + self.config.prefetch_timeout_per_1k_tokens_s * hit / 1000
                )
            lookup = _Lookup(token_ids, salt, handles, started, deadline)
            self._lookups[request_id] = lookup
            while len(self._lookups) > self.config.prefetch_max_pending:
                _, oldest = self._lookups.popitem(last=False)
                oldest.cancel()
                self.counters.prefetches_abandoned += 1
        self._lookups.move_to_end(request_id)
        self.counters.lookups += 1
        self._expire_pins(loop.time())
        policy = self.config.prefetch_policy
        answer: int | None
        if (
            policy == "best_effort"
            or lookup.done()
            or (lookup.deadline is not None and loop.time() >= lookup.deadline)
        ):
            if len(groups) == 1:
                answer = lookup.handles[0].ready_tokens()
            else:
                answer = self._hybrid_ready(groups, lookup, len(token_ids), limit)
            self.counters.lookup_hit_tokens += answer
            if answer > 0:
                self._pin(lookup, answer, loop.time())
        else:
            answer = None
            self.counters.lookups_pending += 1
        self.counters.lookup_seconds += time.perf_counter() - clock
        return answer

    def _pin(self, lookup: _Lookup, answer: int, now: float) -> None:
        """Pin the L1 chunks of an answer (chunks the handles load are held by their
        reservations already) within the budget left."""
        room = self.pin_budget_bytes - self._pinned_bytes()
        last_chunk = -(-answer // self.config.chunk_size)
        complete = True
        for handle in lookup.handles:
            pinned, whole = handle.pin_l1(last_chunk - handle.first_chunk, max(room, 0))
            room -= pinned
            complete = complete and whole
        if not complete:
            self.counters.pins_over_budget += 1
        if lookup.pinned_at is None:
            lookup.pinned_at = now

    def _pinned_bytes(self) -> int:
        return sum(h.pinned_bytes() for lookup in self._lookups.values() for h in lookup.handles)

    def _expire_pins(self, now: float) -> None:
        for lookup in self._lookups.values():
            if lookup.pinned_at is not None and now - lookup.pinned_at > self.pin_timeout_s:
                for handle in lookup.handles:
                    handle.unpin()
                lookup.pinned_at = None
                self.counters.pins_expired += 1

    async def _prefetch_groups(
        self,
        groups: list[LayerGroup],
        token_ids: list[int],
        salt: KeySalt | None,
        limit: int | None,
    ) -> list[PrefetchHandle]:
        """One prefetch per group: full-attention groups from the start; sliding-window groups
        over the window before the longest prefix every full group has located (shorter
        answers whose window starts earlier are misses there)."""
        if len(groups) == 1:
            return [await self._prefetch_with_partial(groups[0].model_name, token_ids, salt)]
        handles: dict[str, PrefetchHandle] = {}
        located = len(token_ids) if limit is None else min(limit, len(token_ids))
        for group in groups:
            if group.sliding_window is None:
                handle = await self._engine.prefetch(
                    token_ids, model_name=group.model_name, salt=salt, worth_loading=True
                )
                handles[group.model_name] = handle
                located = min(located, handle.hit_tokens)
        block = max(self._block_size, 1)
        located = located // block * block
        for group in groups:
            if group.sliding_window is not None:
                start = window_start(located, group.sliding_window, block)
                handles[group.model_name] = await self._engine.prefetch(
                    token_ids, model_name=group.model_name, salt=salt, from_token=start
                )
        return [handles[group.model_name] for group in groups]

    async def _prefetch_with_partial(
        self, model_name: str, token_ids: list[int], salt: KeySalt | None
    ) -> PrefetchHandle:
        """The prefetch of the cached prefix, extended into the first chunk it misses by the
        longest stored partial chunk there (a prompt stored with a partial last chunk, which a
        longer follow-up extends): its key is that of the prefix cut at a whole block. Partial
        chunks are looked for in the tiers' indexes (no I/O per candidate: a remote tier knows
        the keys it has seen)."""
        handle = await self._engine.prefetch(
            token_ids, model_name=model_name, salt=salt, worth_loading=True
        )
        hit, chunk, block = handle.hit_tokens, self.config.chunk_size, max(self._block_size, 1)
        if hit >= len(token_ids) or hit % chunk:
            return handle
        for length in range(min(chunk - block, len(token_ids) - hit) // block * block, 0, -block):
            keys = self._engine.chunk_keys(
                token_ids[: hit + length], model_name=model_name, salt=salt
            )
            if self._engine.tier_of(keys[-1]) is None:
                continue
            partial = await self._engine.prefetch(
                token_ids[: hit + length], model_name=model_name, salt=salt, worth_loading=True
            )
            if partial.hit_tokens == hit + length:
                handle.close()
                self.counters.partial_chunk_hits += 1
                if self._tier_events is not None:
                    self._remember_tokens(token_ids[: hit + length], model_name, salt)
                return partial
            partial.close()
        return handle

    def _hybrid_ready(
        self, groups: list[LayerGroup], lookup: _Lookup, num_tokens: int, limit: int | None
    ) -> int:
        block, chunk = self._block_size, self.config.chunk_size
        end = num_tokens if limit is None else min(limit, num_tokens)
        windows: list[tuple[int, int, list[bool]]] = []  # window, first chunk, ready per chunk
        for group, handle in zip(groups, lookup.handles, strict=True):
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
