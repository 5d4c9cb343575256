# vLLM's base classes are Any where vLLM is not installed (the light .venv that lints).
"""The connector's counters as vLLM's connector stats: `TieredKVConnectorStats`.

Owns the stats type vLLM aggregates over the scheduler and the workers and logs per interval,
and the names in it: `WORKER_STATS` (each read from the engine host's `HostStats`) and
`SCHEDULER_STATS` (the scheduler half's own counters). Each half reports only its own names,
as deltas since its last report; must not read either half's state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tiered_kv.integrations.host_stats import HostStats
from tiered_kv.storage import TierReadStats
from tiered_kv.tiers.l3_remote import RemoteStats


@dataclasses.dataclass
class TieredKVConnectorStats(KVConnectorStats):
    """Counters of one logging interval, summed over the scheduler and the workers (names in
    `WORKER_STATS` and `SCHEDULER_STATS`): hits per tier, tokens loaded and stored, lookup
    latency, load errors."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: value for key, value in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


WorkerStat = Callable[[HostStats], int | float]


def _reads_of(stats: HostStats, tier: str) -> TierReadStats | None:
    """The reads of the lower tier ``tier`` (lower case); None while it or the storage does not
    exist."""
    storage = stats.storage
    for traffic in () if storage is None else storage.tiers:
        if traffic.name.lower() == tier:
            return traffic.reads
    return None


def _tier_reads(tier: str, read: Callable[[TierReadStats], int]) -> Callable[[HostStats], int]:
    """``read`` of the lower tier ``tier``'s reads (0 while they do not exist)."""

    def get(stats: HostStats) -> int:
        reads = _reads_of(stats, tier)
        return 0 if reads is None else read(reads)

    return get


def _l3_errors(stats: HostStats) -> int:
    """Failed L3 reads, and failed existence checks of the remote tier."""
    reads = _reads_of(stats, "l3")
    remote = next((tier for name, tier in stats.lower if name.lower() == "l3"), None)
    return (0 if reads is None else reads.failures) + (
        remote.exists_failures if isinstance(remote, RemoteStats) else 0
    )


# Worker-side stats: name -> how it is read from the engine host's `HostStats` (attributes, so
# that a renamed field fails type checking). The worker adds ``load_error_blocks``: blocks it
# reported to vLLM as not loaded.
WORKER_STATS: dict[str, WorkerStat] = {
    "loads": lambda stats: stats.host.loads,
    "loaded_tokens": lambda stats: stats.host.loaded_tokens,
    "load_shortfall_tokens": lambda stats: stats.host.load_shortfall_tokens,
    "stores": lambda stats: stats.host.stores,
    "stored_tokens": lambda stats: stats.host.stored_tokens,
    "lookups": lambda stats: stats.host.lookups,
    "lookups_pending": lambda stats: stats.host.lookups_pending,
    "lookup_seconds": lambda stats: stats.host.lookup_seconds,
    "tier_events_dropped": lambda stats: stats.tier_events_dropped,
    "prefills_observed": lambda stats: stats.host.prefills_observed,
    "storage_hits_l1": lambda stats: 0 if stats.storage is None else stats.storage.l1_hits,
    "storage_hits_l2": _tier_reads("l2", lambda reads: reads.hits),
    "storage_hits_l3": _tier_reads("l3", lambda reads: reads.hits),
    "declined_chunks_l2": _tier_reads("l2", lambda reads: reads.declined),
    "declined_chunks_l3": _tier_reads("l3", lambda reads: reads.declined),
    "prefetch_failed": lambda stats: (
        0 if stats.prefetch is None else stats.prefetch.counters.failed
    ),
    "l2_errors": _tier_reads("l2", lambda reads: reads.failures),
    "l3_errors": _l3_errors,
}
# Scheduler-side stats: lookups answered (not "ask again") and pending, the seconds from a
# request's first lookup to its answer (summed), tokens claimed for loading, and router events
# dropped at the scheduler's bound.
SCHEDULER_STATS = (
    "scheduler_lookups_answered",
    "scheduler_lookups_pending",
    "scheduler_lookup_latency_seconds",
    "claimed_tokens",
    "kv_events_dropped",
)


def worker_totals(stats: HostStats) -> dict[str, int | float]:
    """The `WORKER_STATS` totals in an engine host's `HostStats` snapshot."""
    return {name: read(stats) for name, read in WORKER_STATS.items()}
