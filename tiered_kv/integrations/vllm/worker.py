"""The connector's worker half: the engine next to vLLM's KV caches (`WorkerHalf`).

Owns, in each worker's process (one per tensor-parallel rank): an `EngineHost` (the engine on
its own loop thread, serving the scheduler's lookups on the channel), the registration of
vLLM's per-layer caches, and each step's work from the scheduler's plan: loads in
`start_load_kv` before the forward pass, stores in `wait_for_save` after it (the copy out of
the blocks is done when it returns, so vLLM may free them at once), blocks whose load fell
short reported for vLLM to recompute, and the step's forward timed when it was one request's
prefill (the recompute model of ``load_policy="cost"``). Layerwise (``EngineConfig.layerwise``,
on for CUDA caches by default): `start_load_kv` settles and enqueues the loads, each attention
layer waits for its own layer (`wait_for_layer_load`), `save_kv_layer` copies each layer out as
it is written, and `wait_for_save` commits (docs/layerwise.md). Hybrid models keep one
registration per KV cache group; a sliding-window group stores and loads only its window.

Called on the worker's model-runner thread only, one hook at a time. Must not let a tiered_kv
failure fail a request (a failed load is blocks vLLM recomputes, a failed store a future miss:
both logged and counted in ``failures``), write into blocks outside a load's claim or inside
vLLM's own prefix hit, or hold scheduler state: it knows a request only through the plan.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from tiered_kv.config import EngineConfig
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.engine_host import EngineHost, LoadOptions
from tiered_kv.integrations.host_stats import HostStats
from tiered_kv.integrations.kv_events import EventGroup, TieredKVEvents, to_vllm_events
from tiered_kv.integrations.layer_groups import window_start
from tiered_kv.integrations.lookup_channel import socket_path
from tiered_kv.integrations.prefill_timer import GpuPrefillTimer
from tiered_kv.integrations.vllm.config import ConnectorSettings, default_fingerprint
from tiered_kv.integrations.vllm.metadata import LoadSpec, StoreSpec, TieredKVMetadata
from tiered_kv.integrations.vllm.stats import TieredKVConnectorStats, worker_totals
from tiered_kv.keys import KeySalt
from tiered_kv.sync import SyncLayerwiseRetrieve, SyncLayerwiseStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

logger = logging.getLogger(__name__)


class WorkerHalf:
    """`TieredKVConnector`'s worker side: the connector forwards vLLM's worker hooks here,
    with the step's metadata (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, vllm_config: VllmConfig) -> None:
        if not settings.fingerprint_given:
            started = time.perf_counter()
            fingerprint = default_fingerprint(vllm_config)
            engine_config = dataclasses.replace(settings.engine_config, fingerprint=fingerprint)
            settings = dataclasses.replace(settings, engine_config=engine_config)
            logger.info(
                "TieredKVConnector: model fingerprint %s (%.3f s)",
                fingerprint,
                time.perf_counter() - started,
            )
        self.settings = settings  # its engine_config carries the fingerprint
        self._vllm_config = vllm_config  # read at registration: vLLM's resolved KV layout
        self._host: EngineHost | None = EngineHost(settings.engine_config)
        self._event_groups: dict[str, EventGroup] = {}  # model name in keys -> group
        self._finished_recving: set[str] = set()  # hybrid: async loads done this step
        self._failed_recving: set[str] = set()  # hybrid: ... and those that fell short
        self._layerwise = False  # decided at registration (EngineConfig.layerwise)
        self._layer_index: dict[str, int] = {}  # layer name -> registration order
        self._gpu_timer: GpuPrefillTimer | None = None  # CUDA caches: prefills timed by events
        self._step_started: float | None = None  # perf_counter() at the step's metadata
        self._loads_timed: tuple[float, float] | None = None  # start_load_kv's begin and end
        self._loads: list[SyncLayerwiseRetrieve] = []  # this step's layerwise loads
        self._savers: list[tuple[str, SyncLayerwiseStore]] = []  # this step's layerwise stores
        self._stores_begun = False  # the step's first save_kv_layer has staged its stores
        self._load_errors: set[int] = set()
        self._stats_last: dict[str, float] = {}
        self.load_error_blocks = 0  # blocks reported to vLLM as not loaded (recomputed)
        self.failures = 0  # loads / stores that raised (logged, counted, turned into misses)

    @property
    def engine_config(self) -> EngineConfig:
        """The engine's config, with the fingerprint this worker computed unless given."""
        return self.settings.engine_config

    @property
    def host(self) -> EngineHost:
        """The worker's engine host; raises `RuntimeError` once shut down."""
        if self._host is None:
            raise RuntimeError("TieredKVConnector: the worker's engine is closed (shut down)")
        return self._host

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        host = self.host
        settings = self.settings
        first = next(iter(kv_caches.values()))
        hints = settings.options.layout_hints
        if hints is None:
            if first.device.type == "cpu":
                hints = {"format": "blocks", "block_size": settings.block_size}
            else:
                hints = {"block_size": settings.block_size}
                memory_order = _head_position_order(self._vllm_config)
                if memory_order is not None:
                    hints["kv_layout"] = memory_order
        rank = _tensor_parallel_rank()
        if settings.hybrid:
            for index, group in enumerate(settings.groups):
                missing = [name for name in group.layer_names if name not in kv_caches]
                if missing:
                    raise ConfigError(
                        f"TieredKVConnector: layers {missing[:4]} of KV cache group {index} "
                        "have no KV cache tensor"
                    )
                host.register_kv_caches(
                    {name: kv_caches[name] for name in group.layer_names},
                    model_name=settings.group_model_name(index),
                    world_size=settings.world_size,
                    worker_id=rank,
                    layout_hints=hints,
                    sliding_window=group.sliding_window,
                    block_size=settings.block_size,
                )
        else:
            host.register_kv_caches(
                kv_caches,
                model_name=settings.model_name,
                world_size=settings.world_size,
                worker_id=rank,
                layout_hints=hints,
            )
        host.serve_lookups(socket_path(settings.socket_dir, settings.instance_id, rank))
        if settings.publish_events and rank == 0:  # rank 0's tiers speak for the instance
            self._event_groups = self._groups_for_events()
            host.watch_tiers()
        layerwise = self.engine_config.layerwise
        if settings.hybrid and layerwise:
            raise ConfigError(
                "TieredKVConnector: layerwise loads and stores of hybrid models (several KV "
                "cache groups) are not supported yet; set layerwise to false"
            )
        if settings.hybrid:
            layerwise = False
        on_cuda = first.device.type == "cuda"
        self._gpu_timer = GpuPrefillTimer(first.device) if on_cuda else None
        self._layerwise = on_cuda if layerwise is None else layerwise
        self._layer_index = {name: index for index, name in enumerate(kv_caches)}
        logger.info(
            "TieredKVConnector: %d layers registered (%s, strides %s, hints %s), rank %d/%d, "
            "%s loads and stores",
            len(kv_caches),
            tuple(first.shape),
            first.stride(),
            hints,
            rank,
            settings.world_size,
            "layerwise" if self._layerwise else "whole",
        )

    def bind_connector_metadata(self, meta: KVConnectorMetadata) -> None:
        """The step begins: its forward pass starts about now (before it: `start_load_kv`
        when the step has synchronous loads, see `_observe_prefill`)."""
        self._step_started = time.perf_counter()
        self._loads_timed = None
        timer = self._gpu_timer
        if timer is not None:
            self._report_gpu_prefills(timer)
            if isinstance(meta, TieredKVMetadata) and meta.prefill is not None and not meta.loads:
                timer.begin(*meta.prefill)  # a prefill without loads: all of it is compute

    def start_load_kv(self, meta: KVConnectorMetadata | None) -> None:
        began = time.perf_counter()
        try:
            self._start_loads(meta)
        finally:
            self._loads_timed = (began, time.perf_counter())

    def _start_loads(self, meta: KVConnectorMetadata | None) -> None:
        plan = _step_plan(meta)
        host = self.host
        self._finish_loads()
        for spec in plan.loads:
            end = spec.end
            if spec.group_block_ids is not None:
                self._load_groups(host, spec)
                continue
            options = LoadOptions(
                skip_prefix_tokens=spec.skip_prefix_tokens,
                claimed_tokens=end,
                salt=KeySalt.from_wire(spec.salt),
                request_id=spec.request_id,
            )
            try:
                if self._layerwise:
                    # Decided now (late or failed chunks included); copies land per layer.
                    load = host.load_layerwise(spec.token_ids, spec.block_ids, **options)
                    self._loads.append(load)
                    valid = load.result.valid_tokens
                else:
                    valid = host.load(spec.token_ids, spec.block_ids, **options).valid_tokens
            except Exception:  # the boundary with vLLM: a failed load is recomputed
                self.failures += 1
                logger.warning(
                    "TieredKVConnector: load of %s failed", spec.request_id, exc_info=True
                )
                valid = spec.skip_prefix_tokens
            if valid < end:
                block = self.settings.block_size
                first_bad = valid // block
                failed = spec.block_ids[first_bad : -(-end // block)]
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
        released = [spec.request_id for spec in plan.loads] + plan.release
        if released:
            host.release(released)

    def _load_groups(self, host: EngineHost, spec: LoadSpec) -> None:
        """A hybrid model's load (vLLM loads it asynchronously): every group's blocks, a
        sliding-window group's only from its window before the claim's end. Done when this
        returns; a group that falls short fails the whole load (`get_transfer_results`): vLLM
        cannot take failed blocks from models with several groups, it recomputes the request."""
        assert spec.group_block_ids is not None
        block = self.settings.block_size
        end, salt = spec.end, KeySalt.from_wire(spec.salt)
        short = False
        for index, (group, block_ids) in enumerate(
            zip(self.settings.groups, spec.group_block_ids, strict=True)
        ):
            skip = spec.skip_prefix_tokens
            if group.sliding_window is not None:
                skip = max(skip, window_start(end, group.sliding_window, block))
            try:
                valid = host.load(
                    spec.token_ids,
                    block_ids,
                    skip_prefix_tokens=skip,
                    claimed_tokens=end,
                    salt=salt,
                    model_name=self.settings.group_model_name(index),
                    request_id=spec.request_id,
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
            self.load_error_blocks += -(-(end - spec.skip_prefix_tokens) // block)
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
        chunk, block = self.engine_config.chunk_size, self.settings.block_size
        target = len(spec.token_ids)
        salt = KeySalt.from_wire(spec.salt)
        for index, (group, block_ids) in enumerate(
            zip(self.settings.groups, spec.group_block_ids, strict=True)
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
                model_name=self.settings.group_model_name(index),
                salt=salt,
                skip_prefix_tokens=skip,
            )

    def _groups_for_events(self) -> dict[str, EventGroup]:
        """Model name in chunk keys -> what KV events say of its group."""
        settings = self.settings
        if not settings.hybrid:
            return {settings.model_name: EventGroup()}
        return {
            settings.group_model_name(index): EventGroup(
                index,
                "full_attention" if group.sliding_window is None else "sliding_window",
                group.sliding_window,
            )
            for index, group in enumerate(settings.groups)
        }

    def _begin_stores(self, meta: KVConnectorMetadata | None) -> None:
        """Layerwise: stage this step's stores, at the step's first `save_kv_layer` (vLLM may
        call `start_load_kv` after the forward pass when the step has no synchronous loads)."""
        self._stores_begun = True
        host = self.host
        for store in _step_plan(meta).stores:
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

    def save_kv_layer(self, layer_name: str, meta: KVConnectorMetadata | None) -> None:
        """Layerwise: copy this layer of the step's stores out, after the work that wrote it
        (an event on the current stream); whole stores run in `wait_for_save`."""
        index = self._layer_index.get(layer_name)
        if index is None or not self._layerwise:
            return
        if not self._stores_begun:
            self._begin_stores(meta)
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

    def wait_for_save(self, meta: KVConnectorMetadata | None) -> None:
        self._observe_prefill(meta, time.perf_counter())
        host = self.host
        savers, self._savers = self._savers, []
        begun, self._stores_begun = self._stores_begun, False
        for request_id, saver in savers:
            try:
                host.commit_store(saver)  # stores nothing unless every layer was saved
            except Exception:  # a failed store is a future miss, never a failed request
                self.failures += 1
                logger.warning("TieredKVConnector: store of %s failed", request_id, exc_info=True)
        self._finish_loads()
        plan = _step_plan(meta)
        if (self._layerwise and begun) or not plan.stores:
            return  # layerwise stores were committed above
        for spec in plan.stores:
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

    def _observe_prefill(self, meta: KVConnectorMetadata | None, forward_ended: float) -> None:
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

    def get_kv_connector_stats(self) -> TieredKVConnectorStats | None:
        """This interval's `WORKER_STATS` and ``load_error_blocks`` (deltas; None when all are
        zero or the engine is closed)."""
        if self._host is None:
            return None
        totals = worker_totals(self._host.stats())
        totals["load_error_blocks"] = self.load_error_blocks
        data = {}
        for name, value in totals.items():
            data[name] = value - self._stats_last.get(name, 0)
            self._stats_last[name] = value
        stats = TieredKVConnectorStats(data=data)
        return None if stats.is_empty() else stats

    def get_kv_connector_kv_cache_events(self) -> TieredKVEvents | None:
        """This step's tier activity as vLLM KV events (rank 0 only; None when there was none
        or vLLM publishes no KV events)."""
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

    def engine_stats(self) -> HostStats:
        """The engine's statistics plus the host's (``to_prometheus()`` for Prometheus)."""
        return self.host.stats()

    def shutdown(self) -> None:
        host, self._host = self._host, None
        if host is not None:
            host.close()


def _step_plan(meta: KVConnectorMetadata | None) -> TieredKVMetadata:
    """The step's plan as bound by vLLM; raises `TypeError` for anything else (none bound)."""
    if not isinstance(meta, TieredKVMetadata):
        raise TypeError(f"TieredKVConnector: unexpected metadata {type(meta).__name__}")
    return meta


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
