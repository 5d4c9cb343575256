"""One vLLM run, in its own process: ``python tests/vllm/vllm_runner.py SPEC.json OUT.json``.

SPEC: {"model": dir, "connector": extra config dict or null, "role": "kv_both",
"multiprocess": false, "block_size": 32, "max_tokens": 8 or [per batch], "batches": [[token
lists], ...], "load_failure_policy": "recompute", "enable_prefix_caching": true,
"max_num_batched_tokens": n, "kv_cache_memory_bytes": n, "max_model_len": n, "max_num_seqs": n,
"kill_before_batch": {"index": pid}, "lora_modules": {name: [int id, path]}, "max_lora_rank": n,
"kv_events_endpoint": "ipc://..." (vLLM publishes its KV events there over ZMQ, topic "kv"),
"reset_prefix_cache_before": [batch indexes] (vLLM's own prefix cache is emptied first)}.
A prompt is a list of token ids or {"tokens": [...], "cache_salt": str, "lora": name,
"image_seed": n} (a random 32x32 image made from the seed; the spec then needs "images": true).
Each batch
is one ``LLM.generate`` call (greedy), run in
order; ``kill_before_batch`` SIGKILLs a process (an L3 server) before that batch. OUT: per batch,
per prompt, the output token ids and vLLM's ``num_cached_tokens``, the seconds each batch took
(``batch_seconds``: time to first token when ``max_tokens`` is 1); the connector stats vLLM's
stat loggers received (summed) and its preemption count; in single-process mode also the
worker engine's stats. Runs in the vLLM venv only; nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kwargs: dict[str, Any] = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tiered_kv.integrations.vllm",
            kv_role=spec.get("role", "kv_both"),
            kv_connector_extra_config=spec["connector"],
            kv_load_failure_policy=spec.get("load_failure_policy", "recompute"),
        )
    loras = {
        name: LoRARequest(name, int(int_id), path)
        for name, (int_id, path) in spec.get("lora_modules", {}).items()
    }
    if loras:
        kwargs.update(enable_lora=True, max_lora_rank=spec.get("max_lora_rank", 8), max_loras=2)
    if spec.get("images"):
        kwargs["limit_mm_per_prompt"] = {"image": 1}
    if spec.get("kv_events_endpoint"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=spec["kv_events_endpoint"],
            topic="kv",
        )
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
        kwargs["enable_chunked_prefill"] = True
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        block_size=spec.get("block_size", 32),
        max_model_len=spec.get("max_model_len", 2048),
        kv_cache_memory_bytes=spec.get("kv_cache_memory_bytes", 16 << 20),
        enforce_eager=True,
        seed=0,
        max_num_seqs=spec.get("max_num_seqs", 8),
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        disable_log_stats=False,
        **kwargs,
    )
    init_s = time.monotonic() - started
    observed = _observe_stats(llm)
    max_tokens = spec.get("max_tokens", 8)
    kills = {int(index): int(pid) for index, pid in spec.get("kill_before_batch", {}).items()}
    resets = set(spec.get("reset_prefix_cache_before", ()))
    batches = []
    batch_seconds = []
    for index, batch in enumerate(spec["batches"]):
        if index in kills:
            os.kill(kills[index], signal.SIGKILL)
        if index in resets and not llm.reset_prefix_cache():
            raise RuntimeError(f"vLLM did not reset its prefix cache before batch {index}")
        tokens = max_tokens[index] if isinstance(max_tokens, list) else max_tokens
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        batch_started = time.perf_counter()
        prompts = [p if isinstance(p, dict) else {"tokens": p} for p in batch]
        requests = []
        for prompt in prompts:
            request = TokensPrompt(prompt_token_ids=prompt["tokens"])
            if prompt.get("cache_salt") is not None:
                request["cache_salt"] = prompt["cache_salt"]
            if prompt.get("image_seed") is not None:
                request["multi_modal_data"] = {"image": _image(prompt["image_seed"])}
            requests.append(request)
        lora = [loras[p["lora"]] if p.get("lora") else None for p in prompts]
        outputs = llm.generate(
            requests, params, use_tqdm=False, lora_request=lora if loras else None
        )
        batch_seconds.append(time.perf_counter() - batch_started)
        batches.append(
            [
                {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
                for o in outputs
            ]
        )
    result: dict[str, Any] = {
        "batches": batches,
        "batch_seconds": batch_seconds,
        "init_s": init_s,
        **observed,
    }
    if spec.get("connector") is not None and not spec.get("multiprocess"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        stats = connector.engine_stats()
        result["engine_stats"] = stats.as_dict()
        result["metrics_text"] = stats.to_prometheus()
        result["failures"] = connector.failures
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    result["hma_disabled"] = scheduler_config.disable_hybrid_kv_cache_manager
    if not spec.get("multiprocess"):
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        result["kv_cache_groups"] = [
            type(group.kv_cache_spec).__name__
            for group in scheduler.kv_cache_config.kv_cache_groups
        ]
    llm.llm_engine.engine_core.shutdown()
    result["total_s"] = time.monotonic() - started
    with open(out_path, "w") as f:
        json.dump(result, f)


def _image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).random((32, 32, 3)) * 255
    return Image.fromarray(pixels.astype("uint8"))


def _observe_stats(llm: Any) -> dict[str, Any]:
    """Sum what vLLM hands its stat loggers: the connector's stats (as the logging stat logger
    aggregates them) and the number of preempted requests that were scheduled again."""
    observed: dict[str, Any] = {"connector_stats": {}, "preempted_requests": 0}
    manager = llm.llm_engine.logger_manager
    record = manager.record

    def record_and_observe(scheduler_stats: Any, *args: Any, **kwargs: Any) -> None:
        if scheduler_stats is not None:
            totals = observed["connector_stats"]
            for key, value in (scheduler_stats.kv_connector_stats or {}).items():
                totals[key] = totals.get(key, 0) + value
            observed["preempted_requests"] += scheduler_stats.prefix_cache_stats.preempted_requests
        record(scheduler_stats, *args, **kwargs)

    manager.record = record_and_observe
    return observed


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
