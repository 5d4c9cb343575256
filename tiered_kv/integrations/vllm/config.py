"""What the connector reads from vLLM's config: `ConnectorSettings`, shared by both halves.

Owns the parsing of ``kv_connector_extra_config`` (`parse_extra_config`: `EngineConfig` fields
and `ConnectorOptions`), the settings both halves read from vLLM's config (`ConnectorSettings`:
block size, tensor-parallel size, roles, the lookup sockets' directory, the KV cache groups),
and the chunk keys' default fingerprint (`default_fingerprint`). Plain values, computed once
when vLLM creates a connector, in whichever process that is; must not start anything, hold
state, or import the halves (both import it).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tiered_kv.config import EngineConfig
from tiered_kv.errors import ConfigError
from tiered_kv.integrations.fingerprint import model_fingerprint
from tiered_kv.integrations.lookup_channel import default_socket_dir

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

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


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """One of vLLM's KV cache groups as the connector moves it."""

    layer_names: tuple[str, ...]
    sliding_window: int | None  # None: full attention


def layer_groups(kv_cache_config: KVCacheConfig | None, block_size: int) -> list[KVCacheGroup]:
    """vLLM's KV cache groups (several under the hybrid allocator: sliding-window and full
    attention layers apart). Raises `ConfigError` for a hybrid model whose groups are not
    attention with vLLM's block size (Mamba state, another block size): not supported yet."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) <= 1:
        return [KVCacheGroup(tuple(groups[0].layer_names) if groups else (), None)]
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
        out.append(KVCacheGroup(tuple(group.layer_names), window))
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """Everything either half reads from vLLM's config, resolved once (`from_vllm`)."""

    engine_config: EngineConfig
    options: ConnectorOptions
    block_size: int
    world_size: int  # tensor-parallel size: the workers' ranks
    model_name: str  # in chunk keys; a hybrid group's is `group_model_name`
    is_producer: bool  # stores
    is_consumer: bool  # looks up and loads
    instance_id: str  # vLLM's engine_id: names the lookup sockets
    socket_dir: str
    groups: tuple[KVCacheGroup, ...]
    publish_events: bool  # vLLM publishes KV events (docs/vllm.md, "KV events")
    load_failure_policy: str  # vLLM's kv_load_failure_policy
    fingerprint_given: bool  # else each worker computes `default_fingerprint`

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups (vLLM's hybrid allocator)."""
        return len(self.groups) > 1

    def group_model_name(self, index: int) -> str:
        """The model name of a hybrid model's group ``index`` in chunk keys."""
        return f"{self.model_name}#g{index}"

    @classmethod
    def from_vllm(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None
    ) -> ConnectorSettings:
        """Raises `ConfigError` for what the connector does not support (pipeline parallelism,
        sleep mode, hybrid groups other than attention with vLLM's block size), an unknown extra
        key, or no ``kv_transfer_config``."""
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ConfigError("TieredKVConnector: vLLM's kv_transfer_config is not set")
        engine_config, options = parse_extra_config(transfer.kv_connector_extra_config)
        block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ConfigError("TieredKVConnector: pipeline parallelism is not supported yet")
        model = vllm_config.model_config
        if model is not None and model.enable_sleep_mode:  # vLLM 0.32 does not check it itself
            raise ConfigError(
                "TieredKVConnector: vLLM's sleep mode (enable_sleep_mode=True) is not supported: "
                "weights loaded at a wake-up would be served KV stored under the old ones "
                '(docs/vllm.md, "vLLM versions"); turn sleep mode off'
            )
        events_config = getattr(vllm_config, "kv_events_config", None)
        return cls(
            engine_config=engine_config,
            options=options,
            block_size=block_size,
            world_size=int(parallel.tensor_parallel_size),
            model_name=options.model_name or str(vllm_config.model_config.model),
            is_producer=bool(transfer.is_kv_producer),
            is_consumer=bool(transfer.is_kv_consumer),
            instance_id=str(transfer.engine_id),
            socket_dir=options.lookup_socket_dir or default_socket_dir(),
            groups=tuple(layer_groups(kv_cache_config, block_size)),
            publish_events=bool(events_config and events_config.enable_kv_cache_events),
            load_failure_policy=str(transfer.kv_load_failure_policy),
            fingerprint_given=fingerprint_given(transfer.kv_connector_extra_config),
        )


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
