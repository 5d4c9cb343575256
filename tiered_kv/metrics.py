"""The engine's statistics as one typed snapshot (`EngineStats`) and its one Prometheus renderer.

Owns `EngineStats` (every component's frozen stats dataclass, taken together by
`TieredKVEngine.stats()`) and what is derived from it: its Prometheus text format (0.0.4,
`EngineStats.to_prometheus`, no dependency; metric families with stable names, types, help texts
and labels are its internal step), its nested name → number dicts for JSON output
(`EngineStats.as_dict`), the parser of that text format (`parse_prometheus`, used by tests and
handy for scrapers in scripts), and, when the optional ``prometheus-client`` is installed, a
`PrometheusCollector` for its registry (the same families). Must not keep state of its own or
touch the engine's internals: everything comes from the snapshot. Never reads a name back out of
a dict key; nor should its readers: `as_dict` is for JSON output, code reads the attributes.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal

from tiered_kv.gpu.base import MoverStats
from tiered_kv.memory import ArenaStats
from tiered_kv.prefetch import PrefetchStats
from tiered_kv.storage import LowerTierTraffic, StorageStats
from tiered_kv.tiers.base import TierStats
from tiered_kv.tiers.l1 import L1Stats


@dataclasses.dataclass(slots=True)
class EngineCounters:
    """The engine's own counters (calls, tokens); `EngineStats.engine` is a copy."""

    store_calls: int = 0
    stored_chunks: int = 0
    stored_tokens: int = 0
    store_skipped_present: int = 0
    store_skipped_no_space: int = 0
    lookup_calls: int = 0
    lookup_hit_tokens: int = 0
    retrieve_calls: int = 0
    retrieved_tokens: int = 0
    retrieved_chunks: int = 0
    retrieve_scatter_batches: int = 0
    retrieve_waited_seconds: float = 0.0
    retrieve_late_tokens: int = 0
    retrieve_failed_tokens: int = 0
    retrieve_layerwise_calls: int = 0
    store_layerwise_calls: int = 0
    prefetch_calls: int = 0
    cost_probes: int = 0  # chunks of declined tiers read anyway, to keep their cost measured


StatsDict = dict[str, dict[str, int | float]]
Labels = tuple[tuple[str, str], ...]

