"""A request trace replayed through the real engine, in arrival order, as a serving engine would.

Each request (`trace_sim.TraceRequest`) becomes a prompt of token ids made per block id (so
equal ids give equal tokens, and requests share a prefix exactly where their leading ids
agree), one engine chunk per trace block. For each request: ``lookup``; ``retrieve`` into the
request's blocks of a small vLLM-shaped paged cache when something hit; then ``store``
(chunks some tier holds are skipped, as always). Hits are the tokens ``retrieve`` actually
delivered, never what ``lookup`` promised; per tier, the chunks each one served.

KV per token is small by default (`KV_BYTES_PER_TOKEN`) so thousands of requests replay in
minutes on a laptop; tier sizes are given in trace blocks (L1 holds ``l1_blocks`` full chunks;
a request's last, shorter chunk takes less). Writes are flushed after each request by default
(``flush_each``), so what reaches L2 does not depend on the machine's disk speed.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tiered_kv.benchmarks.trace_sim import BLOCK_TOKENS, TraceRequest
from tiered_kv.config import EngineConfig
from tiered_kv.engine import TieredKVEngine

PAGE = 16  # tokens per block of the paged cache
LAYERS, HEADS, HEAD_SIZE = 1, 1, 4  # bf16 K and V: 16 bytes of KV per token
KV_BYTES_PER_TOKEN = LAYERS * 2 * HEADS * HEAD_SIZE * 2


@dataclasses.dataclass
class ReplayResult:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0  # delivered by retrieve
    l1_chunks: int = 0  # chunks retrieve found in L1
    l2_chunks: int = 0  # chunks read up from L2
    l2_writes: int = 0
    l2_writes_dropped: int = 0

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def block_tokens_of(block_id: int, block_tokens: int) -> list[int]:
    """The token ids standing for trace block ``block_id`` (distinct blocks, distinct ids)."""
    base = (block_id * 2_654_435_761) % 1_000_000_007
    return [(base + i) % 50_000 + 1 for i in range(block_tokens)]


def prompt_of(request: TraceRequest, block_tokens: int) -> list[int]:
    tokens: list[int] = []
    for block in request.hash_ids:
        tokens.extend(block_tokens_of(block, block_tokens))
    return tokens[: request.input_length]


async def replay(
    requests: Sequence[TraceRequest],
    *,
    l1_blocks: int,
    l2_blocks: int = 0,
    l2_dir: str | Path | None = None,
    block_tokens: int = BLOCK_TOKENS,
    flush_each: bool = True,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay ``requests`` through a fresh engine with L1 of ``l1_blocks`` chunks and, when
    ``l2_blocks``, an L2 of that many under ``l2_dir`` (a temp dir by default)."""
    chunk_bytes = block_tokens * KV_BYTES_PER_TOKEN
    longest = max((request.input_length for request in requests), default=1)
    pages = -(-longest // PAGE)
    caches = [
        torch.zeros((2, pages + 1, PAGE, HEADS, HEAD_SIZE), dtype=torch.bfloat16)
        for _ in range(LAYERS)
    ]
    with tempfile.TemporaryDirectory(prefix="tkv-trace-") as scratch:
        fields: dict[str, object] = {
            "chunk_size": block_tokens,
            "l1_size": l1_blocks * chunk_bytes,
            "load_policy": "always",
        }
        if l2_blocks:
            fields.update(
                l2_path=str(l2_dir or Path(scratch) / "l2"),
                l2_size=l2_blocks * (chunk_bytes + 4096),  # each file: a 4 KiB header page
                l2_durability="none",
            )
        result = ReplayResult()
        async with TieredKVEngine(EngineConfig(**fields)) as engine:  # type: ignore[arg-type]
            engine.register_kv_caches(
                caches, model_name="trace", layout_hints={"block_size": PAGE, "kv_layout": "NHD"}
            )
            for index, request in enumerate(requests):
                tokens = prompt_of(request, block_tokens)
                blocks = list(range(1, -(-len(tokens) // PAGE) + 1))
                before = engine.storage.stats()
                if await engine.lookup(tokens):
                    result.hit_tokens += (await engine.retrieve(tokens, blocks)).valid_tokens
                after = engine.storage.stats()
                result.l1_chunks += after.l1_hits - before.l1_hits
                if l2_blocks:
                    result.l2_chunks += after.tier("L2").reads.hits - before.tier("L2").reads.hits
                await engine.store(tokens, blocks)
                if flush_each:
                    await engine.flush()
                result.requests += 1
                result.prompt_tokens += request.input_length
                if progress is not None:
                    progress(index + 1)
            if l2_blocks:
                writes = engine.storage.stats().tier("L2").writes
                assert writes is not None
                result.l2_writes, result.l2_writes_dropped = writes.done, writes.dropped_full
    return result
