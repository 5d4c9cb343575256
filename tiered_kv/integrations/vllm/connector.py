# vLLM's base classes are Any where vLLM is not installed (the light .venv that lints).
"""`TieredKVConnector`: the class vLLM instantiates, once per role.

Owns the half for its role and nothing else: a `SchedulerHalf` in the scheduler's process, a
`WorkerHalf` in each worker's process (both may share one process when vLLM runs its engine
core in-process; they share no state). Each vLLM hook forwards to that half, with what vLLM
keeps on the connector itself (the step's metadata, the scheduler's KV cache manager). A hook
of the other role answers as the connector has no such half: a query answers "nothing" (no
tokens matched, no finished loads, no failed blocks, no events); a hook that would act on the
missing half raises `RuntimeError`. Called on vLLM's threads for the role (the scheduler's
thread, or the worker's model-runner thread); must not keep state of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
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
from tiered_kv.integrations.host_stats import HostStats
from tiered_kv.integrations.vllm.config import ConnectorOptions, ConnectorSettings
from tiered_kv.integrations.vllm.scheduler import SchedulerHalf
from tiered_kv.integrations.vllm.stats import TieredKVConnectorStats
from tiered_kv.integrations.vllm.worker import WorkerHalf

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector backed by a tiered_kv engine per worker (docs/vllm.md)."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """False: vLLM 0.33 then refuses ``enable_sleep_mode`` with this connector. A wake-up
        is where RL loops load new weights in place, which the chunk keys' fingerprint (taken
        from the weight files at start-up) cannot see: the tiers would serve KV of the old
        weights as hits. vLLM 0.32 never asks; `ConnectorSettings.from_vllm` refuses sleep mode
        on both (docs/vllm.md, "vLLM versions")."""
        return False

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.from_vllm(vllm_config, kv_cache_config)
        self._scheduler: SchedulerHalf | None = None
        self._worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerHalf(settings)
        else:
            self._worker = WorkerHalf(settings, vllm_config)

    @property
    def settings(self) -> ConnectorSettings:
        """What this connector read from vLLM's config (a worker's `EngineConfig` carries the
        fingerprint it computed)."""
        if self._worker is not None:
            return self._worker.settings
        return self.scheduler_half.settings

    @property
    def options(self) -> ConnectorOptions:
        return self.settings.options

    @property
    def engine_config(self) -> EngineConfig:
        return self.settings.engine_config

    @property
    def failures(self) -> int:
        """Loads, stores and events that raised on this worker (logged, counted, turned into
        misses); 0 on the scheduler."""
        return 0 if self._worker is None else self._worker.failures

    @property
    def scheduler_half(self) -> SchedulerHalf:
        """This connector's scheduler half; raises `RuntimeError` on the worker role."""
        if self._scheduler is None:
            raise RuntimeError("TieredKVConnector: a worker-role connector has no scheduler half")
        return self._scheduler

    @property
    def worker_half(self) -> WorkerHalf:
        """This connector's worker half; raises `RuntimeError` on the scheduler role."""
        if self._worker is None:
            raise RuntimeError("TieredKVConnector: a scheduler-role connector has no worker half")
        return self._worker

    # -- worker hooks ------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_half.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_half.start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if self._worker is not None:
            self._worker.save_kv_layer(layer_name, self._connector_metadata)

    def wait_for_save(self) -> None:
        self.worker_half.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        return self._worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set() if self._worker is None else self._worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """Worker: this step's tier activity as vLLM KV events (rank 0 only; None when there
        was none or vLLM publishes no KV events)."""
        if self._worker is None:
            return None
        return self._worker.get_kv_connector_kv_cache_events()

    def engine_stats(self) -> HostStats:
        """The worker's engine statistics plus its host's (worker role only;
        ``to_prometheus()`` for Prometheus)."""
        return self.worker_half.engine_stats()

    # -- scheduler hooks ---------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_half.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_half.build_connector_meta(scheduler_output, self._kv_cache_manager)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_half.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_half.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler: the workers' tier events since the last call, for vLLM's publisher."""
        return () if self._scheduler is None else self._scheduler.take_events()

    # -- both roles --------------------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This interval's counters: the scheduler's own, or the worker's engine's (deltas)."""
        if self._scheduler is not None:
            return self._scheduler.get_kv_connector_stats()
        return None if self._worker is None else self._worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return TieredKVConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