PREFIX = "tiered_kv"
PREFETCH_OUTCOMES = ("ready_in_time", "ready_after_wait", "late", "cancelled", "failed", "unused")
PREFETCH_LOAD_KINDS = ("loads_started", "loads_deduplicated", "stopped_no_space", "stopped_budget")
# Results of lower-tier writes: `WriteQueueStats` fields, each a label value of writes_total.
WRITE_RESULTS = (
    "done",
    "failed",
    "dropped_full",
    "dropped_close",
    "skipped_present",
    "demoted",
    "demotions_refused",
    "admitted",
)
ENGINE_COUNTERS = (
    ("store_calls", "store() calls"),
    ("stored_tokens", "tokens newly stored"),
    ("lookup_calls", "lookup() calls"),
    ("lookup_hit_tokens", "tokens found cached by lookup()"),
    ("retrieve_calls", "retrieve() calls"),
    ("retrieved_tokens", "tokens delivered by retrieve()"),
    ("retrieve_late_tokens", "cached tokens not delivered because loads were late"),
    ("retrieve_failed_tokens", "cached tokens not delivered because a load failed"),
)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    """Every component's statistics at one moment (`TieredKVEngine.stats()`). Sections are
    None while their component does not exist (before open, after close)."""

    engine: EngineCounters  # a copy
    l1: L1Stats | None = None
    arena: ArenaStats | None = None
    storage: StorageStats | None = None
    prefetch: PrefetchStats | None = None
    lower: tuple[tuple[str, TierStats], ...] = ()  # (tier name, its statistics), top first
    mover: MoverStats | None = None

    def transfer_paths(self) -> dict[str, tuple[float, float]]:
        """Bytes and busy seconds per data path: device<->L1 (the mover), L1<->each lower tier."""
        paths: dict[str, tuple[float, float]] = {}
        if self.mover is not None:
            paths["device_to_l1"] = (float(self.mover.bytes_gathered), self.mover.gather_seconds)
            paths["l1_to_device"] = (float(self.mover.bytes_scattered), self.mover.scatter_seconds)
        for tier in _unique_tiers(self.storage):
            name = tier.name.lower()
            writes = tier.writes
            paths[f"l1_to_{name}"] = (
                (float(writes.bytes_written), writes.busy_seconds) if writes else (0.0, 0.0)
            )
            paths[f"{name}_to_l1"] = (float(tier.reads.bytes_read), tier.reads.busy_seconds)
        return paths

    def throughput_gbps(self) -> dict[str, float]:
        """GB/s (1e9 bytes) per path over the time the path was busy; 0 when it never ran."""
        return {
            path: _gbps(nbytes, seconds)
            for path, (nbytes, seconds) in self.transfer_paths().items()
        }

    def tier(self, name: str) -> TierStats:
        """The lower tier ``name``'s own statistics (names compared without case)."""
        for tier_name, stats in self.lower:
            if tier_name.lower() == name.lower():
                return stats
        raise KeyError(f"no lower tier named {name!r}; tiers: {[n for n, _ in self.lower]}")

    def as_dict(self) -> StatsDict:
        """Nested sections of name → number, for JSON output: engine, l1, storage, one per lower
        tier by lower-case name (l2 for the disk tier), prefetch, arena, mover, and throughput
        (``<path>_gbps`` per data path)."""
        return _as_dict(self)

    def to_prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4): hits and misses per tier,
        bytes and GB/s per path, prefetch outcomes, queue depths, occupancy."""
        return _render(_families(self))


def _gbps(nbytes: float, seconds: float) -> float:
    return (nbytes / seconds / 1e9) if seconds > 0 else 0.0


def _unique_tiers(storage: StorageStats | None) -> list[LowerTierTraffic]:
    """Lower tiers by name, the first of two tiers with the same name winning (as sections do)."""
    if storage is None:
        return []
    seen: dict[str, LowerTierTraffic] = {}
    for tier in storage.tiers:
        seen.setdefault(tier.name.lower(), tier)
    return list(seen.values())


# -- the as_dict() view ----------------------------------------------------------------------------
def _flat(stats: object, out: dict[str, int | float] | None = None) -> dict[str, int | float]:
    """A stats dataclass as name → number: None fields left out, a nested stats dataclass
    inlined (its names where the outer has none), a mapping as ``<field>_<name>``."""
    out = {} if out is None else out
    for field in dataclasses.fields(stats):  # type: ignore[arg-type]
        value = getattr(stats, field.name)
        if value is None or isinstance(value, str):
            continue
        if dataclasses.is_dataclass(value):
            for name, inner in _flat(value).items():
                out.setdefault(name, inner)
        elif isinstance(value, Mapping):
            for name, inner in value.items():
                out[f"{field.name}_{name}"] = inner
        else:
            out[field.name] = int(value) if isinstance(value, bool) else value
    return out


def _storage_dict(storage: StorageStats) -> dict[str, int | float]:
    out: dict[str, int | float] = {"hits_l1": storage.l1_hits}
    for tier in storage.tiers:
        key = f"hits_{tier.name.lower()}"
        out[key] = out.get(key, 0) + tier.reads.hits
    for name in (
        "misses",
        "promotions",
        "promotion_failures",
        "located_l1",
        "located_misses",
        "demoting",
        "touches_sent",
        "touch_failures",
    ):
        out[name] = getattr(storage, name)
    for tier in storage.tiers:
        name, reads = tier.name.lower(), tier.reads
        out[f"located_{name}"] = reads.located
        out[f"{name}_read_failures"] = reads.failures
        out[f"{name}_read_bytes"] = reads.bytes_read
        out[f"{name}_read_seconds"] = reads.read_seconds
        out[f"{name}_read_busy_seconds"] = reads.busy_seconds
        out[f"{name}_declined_chunks"] = reads.declined
        out[f"{name}_declined_saved_seconds"] = reads.declined_saved_seconds
    for tier in storage.tiers:
        if tier.writes is None:
            continue
        prefix = f"{tier.name.lower()}_write"
        for name, value in _flat(tier.writes).items():
            # bytes_written / write_seconds read as <tier>_write_bytes / _write_seconds.
            short = {"bytes_written": "bytes", "write_seconds": "seconds"}.get(name, name)
            out[f"{prefix}_{short}"] = value
    return out


def _as_dict(stats: EngineStats) -> StatsDict:
    out: StatsDict = {"engine": dict(dataclasses.asdict(stats.engine))}
    if stats.l1 is not None:
        out["l1"] = _flat(stats.l1)
    if stats.storage is not None:
        out["storage"] = _storage_dict(stats.storage)
    for name, tier in stats.lower:
        out.setdefault(name.lower(), _flat(tier))
    if stats.prefetch is not None:
        out["prefetch"] = _flat(stats.prefetch)
    if stats.arena is not None:
        out["arena"] = _flat(stats.arena)
    if stats.mover is not None:
        mover = stats.mover
        out["mover"] = {
            "bytes_gathered": mover.bytes_gathered,
            "bytes_scattered": mover.bytes_scattered,
            "gather_seconds": mover.gather_seconds,
            "scatter_seconds": mover.scatter_seconds,
            **mover.extra,
        }
    out["throughput"] = {f"{path}_gbps": gbps for path, gbps in stats.throughput_gbps().items()}
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class _Sample:
    labels: Labels
    value: float


@dataclasses.dataclass(frozen=True, slots=True)
class _Family:
    """One metric: ``name`` (without the ``_total`` suffix of counters' samples), its type,
    help text, and samples (one per label set)."""

    name: str
    kind: Literal["counter", "gauge"]
    help: str
    samples: tuple[_Sample, ...]


_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


# -- families -----------------------------------------------------------------------------------
class _Builder:
    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}

    def add(
        self,
        name: str,
        metric_type: Literal["counter", "gauge"],
        help_text: str,
        value: float,
        **labels: str,
    ) -> None:
        full = f"{PREFIX}_{name}"
        if not _NAME_RE.fullmatch(full):
            raise ValueError(f"invalid metric name {full!r}")
        sample = _Sample(tuple(sorted(labels.items())), float(value))
        family = self.families.get(full)
        if family is None:
            self.families[full] = _Family(full, metric_type, help_text, (sample,))
        else:
            self.families[full] = dataclasses.replace(family, samples=(*family.samples, sample))


def _storage_families(b: _Builder, storage: StorageStats | None) -> None:
    tiers = _unique_tiers(storage)
    hits: dict[str, float] = {"l1": _get(storage, "l1_hits")}
    for tier in [] if storage is None else storage.tiers:
        hits[tier.name.lower()] = hits.get(tier.name.lower(), 0) + tier.reads.hits
    for name, count in hits.items():
        b.add("hits", "counter", "chunks delivered from each tier", count, tier=name)
    b.add("misses", "counter", "chunk reads that found no usable copy", _get(storage, "misses"))
    located = [("l1", _get(storage, "located_l1"))]
    located += [(tier.name.lower(), tier.reads.located) for tier in tiers]
    for name, count in located:
        b.add("lookup_chunks", "counter", "chunks located by lookup, by tier", count, tier=name)
    b.add(
        "lookup_misses",
        "counter",
        "lookups whose prefix ended before the request's end",
        _get(storage, "located_misses"),
    )
    for tier in tiers:
        name = tier.name.lower()
        b.add(
            "declined_chunks",
            "counter",
            "chunks lookups found in a tier and left unclaimed: loading was slower than "
            "recomputing (load_policy cost)",
            tier.reads.declined,
            tier=name,
        )
        b.add(
            "declined_saved_seconds",
            "counter",
            "time declined claims saved against loading, by the cost model's estimate",
            tier.reads.declined_saved_seconds,
            tier=name,
        )
    for tier in tiers:
        name = tier.name.lower()
        b.add(
            "read_failures",
            "counter",
            "lower-tier reads that failed (counted as misses)",
            tier.reads.failures,
            tier=name,
        )
        if tier.writes is None:
            continue
        b.add(
            "write_queue_depth",
            "gauge",
            "chunks waiting for their lower-tier write",
            tier.writes.queue_depth,
            tier=name,
        )
        b.add(
            "write_queue_capacity",
            "gauge",
            "bound of each lower-tier write queue",
            tier.writes.queue_capacity,
            tier=name,
        )
        for result in WRITE_RESULTS:
            b.add(
                "writes",
                "counter",
                "lower-tier writes by result",
                getattr(tier.writes, result),
                tier=name,
                result=result,
            )


def _get(stats: object | None, name: str) -> float:
    return 0 if stats is None else float(getattr(stats, name))


def _prefetch_families(b: _Builder, prefetch: PrefetchStats) -> None:
    counters = prefetch.counters
    for outcome in PREFETCH_OUTCOMES:
        b.add(
            "prefetch_outcomes",
            "counter",
            "prefetched chunks by outcome",
            getattr(counters, outcome),
            outcome=outcome,
        )
    for kind in PREFETCH_LOAD_KINDS:
        b.add(
            "prefetch_loads",
            "counter",
            "prefetch reservations by kind",
            getattr(counters, kind),
            kind=kind,
        )
    b.add(
        "prefetch_bytes_loaded",
        "counter",
        "bytes loaded into L1 by prefetch",
        counters.bytes_loaded,
    )
    b.add(
        "prefetch_in_flight",
        "gauge",
        "prefetch loads not finished (queued + running)",
        prefetch.in_flight,
    )
    b.add("prefetch_queued", "gauge", "prefetch loads waiting for a tier slot", prefetch.queued)
    b.add(
        "prefetch_reserved_bytes",
        "gauge",
        "L1 bytes held by prefetch reservations",
        prefetch.reserved_bytes,
    )


def _families(stats: EngineStats) -> list[_Family]:
    """The snapshot's metric families, in exposition order."""
    b = _Builder()
    for name, help_text in ENGINE_COUNTERS:
        b.add(name, "counter", help_text, getattr(stats.engine, name))
    _storage_families(b, stats.storage)
    for path, (nbytes, seconds) in stats.transfer_paths().items():
        b.add("transfer_bytes", "counter", "bytes moved per data path", nbytes, path=path)
        b.add("transfer_seconds", "counter", "seconds each data path was busy", seconds, path=path)
        b.add(
            "throughput_gbps",
            "gauge",
            "GB/s per data path over its busy time",
            _gbps(nbytes, seconds),
            path=path,
        )
    if stats.prefetch is not None:
        _prefetch_families(b, stats.prefetch)
    occupancy: list[tuple[str, int | None, int | None, int | None]] = []
    if stats.l1 is not None:
        l1 = stats.l1
        occupancy.append(("l1", l1.bytes_used, l1.entries, None))
        b.add("evictions", "counter", "chunks evicted per tier", l1.evictions, tier="l1")
        b.add("l1_dirty_chunks", "gauge", "L1 chunks waiting for a write_back demotion", l1.dirty)
    if stats.arena is not None:
        b.add("capacity_bytes", "gauge", "capacity per tier", stats.arena.capacity, tier="l1")
        b.add(
            "l1_arena_used_bytes",
            "gauge",
            "host arena bytes allocated (staging included)",
            stats.arena.used,
        )
    seen = {"l1"}
    for name, tier_stats in stats.lower:
        if name.lower() not in seen:
            seen.add(name.lower())
            occupancy.append(
                (name.lower(), tier_stats.bytes_used, tier_stats.entries, tier_stats.capacity)
            )
    for name, used, entries, capacity in occupancy:
        if used is not None:
            b.add("occupancy_bytes", "gauge", "bytes held per tier", used, tier=name)
        if entries is not None:
            b.add("entries", "gauge", "chunks held per tier", entries, tier=name)
        if capacity is not None:
            b.add("capacity_bytes", "gauge", "capacity per tier", capacity, tier=name)
    return list(b.families.values())


# -- text exposition ----------------------------------------------------------------------------
def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == int(value) and abs(value) < 1 << 53:
        return str(int(value))
    return repr(value)


def _render(families: Iterable[_Family]) -> str:
    """The Prometheus text format: HELP and TYPE lines, then samples (counters get
    ``_total``)."""
    lines: list[str] = []
    for family in families:
        sample_name = f"{family.name}_total" if family.kind == "counter" else family.name
        help_text = family.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"# HELP {sample_name} {help_text}")
        lines.append(f"# TYPE {sample_name} {family.kind}")
        for sample in family.samples:
            label_text = ""
            if sample.labels:
                for key, _ in sample.labels:
                    if not _LABEL_RE.fullmatch(key):
                        raise ValueError(f"invalid label name {key!r} in {family.name}")
                inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sample.labels)
                label_text = "{" + inner + "}"
            lines.append(f"{sample_name}{label_text} {_format_value(sample.value)}")
    return "\n".join(lines) + "\n"


