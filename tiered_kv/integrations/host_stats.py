"""An engine host's statistics: its counters (`HostCounters`) and its snapshot (`HostStats`).

Owns what the host counts for its serving stack beyond the engine's own counters (lookups,
loads measured against the scheduler's claims, stores, pins, prefill reports) and the typed
snapshot `EngineHost.stats` returns: the engine's `EngineStats` plus the host's numbers. Readers
take fields by attribute, so a renamed field fails type checking; ``as_dict`` is for JSON only.
Must not keep state beyond the counters nor read the engine: the host fills them in, on its
loop (prefill reports are counted on the reporting thread) and copies them into each snapshot.
"""

from __future__ import annotations

import dataclasses

from tiered_kv.metrics import EngineStats, StatsDict


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

    def count_load(self, valid_tokens: int, claimed_tokens: int, skip_prefix_tokens: int) -> None:
        """One load that delivered ``valid_tokens`` of the ``claimed_tokens`` the serving stack
        counted on (tokens before ``skip_prefix_tokens`` it had already)."""
        delivered = min(valid_tokens, claimed_tokens)
        self.loads += 1
        self.loaded_tokens += max(delivered - skip_prefix_tokens, 0)
        self.load_shortfall_tokens += claimed_tokens - delivered

    def count_store(self, stored_tokens: int) -> None:
        self.stores += 1
        self.stored_tokens += stored_tokens


@dataclasses.dataclass(frozen=True, slots=True)
class HostStats(EngineStats):
    """`EngineHost.stats`: the engine's snapshot plus the host's own numbers (its ``host``
    section in `as_dict`; Prometheus text has the engine's only)."""

    host: HostCounters = dataclasses.field(kw_only=True)  # a copy
    prefetches_held: int = dataclasses.field(kw_only=True)
    pinned_bytes: int = dataclasses.field(kw_only=True)
    tier_events: int = dataclasses.field(kw_only=True)
    tier_events_dropped: int = dataclasses.field(kw_only=True)

    @classmethod
    def of(
        cls,
        engine: EngineStats,
        host: HostCounters,
        *,
        prefetches_held: int,
        pinned_bytes: int,
        tier_events: int,
        tier_events_dropped: int,
    ) -> HostStats:
        """The engine's snapshot with the host's numbers (``host`` is copied)."""
        return cls(
            **{f.name: getattr(engine, f.name) for f in dataclasses.fields(engine)},
            host=dataclasses.replace(host),
            prefetches_held=prefetches_held,
            pinned_bytes=pinned_bytes,
            tier_events=tier_events,
            tier_events_dropped=tier_events_dropped,
        )

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
