"""Typed metrics and the Prometheus text exposition of the engine's statistics.

Owns the mapping from `TieredKVEngine.stats()` (nested name → number dicts) to metric families
with stable names, types, help texts and labels; renders them in the Prometheus text format
(0.0.4) without any dependency; parses that format back (`parse_prometheus`, used by tests and
handy for scrapers in scripts); and, when the optional ``prometheus-client`` is installed, offers
a `PrometheusCollector` for its registry. Must not keep state of its own or touch the engine's
internals: everything comes from `stats()`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

Stats = Mapping[str, Mapping[str, int | float]]
Labels = tuple[tuple[str, str], ...]

PREFIX = "tiered_kv"
PREFETCH_OUTCOMES = ("ready_in_time", "ready_after_wait", "late", "cancelled", "failed", "unused")
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


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    labels: Labels
    value: float


@dataclasses.dataclass(frozen=True, slots=True)
class MetricFamily:
    """One metric: ``name`` (without the ``_total`` suffix of counters' samples), its type,
    help text, and samples (one per label set)."""

    name: str
    kind: Literal["counter", "gauge"]
    help: str
    samples: tuple[Sample, ...]

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"MetricFamily: invalid metric name {self.name!r}")
        if self.kind not in ("counter", "gauge"):
            raise ValueError(f"MetricFamily: kind must be 'counter' or 'gauge', got {self.kind!r}")

    def value(self, **labels: str) -> float | None:
        wanted = tuple(sorted(labels.items()))
        for sample in self.samples:
            if tuple(sorted(sample.labels)) == wanted:
                return sample.value
        return None


_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


# -- paths and throughput -----------------------------------------------------------------------
def transfer_paths(stats: Stats) -> dict[str, tuple[float, float]]:
    """Bytes and busy seconds per data path: device<->L1 (the mover), L1<->each lower tier."""
    paths: dict[str, tuple[float, float]] = {}
    mover = stats.get("mover", {})
    if mover:
        paths["device_to_l1"] = (
            float(mover.get("bytes_gathered", 0)),
            float(mover.get("gather_seconds", 0)),
        )
        paths["l1_to_device"] = (
            float(mover.get("bytes_scattered", 0)),
            float(mover.get("scatter_seconds", 0)),
        )
    storage = stats.get("storage", {})
    for name in _lower_tier_names(storage):
        paths[f"l1_to_{name}"] = (
            float(storage.get(f"{name}_write_bytes", 0)),
            float(storage.get(f"{name}_write_busy_seconds", 0)),
        )
        paths[f"{name}_to_l1"] = (
            float(storage.get(f"{name}_read_bytes", 0)),
            float(storage.get(f"{name}_read_busy_seconds", 0)),
        )
    return paths


def throughput_gbps(stats: Stats) -> dict[str, int | float]:
    """GB/s (1e9 bytes) per path over the time the path was busy; 0 when it never ran."""
    return {
        f"{path}_gbps": (nbytes / seconds / 1e9) if seconds > 0 else 0.0
        for path, (nbytes, seconds) in transfer_paths(stats).items()
    }


def _lower_tier_names(storage: Mapping[str, int | float]) -> list[str]:
    return [key[len("located_") :] for key in storage if _is_located_tier(key)]


def _is_located_tier(key: str) -> bool:
    return key.startswith("located_") and key not in ("located_l1", "located_misses")


# -- families -----------------------------------------------------------------------------------
class _Builder:
    def __init__(self) -> None:
        self.families: dict[str, MetricFamily] = {}

    def add(
        self,
        name: str,
        metric_type: Literal["counter", "gauge"],
        help_text: str,
        value: float,
        **labels: str,
    ) -> None:
        full = f"{PREFIX}_{name}"
        sample = Sample(tuple(sorted(labels.items())), float(value))
        family = self.families.get(full)
        if family is None:
            self.families[full] = MetricFamily(full, metric_type, help_text, (sample,))
        else:
            self.families[full] = dataclasses.replace(family, samples=(*family.samples, sample))


def engine_metrics(stats: Stats) -> list[MetricFamily]:
    """Metric families from `TieredKVEngine.stats()`."""
    b = _Builder()
    engine = stats.get("engine", {})
    for name, help_text in (
        ("store_calls", "store() calls"),
        ("stored_tokens", "tokens newly stored"),
        ("lookup_calls", "lookup() calls"),
        ("lookup_hit_tokens", "tokens found cached by lookup()"),
        ("retrieve_calls", "retrieve() calls"),
        ("retrieved_tokens", "tokens delivered by retrieve()"),
        ("retrieve_late_tokens", "cached tokens not delivered because loads were late"),
        ("retrieve_failed_tokens", "cached tokens not delivered because a load failed"),
    ):
        if name in engine:
            b.add(name, "counter", help_text, engine[name])
    storage = stats.get("storage", {})
    tiers = _lower_tier_names(storage)
    for key, count in storage.items():
        if key.startswith("hits_"):
            b.add(
                "hits",
                "counter",
                "chunks delivered from each tier",
                count,
                tier=key[len("hits_") :],
            )
    b.add("misses", "counter", "chunk reads that found no usable copy", storage.get("misses", 0))
    b.add(
        "lookup_chunks",
        "counter",
        "chunks located by lookup, by tier",
        storage.get("located_l1", 0),
        tier="l1",
    )
    for name in tiers:
        b.add(
            "lookup_chunks",
            "counter",
            "chunks located by lookup, by tier",
            storage.get(f"located_{name}", 0),
            tier=name,
        )
    b.add(
        "lookup_misses",
        "counter",
        "lookups whose prefix ended before the request's end",
        storage.get("located_misses", 0),
    )
    for name in tiers:
        b.add(
            "read_failures",
            "counter",
            "lower-tier reads that failed (counted as misses)",
            storage.get(f"{name}_read_failures", 0),
            tier=name,
        )
        prefix = f"{name}_write"
        if f"{prefix}_queue_depth" in storage:
            b.add(
                "write_queue_depth",
                "gauge",
                "chunks waiting for their lower-tier write",
                storage[f"{prefix}_queue_depth"],
                tier=name,
            )
            b.add(
                "write_queue_capacity",
                "gauge",
                "bound of each lower-tier write queue",
                storage.get(f"{prefix}_queue_capacity", 0),
                tier=name,
            )
            for result in WRITE_RESULTS:
                b.add(
                    "writes",
                    "counter",
                    "lower-tier writes by result",
                    storage.get(f"{prefix}_{result}", 0),
                    tier=name,
                    result=result,
                )
    for path, (nbytes, seconds) in transfer_paths(stats).items():
        b.add("transfer_bytes", "counter", "bytes moved per data path", nbytes, path=path)
        b.add("transfer_seconds", "counter", "seconds each data path was busy", seconds, path=path)
        b.add(
            "throughput_gbps",
            "gauge",
            "GB/s per data path over its busy time",
            (nbytes / seconds / 1e9) if seconds > 0 else 0.0,
            path=path,
        )
    prefetch = stats.get("prefetch", {})
    if prefetch:
        for outcome in PREFETCH_OUTCOMES:
            b.add(
                "prefetch_outcomes",
                "counter",
                "prefetched chunks by outcome",
                prefetch.get(outcome, 0),
                outcome=outcome,
            )
        for kind in ("loads_started", "loads_deduplicated", "stopped_no_space", "stopped_budget"):
            b.add(
                "prefetch_loads",
                "counter",
                "prefetch reservations by kind",
                prefetch.get(kind, 0),
                kind=kind,
            )
        b.add(
            "prefetch_bytes_loaded",
            "counter",
            "bytes loaded into L1 by prefetch",
            prefetch.get("bytes_loaded", 0),
        )
        b.add(
            "prefetch_in_flight",
            "gauge",
            "prefetch loads not finished (queued + running)",
            prefetch.get("in_flight", 0),
        )
        b.add(
            "prefetch_queued",
            "gauge",
            "prefetch loads waiting for a tier slot",
            prefetch.get("queued", 0),
        )
        b.add(
            "prefetch_reserved_bytes",
            "gauge",
            "L1 bytes held by prefetch reservations",
            prefetch.get("reserved_bytes", 0),
        )
    l1 = stats.get("l1", {})
    arena = stats.get("arena", {})
    if l1:
        b.add("occupancy_bytes", "gauge", "bytes held per tier", l1.get("bytes_used", 0), tier="l1")
        b.add("entries", "gauge", "chunks held per tier", l1.get("entries", 0), tier="l1")
        b.add("evictions", "counter", "chunks evicted per tier", l1.get("evictions", 0), tier="l1")
        b.add(
            "l1_dirty_chunks",
            "gauge",
            "L1 chunks waiting for a write_back demotion",
            l1.get("dirty", 0),
        )
    if arena:
        b.add("capacity_bytes", "gauge", "capacity per tier", arena.get("capacity", 0), tier="l1")
        b.add(
            "l1_arena_used_bytes",
            "gauge",
            "host arena bytes allocated (staging included)",
            arena.get("used", 0),
        )
    for name in tiers:
        section = stats.get(name, {})
        if "bytes_used" in section:
            b.add(
                "occupancy_bytes", "gauge", "bytes held per tier", section["bytes_used"], tier=name
            )
        if "entries" in section:
            b.add("entries", "gauge", "chunks held per tier", section["entries"], tier=name)
        if "capacity" in section:
            b.add("capacity_bytes", "gauge", "capacity per tier", section["capacity"], tier=name)
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


def render_prometheus(families: Iterable[MetricFamily]) -> str:
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

        prometheus_client.REGISTRY.register(PrometheusCollector(engine))

    `collect` runs in the scraping thread: pass ``stats`` a thread-safe callable (for example
    `SyncTieredKVEngine.stats`) when the engine's loop runs elsewhere.
    """

    def __init__(self, stats: Any) -> None:
        import prometheus_client.core  # noqa: F401 - fail early without the extra

        self._stats = stats

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for family in engine_metrics(self._stats()):
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