_SAMPLE_RE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$"
)
_LABEL_PAIR_RE = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*(?:,|$)')


def parse_prometheus(text: str) -> dict[tuple[str, Labels], float]:
    """Parse the text format strictly: every sample under a TYPE line of its family, label
    syntax and values checked. Returns (sample name, sorted labels) → value."""
    types: dict[str, str] = {}
    out: dict[tuple[str, Labels], float] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] == "TYPE":
                if len(parts) != 4 or parts[3] not in ("counter", "gauge", "untyped"):
                    raise ValueError(f"line {number}: bad TYPE line {line!r}")
                types[parts[2]] = parts[3]
            continue
        match = _SAMPLE_RE.match(line)
        if match is None:
            raise ValueError(f"line {number}: not a sample: {line!r}")
        name = match.group("name")
        if name not in types:
            raise ValueError(f"line {number}: sample {name} has no TYPE line before it")
        labels: list[tuple[str, str]] = []
        raw = match.group("labels")
        if raw:
            position = 0
            while position < len(raw):
                pair = _LABEL_PAIR_RE.match(raw, position)
                if pair is None or pair.end() == position:
                    raise ValueError(f"line {number}: bad labels {raw!r}")
                text = re.sub(
                    r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), pair.group(2)
                )
                labels.append((pair.group(1), text))
                position = pair.end()
        try:
            value = float(match.group("value"))
        except ValueError:
            raise ValueError(f"line {number}: bad value {match.group('value')!r}") from None
        key = (name, tuple(sorted(labels)))
        if key in out:
            raise ValueError(f"line {number}: duplicate sample {key}")
        out[key] = value
    return out


# -- optional prometheus_client integration -----------------------------------------------------
class PrometheusCollector:
    """A ``prometheus_client`` collector over an engine (needs the ``metrics`` extra)::

        prometheus_client.REGISTRY.register(PrometheusCollector(sync_engine.stats))

    ``stats``: a callable returning `EngineStats`; the collector exports the families
    `EngineStats.to_prometheus` renders. `collect` runs in the scraping thread: pass a
    thread-safe one (`SyncTieredKVEngine.stats`) when the engine's loop runs elsewhere.
    """

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        import prometheus_client.core  # noqa: F401 - fail early without the extra

        self._stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._stats()
        if not isinstance(stats, EngineStats):
            raise TypeError(
                "PrometheusCollector: the callable returned "
                f"{type(stats).__name__}, not EngineStats; pass engine.stats"
            )
        for family in _families(stats):
            names = sorted({k for sample in family.samples for k, _ in sample.labels})
            metric: Any
            if family.kind == "counter":
                metric = CounterMetricFamily(family.name, family.help, labels=names)
            else:
                metric = GaugeMetricFamily(family.name, family.help, labels=names)
            for sample in family.samples:
                values = dict(sample.labels)
                metric.add_metric([values.get(name, "") for name in names], sample.value)
            yield metric
