"""One vLLM run, in its own process: ``python tests/vllm/vllm_runner.py SPEC.json OUT.json``.

SPEC: {"model": dir, "connector": extra config dict or null, "role": "kv_both",
"multiprocess": false, "block_size": 32, "max_tokens": 8, "batches": [[token lists], ...],
"load_failure_policy": "recompute", "enable_prefix_caching": true, "max_num_batched_tokens": n}.
Each batch is one ``LLM.generate`` call (greedy), run in order. OUT: per batch, per prompt, the
output token ids and vLLM's ``num_cached_tokens``; in single-process mode also the worker
engine's stats. Runs in the vLLM venv only; nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if spec.get("multiprocess") else "0"
    started = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tiered_kv.integrations.vllm",
            kv_role=spec.get("role", "kv_both"),
            kv_connector_extra_config=spec["connector"],
            kv_load_failure_policy=spec.get("load_failure_policy", "recompute"),
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
        max_num_seqs=8,
        enable_prefix_caching=spec.get("enable_prefix_caching", True),
        **kwargs,
    )
    init_s = time.monotonic() - started
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    batches = []
    for batch in spec["batches"]:
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False
        )
        batches.append(
            [
                {"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
                for o in outputs
            ]
        )
    result: dict = {"batches": batches, "init_s": init_s}
    if spec.get("connector") is not None and not spec.get("multiprocess"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        connector = get_kv_transfer_group()
        result["engine_stats"] = connector.engine_stats()
        result["metrics_text"] = connector.engine_metrics_text()
        result["failures"] = connector.failures
    llm.llm_engine.engine_core.shutdown()
    result["total_s"] = time.monotonic() - started
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
