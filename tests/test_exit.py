"""A script that ends without closing its engine (as a vLLM script that just ends does).

The blocking facade's exit hook closes the engine, even one its owner no longer references:
the L2 writes still queued when the script ended are flushed (a fresh process finds every
chunk, bit for bit), and nothing raises at exit (before the data planes owned their threads,
the close met ``RuntimeError: cannot schedule new futures after interpreter shutdown`` from
the loop's default executor).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.kvfactory import make_caches, poison_blocks
from tiered_kv import EngineConfig, SyncTieredKVEngine

TOKENS = list(range(5000, 5000 + 32 * 12))  # 12 chunks of 32
SRC = list(range(24))
DST = list(range(32, 56))

_SCRIPT = """
import sys
import torch
from tests.kvfactory import make_caches
from tiered_kv import EngineConfig, SyncTieredKVEngine

def serve() -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=64, seed=7)
    config = EngineConfig(
        chunk_size=32, l1_size="8MiB", l2_path=sys.argv[1], l2_durability="per_write"
    )
    engine = SyncTieredKVEngine(config)
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    tokens = list(range(5000, 5000 + 32 * 12))
    assert engine.store(tokens, list(range(24))) == len(tokens)
    print("stored", flush=True)

# No close, and no reference kept: the interpreter exits with the L2 writes still queued.
serve()
"""


@pytest.mark.slow
def test_a_script_that_never_closes_its_engine_keeps_its_writes(tmp_path: Path) -> None:
    l2 = tmp_path / "l2"
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_SCRIPT), str(l2)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "stored" in done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    assert "Error" not in done.stderr, done.stderr

    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=64, seed=7)
    reference = caches.snapshot()
    config = EngineConfig(chunk_size=32, l1_size="8MiB", l2_path=str(l2))
    with SyncTieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert engine.lookup(TOKENS) == len(TOKENS)
        poison_blocks(caches, DST)
        assert engine.retrieve(TOKENS, DST).valid_tokens == len(TOKENS)
        assert engine.stats().tier("L2").hits == 12
    for layer, physical in enumerate(caches.physical):
        assert torch.equal(
            physical[:, DST].view(torch.uint8), reference[layer][0][:, SRC].view(torch.uint8)
        )
