"""`TieredKVConnector` broken on purpose, one way per class: `connector_conformance` must name
each break, on every vLLM version (tests/vllm/test_connector_conformance.py holds what it must
say). Imported only in the checker's subprocess, against whichever vLLM is first on
``sys.path`` there."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from tiered_kv.integrations.vllm import TieredKVConnector


class MissingAbstract(TieredKVConnector):
    """The base's abstract `build_connector_meta` back in place of ours."""

    build_connector_meta = KVConnectorBase_V1.build_connector_meta


class RenamedParameter(TieredKVConnector):
    """vLLM calls ``request_finished(request=..., block_ids=...)``."""

    def request_finished(self, req: Any, block_ids: list[int]) -> tuple[bool, Any]:
        return False, None


class KeywordOnly(TieredKVConnector):
    """vLLM passes ``num_computed_tokens`` by position."""

    def get_num_new_matched_tokens(
        self, request: Any, *, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False


class SwappedParameters(TieredKVConnector):
    """Both names kept, their order swapped."""

    def update_state_after_alloc(self, blocks: Any, request: Any, num_external_tokens: int) -> None:
        return None


class ExtraRequired(TieredKVConnector):
    """A parameter vLLM never passes, without a default."""

    def wait_for_layer_load(self, layer_name: str, timeout: float) -> None:
        return None


class DroppedKwargs(TieredKVConnector):
    """vLLM passes extra keywords to ``save_kv_layer``."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        return None


class SleepModeAsMethod(TieredKVConnector):
    """vLLM 0.33 calls ``connector_cls.supports_sleep_mode(kv_transfer_config)`` on the class."""

    def supports_sleep_mode(self, kv_transfer_config: Any) -> bool:
        return False


class StrayHook(TieredKVConnector):
    """A hook name no vLLM calls (as a renamed one would be)."""

    def get_finished_loads(self) -> set[str]:
        return set()
