"""A request trace replayed through the real engine, in arrival order, as a serving engine would.

Each request (`trace_sim.TraceRequest`) becomes a prompt of token ids made per block id (so
equal ids give equal tokens, and requests share a prefix exactly where their leading ids
agree); a trace block is ``block_tokens / chunk_tokens`` engine chunks (one by default). For
each request: ``lookup``; ``retrieve`` into the request's blocks of a small vLLM-shaped paged
cache when something hit; then ``store`` (chunks some tier holds are skipped, as always). Hits
are the tokens ``retrieve`` actually delivered, never what ``lookup`` promised; per tier, the
chunks and tokens each one served (L2's from the bytes it read: loads are never partial).

KV per token is small by default (`KV_BYTES_PER_TOKEN`) so thousands of requests replay in
minutes on a laptop; tier sizes are given in trace blocks (L1 holds ``l1_blocks`` full blocks;
a request's last, shorter chunk takes less). Writes are flushed after each request by default
(``flush_each``), so what reaches L2 does not depend on the machine's disk speed. Requests go
back to back unless ``time_scale`` spaces them as the trace's arrival times say.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tiered_kv.benchmarks.trace_sim import BLOCK_TOKENS, TraceRequest
from tiered_kv.codec import PAYLOAD_ALIGN
from tiered_kv.config import EngineConfig, Eviction, IoPlane
from tiered_kv.engine import TieredKVEngine
from tiered_kv.memory import ALIGN

PAGE = 16  # tokens per block of the paged cache
KV_BYTES_PER_TOKEN = 16  # one layer, bf16 K and V of one head of 4
LARGEST_HEAD = 256  # head size the paged cache's shape stays under where the bytes allow

# Seams for tests of ``time_scale`` (a fake clock): never the asyncio module's own sleep,
# which the engine's tasks share.
_sleep = asyncio.sleep
_monotonic = time.monotonic


@dataclasses.dataclass
class ReplayResult:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0  # delivered by retrieve
    l1_hit_tokens: int = 0  # of those, found in L1
    l2_hit_tokens: int = 0  # of those, read up from L2
    l1_chunks: int = 0  # chunks retrieve found in L1
    l2_chunks: int = 0  # chunks read up from L2
    l1_bytes_delivered: int = 0  # KV bytes of the chunks found in L1
    l2_bytes_read: int = 0
    l2_bytes_written: int = 0
    l2_writes: int = 0
    l2_writes_dropped: int = 0  # for a full write queue

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def l1_ratio(self) -> float:
        return self.l1_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def l2_ratio(self) -> float:
        return self.l2_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class PagedCacheShape:
    """One layer of a vLLM NHD cache whose K and V take ``nbytes_per_token`` bytes per token."""

    dtype: torch.dtype
    heads: int
    head_size: int

    @property
    def nbytes_per_token(self) -> int:
        return 2 * self.heads * self.head_size * self.dtype.itemsize


def paged_cache_shape(kv_bytes_per_token: int) -> PagedCacheShape:
    """The shape giving exactly ``kv_bytes_per_token`` bytes per token: bf16 where it divides
    by 4, else float8 (K and V of one byte each); ValueError for what neither can make."""
    if (
        isinstance(kv_bytes_per_token, bool)
        or not isinstance(kv_bytes_per_token, int)
        or kv_bytes_per_token < 4
        or kv_bytes_per_token % 2
    ):
        raise ValueError(
            f"kv_bytes_per_token must be an even int >= 4 (K and V of bf16 or float8 "
            f"elements), got {kv_bytes_per_token!r}"
        )
    dtype = torch.bfloat16 if kv_bytes_per_token % 4 == 0 else torch.float8_e4m3fn
    elements = kv_bytes_per_token // (2 * dtype.itemsize)  # of K (or V) per token
    head_size = max(d for d in range(1, min(elements, LARGEST_HEAD) + 1) if elements % d == 0)
    return PagedCacheShape(dtype, elements // head_size, head_size)


def chunks_per_block(block_tokens: int, chunk_tokens: int) -> int:
    """Engine chunks in a trace block; ValueError unless ``chunk_tokens`` divides it."""
    if chunk_tokens < 1 or block_tokens % chunk_tokens:
        raise ValueError(
            f"chunk_tokens={chunk_tokens} must divide block_tokens={block_tokens}: a trace "
            "block is a whole number of engine chunks"
        )
    return block_tokens // chunk_tokens


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
    chunk_tokens: int | None = None,
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN,
    l1_eviction: Eviction = "lru",
    l2_eviction: Eviction = "lru",
    time_scale: float | None = None,
    io_plane: IoPlane = "auto",
    flush_each: bool = True,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay ``requests`` through a fresh engine with L1 of ``l1_blocks`` trace blocks and, when
    ``l2_blocks``, an L2 of that many under ``l2_dir`` (a temp dir by default). Chunks are
    ``chunk_tokens`` tokens (default: a block). ``time_scale`` s > 0: each request starts no
    sooner than s x (its arrival - the first's) after the first started (one running late
    delays the next, none is skipped); None or 0: back to back. ``progress(n)`` after the
    n-th request."""
    chunk_tokens = block_tokens if chunk_tokens is None else chunk_tokens
    per_block = chunks_per_block(block_tokens, chunk_tokens)
    shape = paged_cache_shape(kv_bytes_per_token)
    if time_scale is not None and not time_scale >= 0:
        raise ValueError(f"time_scale must be None or >= 0, got {time_scale}")
    chunk_bytes = chunk_tokens * kv_bytes_per_token
    l1_chunk_bytes = -(-chunk_bytes // ALIGN) * ALIGN  # L1 allocates whole alignment units
    longest = max((request.input_length for request in requests), default=1)
    pages = -(-longest // PAGE)
    cache = torch.zeros((2, pages + 1, PAGE, shape.heads, shape.head_size), dtype=shape.dtype)
    with tempfile.TemporaryDirectory(prefix="tkv-trace-") as scratch:
        lower: dict[str, Any] = {}
        if l2_blocks:
            lower = {
                "l2_path": str(l2_dir or Path(scratch) / "l2"),
                # each file: a header page, then the chunk's bytes
                "l2_size": l2_blocks * per_block * (chunk_bytes + PAYLOAD_ALIGN),
                "l2_durability": "none",
            }
        config = EngineConfig(
            chunk_size=chunk_tokens,
            l1_size=l1_blocks * per_block * l1_chunk_bytes,
            load_policy="always",
            io_plane=io_plane,
            l1_eviction=l1_eviction,
            l2_eviction=l2_eviction,
            **lower,
        )
        result = ReplayResult()
        async with TieredKVEngine(config) as engine:
            engine.register_kv_caches(
                [cache], model_name="trace", layout_hints={"block_size": PAGE, "kv_layout": "NHD"}
            )
            started = _monotonic()
            for index, request in enumerate(requests):
                if time_scale:
                    due = (request.timestamp_ms - requests[0].timestamp_ms) / 1000 * time_scale
                    delay = started + due - _monotonic()
                    if delay > 0:
                        await _sleep(delay)
                tokens = prompt_of(request, block_tokens)
                blocks = list(range(1, -(-len(tokens) // PAGE) + 1))
                before = engine.storage.stats()
                delivered = 0
                if await engine.lookup(tokens):
                    delivered = (await engine.retrieve(tokens, blocks)).valid_tokens
                after = engine.storage.stats()
                result.l1_chunks += after.l1_hits - before.l1_hits
                from_l2 = 0
                if l2_blocks:
                    read_before, read_after = before.tier("L2").reads, after.tier("L2").reads
                    result.l2_chunks += read_after.hits - read_before.hits
                    from_l2 = (read_after.bytes_read - read_before.bytes_read) // kv_bytes_per_token
                result.hit_tokens += delivered
                result.l2_hit_tokens += from_l2
                result.l1_hit_tokens += delivered - from_l2
                await engine.store(tokens, blocks)
                if flush_each:
                    await engine.flush()
                result.requests += 1
                result.prompt_tokens += request.input_length
                if progress is not None:
                    progress(index + 1)
            result.l1_bytes_delivered = result.l1_hit_tokens * kv_bytes_per_token
            if l2_blocks:
                l2 = engine.storage.stats().tier("L2")
                result.l2_bytes_read = l2.reads.bytes_read
                if l2.writes is not None:
                    writes = l2.writes
                    result.l2_writes, result.l2_writes_dropped = writes.done, writes.dropped_full
                    result.l2_bytes_written = writes.bytes_written
    return result
