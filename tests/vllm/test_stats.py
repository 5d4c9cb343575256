"""The worker's connector stats (`WORKER_STATS`) read from a real `EngineHost`'s typed snapshot:
loads, stores and hits per tier as they happened, read failures counted, and every figure the
same as the snapshot's JSON view (`as_dict`) gives under its own name."""

from __future__ import annotations

import pytest
import torch

from tests.kvfactory import make_caches
from tiered_kv import EngineConfig
from tiered_kv.integrations.engine_host import EngineHost
from tiered_kv.integrations.host_stats import HostStats
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

# Importing vLLM (the stats module's base class) in the test process trips torch's own
# deprecation warnings: imported inside the tests, under this filter, as in
# test_connector_hooks.py.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

CHUNK = 32
TOKENS = list(range(3000, 3096))  # three chunks
SRC, DST = [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]
# Each worker stat's entries in the JSON view: (section, name), summed.
AS_DICT: dict[str, tuple[tuple[str, str], ...]] = {
    **{
        name: (("host", name),)
        for name in (
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
    },
    **{f"storage_hits_{tier}": (("storage", f"hits_{tier}"),) for tier in ("l1", "l2", "l3")},
    **{
        f"declined_chunks_{tier}": (("storage", f"{tier}_declined_chunks"),)
        for tier in ("l2", "l3")
    },
    "prefetch_failed": (("prefetch", "failed"),),
    "l2_errors": (("storage", "l2_read_failures"),),
    "l3_errors": (("storage", "l3_read_failures"), ("l3", "exists_failures")),
}


def _stored_then_loaded(tier: FaultyTier) -> HostStats:
    """Three chunks stored, moved out of L1 to ``tier``, then loaded back."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    host = EngineHost(EngineConfig(chunk_size=CHUNK, l1_size="8MiB"), lower_tiers=[tier])
    try:
        host.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert host.store(TOKENS, SRC) == 96
        host.flush()
        host.evict_l1()
        host.load(TOKENS, DST, skip_prefix_tokens=0)
        return host.stats()
    finally:
        host.close()


def _as_dict_totals(stats: HostStats) -> dict[str, int | float]:
    flat = stats.as_dict()
    return {
        name: sum(flat.get(section, {}).get(key, 0) for section, key in entries)
        for name, entries in AS_DICT.items()
    }


def test_worker_stats_count_the_loads_stores_and_hits_that_happened() -> None:
    from tiered_kv.integrations.vllm.stats import WORKER_STATS, worker_totals

    stats = _stored_then_loaded(FaultyTier(MemoryTier("L2")))
    totals = worker_totals(stats)
    assert set(totals) == set(WORKER_STATS) == set(AS_DICT)
    assert (totals["stores"], totals["stored_tokens"]) == (1, 96)
    assert (totals["loads"], totals["loaded_tokens"], totals["load_shortfall_tokens"]) == (1, 96, 0)
    assert (totals["storage_hits_l1"], totals["storage_hits_l2"]) == (0, 3)
    assert totals["storage_hits_l3"] == totals["l3_errors"] == totals["l2_errors"] == 0
    assert totals == _as_dict_totals(stats)


def test_worker_stats_count_failed_reads() -> None:
    from tiered_kv.integrations.vllm.stats import worker_totals

    stats = _stored_then_loaded(FaultyTier(MemoryTier("L2"), get_failure_rate=1.0))
    totals = worker_totals(stats)
    assert totals["l2_errors"] >= 1 and totals["storage_hits_l2"] == 0
    assert totals["load_shortfall_tokens"] == 96
    assert totals == _as_dict_totals(stats)
