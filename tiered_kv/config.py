"""`EngineConfig`: every knob of the engine, validated once, with `TIERED_KV_*` env overrides.

Owns parsing of human sizes ("8GiB") and the checks that give clear messages. Imports stdlib only.
"""

from __future__ import annotations

import dataclasses
import decimal
import importlib.util
import os
import re
import urllib.parse
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, get_args

from tiered_kv.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
LoadPolicy = Literal["cost", "always"]
WritePolicy = Literal["write_through", "write_back", "selective"]
L2Durability = Literal["none", "batched", "per_write"]
IoPlane = Literal["auto", "threads", "processes"]
Eviction = Literal["lru", "reuse"]
PREFETCH_POLICIES: tuple[PrefetchPolicy, ...] = get_args(PrefetchPolicy)
LOAD_POLICIES: tuple[LoadPolicy, ...] = get_args(LoadPolicy)
WRITE_POLICIES: tuple[WritePolicy, ...] = get_args(WritePolicy)
L2_DURABILITIES: tuple[L2Durability, ...] = get_args(L2Durability)
IO_PLANES: tuple[IoPlane, ...] = get_args(IoPlane)
EVICTIONS: tuple[Eviction, ...] = get_args(Eviction)
_INT_FIELDS = (
    "chunk_size",
    "lower_write_queue",
    "prefetch_max_pending",
    "retrieve_batch_chunks",
    "selective_min_hits",
)
# Ints where None means "sized from the machine" (TIERED_KV_<FIELD>="" or "auto").
_AUTO_INT_FIELDS = ("prefetch_concurrency", "l2_io_threads", "io_workers")
_FLOAT_FIELDS = (
    "close_timeout_s",
    "store_wait_s",
    "l2_sync_interval_s",
    "prefetch_timeout_base_s",
    "prefetch_timeout_per_1k_tokens_s",
    "prefetch_l1_fraction",
)
_DEFAULT_WRITE_QUEUE = 4096
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "512 MiB", "1.5GB"."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{name}: cannot parse size {value!r}; use an int or a number with one of "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        # Decimal, not float: "4.1MB" is exactly 4_100_000 bytes.
        return int(decimal.Decimal(match.group(1)) * _SIZE_UNITS[unit])
    raise ConfigError(f"{name}: expected int or str, got {type(value).__name__}")


