"""The statistics snapshot and its Prometheus text: names, labels, real values, parsing."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from tests.kvfactory import make_caches
from tiered_kv import EngineConfig, SyncTieredKVEngine, TieredKVEngine
from tiered_kv.metrics import EngineCounters, EngineStats, parse_prometheus
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

TOKENS = list(range(1000, 1100))
SRC, DST = list(range(7)), list(range(8, 15))


def _config(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"chunk_size": 32, "l1_size": "8MiB"}
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


async def _exercised_engine(engine: TieredKVEngine, tier: FaultyTier) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16)
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    await engine.store(TOKENS, SRC)
    await engine.flush()
    await engine.evict_l1()
    assert await engine.lookup(TOKENS) == 100
    handle = await engine.prefetch(TOKENS)
    assert (await engine.retrieve(TOKENS, DST, prefetch=handle)).valid_tokens == 100
    assert (await engine.retrieve(TOKENS, DST)).valid_tokens == 100
    assert await engine.lookup(list(range(5000, 5100))) == 0


async def test_prometheus_text_parses_and_carries_the_engine_numbers() -> None:
    tier = FaultyTier(MemoryTier(), get_delay_s=0.01)
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as engine:
        await _exercised_engine(engine, tier)
        stats = engine.stats()
    text = stats.to_prometheus()
    samples = parse_prometheus(text)

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert stats.storage is not None and stats.l1 is not None
    assert value("tiered_kv_hits_total", tier="l1") == stats.storage.l1_hits == 4
    assert value("tiered_kv_hits_total", tier="l2") == 4
    assert value("tiered_kv_lookup_chunks_total", tier="l2") == 8  # the lookup's, the prefetch's
    assert value("tiered_kv_lookup_misses_total") == 1
    outcomes = {
        outcome: value("tiered_kv_prefetch_outcomes_total", outcome=outcome)
        for outcome in ("ready_in_time", "ready_after_wait", "late", "cancelled", "failed")
    }
    assert outcomes["ready_in_time"] + outcomes["ready_after_wait"] == 4
    assert outcomes["late"] == outcomes["cancelled"] == outcomes["failed"] == 0
    assert value("tiered_kv_prefetch_loads_total", kind="loads_started") == 4
    assert value("tiered_kv_write_queue_depth", tier="l2") == 0
    assert value("tiered_kv_writes_total", tier="l2", result="done") == 4
    assert (
        value("tiered_kv_transfer_bytes_total", path="l2_to_l1")
        == stats.storage.tier("L2").reads.bytes_read
    )
    assert value("tiered_kv_transfer_bytes_total", path="l1_to_device") > 0
    assert value("tiered_kv_throughput_gbps", path="l1_to_l2") > 0
    assert value("tiered_kv_occupancy_bytes", tier="l1") == stats.l1.bytes_used
    assert value("tiered_kv_occupancy_bytes", tier="l2") > 0
    assert value("tiered_kv_capacity_bytes", tier="l1") == 8 * 1024 * 1024
    assert value("tiered_kv_retrieved_tokens_total") == 200
    # Every family has HELP and TYPE lines, counters end in _total.
    for line in text.splitlines():
        if line.startswith("# TYPE") and line.endswith(" counter"):
            assert line.split()[2].endswith("_total")


async def test_throughput_section_reports_gb_per_second_per_path(tmp_path: object) -> None:
    tier = FaultyTier(MemoryTier())
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as engine:
        await _exercised_engine(engine, tier)
        snapshot = engine.stats()
    throughput = snapshot.throughput_gbps()
    assert set(throughput) >= {"device_to_l1", "l1_to_device", "l1_to_l2", "l2_to_l1"}
    assert all(v > 0 and math.isfinite(v) for v in throughput.values())
    assert snapshot.as_dict()["throughput"] == {f"{k}_gbps": v for k, v in throughput.items()}
    samples = parse_prometheus(snapshot.to_prometheus())
    for path, gbps in throughput.items():
        assert samples[("tiered_kv_throughput_gbps", (("path", path),))] == pytest.approx(gbps)


def test_prometheus_client_parser_accepts_our_text() -> None:
    parser = pytest.importorskip("prometheus_client.parser")
    with SyncTieredKVEngine(_config(), lower_tiers=[MemoryTier()]) as engine:
        engine.register_kv_caches(make_caches("mla", torch.float16).entries, model_name="m")
        engine.store(TOKENS, SRC)
        engine.flush()
        text = engine.stats().to_prometheus()
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    assert families["tiered_kv_hits"].type == "counter"
    assert families["tiered_kv_write_queue_depth"].type == "gauge"
    ours = parse_prometheus(text)
    theirs = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in families.values()
        for s in family.samples
    }
    assert ours == theirs


def test_prometheus_client_collector_exports_the_same_families() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from tiered_kv.metrics import PrometheusCollector

    with SyncTieredKVEngine(_config(), lower_tiers=[MemoryTier()]) as engine:
        engine.register_kv_caches(make_caches("mla", torch.float16).entries, model_name="m")
        engine.store(TOKENS, SRC)
        registry = CollectorRegistry()
        registry.register(PrometheusCollector(engine.stats))
        exported = parse_prometheus(generate_latest(registry).decode())
        ours = parse_prometheus(engine.stats().to_prometheus())
        # The dict view is for reading; metrics come from the typed snapshot only.
        wrong = CollectorRegistry()
        wrong.register(PrometheusCollector(lambda: engine.stats().as_dict()))  # type: ignore[arg-type,return-value]
        with pytest.raises(TypeError, match=r"pass engine\.stats"):
            generate_latest(wrong)
    assert ours == exported


async def test_prometheus_text_escapes_labels_and_formats_values() -> None:
    odd = 'odd"\\name\n'  # a custom tier's name becomes a label value as it is (lower-cased)
    async with TieredKVEngine(_config(), lower_tiers=[MemoryTier(name=odd)]) as engine:
        engine.register_kv_caches(make_caches("mla", torch.float16).entries, model_name="m")
        await engine.store(TOKENS, SRC)
        await engine.flush()
        text = engine.stats().to_prometheus()
    assert 'tiered_kv_entries{tier="odd\\"\\\\name\\n"} 4' in text
    assert parse_prometheus(text)[("tiered_kv_entries", (("tier", odd),))] == 4
    # Whole numbers print as integers, others as floats.
    text = EngineStats(EngineCounters(store_calls=3)).to_prometheus()
    assert "tiered_kv_store_calls_total 3\n" in text
    text = EngineStats(EngineCounters(stored_tokens=1.5)).to_prometheus()  # type: ignore[arg-type]
    assert parse_prometheus(text)[("tiered_kv_stored_tokens_total", ())] == 1.5


@pytest.mark.parametrize(
    "text",
    [
        "tiered_kv_x 1\n",  # no TYPE line
        "# TYPE tiered_kv_x gauge\ntiered_kv_x{tier=unquoted} 1\n",
        "# TYPE tiered_kv_x gauge\ntiered_kv_x one\n",
        "# TYPE tiered_kv_x gauge\ntiered_kv_x 1\ntiered_kv_x 2\n",  # duplicate
        "# TYPE tiered_kv_x histogramish\n",
    ],
)
def test_parser_rejects_malformed_text(text: str) -> None:
    with pytest.raises(ValueError):
        parse_prometheus(text)


async def test_the_dict_view_keeps_the_sections_the_demo_reads() -> None:
    async with TieredKVEngine(_config(), lower_tiers=[MemoryTier()]) as engine:
        engine.register_kv_caches(make_caches("mla", torch.float16).entries, model_name="m")
        await engine.store(TOKENS, SRC)
        await asyncio.sleep(0)
        stats = engine.stats().as_dict()
    for section in ("engine", "l1", "storage", "arena", "mover", "prefetch", "throughput"):
        assert section in stats
    assert {"hits_l1", "misses", "promotion_failures"} <= set(stats["storage"])
    assert {"evictions", "bytes_used", "dirty"} <= set(stats["l1"])


async def test_path_throughput_is_over_busy_time_not_summed_latencies() -> None:
    """Writes to a lower tier overlap (two writers per tier): dividing bytes by the sum of their
    latencies understated the demo's disk write rate about 4x. The path is busy while any write
    runs, so time two writes spend together counts once. The tier holds its first two writes
    at a gate for ``HOLD`` seconds after both have started: whatever the scheduling, they
    overlap for at least that long."""
    hold = 0.2
    tier = FaultyTier(MemoryTier())
    tier.gate = asyncio.Event()
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as engine:
        caches = make_caches("mla", torch.float16)
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        await engine.store(TOKENS, SRC)  # 4 chunks, 2 writers
        for _ in range(2000):
            if tier.active == 2:
                break
            await asyncio.sleep(0.005)
        assert tier.active == 2, "both writers should be inside the tier"
        await asyncio.sleep(hold)
        tier.gate.set()
        assert await engine.flush() == 0
        stats = engine.stats()
        writes = stats.storage.tier(tier.name).writes
        summed, busy = writes.write_seconds, writes.busy_seconds
        assert writes.done == 4
        assert busy >= hold
        assert summed - busy >= hold, (busy, summed)  # the overlap was counted once
        gbps = stats.throughput_gbps()[f"l1_to_{tier.name.lower()}"]
        assert gbps == pytest.approx(writes.bytes_written / busy / 1e9)


async def test_stats_are_a_typed_snapshot_and_its_views_derive_from_it() -> None:
    """Each component hands out a frozen stats dataclass; engine.stats() takes them together,
    so a tier named like a counter ("misses") cannot confuse the derived numbers."""
    tier = FaultyTier(MemoryTier(name="misses"))
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as engine:
        await _exercised_engine(engine, tier)
        snapshot = engine.stats()
        assert isinstance(snapshot, EngineStats)
        assert snapshot.as_dict() == engine.stats().as_dict()
    samples = parse_prometheus(snapshot.to_prometheus())
    assert snapshot.storage is not None and snapshot.l1 is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        snapshot.storage.misses = 5  # type: ignore[misc]
    (traffic,) = snapshot.storage.tiers
    assert traffic.name == "misses" and traffic.reads.hits == 4
    assert traffic.writes is not None and traffic.writes.done == 4
    assert snapshot.storage.misses == 0
    assert snapshot.tier("MISSES").entries == 4 and snapshot.storage.tier("Misses") is traffic
    # The tier's name never collides with the counter of the same name.
    assert samples[("tiered_kv_misses_total", ())] == 0
    assert samples[("tiered_kv_hits_total", (("tier", "misses"),))] == 4
    assert samples[("tiered_kv_writes_total", (("result", "done"), ("tier", "misses")))] == 4
    assert samples[("tiered_kv_entries", (("tier", "misses"),))] == 4
    # A closed engine still answers, from the sections that remain.
    closed = engine.stats()
    assert closed.storage is None and closed.engine.retrieve_calls == 2
