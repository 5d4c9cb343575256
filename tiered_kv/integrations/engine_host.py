"""`EngineHost`: a `TieredKVEngine` on its own event-loop thread, for serving-stack workers.

Owns the engine (whose lookups claim only what ``load_policy`` finds worth loading, from the
prefill times the serving stack reports with `observe_prefill`), its loop thread, the
`LookupServer` that answers a scheduler in another thread or process, and the host's parts,
each of one concept: `HostLookups` (per-request prefetches and the pins that hold an answered
claim), `LayerGroups` (the registered groups of a hybrid model), `TierWatch` (tier events with
their chunks' tokens) and `HostCounters` (`HostStats`, the snapshot). It wires them together and
hops each call onto the loop. The blocking methods are for the worker's own threads (never the
loop's); everything touching the engine, the lookups or the watch runs on the loop.
Must not import a serving stack or touch KV bytes itself (the engine's mover does).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict

from tiered_kv.config import EngineConfig
from tiered_kv.integrations.host_lookups import HostLookups, PinLimits
from tiered_kv.integrations.host_stats import HostCounters, HostStats
from tiered_kv.integrations.layer_groups import LayerGroups
from tiered_kv.integrations.lookup_channel import LookupServer
from tiered_kv.integrations.tier_watch import ResolvedTierEvent, TierWatch
from tiered_kv.keys import KeySalt, TokenIds
from tiered_kv.layout import MemoryLayoutDesc
from tiered_kv.retrieval import LayerwiseRetrieve, RetrieveResult
from tiered_kv.sync import SyncLayerwiseRetrieve, SyncLayerwiseStore, SyncTieredKVEngine
from tiered_kv.tiers.base import LowerTier

logger = logging.getLogger(__name__)


class LoadOptions(TypedDict):
    """The keyword arguments `EngineHost.load` and `EngineHost.load_layerwise` share, for a
    caller that picks the verb at run time (``host.load(tokens, blocks, **options)``)."""

    skip_prefix_tokens: int
    claimed_tokens: int | None
    salt: KeySalt | None
    request_id: str | None


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
        budget = config.l1_bytes // 4 if pin_budget_bytes is None else pin_budget_bytes
        pins = PinLimits(budget, pin_timeout_s)  # checked before the engine opens
        self.counters = HostCounters()
        self._server: LookupServer | None = None
        super().__init__(config, lower_tiers=lower_tiers)
        self._groups = LayerGroups(self._engine)
        self._watch = TierWatch(self.config.chunk_size)
        self._lookups = HostLookups(
            self._engine, self._groups, self.counters, self._remember_tokens, pins
        )

    @property
    def pin_budget_bytes(self) -> int:
        return self._lookups.pins.budget_bytes

    @property
    def pin_timeout_s(self) -> float:
        return self._lookups.pins.timeout_s

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
        for every group registered (`HostLookups.answer`)."""
        desc = super().register_kv_caches(
            kv_caches,
            model_name=model_name,
            world_size=world_size,
            worker_id=worker_id,
            layout_hints=layout_hints,
        )
        self._groups.register(model_name, sliding_window, block_size or desc.token_multiple)
        return desc

    def serve_lookups(self, path: str) -> None:
        """Answer a scheduler's lookups (`HostLookups.answer`) on the Unix socket ``path`` (see
        `lookup_channel`)."""

        async def start() -> None:
            server = LookupServer(path, self._lookups.answer)
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
                prefetch=self._lookups.prefetch_of(request_id, model_name),
            )
            self.counters.count_load(result.valid_tokens, claimed, skip_prefix_tokens)
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
                prefetch=self._lookups.prefetch_of(request_id, None),
            )
            self.counters.count_load(load.result.valid_tokens, claimed, skip_prefix_tokens)
            return load

        return SyncLayerwiseRetrieve(self, self._call(load()))

    def commit_store(self, saver: SyncLayerwiseStore) -> int:
        """Commit a layerwise store begun with `store_layerwise` (every layer saved); new
        tokens stored."""
        stored = saver.commit()
        self.counters.count_store(stored)
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
            self.counters.count_store(stored)
            self._remember_tokens(token_ids, model_name, salt)
            return stored

        return self._call(store())

    def release(self, request_ids: Iterable[str]) -> None:
        """Free the prefetches of these requests (loaded, finished or not going to load)."""
        ids = list(request_ids)
        if not ids or self._closed:
            return
        self._run_on_loop(lambda: self._lookups.release(ids))

    def stats(self) -> HostStats:
        """The engine's statistics and the host's, taken together on the loop."""

        def stats() -> HostStats:
            watch = self._watch
            return HostStats.of(
                self._engine.stats(),
                self.counters,
                prefetches_held=len(self._lookups),
                pinned_bytes=self._lookups.pinned_bytes(),
                tier_events=watch.emitted(),
                tier_events_dropped=watch.dropped(),
            )

        return self._run_on_loop(stats)

    def observe_prefill(self, new_tokens: int, prefix_tokens: int, seconds: float) -> None:
        """A prefill the model ran (`TieredKVEngine.observe_prefill`: the recompute model of
        ``load_policy="cost"``). Returns at once: the observation is queued onto the loop."""
        if new_tokens < 1 or prefix_tokens < 0 or not 0 < seconds < float("inf"):
            raise ValueError(
                f"observe_prefill: expected new_tokens >= 1, prefix_tokens >= 0 and seconds > 0, "
                f"got {new_tokens}, {prefix_tokens}, {seconds}"
            )
        if not self._closed:
            self._loop.call_soon(self._engine.observe_prefill, new_tokens, prefix_tokens, seconds)
        self.counters.prefills_observed += 1

    def watch_tiers(self, capacity: int = 8192, remembered_chunks: int = 8192) -> None:
        """Record chunks entering and leaving every tier from now on (`tier_events` drains
        them): at most ``capacity`` undrained events (the oldest are dropped beyond, counted in
        ``tier_events_dropped``), and the tokens of the last ``remembered_chunks`` chunks stored
        or looked up, for the events' token ids."""
        if remembered_chunks < 1:
            raise ValueError(f"remembered_chunks: expected >= 1, got {remembered_chunks}")
        self._run_on_loop(
            lambda: self._watch.watch(self._engine.watch_tiers(capacity), remembered_chunks)
        )

    def tier_events(self) -> list[ResolvedTierEvent]:
        """The tier events since the last call, oldest first, with their chunks' tokens where
        known; [] at once (no hop to the loop) when there are none or nobody watches."""
        if not self._watch.pending() or self._closed:
            return []
        return self._run_on_loop(self._watch.drain)

    def close(self) -> None:
        """Stop serving lookups, free every prefetch, close the engine (flushing pending lower-
        tier writes, bounded by ``close_timeout_s``) and stop the loop thread. Idempotent."""
        if self._closed:
            return

        async def stop_serving() -> None:
            server, self._server = self._server, None
            if server is not None:
                await server.aclose()
            self._lookups.close()

        try:
            self._call(stop_serving())
        finally:
            super().close()

    # -- on the loop ------------------------------------------------------------------------
    def _remember_tokens(
        self, token_ids: Sequence[int], model_name: str | None, salt: KeySalt | None
    ) -> None:
        """Keep the tokens of ``token_ids``'s chunks for tier events, while someone watches."""
        if self._watch.watching:
            keys = self._engine.chunk_keys(token_ids, model_name=model_name, salt=salt)
            self._watch.remember(keys, token_ids, self._groups.block_size)
