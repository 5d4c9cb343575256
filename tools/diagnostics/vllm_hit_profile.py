"""Where does an L1 hit through the vLLM connector spend the time that vLLM's own hit does not?

Runs in the vLLM venv (``.venv-vllm/bin/python tools/diagnostics/vllm_hit_profile.py``), in one
process (vLLM's engine core in-process). Builds bench/vllm_ttft.py's random Llama, stores
``--prompts`` prompts through the connector (L1 only), then per prompt: vLLM's prefix cache
emptied, an L1 hit, then the same prompt again (vLLM's own hit), each one ``generate`` with
``max_tokens=1``. Prints the median wall time of each kind, the connector hooks' time per kind
(every hook of both roles, wrapped), and the main thread's cProfile functions whose own time
grew most from own hits to L1 hits (per request).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import os
import pathlib
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "request_finished",
    "update_connector_output",
    "take_events",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
)


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 131 + (i * i) % 97) % 500 + 4 for i in range(length)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=6)
    args = parser.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(ROOT))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from bench.vllm_ttft import HEAD_DIM, HEADS, HIDDEN, KV_BYTES_PER_TOKEN, KV_HEADS, LAYERS
    from tests.vllm.tiny_llama import build_tiny_llama
    from tiered_kv.integrations.vllm.connector import TieredKVConnector

    spent: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - start
                calls[name] += 1

        return wrapper

    for hook in HOOKS:
        setattr(TieredKVConnector, hook, timed(hook, getattr(TieredKVConnector, hook)))

    model = build_tiny_llama(
        pathlib.Path(tempfile.mkdtemp(prefix="hit-profile-")) / "model",
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )
    llm = LLM(
        model=str(model),
        dtype="float32",
        block_size=32,
        max_model_len=args.tokens + 64,
        kv_cache_memory_bytes=max(256 << 20, 3 * args.tokens * KV_BYTES_PER_TOKEN),
        enforce_eager=True,
        seed=0,
        max_num_seqs=1,
        enable_prefix_caching=True,
        max_num_batched_tokens=max(2048, args.tokens + 64),
        enable_chunked_prefill=True,
        kv_transfer_config=KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tiered_kv.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "chunk_size": 256,
                "l1_size": "512MiB",
                "model_name": "profile-llama",
            },
        ),
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def generate(tokens: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return time.perf_counter() - start, out[0].num_cached_tokens

    prompts = [_prompt(seed, args.tokens) for seed in range(1, args.prompts + 2)]
    for tokens in prompts:  # stored (the first is a warm-up of every path)
        generate(tokens)
    llm.reset_prefix_cache()
    generate(prompts[0])
    generate(prompts[0])
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    def mover_seconds() -> float:
        mover = get_kv_transfer_group().engine_stats().mover
        return 0.0 if mover is None else mover.scatter_seconds

    copy_seconds = 0.0
    walls: dict[str, list[float]] = {"l1_hit": [], "own_hit": []}
    hook_time: dict[str, dict[str, float]] = {"l1_hit": {}, "own_hit": {}}
    profiles = {"l1_hit": cProfile.Profile(), "own_hit": cProfile.Profile()}
    for tokens in prompts[1:]:
        for kind in ("l1_hit", "own_hit"):
            if kind == "l1_hit" and not llm.reset_prefix_cache():
                raise SystemExit("vLLM did not reset its prefix cache")
            spent.clear()
            before = mover_seconds()
            profiles[kind].enable()
            wall, cached = generate(tokens)
            profiles[kind].disable()
            copy_seconds += mover_seconds() - before
            if cached == 0:
                raise SystemExit(f"{kind}: nothing cached")
            walls[kind].append(wall)
            for name, seconds in spent.items():
                hook_time[kind][name] = hook_time[kind].get(name, 0.0) + seconds
    n = len(prompts) - 1
    import threading

    for thread in threading.enumerate():
        if thread.native_id is not None:
            print(f"thread {thread.name}: cpus {sorted(os.sched_getaffinity(thread.native_id))}")
    print(f"torch threads {__import__('torch').get_num_threads()}, cpus {os.cpu_count()}")
    for kind, values in walls.items():
        print(f"{kind}: median {1e3 * statistics.median(values):.1f} ms, best "
              f"{1e3 * min(values):.1f} ms over {n}")  # fmt: skip
    print(f"the mover's copies (its worker thread): {1e3 * copy_seconds / n:.2f} ms per L1 hit")
    print("connector hooks, ms per request (L1 hit / own hit):")
    for name in sorted(hook_time["l1_hit"], key=lambda h: -hook_time["l1_hit"][h]):
        print(f"  {name:36s} {1e3 * hook_time['l1_hit'][name] / n:7.2f} "
              f"{1e3 * hook_time['own_hit'].get(name, 0.0) / n:7.2f}")  # fmt: skip
    own = {key: value[2] for key, value in pstats.Stats(profiles["own_hit"]).stats.items()}  # type: ignore[attr-defined]
    hit = pstats.Stats(profiles["l1_hit"]).stats  # type: ignore[attr-defined]
    grew = sorted(hit.items(), key=lambda kv: -(kv[1][2] - own.get(kv[0], 0.0)))[:30]
    print("main thread, own-time growth per request, ms (L1 hit - own hit), calls per request:")
    for (file, line, name), (_, ncalls, tottime, _, _) in grew:
        where = f"{file.rsplit('/', 2)[-2:]}:{line}({name})".replace("'", "")
        print(f"  {1e3 * (tottime - own.get((file, line, name), 0.0)) / n:7.2f} "
              f"{ncalls / n:7.1f}  {where}")  # fmt: skip


if __name__ == "__main__":
    main()