def format_size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings. Sizes accept ints (bytes) or strings like "8GiB"; they are stored as ints.

    chunk_size: tokens per chunk, the unit of storage.
    l1_size: bytes of the host arena (pinned when CUDA is available, see ``pin_memory``).
    l2_path: directory of the disk tier; None disables it.
    l2_size: capacity of the disk tier in bytes (LRU beyond it).
    l3_url: remote tier URL; None disables it. ``tkv://host:port`` (``tiered-kv serve``),
        ``redis://``, ``rediss://``, ``valkey://``, ``valkeys://``, or a Cluster form
        (``redis+cluster://host:port``, ``valkey+cluster://...``), or
        ``mooncake://master:port?...`` (Mooncake Store; `MooncakeOptions`); see `L3_SCHEMES`.
        Redis and Valkey need the ``redis`` extra (``pip install 'tiered-kv[redis]'``),
        Mooncake the ``mooncake`` extra.
    l3_timeout_s: bound on every remote request; beyond it the request is a miss / skipped store.
    l3_token_file: file holding the shared token of a ``tkv://`` server (for Redis: the password
        when the URL has none).
    l3_key_prefix: first part of Redis key names (``<prefix>:<namespace>:<chunk>``).
    l3_ttl_s: Redis expiry of stored chunks in seconds; None keeps them until evicted.
    l3_pool_size: connections per remote store, each received on its own thread (``tkv://``);
        None (the default) sizes it from the machine (one per core, 4 to 8).
    namespace: tenant / cache salt; two namespaces never share a chunk.
    fingerprint: model weights / version tag; part of every key.
    lower_write_queue: chunks that may wait for their background write, per lower tier (L2,
        L3, custom tiers: each has a queue this long, and holding at most half of L1's bytes).
        A store waits for room (``store_wait_s``) while the tier's writes make progress; a
        write that meets a full queue anyway drops the oldest waiting write whose chunk is
        still in L1, else is dropped itself (write_through, selective; counted), or the L1
        eviction is refused (write_back).
    close_timeout_s: how long ``aclose()`` lets calls in flight finish and waits for pending
        lower-tier writes (L2, L3, custom tiers) before cancelling and dropping them.
    store_wait_s: how long, in all, a store waits for lower-tier writes: for room in their
        write queues, and for L1 room when the prompt is larger than L1's free room (it streams
        through L1). A wait that sees no write end for a second stops early (the tier is
        stalled). Then what L1 takes is committed (full queues drop, counted) and the chunks
        still left are skipped and counted (``store_skipped_no_space``). 0 never waits (L1
        keeps what fits, full queues drop).
    pin_memory: pin the arena; None means "when CUDA is available".
    l2_durability: when L2's writes reach the disk itself, not only the page cache:
        "batched" (the default: every ``l2_sync_interval_s``, one ``syncfs`` for all the writes
        since the last), "per_write" (each file and its directory fsynced before it becomes
        visible, the put returning after), or "none" (when the kernel writes them back). A
        chunk is visible once its file is renamed into place whole and every read checks its
        checksums, so a crash (of the machine; a killed process loses nothing the kernel has)
        may lose the chunks written since the last sync and never serves a torn one
        (docs/architecture.md, "L2 disk tier").
    l2_sync_interval_s: the batch of "batched" durability, in seconds (> 0).
    l1_eviction, l2_eviction: which chunks L1 and L2 let go first when full
        (docs/eviction.md): "reuse" (the default: age scaled by how often requests used a
        chunk, a prompt's last partial chunk early, a prompt's tail before its head) or "lru"
        (least recently used first).
    io_plane: where L2 reads and writes, and ``tkv://`` GETs and PUTs, move their bytes:
        "processes" (I/O worker processes that read and receive straight into L1 and write and
        send straight from it, L1 then being a shared memfd mapping; each worker has its own
        connection to a ``tkv://`` server; `tiered_kv.io.plane`), so the engine's interpreter
        lock never paces them; "threads" (the tiers' threads in this process); "auto" (the
        default): processes where shared memory works (Linux), else threads. Workers start
        only when a tier uses them (an L2 directory, a ``tkv://`` store). A tier with a custom
        ``file_ops`` stays on threads; Redis and Mooncake keep their own clients.
    io_workers: reader processes of the "processes" plane; None sizes them from the machine
        (one per core, 2 to 16). Writers are a quarter as many, 2 to 4.
    prefetch_policy: what retrieve does with chunks still loading: "best_effort" (use what is
        in L1 now), "wait_complete" (wait for every load), "timeout" (wait at most
        ``prefetch_timeout_base_s`` + ``prefetch_timeout_per_1k_tokens_s`` per 1000 tokens
        still loading). Chunks not ready are reported; the serving engine recomputes them.
    prefetch_concurrency: loads in flight per lower tier; None (the default) takes each tier's
        own parallelism (L2: ``l2_io_threads``; L3: its connections).
    l2_io_threads: L2's blocking I/O threads (reads and writes in parallel, each straight into
        or out of its L1 object); None sizes them from the machine (one per core, 4 to 16).
    prefetch_l1_fraction: share of L1 that prefetch reservations may hold, in (0, 1].
    prefetch_max_pending: a serving stack's lookups whose prefetch is held until the request
        loads (`EngineHost`); beyond it the oldest is cancelled (a request that never loads).
    retrieve_batch_chunks: chunks per scatter in retrieve; each batch's L1 references are
        dropped before the next loads, so a prefix larger than L1 can still be delivered.
    write_policy: how every lower tier is written unless ``write_policies`` names it:
        "write_through", "write_back" (on L1 eviction) or "selective" (after
        ``selective_min_hits`` hits).
    write_policies: per-tier overrides, tier name → policy, e.g. ``{"L2": "write_back",
        "L3": "selective"}``; names compare without case. Stored as a read-only mapping
        (`types.MappingProxyType`) keyed by upper-case names; left out of the config's hash.
        ``TIERED_KV_WRITE_POLICIES`` gives it as ``L2=write_back,L3=selective``.
    selective_min_hits: hits a chunk needs before a "selective" tier stores it.
    layerwise: integrations (the vLLM connector) load and store layer by layer, overlapping
        the model (docs/layerwise.md); None means "for CUDA caches" (on the CPU a layer's wait
        blocks the model's thread, so whole loads are as fast there).
    load_policy: "cost" (the default): lookup claims only the prefix whose expected load time
        beats recomputing it, from each tier's measured reads and the recompute model
        (`TieredKVEngine.observe_prefill`; without one every hit is claimed); "always": every
        hit is claimed (docs/cost.md).
    """

    chunk_size: int = 256
    l1_size: int | str = "1GiB"
    l2_path: str | None = None
    l2_size: int | str = "16GiB"
    l3_url: str | None = None
    l3_timeout_s: float = 5.0
    l3_token_file: str | None = None
    l3_key_prefix: str = "tkv"
    l3_ttl_s: float | None = None
    l3_pool_size: int | None = None
    namespace: str = ""
    fingerprint: str = ""
    lower_write_queue: int = _DEFAULT_WRITE_QUEUE
    close_timeout_s: float = 30.0
    store_wait_s: float = 10.0
    pin_memory: bool | None = None
    l2_durability: L2Durability = "batched"
    l2_sync_interval_s: float = 0.1
    io_plane: IoPlane = "auto"
    l1_eviction: Eviction = "reuse"
    l2_eviction: Eviction = "reuse"
    io_workers: int | None = None
    prefetch_policy: PrefetchPolicy = "wait_complete"
    prefetch_timeout_base_s: float = 0.005
    prefetch_timeout_per_1k_tokens_s: float = 0.002
    prefetch_concurrency: int | None = None
    l2_io_threads: int | None = None
    prefetch_l1_fraction: float = 0.5
    prefetch_max_pending: int = 256
    retrieve_batch_chunks: int = 16
    write_policy: WritePolicy = "write_through"
    write_policies: Mapping[str, WritePolicy] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}), hash=False
    )
    selective_min_hits: int = 2
    layerwise: bool | None = None
    load_policy: LoadPolicy = "cost"

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int):
            raise ConfigError(f"chunk_size: expected int, got {self.chunk_size!r}")
        if not 1 <= self.chunk_size <= 1 << 20:
            raise ConfigError(f"chunk_size: must be in [1, 1048576], got {self.chunk_size}")
        object.__setattr__(self, "l1_size", parse_size(self.l1_size, name="l1_size"))
        object.__setattr__(self, "l2_size", parse_size(self.l2_size, name="l2_size"))
        if self.l1_size == 0:
            raise ConfigError("l1_size: must be > 0 (the host tier stages every transfer)")
        if self.l2_path is not None:
            object.__setattr__(self, "l2_path", os.fspath(self.l2_path))
        if self.l3_url is not None:
            parse_l3_url(self.l3_url)
        self._check_l3_options()
        for name in ("namespace", "fingerprint"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name}: expected str, got {getattr(self, name)!r}")
        self._check_write_queue()
        if not self.close_timeout_s >= 0:
            raise ConfigError(f"close_timeout_s: must be >= 0, got {self.close_timeout_s}")
        if not self.store_wait_s >= 0:
            raise ConfigError(f"store_wait_s: must be >= 0, got {self.store_wait_s}")
        self._validate_policies()

    def _check_write_queue(self) -> None:
        value = self.lower_write_queue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"lower_write_queue: expected int, got {value!r}")
        if value < 1:
            raise ConfigError(f"lower_write_queue: must be >= 1, got {value}")

    def _validate_policies(self) -> None:
        for name in ("l1_eviction", "l2_eviction"):
            if getattr(self, name) not in EVICTIONS:
                raise ConfigError(
                    f"{name}: expected one of {EVICTIONS}, got {getattr(self, name)!r}"
                )
        if self.io_plane not in IO_PLANES:
            raise ConfigError(f"io_plane: expected one of {IO_PLANES}, got {self.io_plane!r}")
        if self.l2_durability not in L2_DURABILITIES:
            raise ConfigError(
                f"l2_durability: expected one of {L2_DURABILITIES}, got {self.l2_durability!r}"
            )
        interval = self.l2_sync_interval_s
        if isinstance(interval, bool) or not isinstance(interval, int | float) or not interval > 0:
            raise ConfigError(f"l2_sync_interval_s: expected a number > 0, got {interval!r}")
        if self.load_policy not in LOAD_POLICIES:
            raise ConfigError(
                f"load_policy: expected one of {LOAD_POLICIES}, got {self.load_policy!r}"
            )
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ConfigError(
                f"prefetch_policy: expected one of {PREFETCH_POLICIES}, "
                f"got {self.prefetch_policy!r}"
            )
        for name in ("prefetch_timeout_base_s", "prefetch_timeout_per_1k_tokens_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"{name}: expected a number >= 0, got {value!r}")
        for name in ("prefetch_concurrency", "l2_io_threads", "io_workers"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ConfigError(f"{name}: expected None or an int >= 1, got {value!r}")
        for name in (
            "prefetch_max_pending",
            "retrieve_batch_chunks",
            "selective_min_hits",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: expected an int >= 1, got {value!r}")
        fraction = self.prefetch_l1_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
            raise ConfigError(f"prefetch_l1_fraction: expected a number, got {fraction!r}")
        if not 0 < fraction <= 1:
            raise ConfigError(f"prefetch_l1_fraction: must be in (0, 1], got {fraction}")
        if self.layerwise is not None and not isinstance(self.layerwise, bool):
            raise ConfigError(f"layerwise: expected true, false or None, got {self.layerwise!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(
                f"write_policy: expected one of {WRITE_POLICIES}, got {self.write_policy!r}"
            )
        self._freeze_write_policies()

    def _freeze_write_policies(self) -> None:
        """``write_policies`` checked and stored read-only under upper-case tier names."""
        policies = self.write_policies
        if isinstance(policies, str) or not isinstance(policies, Mapping):
            hint = " (the 'TIER=POLICY,...' form is for TIERED_KV_WRITE_POLICIES)"
            raise ConfigError(
                "write_policies: expected a mapping tier name -> policy, e.g. "
                f"{{'L2': 'write_back'}}, got {policies!r}"
                + (hint if isinstance(policies, str) else "")
            )
        out: dict[str, WritePolicy] = {}
        for tier, policy in policies.items():
            if not isinstance(tier, str) or not tier.strip():
                raise ConfigError(
                    f"write_policies: tier names must be non-empty strings, got {tier!r}"
                )
            if policy not in WRITE_POLICIES:
                raise ConfigError(
                    f"write_policies[{tier!r}]: expected one of {WRITE_POLICIES}, got {policy!r}"
                )
            name = tier.strip().upper()
            if out.get(name, policy) != policy:
                raise ConfigError(
                    f"write_policies: tier {name} is given two policies, {out[name]!r} and "
                    f"{policy!r} (tier names compare without case)"
                )
            out[name] = policy
        object.__setattr__(self, "write_policies", MappingProxyType(out))

    def write_policy_for(self, tier_name: str) -> WritePolicy:
        """The policy of the lower tier ``tier_name``: its ``write_policies`` entry, else
        ``write_policy``."""
        return self.write_policies.get(tier_name.upper(), self.write_policy)

    def _check_l3_options(self) -> None:
        if isinstance(self.l3_timeout_s, bool) or not isinstance(self.l3_timeout_s, int | float):
            raise ConfigError(f"l3_timeout_s: expected a number, got {self.l3_timeout_s!r}")
        if not 0 < self.l3_timeout_s <= 3600:
            raise ConfigError(f"l3_timeout_s: must be in (0, 3600], got {self.l3_timeout_s}")
        if self.l3_token_file is not None:
            object.__setattr__(self, "l3_token_file", os.fspath(self.l3_token_file))
        if not isinstance(self.l3_key_prefix, str) or not self.l3_key_prefix:
            raise ConfigError(
                f"l3_key_prefix: expected a non-empty str, got {self.l3_key_prefix!r}"
            )
        if self.l3_ttl_s is not None:
            ttl = self.l3_ttl_s
            if isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0:
                raise ConfigError(f"l3_ttl_s: must be a number > 0 or None, got {ttl!r}")
        if self.l3_pool_size is None:
            pass
        elif isinstance(self.l3_pool_size, bool) or not isinstance(self.l3_pool_size, int):
            raise ConfigError(f"l3_pool_size: expected None or an int, got {self.l3_pool_size!r}")
        elif not 1 <= self.l3_pool_size <= 1024:
            raise ConfigError(f"l3_pool_size: must be in [1, 1024], got {self.l3_pool_size}")

    @property
    def l1_bytes(self) -> int:
        assert isinstance(self.l1_size, int)  # normalized in __post_init__
        return self.l1_size

    @property
    def l2_bytes(self) -> int:
        assert isinstance(self.l2_size, int)
        return self.l2_size

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> EngineConfig:
        """Defaults, then ``TIERED_KV_<FIELD>`` variables, then explicit ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(f"TIERED_KV_{field.name.upper()}")
            if raw is not None:
                values[field.name] = _from_env_string(field.name, raw)
        values.update(overrides)
        return cls(**values)


@dataclasses.dataclass(frozen=True, slots=True)
class L3Scheme:
    """What an ``l3_url`` scheme stands for: which store (``"tkv"``: the built-in server,
    ``"redis"``: Redis or Valkey, ``"mooncake"``: Mooncake Store), over TLS or not, one node or
    a Cluster."""

    store: str
    tls: bool = False
    cluster: bool = False


L3_SCHEMES: Mapping[str, L3Scheme] = MappingProxyType(
    {
        "tkv": L3Scheme("tkv"),
        "redis": L3Scheme("redis"),
        "rediss": L3Scheme("redis", tls=True),
        "valkey": L3Scheme("redis"),
        "valkeys": L3Scheme("redis", tls=True),
        "redis+cluster": L3Scheme("redis", cluster=True),
        "rediss+cluster": L3Scheme("redis", tls=True, cluster=True),
        "valkey+cluster": L3Scheme("redis", cluster=True),
        "valkeys+cluster": L3Scheme("redis", tls=True, cluster=True),
        "mooncake": L3Scheme("mooncake"),
    }
)
"""The one table of L3 URL schemes; `tiered_kv.tiers.factory` maps each store to its connector."""

# The Python package each store needs beyond the core dependencies, and the extra that brings it.
_STORE_PACKAGES = {"redis": ("redis", "redis"), "mooncake": ("mooncake", "mooncake")}

MOONCAKE_PROTOCOLS = ("tcp", "rdma")
MOONCAKE_MIN_SEGMENT = 16 << 20  # Mooncake refuses a smaller segment (-600)
_MOONCAKE_QUERY = (
    "metadata",
    "segment",
    "local_buffer",
    "protocol",
    "devices",
    "local_hostname",
    "replicas",
)


@dataclasses.dataclass(frozen=True, slots=True)
class MooncakeOptions:
    """The query of a ``mooncake://MASTER:PORT?...`` URL (docs/remote.md): ``metadata`` the
    transfer engine's metadata server (default ``http://MASTER:8080/metadata``, the master's own
    HTTP metadata server; ``P2PHANDSHAKE`` for none), ``segment`` the bytes this engine lends to
    the pool (default 1GiB; 0 lends none, else at least 16MiB), ``local_buffer`` the client's
    own staging buffer (default 16MiB; transfers go straight from and into L1), ``protocol``
    ``tcp`` or ``rdma``,
    ``devices`` the RDMA devices (comma-separated, e.g. ``mlx5_0,mlx5_1``), ``local_hostname``
    the address other engines reach this one's segment at (default ``127.0.0.1`` when the master
    is on loopback, else this host's name), ``replicas`` copies of every chunk (default 1)."""

    master: str
    metadata: str
    segment_bytes: int = 1 << 30
    local_buffer_bytes: int = 16 << 20
    protocol: str = "tcp"
    devices: str = ""
    local_hostname: str = "127.0.0.1"
    replicas: int = 1


def _mooncake_options(url: str, parts: urllib.parse.SplitResult) -> MooncakeOptions:
    assert parts.hostname is not None and parts.port is not None  # checked by the caller
    try:
        query = urllib.parse.parse_qs(parts.query, keep_blank_values=True, strict_parsing=False)
    except ValueError as exc:
        raise ConfigError(f"l3_url: bad query in {url!r}: {exc}") from None
    values: dict[str, str] = {}
    for name, given in query.items():
        if name not in _MOONCAKE_QUERY:
            raise ConfigError(
                f"l3_url: unknown mooncake:// option {name!r} in {url!r}; "
                f"use {', '.join(_MOONCAKE_QUERY)}"
            )
        if len(given) != 1:
            raise ConfigError(f"l3_url: mooncake:// option {name!r} given {len(given)} times")
        values[name] = given[0]
    host = parts.hostname
    loopback = host in ("localhost", "::1") or host.startswith("127.")
    netloc_host = f"[{host}]" if ":" in host else host
    protocol = values.get("protocol", "tcp")
    if protocol not in MOONCAKE_PROTOCOLS:
        raise ConfigError(
            f"l3_url: mooncake:// protocol must be one of {', '.join(MOONCAKE_PROTOCOLS)}, "
            f"got {protocol!r}"
        )
    replicas_raw = values.get("replicas", "1")
    if not replicas_raw.isdigit() or int(replicas_raw) < 1:
        raise ConfigError(f"l3_url: mooncake:// replicas must be an int >= 1, got {replicas_raw!r}")
    metadata = values.get("metadata", f"http://{netloc_host}:8080/metadata")
    if not metadata:
        raise ConfigError(f"l3_url: mooncake:// metadata is empty in {url!r}")
    local_hostname = values.get("local_hostname")
    if local_hostname is None:
        import socket

        local_hostname = "127.0.0.1" if loopback else socket.gethostname()
    segment_bytes = parse_size(values.get("segment", "1GiB"), name="mooncake:// segment")
    if 0 < segment_bytes < MOONCAKE_MIN_SEGMENT:
        raise ConfigError(
            f"l3_url: mooncake:// segment must be 0 (lend none) or at least 16MiB (Mooncake's "
            f"minimum), got {values['segment']!r}"
        )
    return MooncakeOptions(
        master=f"{netloc_host}:{parts.port}",
        metadata=metadata,
        segment_bytes=segment_bytes,
        local_buffer_bytes=parse_size(
            values.get("local_buffer", "16MiB"), name="mooncake:// local_buffer"
        ),
        protocol=protocol,
        devices=values.get("devices", ""),
        local_hostname=local_hostname,
        replicas=int(replicas_raw),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class L3Url:
    """An ``l3_url`` taken apart (by `parse_l3_url`, the only place that checks one)."""

    url: str
    scheme_name: str
    scheme: L3Scheme
    host: str
    port: int | None
    mooncake: MooncakeOptions | None = None  # for a mooncake:// URL, its query


def parse_l3_url(url: object) -> L3Url:
    """A URL of a scheme in `L3_SCHEMES` with a host (and, for ``tkv://``, a port); a
    `ConfigError` naming the problem otherwise, or naming the extra to install when the store's
    client library is missing (``pip install 'tiered-kv[redis]'``)."""
    if not isinstance(url, str):
        raise ConfigError(f"l3_url: expected str or None, got {url!r}")
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"l3_url: bad port in {url!r}") from None
    scheme = L3_SCHEMES.get(parts.scheme)
    if scheme is None:
        raise ConfigError(
            f"l3_url: unknown scheme in {url!r}; use one of {', '.join(L3_SCHEMES)} "
            "(e.g. tkv://127.0.0.1:7474 or redis://localhost:6379/0)"
        )
    if not parts.hostname:
        raise ConfigError(f"l3_url: no host in {url!r}")
    if scheme.store == "tkv" and port is None:
        raise ConfigError(f"l3_url: tkv:// needs a port, e.g. tkv://127.0.0.1:7474; got {url!r}")
    if scheme.store == "mooncake" and port is None:
        raise ConfigError(
            f"l3_url: mooncake:// needs the master's RPC port, e.g. mooncake://10.0.0.5:50051; "
            f"got {url!r}"
        )
    needed = _STORE_PACKAGES.get(scheme.store)
    if needed is not None and importlib.util.find_spec(needed[0]) is None:
        raise ConfigError(
            f"l3_url: {parts.scheme}:// needs the {needed[0]!r} package, which is not installed; "
            f"install the extra: pip install 'tiered-kv[{needed[1]}]'"
        )
    mooncake = _mooncake_options(url, parts) if scheme.store == "mooncake" else None
    return L3Url(url, parts.scheme, scheme, parts.hostname, port, mooncake)


def _l3_from_env_string(name: str, raw: str) -> Any:
    if name == "l3_pool_size":
        if raw.strip().lower() in ("", "auto", "none"):
            return None
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"TIERED_KV_{name.upper()}: expected an int, got {raw!r}") from None
    if name == "l3_ttl_s" and raw.strip().lower() in ("", "none"):
        return None
    if name in ("l3_timeout_s", "l3_ttl_s"):
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"TIERED_KV_{name.upper()}: expected a number, got {raw!r}") from None
    if name in ("l3_url", "l3_token_file"):
        return raw or None
    return raw


def _from_env_string(name: str, raw: str) -> Any:
    if name.startswith("l3_"):
        return _l3_from_env_string(name, raw)
    if name in _AUTO_INT_FIELDS and raw.strip().lower() in ("", "auto", "none"):
        return None
    if name in _INT_FIELDS or name in _AUTO_INT_FIELDS:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"TIERED_KV_{name.upper()}: expected an int, got {raw!r}") from None
    if name in _FLOAT_FIELDS:
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"TIERED_KV_{name.upper()}: expected a number, got {raw!r}") from None
    if name in ("pin_memory", "layerwise"):
        lowered = raw.strip().lower()
        if lowered in ("", "auto"):
            return None
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"TIERED_KV_{name.upper()}: expected true/false, got {raw!r}")
    if name in ("l2_path", "l3_url"):
        return raw or None
    if name == "write_policies":
        return _parse_write_policies(raw)
    return raw


def _parse_write_policies(raw: str) -> dict[str, str]:
    """``TIERED_KV_WRITE_POLICIES`` ("L2=write_back,L3=selective") as tier name -> policy;
    `EngineConfig` checks the names and policies."""
    out: dict[str, str] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        tier, sep, policy = item.partition("=")
        tier, policy = tier.strip(), policy.strip()
        if not sep or not tier or policy not in WRITE_POLICIES:
            raise ConfigError(
                f"TIERED_KV_WRITE_POLICIES: expected 'TIER=POLICY[,...]' with POLICY one of "
                f"{WRITE_POLICIES}, got {item.strip()!r}"
            )
        out[tier] = policy
    return out
