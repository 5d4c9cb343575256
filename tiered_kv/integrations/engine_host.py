"""`EngineHost`: a `TieredKVEngine` on its own event-loop thread, for serving-stack workers.

Owns the engine, its loop thread, the per-request prefetches that lookups start (keyed by the
serving stack's request id, released when the request is loaded, finished or abandoned), and the
`LookupServer` that answers a scheduler in another thread or process. Blocking methods are for
the worker's own threads; everything touching the engine or the prefetches runs on the loop.
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
from tiered_kv.engine import RetrieveResult
from tiered_kv.integrations.lookup_channel import LookupServer
from tiered_kv.keys import KeySalt, TokenIds
from tiered_kv.layout import MemoryLayoutDesc
from tiered_kv.prefetch import PrefetchHandle
from tiered_kv.retrieval import LayerwiseRetrieve
from tiered_kv.sync import SyncLayerwiseRetrieve, SyncLayerwiseStore, SyncTieredKVEngine
from tiered_kv.tiers.base import LowerTier

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True, eq=False)
class _Lookup:
    token_ids: list[int]
    salt: KeySalt | None
    handle: PrefetchHandle
    started: float
    deadline: float | None  # prefetch policy "timeout": answer with what is ready by then


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


class EngineHost(SyncTieredKVEngine):
    """The blocking engine facade (its own loop thread), plus what a serving stack's worker
    needs: lookups answered on the loop for a scheduler elsewhere, per-request prefetches, and
    counters. ``close()`` (or ``with``) ends all of it.

    Thread-safety: the blocking methods may be called from any thread but the loop's; the
    lookup path runs on the loop. Prefetch handles never leave the loop.
    """

    def __init__(self, config: EngineConfig, *, lower_tiers: Sequence[LowerTier] = ()) -> None:
        self.counters = HostCounters()
        self._lookups: OrderedDict[str, _Lookup] = OrderedDict()
        self._server: LookupServer | None = None
        self._model_name: str | None = None
        super().__init__(config, lower_tiers=lower_tiers)

    def register_kv_caches(
        self,
        kv_caches: Sequence[Any] | Mapping[str, Any],
        *,
        model_name: str,
        world_size: int = 1,
        worker_id: int = 0,
        layout_hints: Mapping[str, Any] | None = None,
    ) -> MemoryLayoutDesc:
        desc = super().register_kv_caches(
            kv_caches,
            model_name=model_name,
            world_size=world_size,
            worker_id=worker_id,
            layout_hints=layout_hints,
        )
        self._model_name = model_name
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
    ) -> RetrieveResult:
        """Retrieve the cached prefix into ``block_ids``. ``claimed_tokens`` (default: all of
        ``token_ids``) is what the serving stack counts on; the counters measure against it."""
        claimed = len(token_ids) if claimed_tokens is None else claimed_tokens

        async def load() -> RetrieveResult:
            result = await self._engine.retrieve_detailed(
                token_ids, block_ids, skip_prefix_tokens=skip_prefix_tokens, salt=salt
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
    ) -> SyncLayerwiseRetrieve:
        """`load`, layer by layer: returns once the delivered prefix is decided (``result``)
        and its copies are enqueued; the model waits per layer (``wait_layer``)."""
        claimed = len(token_ids) if claimed_tokens is None else claimed_tokens

        async def load() -> LayerwiseRetrieve:
            load = await self._engine.retrieve_layerwise(
                token_ids, block_ids, skip_prefix_tokens=skip_prefix_tokens, salt=salt
            )
            delivered = min(load.result.valid_tokens, claimed)
            self.counters.loads += 1
            self.counters.loaded_tokens += max(delivered - skip_prefix_tokens, 0)
            self.counters.load_shortfall_tokens += claimed - delivered
            return load

        return SyncLayerwiseRetrieve(self, self._call(load()))

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
    ) -> int:
        """Copy the tokens' KV out of ``block_ids`` (done when this returns); new tokens stored."""

        async def store() -> int:
            stored = await self._engine.store(
                token_ids, block_ids, model_name=model_name, salt=salt
            )
            self.counters.stores += 1
            self.counters.stored_tokens += stored
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
                    lookup.handle.cancel()

        self._call(release())

    def stats(self) -> dict[str, dict[str, int | float]]:
        async def stats() -> dict[str, dict[str, int | float]]:
            out = self._engine.stats()
            out["host"] = dict(dataclasses.asdict(self.counters))
            out["host"]["prefetches_held"] = len(self._lookups)
            return out

        return self._call(stats())

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
                lookup.handle.cancel()
            self._lookups.clear()

        try:
            self._call(stop_serving())
        finally:
            super().close()

    # -- on the loop ------------------------------------------------------------------------
    async def answer_lookup(
        self, request_id: str, token_ids: list[int], salt: KeySalt | None = None
    ) -> int | None:
        """Tokens of ``token_ids``'s cached prefix now in host memory, or None ("ask again")
        while the loads the first lookup started are in flight, per ``prefetch_policy``:
        best_effort answers at once, wait_complete when every load ended, timeout when every
        load ended or its budget ran out. Failed loads (a corrupt chunk) end the prefix."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        clock = time.perf_counter()
        lookup = self._lookups.get(request_id)
        if (
            lookup is None
            or lookup.token_ids != token_ids
            or lookup.salt != salt
            or lookup.handle.released
        ):
            if lookup is not None:
                lookup.handle.cancel()
            handle = await self._engine.prefetch(token_ids, model_name=self._model_name, salt=salt)
            deadline = None
            if self.config.prefetch_policy == "timeout":
                deadline = started + (
                    self.config.prefetch_timeout_base_s
                    + self.config.prefetch_timeout_per_1k_tokens_s * handle.hit_tokens / 1000
                )
            lookup = _Lookup(token_ids, salt, handle, started, deadline)
            self._lookups[request_id] = lookup
            while len(self._lookups) > self.config.prefetch_max_pending:
                _, oldest = self._lookups.popitem(last=False)
                oldest.handle.cancel()
                self.counters.prefetches_abandoned += 1
        self._lookups.move_to_end(request_id)
        self.counters.lookups += 1
        handle = lookup.handle
        policy = self.config.prefetch_policy
        answer: int | None
        if (
            policy == "best_effort"
            or handle.done()
            or (lookup.deadline is not None and loop.time() >= lookup.deadline)
        ):
            answer = handle.ready_tokens()
            self.counters.lookup_hit_tokens += answer
        else:
            answer = None
            self.counters.lookups_pending += 1
        self.counters.lookup_seconds += time.perf_counter() - clock
        return answer
