# vLLM's base classes are Any where vLLM is not installed (the light .venv that lints).
"""The connector's counters as vLLM's connector stats: `TieredKVConnectorStats`.

Owns the stats type vLLM aggregates over the scheduler and the workers and logs per interval,
and the names in it: `WORKER_STATS` (each a sum of engine-host stats entries) and
`SCHEDULER_STATS` (the scheduler half's own counters). Each half reports only its own names,
as deltas since its last report; must not read either half's state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats


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


_HOST_STATS = (
    "loads",
    "loaded_tokens",
    "load_shortfall_tokens",
    "stores",
    "stored_tokens",
    "lookups",
    "lookups_pending",
    "lookup_seconds",
    "tier_events_dropped",
    "prefills_observed",
)
# Worker-side stats: name -> the engine-host stats entries (section, key) it sums. The worker
# adds ``load_error_blocks``: blocks it reported to vLLM as not loaded.
WORKER_STATS: dict[str, tuple[tuple[str, str], ...]] = {
    **{name: (("host", name),) for name in _HOST_STATS},
    **{f"storage_hits_{tier}": (("storage", f"hits_{tier}"),) for tier in ("l1", "l2", "l3")},
    **{
        f"declined_chunks_{tier}": (("storage", f"{tier}_declined_chunks"),)
        for tier in ("l2", "l3")
    },
    "prefetch_failed": (("prefetch", "failed"),),
    "l2_errors": (("storage", "l2_read_failures"),),
    "l3_errors": (("storage", "l3_read_failures"), ("l3", "exists_failures")),
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


def worker_totals(host_stats: Mapping[str, Mapping[str, int | float]]) -> dict[str, int | float]:
    """The `WORKER_STATS` totals in an engine host's ``stats()`` (entries it lacks count 0)."""
    return {
        name: sum(host_stats.get(section, {}).get(key, 0) for section, key in entries)
        for name, entries in WORKER_STATS.items()
    }
