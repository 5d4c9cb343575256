"""A host's lookups: `HostLookups`, the answers a scheduler gets and the prefetches behind them.

Owns, per request (keyed by the serving stack's request id), the prefetches the request's first
lookup started across the layer groups, the answer policy (``prefetch_policy``: answer now, or
"ask again" while loads are in flight), and the pins that make an answer hold: once a lookup has
answered, the L1 chunks of its answer stay pinned until the request is loaded, finished or
abandoned, within a byte budget and a deadline (`PinLimits`). At most ``prefetch_max_pending``
requests are held; the oldest is abandoned beyond. A request's load takes its prefetch over
(`prefetch_of`). Must not block, touch KV bytes or outlive its host: every method runs on the
host's loop, and the host ends them all (`close`) before the engine closes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Iterable

from tiered_kv.engine import TieredKVEngine
from tiered_kv.integrations.host_stats import HostCounters
from tiered_kv.integrations.layer_groups import LayerGroups
from tiered_kv.integrations.tier_watch import RememberTokens
from tiered_kv.keys import KeySalt
from tiered_kv.prefetch import PrefetchHandle


@dataclasses.dataclass(frozen=True, slots=True)
class PinLimits:
    """How much an answered lookup may keep pinned in L1 until its load (``budget_bytes``, over
    every request) and for how long (``timeout_s``: a request never loaded nor ended)."""

    budget_bytes: int
    timeout_s: float

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"pin_timeout_s: must be > 0, got {self.timeout_s}")


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


class HostLookups:
    """The lookups of one host's requests: their prefetches, answers and pins."""

    def __init__(
        self,
        engine: TieredKVEngine,
        groups: LayerGroups,
        counters: HostCounters,
        remember: RememberTokens,
        pins: PinLimits,
    ) -> None:
        self._engine = engine
        self._groups = groups
        self._counters = counters
        self._remember = remember
        self.pins = pins
        self._lookups: OrderedDict[str, _Lookup] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lookups)

    async def answer(
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
        config, counters = self._engine.config, self._counters
        groups = self._groups.current()
        lookup = self._lookups.get(request_id)
        if (
            lookup is None
            or lookup.token_ids != token_ids
            or lookup.salt != salt
            or lookup.released()
        ):
            if lookup is not None:
                lookup.cancel()
            prefetch = await self._groups.prefetch(groups, token_ids, salt, limit)
            handles = prefetch.handles
            if prefetch.partial_tokens is not None:
                counters.partial_chunk_hits += 1
                self._remember(token_ids[: prefetch.partial_tokens], groups[0].model_name, salt)
            for group in groups:  # chunks the prefetch promotes into L1 are announced
                self._remember(token_ids, group.model_name, salt)
            deadline = None
            if config.prefetch_policy == "timeout":
                hit = max(handle.hit_tokens for handle in handles)
                deadline = started + (
                    config.prefetch_timeout_base_s
                    + config.prefetch_timeout_per_1k_tokens_s * hit / 1000
                )
            lookup = _Lookup(token_ids, salt, handles, started, deadline)
            self._lookups[request_id] = lookup
            while len(self._lookups) > config.prefetch_max_pending:
                _, oldest = self._lookups.popitem(last=False)
                oldest.cancel()
                counters.prefetches_abandoned += 1
        self._lookups.move_to_end(request_id)
        counters.lookups += 1
        self._expire_pins(loop.time())
        answer: int | None
        if (
            config.prefetch_policy == "best_effort"
            or lookup.done()
            or (lookup.deadline is not None and loop.time() >= lookup.deadline)
        ):
            answer = self._groups.ready_tokens(groups, lookup.handles, len(token_ids), limit)
            counters.lookup_hit_tokens += answer
            if answer > 0:
                self._pin(lookup, answer, loop.time())
        else:
            answer = None
            counters.lookups_pending += 1
        counters.lookup_seconds += time.perf_counter() - clock
        return answer

    def prefetch_of(self, request_id: str | None, model_name: str | None) -> PrefetchHandle | None:
        """The open prefetch the request's lookup started for this layer group (None: no
        lookup, or it has ended); the load's retrieve takes it over."""
        lookup = None if request_id is None else self._lookups.get(request_id)
        if lookup is None:
            return None
        index = self._groups.index_of(model_name)
        if index is None:
            return None
        handle = lookup.handles[index]
        return None if handle.closed else handle

    def release(self, request_ids: Iterable[str]) -> None:
        """End these requests' prefetches (loaded, finished or not going to load)."""
        for request_id in request_ids:
            lookup = self._lookups.pop(request_id, None)
            if lookup is not None:
                lookup.cancel()

    def close(self) -> None:
        """End every request's prefetch."""
        for lookup in self._lookups.values():
            lookup.cancel()
        self._lookups.clear()

    def pinned_bytes(self) -> int:
        return sum(h.pinned_bytes() for lookup in self._lookups.values() for h in lookup.handles)

    def _pin(self, lookup: _Lookup, answer: int, now: float) -> None:
        """Pin the L1 chunks of an answer (chunks the handles load are held by their
        reservations already) within the budget left."""
        room = self.pins.budget_bytes - self.pinned_bytes()
        last_chunk = -(-answer // self._engine.config.chunk_size)
        complete = True
        for handle in lookup.handles:
            pinned, whole = handle.pin_l1(last_chunk - handle.first_chunk, max(room, 0))
            room -= pinned
            complete = complete and whole
        if not complete:
            self._counters.pins_over_budget += 1
        if lookup.pinned_at is None:
            lookup.pinned_at = now

    def _expire_pins(self, now: float) -> None:
        for lookup in self._lookups.values():
            if lookup.pinned_at is not None and now - lookup.pinned_at > self.pins.timeout_s:
                for handle in lookup.handles:
                    handle.unpin()
                lookup.pinned_at = None
                self._counters.pins_expired += 1
