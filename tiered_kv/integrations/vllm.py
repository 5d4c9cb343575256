"""`TieredKVConnector`: tiered_kv as a vLLM (v1) KV connector.

Load it with::

    KVTransferConfig(kv_connector="TieredKVConnector",
                     kv_connector_module_path="tiered_kv.integrations.vllm",
                     kv_role="kv_both",  # or kv_producer (store only) / kv_consumer (load only)
                     kv_connector_extra_config={"chunk_size": 256, "l2_path": "/var/cache/tkv"})

Owns the two halves vLLM creates. The **scheduler** half (no KV caches in its process) asks the
workers' engines over the local lookup channel how much of a prompt is cached and ready in host
memory, claims whole blocks beyond vLLM's own prefix-cache hit, and plans per step which blocks
each worker loads and stores (`TieredKVMetadata`). The **worker** half owns an `EngineHost`
(the engine on its own loop thread, serving the channel), registers vLLM's per-layer caches,
loads in `start_load_kv` before the forward pass, stores in `wait_for_save` after it (the copy
out of the blocks is done when it returns, so vLLM may free them at once), and reports blocks
whose load fell short so that vLLM recomputes them. Layerwise (``EngineConfig.layerwise``, on
for CUDA caches by default): `start_load_kv` settles and enqueues the loads, each attention
layer waits for its own layer (`wait_for_layer_load`), `save_kv_layer` copies each layer out
as it is written, and `wait_for_save` commits (docs/layerwise.md).

Chunk keys carry what changes KV beyond the tokens: the model's fingerprint (computed from its
config and weight files unless given, `default_fingerprint`) and each request's `KeySalt`
(cache salt, LoRA adapter, multimodal items: `request_salt`). Hybrid models (`SupportsHMA`)
keep one registration per KV cache group; a sliding-window group stores and loads only its
window, and their loads are asynchronous so that a short one is recomputed.

Must not: block the scheduler on disk, network or the workers (a lookup waits for the workers'
replies at most `LOOKUP_WAIT_PER_STEP_S` per step, and answers "ask again" until they have
arrived and their loads are done), claim a partial block, load
into blocks vLLM's own prefix cache owns, or let a tiered_kv failure fail a request (it is a
miss, or failed blocks vLLM recomputes). vLLM is imported here only; importing tiered_kv never
imports this module.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tiered_kv.config import EngineConfig
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.engine_host import EngineHost, window_start
from tiered_kv.integrations.fingerprint import adapter_digest, model_fingerprint
from tiered_kv.integrations.kv_events import EventGroup, TieredKVEvents, to_vllm_events
from tiered_kv.integrations.lookup_channel import (
    LookupClient,
    default_socket_dir,
    socket_path,
)
from tiered_kv.integrations.prefill_timer import GpuPrefillTimer
from tiered_kv.keys import KeySalt
from tiered_kv.sync import SyncLayerwiseRetrieve, SyncLayerwiseStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# -- configuration ------------------------------------------------------------------------------

_ENGINE_FIELDS = tuple(field.name for field in dataclasses.fields(EngineConfig))


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """Connector settings beyond `EngineConfig` (all optional in ``kv_connector_extra_config``).

    model_name: the name in chunk keys; default: vLLM's ``model_config.model``. Two instances
        share chunks only when it (and namespace, fingerprint, layout) agree.
    layout_hints: passed to ``register_kv_caches``; default: ``{"format": "blocks",
        "block_size": BS}`` for vLLM's CPU backend, ``{"block_size": BS, "kv_layout": L}``
        (vLLM's own layout) on GPUs.
    lookup_socket_dir: directory of the scheduler-to-worker sockets (default: a per-user
        directory under the temp dir).
    """

    model_name: str | None = None
    layout_hints: Mapping[str, Any] | None = None
    lookup_socket_dir: str | None = None

    def __post_init__(self) -> None:
        if self.model_name is not None and (
            not isinstance(self.model_name, str) or not self.model_name
        ):
            raise ConfigError(f"model_name: expected a non-empty str, got {self.model_name!r}")
        if self.layout_hints is not None and not isinstance(self.layout_hints, Mapping):
            raise ConfigError(f"layout_hints: expected a dict, got {self.layout_hints!r}")
        if self.lookup_socket_dir is not None and not isinstance(self.lookup_socket_dir, str):
            raise ConfigError(f"lookup_socket_dir: expected a str, got {self.lookup_socket_dir!r}")


_OPTION_FIELDS = tuple(field.name for field in dataclasses.fields(ConnectorOptions))


def fingerprint_given(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether the user set ``fingerprint`` (in the extra config or ``TIERED_KV_FINGERPRINT``,
    even to ""): theirs wins over `default_fingerprint`."""
    environ = os.environ if environ is None else environ
    return "fingerprint" in (extra or {}) or "TIERED_KV_FINGERPRINT" in environ


def parse_extra_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> tuple[EngineConfig, ConnectorOptions]:
    """``kv_connector_extra_config`` as an `EngineConfig` (``TIERED_KV_*`` variables fill what it
    leaves out) and `ConnectorOptions`. Unknown keys raise `ConfigError` naming the known ones."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_ENGINE_FIELDS) - set(_OPTION_FIELDS))
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown keys {unknown}; tiered_kv accepts every "
            f"EngineConfig field {list(_ENGINE_FIELDS)} and {list(_OPTION_FIELDS)}"
        )
    options = ConnectorOptions(**{k: v for k, v in extra.items() if k in _OPTION_FIELDS})
    try:
        config = EngineConfig.from_env(
            environ, **{k: v for k, v in extra.items() if k in _ENGINE_FIELDS}
        )
    except TypeError as exc:  # pragma: no cover - keys are checked above
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None
    return config, options


# -- scheduler -> worker metadata ---------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class LoadSpec:
    """Load ``token_ids``'s cached prefix into ``block_ids``, never writing the first
    ``skip_prefix_tokens`` (vLLM's own prefix-cache hit). The scheduler claimed the tokens up to
    ``claimed_end`` (0: up to the end of ``token_ids``); ``token_ids`` may go on to the end of
    the chunk holding the claim's last token, so that the chunk's key matches the one stored:
    those extra tokens land in the request's own next blocks, which vLLM computes anyway."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_prefix_tokens: int
    claimed_end: int = 0
    salt: list[list[int | str]] | None = None  # `KeySalt.to_wire` of the request's salt
    group_block_ids: list[list[int]] | None = None  # hybrid models: every group's blocks

    @property
    def end(self) -> int:
        return self.claimed_end or len(self.token_ids)


@dataclasses.dataclass(slots=True)
class StoreSpec:
    """Store the KV of ``token_ids`` (whole blocks) from ``block_ids`` after this step."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    salt: list[list[int | str]] | None = None  # `KeySalt.to_wire` of the request's salt
    group_block_ids: list[list[int]] | None = None  # hybrid models: every group's blocks


@dataclasses.dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """One step's plan: loads (before the forward pass), stores (after it), and requests whose
    lookup prefetches the workers may free."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    stores: list[StoreSpec] = dataclasses.field(default_factory=list)
    release: list[str] = dataclasses.field(default_factory=list)
    # (new tokens, prefix tokens) when the step is one request's prefill (`prefill_of_step`):
    # the workers time its forward pass for the recompute model of load_policy "cost".
    prefill: tuple[int, int] | None = None


# -- stats through vLLM ---------------------------------------------------------------------------


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
# Worker-side stats: name -> the engine-host stats entries (section, key) it sums.
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
# Scheduler-side stats: lookups answered (not "ask again"), the seconds from a request's first
# lookup to its answer (summed), tokens claimed for loading, and blocks reported as failed loads
# (counted on the worker).
SCHEDULER_STATS = (
    "scheduler_lookups_answered",
    "scheduler_lookups_pending",
    "scheduler_lookup_latency_seconds",
    "claimed_tokens",
    "kv_events_dropped",
)
# How long one scheduler step may wait, over all its lookups, for the workers' replies (their
# round trip, not their loads: a worker answers "ask again" while it loads). Without it a
# request whose KV is in host memory sits out one step for its answer (docs/vllm.md).
LOOKUP_WAIT_PER_STEP_S = 0.002
# Router events the scheduler holds between a step's output and vLLM's next `take_events`
# (called every step, so only a publisher that stopped draining reaches it): the oldest beyond
# are dropped and counted in ``kv_events_dropped``.
PENDING_EVENTS_MAX = 1 << 16


# -- the connector ------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True, eq=False)
class _RequestState:
    """Scheduler-side bookkeeping of one request."""

    request: Request
    cacheable: bool = True  # False: its KV cannot be keyed (see `request_salt`)
    salt: KeySalt | None = None
    local_tokens: int = 0  # vLLM's block-aligned prefix-cache hit at the last lookup
    load_end: int = 0  # end of the tokens to load (0: none)
    ready_end: int = 0  # the workers' answer: the cached prefix's end (may pass load_end)
    load_pending: bool = False
    stored_end: int = 0  # tokens already handed to a StoreSpec or loaded from the cache
    first_lookup: float | None = None  # time.monotonic() of the first unanswered lookup


@dataclasses.dataclass(frozen=True, slots=True)
class _Group:
    """One of vLLM's KV cache groups as the connector moves it."""

    layer_names: tuple[str, ...]
    sliding_window: int | None  # None: full attention


def layer_groups(kv_cache_config: KVCacheConfig | None, block_size: int) -> list[_Group]:
    """vLLM's KV cache groups (several under the hybrid allocator: sliding-window and full
    attention layers apart). Raises `ConfigError` for a hybrid model whose groups are not
    attention with vLLM's block size (Mamba state, another block size): not supported yet."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return [_Group(tuple(groups[0].layer_names) if groups else (), None)]
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    out = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            window: int | None = int(spec.sliding_window)
            if getattr(spec, "extra_retained_tokens", 0):
                raise ConfigError(
                    f"TieredKVConnector: KV cache group {index} retains "
                    f"{spec.extra_retained_tokens} tokens beyond its sliding window "
                    "(speculative decoding): not supported with the hybrid allocator yet"
                )
        elif type(spec) is FullAttentionSpec:
            window = None
        else:
            raise ConfigError(
                f"TieredKVConnector: KV cache group {index} is {type(spec).__name__}; with "
                "vLLM's hybrid allocator only full and sliding-window attention groups are "
                "supported (set disable_hybrid_kv_cache_manager=True where vLLM allows it)"
            )
        if int(spec.block_size) != block_size:
            raise ConfigError(
                f"TieredKVConnector: KV cache group {index} has block size {spec.block_size}, "
                f"not vLLM's {block_size}: not supported yet"
            )
        out.append(_Group(tuple(group.layer_names), window))
    return out


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by a tiered_kv engine per worker (see the module docstring)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.engine_config, self.options = parse_extra_config(transfer.kv_connector_extra_config)
        self._block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError("TieredKVConnector: pipeline parallelism is not supported yet")
        self._world_size = int(parallel.tensor_parallel_size)
        self._model_name = self.options.model_name or str(vllm_config.model_config.model)
        self._is_producer = bool(transfer.is_kv_producer)
        self._is_consumer = bool(transfer.is_kv_consumer)
        self._instance_id = str(transfer.engine_id)
        self._socket_dir = self.options.lookup_socket_dir or default_socket_dir()
        self._groups = layer_groups(kv_cache_config, self._block_size)
        self._hybrid = len(self._groups) > 1
        events_config = getattr(vllm_config, "kv_events_config", None)
        # Router events (docs/vllm.md, "KV events"): only when vLLM publishes KV events.
        self._publish_events = bool(events_config and events_config.enable_kv_cache_events)
        self._pending_events: deque[KVCacheEvent] = deque()
        self._event_groups: dict[str, EventGroup] = {}  # worker: model name in keys -> group
        self._finished_recving: set[str] = set()  # hybrid: async loads done this step
        self._failed_recving: set[str] = set()  # hybrid: ... and those that fell short
        # scheduler side
        self._requests: dict[str, _RequestState] = {}
        self._release: list[str] = []
        self._lookup_wait_left = LOOKUP_WAIT_PER_STEP_S  # this step's time for lookup replies
        self._client: LookupClient | None = None
        self._adapter_digests: dict[tuple[str, str], str | None] = {}  # LoRA (name, path)
        # worker side
        self._host: EngineHost | None = None
        self._layerwise = False  # decided at registration (EngineConfig.layerwise)
        self._layer_index: dict[str, int] = {}  # layer name -> registration order
        self._on_cuda = False  # the KV caches are CUDA tensors (set at registration)
        self._gpu_timer: GpuPrefillTimer | None = None  # CUDA caches: prefills timed by events
        self._step_started: float | None = None  # perf_counter() at the step's metadata
        self._loads_timed: tuple[float, float] | None = None  # start_load_kv's begin and end
        self._loads: list[SyncLayerwiseRetrieve] = []  # this step's layerwise loads
        self._savers: list[tuple[str, SyncLayerwiseStore]] = []  # this step's layerwise stores
        self._stores_begun = False  # the step's first save_kv_layer has staged its stores
        self._load_errors: set[int] = set()
        self._stats_last: dict[str, float] = {}
        self.load_error_blocks = 0  # blocks reported to vLLM as not loaded (recomputed)
        self._scheduler_stats: dict[str, float] = dict.fromkeys(SCHEDULER_STATS, 0)
        self.failures = 0  # loads / stores that raised (logged, counted, turned into misses)
        if role == KVConnectorRole.SCHEDULER:
            paths = [
                socket_path(self._socket_dir, self._instance_id, rank)
                for rank in range(self._world_size)
            ]
            self._client = LookupClient(paths)
            if self._is_consumer and transfer.kv_load_failure_policy != "recompute":
                logger.warning(
                    "TieredKVConnector: kv_load_failure_policy=%r fails a request whose cached "
                    "KV could not be loaded; 'recompute' recomputes it instead",
                    transfer.kv_load_failure_policy,
                )
        else:
            if not fingerprint_given(transfer.kv_connector_extra_config):
                started = time.perf_counter()
                fingerprint = default_fingerprint(vllm_config)
                self.engine_config = dataclasses.replace(
                    self.engine_config, fingerprint=fingerprint
                )
                logger.info(
                    "TieredKVConnector: model fingerprint %s (%.3f s)",
                    fingerprint,
                    time.perf_counter() - started,
                )
            self._host = EngineHost(self.engine_config)

    # ======================================================================================
    # worker side
    # ======================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        host = self._require_host()
        first = next(iter(kv_caches.values()))
        hints = self.options.layout_hints
        if hints is None:
            if first.device.type == "cpu":
                hints = {"format": "blocks", "block_size": self._block_size}
            else:
                hints = {"block_size": self._block_size}
                memory_order = _head_position_order(self._vllm_config)
                if memory_order is not None:
                    hints["kv_layout"] = memory_order
        rank = _tensor_parallel_rank()
        if self._hybrid:
            for index, group in enumerate(self._groups):
                missing = [name for name in group.layer_names if name not in kv_caches]
                if missing:
                    raise ConfigError(
                        f"TieredKVConnector: layers {missing[:4]} of KV cache group {index} "
                        "have no KV cache tensor"
                    )
                host.register_kv_caches(
                    {name: kv_caches[name] for name in group.layer_names},
                    model_name=self._group_model(index),
                    world_size=self._world_size,
                    worker_id=rank,
                    layout_hints=hints,
                    sliding_window=group.sliding_window,
                    block_size=self._block_size,
                )
        else:
            host.register_kv_caches(
                kv_caches,
                model_name=self._model_name,
                world_size=self._world_size,
                worker_id=rank,
                layout_hints=hints,
            )
        host.serve_lookups(socket_path(self._socket_dir, self._instance_id, rank))
        if self._publish_events and rank == 0:  # rank 0's tiers speak for the instance
            self._event_groups = self._groups_for_events()
            host.watch_tiers()
        layerwise = self.engine_config.layerwise
        if self._hybrid and layerwise:
            raise ConfigError(
                "TieredKVConnector: layerwise loads and stores of hybrid models (several KV "
                "cache groups) are not supported yet; set layerwise to false"
            )
        if self._hybrid:
            layerwise = False
        self._on_cuda = first.device.type == "cuda"
        self._gpu_timer = GpuPrefillTimer(first.device) if self._on_cuda else None
        self._layerwise = self._on_cuda if layerwise is None else layerwise
        self._layer_index = {name: index for index, name in enumerate(kv_caches)}
        logger.info(
            "TieredKVConnector: %d layers registered (%s, strides %s, hints %s), rank %d/%d, "
            "%s loads and stores",
            len(kv_caches),
            tuple(first.shape),
            first.stride(),
            hints,
            rank,
            self._world_size,
            "layerwise" if self._layerwise else "whole",
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # The step's forward pass starts about now (before it: start_load_kv when the step
        # has synchronous loads, see `_observe_prefill`).
        self._step_started = time.perf_counter()
        self._loads_timed = None
        timer = self._gpu_timer
        if timer is not None:
            self._report_gpu_prefills(timer)
            meta = connector_metadata
            if isinstance(meta, TieredKVMetadata) and meta.prefill is not None and not meta.loads:
                timer.begin(*meta.prefill)  # a prefill without loads: all of it is compute

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        began = time.perf_counter()
        try:
            self._start_loads()
        finally:
            self._loads_timed = (began, time.perf_counter())

    def _start_loads(self) -> None:
        meta = self._metadata()
        host = self._require_host()
        self._finish_loads()
        for spec in meta.loads:
            end = spec.end
            if spec.group_block_ids is not None:
                self._load_groups(host, spec)
                continue
            try:
                if self._layerwise:
                    # Decided now (late or failed chunks included); copies land per layer.
                    load = host.load_layerwise(
                        spec.token_ids,
                        spec.block_ids,
                        skip_prefix_tokens=spec.skip_prefix_tokens,
                        claimed_tokens=end,
                        salt=KeySalt.from_wire(spec.salt),
                    )
                    self._loads.append(load)
                    valid = load.result.valid_tokens
                else:
                    valid = host.load(
                        spec.token_ids,
                        spec.block_ids,
                        skip_prefix_tokens=spec.skip_prefix_tokens,
                        claimed_tokens=end,
                        salt=KeySalt.from_wire(spec.salt),
                    ).valid_tokens
            except Exception:  # the boundary with vLLM: a failed load is recomputed
                self.failures += 1
                logger.warning(
                    "TieredKVConnector: load of %s failed", spec.request_id, exc_info=True
                )
                valid = spec.skip_prefix_tokens
            if valid < end:
                first_bad = valid // self._block_size
                failed = spec.block_ids[first_bad : -(-end // self._block_size)]
                self._load_errors.update(failed)
                self.load_error_blocks += len(failed)
                logger.warning(
                    "TieredKVConnector: %s: %d of %d claimed tokens not loaded; vLLM "
                    "recomputes blocks from %d",
                    spec.request_id,
                    end - valid,
                    end - spec.skip_prefix_tokens,
                    first_bad,
                )
        released = [spec.request_id for spec in meta.loads] + meta.release
        if released:
            host.release(released)

    def _load_groups(self, host: EngineHost, spec: LoadSpec) -> None:
        """A hybrid model's load (vLLM loads it asynchronously): every group's blocks, a
        sliding-window group's only from its window before the claim's end. Done when this
        returns; a group that falls short fails the whole load (`get_transfer_results`): vLLM
        cannot take failed blocks from models with several groups, it recomputes the request."""
        assert spec.group_block_ids is not None
        end, salt = spec.end, KeySalt.from_wire(spec.salt)
        short = False
        for index, (group, block_ids) in enumerate(
            zip(self._groups, spec.group_block_ids, strict=True)
        ):
            skip = spec.skip_prefix_tokens
            if group.sliding_window is not None:
                skip = max(skip, window_start(end, group.sliding_window, self._block_size))
            try:
                valid = host.load(
                    spec.token_ids,
                    block_ids,
                    skip_prefix_tokens=skip,
                    claimed_tokens=end,
                    salt=salt,
                    model_name=self._group_model(index),
                ).valid_tokens
            except Exception:  # the boundary with vLLM: a failed load is recomputed
                self.failures += 1
                logger.warning(
                    "TieredKVConnector: load of %s failed", spec.request_id, exc_info=True
                )
                valid = skip
            short = short or valid < end
        self._finished_recving.add(spec.request_id)
        if short:
            self._failed_recving.add(spec.request_id)
            self.load_error_blocks += -(-(end - spec.skip_prefix_tokens) // self._block_size)
            logger.warning(
                "TieredKVConnector: %s: the claimed %d tokens did not all load; vLLM "
                "recomputes the request",
                spec.request_id,
                end - spec.skip_prefix_tokens,
            )

    def _store_groups(self, host: EngineHost, spec: StoreSpec) -> None:
        """A hybrid model's store: every group's chunks, a sliding-window group's only those
        vLLM reads again (the window before the stored end, or before one block less: a repeat
        of the same prompt recomputes its last block) whose blocks it still holds."""
        assert spec.group_block_ids is not None
        chunk, block = self.engine_config.chunk_size, self._block_size
        target = len(spec.token_ids)
        salt = KeySalt.from_wire(spec.salt)
        for index, (group, block_ids) in enumerate(
            zip(self._groups, spec.group_block_ids, strict=True)
        ):
            skip = 0
            if group.sliding_window is not None:
                first = window_start(max(target - block, 0), group.sliding_window, block)
                skip = first // chunk * chunk
                dropped = [i for i, b in enumerate(block_ids[: -(-target // block)]) if b == 0]
                if dropped:  # vLLM's null block (id 0): those blocks' KV is gone
                    skip = max(skip, -(-(dropped[-1] + 1) * block // chunk) * chunk)
                if skip >= target:
                    continue
            host.store(
                spec.token_ids,
                block_ids,
                model_name=self._group_model(index),
                salt=salt,
                skip_prefix_tokens=skip,
            )

    def _groups_for_events(self) -> dict[str, EventGroup]:
        """Model name in chunk keys -> what KV events say of its group."""
        if not self._hybrid:
            return {self._model_name: EventGroup()}
        return {
            self._group_model(index): EventGroup(
                index,
                "full_attention" if group.sliding_window is None else "sliding_window",
                group.sliding_window,
            )
            for index, group in enumerate(self._groups)
        }

    def _group_model(self, index: int) -> str:
        """The model name of a hybrid model's group ``index`` in chunk keys."""
        return f"{self._model_name}#g{index}"

    def _begin_stores(self) -> None:
        """Layerwise: stage this step's stores, at the step's first `save_kv_layer` (vLLM may
        call `start_load_kv` after the forward pass when the step has no synchronous loads)."""
        self._stores_begun = True
        host = self._require_host()
        for store in self._metadata().stores:
            try:
                saver = host.store_layerwise(
                    store.token_ids, store.block_ids, salt=KeySalt.from_wire(store.salt)
                )
            except Exception:
                self.failures += 1
                logger.warning(
                    "TieredKVConnector: store of %s failed", store.request_id, exc_info=True
                )
                continue
            self._savers.append((store.request_id, saver))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layerwise: the current stream waits for this layer of every load of the step (a GPU
        wait; on CPU caches the thread waits for the copy)."""
        index = self._layer_index.get(layer_name)
        if index is None:
            return
        for load in self._loads:
            load.wait_layer(index)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Layerwise: copy this layer of the step's stores out, after the work that wrote it
        (an event on the current stream); whole stores run in `wait_for_save`."""
        index = self._layer_index.get(layer_name)
        if index is None or not self._layerwise:
            return
        if not self._stores_begun:
            self._begin_stores()
        for request_id, saver in self._savers:
            try:
                saver.save_layer(index)
            except Exception:
                self.failures += 1
                logger.warning(
                    "TieredKVConnector: saving layer %s of %s failed",
                    layer_name,
                    request_id,
                    exc_info=True,
                )

    def wait_for_save(self) -> None:
        self._observe_prefill(time.perf_counter())
        host = self._require_host()
        savers, self._savers = self._savers, []
        begun, self._stores_begun = self._stores_begun, False
        for request_id, saver in savers:
            try:
                host.commit_store(saver)  # stores nothing unless every layer was saved
            except Exception:  # a failed store is a future miss, never a failed request
                self.failures += 1
                logger.warning("TieredKVConnector: store of %s failed", request_id, exc_info=True)
        self._finish_loads()
        meta = self._metadata()
        if (self._layerwise and begun) or not meta.stores:
            return  # layerwise stores were committed above
        for spec in meta.stores:
            try:
                if spec.group_block_ids is not None:
                    self._store_groups(host, spec)
                    continue
                host.store(spec.token_ids, spec.block_ids, salt=KeySalt.from_wire(spec.salt))
            except Exception:  # a failed store is a future miss, never a failed request
                self.failures += 1
                logger.warning(
                    "TieredKVConnector: store of %s failed", spec.request_id, exc_info=True
                )

    def _observe_prefill(self, forward_ended: float) -> None:
        """Report the step's forward time to the recompute model when the step was one
        request's prefill (``meta.prefill``): from `bind_connector_metadata` (or the end of
        this step's synchronous loads, which vLLM runs before the forward) to `wait_for_save`.
        Wall time of the worker's thread on CPU caches, where the forward runs in it (steps
        with layerwise loads, which wait inside the forward, are not timed). CUDA caches: the
        GPU's time between two events (`GpuPrefillTimer`), of steps without loads, read at a
        later step."""
        if self._gpu_timer is not None:
            self._gpu_timer.end()
            return
        meta = self._connector_metadata
        host, started = self._host, self._step_started
        if (
            not isinstance(meta, TieredKVMetadata)
            or meta.prefill is None
            or host is None
            or started is None
            or self._layerwise
        ):
            return
        loads = self._loads_timed
        if any(spec.group_block_ids is None for spec in meta.loads):
            if loads is None:
                return
            started = loads[1]  # vLLM loaded before the forward
        elif loads is not None and loads[0] >= started:
            forward_ended = min(forward_ended, loads[0])  # vLLM called it after the forward
        seconds = forward_ended - started
        if seconds > 0:
            new_tokens, prefix_tokens = meta.prefill
            host.observe_prefill(new_tokens, prefix_tokens, seconds)

    def _report_gpu_prefills(self, timer: GpuPrefillTimer) -> None:
        """The recompute model learns every timed prefill the GPU has finished."""
        host = self._host
        if host is None:
            return
        for new_tokens, prefix_tokens, seconds in timer.poll():
            host.observe_prefill(new_tokens, prefix_tokens, seconds)

    def _finish_loads(self) -> None:
        """Drop the host references of the step's layerwise loads (the model has waited for
        every layer by now). A load that failed on the GPU is logged: a CUDA error there has
        broken the context for the model's kernels too."""
        loads, self._loads = self._loads, []
        for load in loads:
            try:
                load.wait()
            except Exception:
                self.failures += 1
                logger.warning("TieredKVConnector: a layerwise load failed", exc_info=True)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if finished_req_ids and self._host is not None:
            self._host.release(finished_req_ids)
        # Stores are synchronous; a hybrid model's loads are reported done in the step that ran
        # them (vLLM loads them asynchronously, so that a failed one can be recomputed).
        recving, self._finished_recving = self._finished_recving, set()
        return None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        failed, self._failed_recving = self._failed_recving, set()
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's counters: the scheduler's own, or the worker's engine's (deltas)."""
        if self._host is None:
            data, self._scheduler_stats = (
                self._scheduler_stats,
                dict.fromkeys(SCHEDULER_STATS, 0),
            )
        else:
            stats = self._host.stats()
            totals = {
                name: sum(stats.get(section, {}).get(key, 0) for section, key in entries)
                for name, entries in WORKER_STATS.items()
            }
            totals["load_error_blocks"] = self.load_error_blocks
            data = {}
            for name, value in totals.items():
                data[name] = value - self._stats_last.get(name, 0)
                self._stats_last[name] = value
        stats_obj = TieredKVConnectorStats(data=data)
        return None if stats_obj.is_empty() else stats_obj

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """Worker: this step's tier activity as vLLM KV events (rank 0 only; None when there
        was none or vLLM publishes no KV events)."""
        host = self._host
        if host is None or not self._event_groups:
            return None
        try:
            events = to_vllm_events(host.tier_events(), self._event_groups)
        except Exception:  # events are advisory: never fail a step for them
            self.failures += 1
            logger.warning("TieredKVConnector: KV events failed", exc_info=True)
            return None
        return TieredKVEvents(events) if events else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return TieredKVConnectorStats(data=dict(data or {}))

    def engine_stats(self) -> dict[str, dict[str, int | float]]:
        """The worker's engine stats plus the host's counters (worker role only)."""
        return self._require_host().stats()

    def engine_metrics_text(self) -> str:
        """The worker's ``engine.metrics_text()`` (Prometheus text; worker role only)."""
        return self._require_host().metrics_text()

    def shutdown(self) -> None:
        host, self._host = self._host, None
        if host is not None:
            host.close()
        client, self._client = self._client, None
        if client is not None:
            client.close()

    # ======================================================================================
    # scheduler side
    # ======================================================================================
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self._is_consumer or self._client is None:
            return 0, False
        block = self._block_size
        # Whole blocks only, and at least one token left for vLLM to compute.
        limit = (request.num_tokens - 1) // block * block
        if limit <= num_computed_tokens:
            return 0, False
        state = self._state(request)
        if not state.cacheable:
            return 0, False
        now = time.monotonic()
        if state.first_lookup is None:
            state.first_lookup = now
        # Ask about every whole block of the request, not only up to the limit: a block-aligned
        # prompt's last chunk was stored whole, and a key over fewer tokens would not match it.
        looked_up = request.num_tokens // block * block
        started = time.monotonic()
        ready = self._client.lookup(
            request.request_id,
            request.all_token_ids[:looked_up],
            state.salt,
            limit,
            wait_s=self._lookup_wait_left,
        )
        self._lookup_wait_left = max(0.0, self._lookup_wait_left - (time.monotonic() - started))
        stats = self._scheduler_stats
        if ready is None:
            stats["scheduler_lookups_pending"] += 1
            return None, False  # the answer or the loads are on the way: vLLM asks again
        stats["scheduler_lookups_answered"] += 1
        # Measured to now: an answer can arrive within the very call that asked.
        stats["scheduler_lookup_latency_seconds"] += time.monotonic() - state.first_lookup
        state.first_lookup = None
        hit = min(ready, limit) // block * block
        state.local_tokens = num_computed_tokens
        state.ready_end = ready
        if hit <= num_computed_tokens:
            return 0, False
        stats["claimed_tokens"] += hit - num_computed_tokens
        # Hybrid models load asynchronously: vLLM recomputes a failed load only then.
        return hit - num_computed_tokens, self._hybrid

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._state(request)
        if num_external_tokens > 0:
            state.load_end = state.local_tokens + num_external_tokens
            state.load_pending = True
        elif self._is_consumer:
            self._release.append(request.request_id)  # its lookup's prefetch is not needed

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._lookup_wait_left = LOOKUP_WAIT_PER_STEP_S  # for the next step's lookups
        meta = TieredKVMetadata(release=self._release)
        self._release = []
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        manager = self._kv_cache_manager

        def resolve(request_id: str) -> Any:
            if block_state is not None:
                return block_state.resolve_block_ids(request_id)
            if manager is not None:
                return manager.get_block_ids(request_id)
            raise RuntimeError("TieredKVConnector: no way to resolve block ids")

        if self._hybrid:  # loads are asynchronous: their requests are not scheduled yet
            for request_id, state in list(self._requests.items()):
                if state.load_pending:
                    self._plan_load(meta, request_id, state, resolve)
        scheduled = scheduler_output.num_scheduled_tokens
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
            self._plan(meta, new.req_id, new.num_computed_tokens, scheduled[new.req_id], resolve)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[index]
            self._plan(meta, req_id, cached.num_computed_tokens[index], scheduled[req_id], resolve)
        if self.engine_config.load_policy == "cost":
            meta.prefill = prefill_of_step(scheduled, computed)
        return meta

    def _plan(
        self,
        meta: TieredKVMetadata,
        request_id: str,
        num_computed: int,
        num_scheduled: int,
        resolve: Callable[[str], Any],
    ) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        if state.load_pending:  # synchronous: loaded in the step that computes the rest
            self._plan_load(meta, request_id, state, resolve)
        block = self._block_size
        if not self._is_producer or not state.cacheable:
            return
        prompt_len = state.request.num_prompt_tokens
        computed_after = min(num_computed + num_scheduled, prompt_len)
        if computed_after >= prompt_len:
            target = prompt_len // block * block  # the whole prompt, whole blocks
        else:  # chunked prefill: whole chunks only, so no partial chunk is stored twice
            chunk = self.engine_config.chunk_size
            target = computed_after // chunk * chunk // block * block
        if target <= state.stored_end:
            return
        groups = [list(ids) for ids in resolve(request_id)]
        count = -(-target // block)
        meta.stores.append(
            StoreSpec(
                request_id,
                list(state.request.all_token_ids[:target]),
                groups[0][:count],
                salt=_wire(state.salt),
                group_block_ids=[ids[:count] for ids in groups] if self._hybrid else None,
            )
        )
        state.stored_end = target

    def _plan_load(
        self,
        meta: TieredKVMetadata,
        request_id: str,
        state: _RequestState,
        resolve: Callable[[str], Any],
    ) -> None:
        state.load_pending = False
        block = self._block_size
        groups = [list(ids) for ids in resolve(request_id)]
        end = state.load_end
        # Load through the end of the chunk holding the claim's last token (its stored key
        # covers the whole chunk), as far as whole blocks vLLM already allocated reach.
        chunk = self.engine_config.chunk_size
        through = -(-end // chunk) * chunk
        if not self._hybrid and end <= state.ready_end < through:
            through = state.ready_end  # that chunk was stored partial: its key ends there
        through = min(
            through,
            state.request.num_tokens // block * block,
            min(len(ids) for ids in groups) * block,
        )
        through = max(through, end)
        count = -(-through // block)
        meta.loads.append(
            LoadSpec(
                request_id,
                list(state.request.all_token_ids[:through]),
                groups[0][:count],
                state.local_tokens,
                claimed_end=end,
                salt=_wire(state.salt),
                group_block_ids=[ids[:count] for ids in groups] if self._hybrid else None,
            )
        )
        state.stored_end = max(state.stored_end, through)  # already in the cache

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        if self._client is not None:
            self._client.forget(request.request_id)
        if self._is_consumer:
            self._release.append(request.request_id)
        return False, None  # stores are copied out before wait_for_save returns

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        events = connector_output.kv_cache_events
        if not self._publish_events or not isinstance(events, TieredKVEvents):
            return
        pending = self._pending_events
        pending.extend(events.get_all_events())
        overflow = len(pending) - PENDING_EVENTS_MAX
        if overflow > 0:
            for _ in range(overflow):
                pending.popleft()
            self._scheduler_stats["kv_events_dropped"] += overflow

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler: the workers' tier events since the last call, for vLLM's publisher."""
        pending, self._pending_events = self._pending_events, deque()
        return pending

    # -- helpers ---------------------------------------------------------------------------
    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            cacheable, salt = request_salt(request, self._adapter_digests)
            state = self._requests[request.request_id] = _RequestState(request, cacheable, salt)
        return state

    def _metadata(self) -> TieredKVMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, TieredKVMetadata):
            raise TypeError(f"TieredKVConnector: unexpected metadata {type(meta).__name__}")
        return meta

    def _require_host(self) -> EngineHost:
        if self._host is None:
            raise RuntimeError("TieredKVConnector: no engine on this side (scheduler role?)")
        return self._host


PREFILL_SHARE = 16  # a step is timed as a prefill when other requests' tokens are <= 1/16


def prefill_of_step(
    scheduled: Mapping[str, int], computed: Mapping[str, int]
) -> tuple[int, int] | None:
    """(new tokens, prefix tokens) when one request's prefill is nearly all of a step's work,
    else None: the request with the most scheduled tokens (more than one), over ``computed``
    tokens already resident, while the others (decodes) add at most 1/16 of its tokens. Those
    are counted as new tokens too, so the estimate errs towards recomputing being slower."""
    if not scheduled:
        return None
    request_id = max(scheduled, key=scheduled.__getitem__)
    new_tokens = scheduled[request_id]
    others = sum(scheduled.values()) - new_tokens
    if new_tokens < 2 or others * PREFILL_SHARE > new_tokens:
        return None
    return new_tokens + others, computed.get(request_id, 0)


def request_salt(
    request: Request, adapter_digests: dict[tuple[str, str], str | None]
) -> tuple[bool, KeySalt | None]:
    """Whether the request's KV can be keyed, and its `KeySalt`: what changes its KV beyond the
    token ids, as vLLM's own block hashes take it (v1/core/kv_cache_utils.py):

    - ``cache_salt``: a mark at token 0 (every chunk);
    - a LoRA adapter: a mark at token 0 with its name, path and a digest of its files
      (`adapter_digest`, remembered per name and path in ``adapter_digests``), so new adapter
      weights at an old path are other keys. An adapter not on local disk yet (a hub id vLLM
      has not downloaded) cannot be identified: the request is neither loaded nor stored;
    - each multimodal item: a mark at its placeholder's first token with its modality,
      vLLM's ``identifier`` (the content hash, or the prompt's ``multi_modal_uuids``) and its
      length, so the text before the first item shares chunks with text-only requests.

    Prompt embeddings are not keyed: such requests are neither loaded nor stored."""
    if getattr(request, "prompt_embeds", None) is not None:
        return False, None
    marks: list[tuple[int, bytes]] = []
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt:
        marks.append((0, b"cache_salt\0" + str(cache_salt).encode()))
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name, path = str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")
        if (name, path) not in adapter_digests:
            adapter_digests[name, path] = _adapter_digest(path)
        digest = adapter_digests[name, path]
        if digest is None:
            return False, None
        marks.append((0, b"lora\0" + f"{name}\0{path}\0{digest}".encode()))
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        text = f"{feature.modality}\0{feature.identifier}\0{int(position.length)}"
        marks.append((int(position.offset), b"mm\0" + text.encode()))
    return True, KeySalt.of(*marks)


def _adapter_digest(path: str) -> str | None:
    """`adapter_digest` of a LoRA adapter on local disk (a directory, or a Hugging Face cache
    snapshot already downloaded); None when it cannot be found (logged)."""
    local = os.path.expanduser(path)
    if not os.path.isdir(local):
        try:
            from huggingface_hub import snapshot_download

            local = str(snapshot_download(path, local_files_only=True))
        except Exception as exc:
            logger.warning(
                "TieredKVConnector: LoRA adapter %r is not on local disk (%s): its requests "
                "are neither loaded nor stored",
                path,
                exc,
            )
            return None
    return adapter_digest(local)


def _wire(salt: KeySalt | None) -> list[list[int | str]] | None:
    return None if salt is None else salt.to_wire()


def default_fingerprint(vllm_config: VllmConfig) -> str:
    """The chunk keys' ``fingerprint`` when the user gives none: `model_fingerprint` over the
    model's config (vLLM's, overrides applied), its weight files (a local directory, or the
    Hugging Face cache snapshot of a hub model), dtype, KV cache dtype, quantization and the
    parallel sizes. Raises `ConfigError` when the weights cannot be found locally (weights
    streamed from object storage, ModelScope): set ``fingerprint`` then."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    config = {
        key: value
        for key, value in model.hf_config.to_dict().items()
        if not key.startswith("_") and key != "transformers_version"
    }
    return model_fingerprint(
        weights_path=_local_weights(model),
        model_config=config,
        dtype=str(model.dtype),
        kv_cache_dtype=str(cache.cache_dtype),
        tensor_parallel_size=int(parallel.tensor_parallel_size),
        pipeline_parallel_size=int(parallel.pipeline_parallel_size),
        extra={
            "quantization": model.quantization,
            "kv_cache_dtype_skip_layers": list(getattr(cache, "kv_cache_dtype_skip_layers", [])),
        },
    )


def _local_weights(model: Any) -> str:
    """Where the model's weights are on this machine: its path, or its Hugging Face cache
    snapshot (vLLM has downloaded it by the time the worker starts)."""
    name = str(model.model)
    if os.path.exists(name):
        return name
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(name, revision=model.revision, local_files_only=True))
    except Exception as exc:
        raise ConfigError(
            f"TieredKVConnector: cannot find the weights of {name!r} on this machine to "
            f"fingerprint them ({type(exc).__name__}: {exc}); set 'fingerprint' in "
            "kv_connector_extra_config to a tag that changes whenever the weights do"
        ) from None


def _head_position_order(vllm_config: VllmConfig) -> str | None:
    """Return "HND" or "NHD": whether heads or positions come first in memory in vLLM's resolved KV
    cache layout (0.32 names layouts by the memory order of [L, B, H, N, C]); None if unknown.
    Untested on GPUs so far: pass ``layout_hints`` to override."""
    try:
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
        name = str(layout.name)
    except Exception:  # not resolved yet, or an older vLLM
        return None
    if name.find("H") < 0 or name.find("N") < 0:
        return None
    return "HND" if name.find("H") < name.find("N") else "NHD"


def _tensor_parallel_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError):  # no TP group (single worker)
        return 0


__all__ = [
    "ConnectorOptions",
    "LoadSpec",
    "StoreSpec",
    "TieredKVConnector",
    "TieredKVConnectorStats",
    "TieredKVMetadata",
    "SCHEDULER_STATS",
    "default_fingerprint",
    "fingerprint_given",
    "WORKER_STATS",
    "parse_extra_config",
    "request_salt",
]
