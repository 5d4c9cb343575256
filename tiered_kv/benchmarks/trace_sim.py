"""Block caches replayed over a request trace: LRU and the offline optimum (Belady).

A trace in the format of Mooncake's FAST'25 release lists each request's prompt as blocks
(``hash_ids``, ``block_tokens`` tokens each; the last one shorter when ``input_length`` is not
a whole number of blocks): equal ids are equal blocks. A cache of ``capacity`` blocks serves a
request the longest leading run of its blocks that it holds (prefix semantics: KV of a block
is useless without its prefix), then holds the request's blocks as used at that request:
- LRU: every block of the request becomes the most recent, in prompt order; the least
  recently used go when the cache is over capacity.
- Belady: when a block must come in and the cache is full, the block used again farthest in
  the future goes, or the new block stays out when it is itself used again later than every
  cached block (or never). It knows the future, so no online policy beats it on a block
  basis; with prefix semantics it is the reference the issue names, not a proven bound.

Pure Python, no torch: `tiered-kv bench trace` (and its tests) compare the engine's own
policies against both at the same sizes. ``python -m tiered_kv.benchmarks.trace_sim FILE``
prints the share of prompt tokens each serves from cache at a few sizes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import json
import math
import sys
from collections.abc import Container, Sequence
from pathlib import Path

from tiered_kv.errors import TieredKVError
from tiered_kv.eviction import EvictionOrder, make_order

BLOCK_TOKENS = 512  # Mooncake's traces: 512-token blocks


class TraceError(TieredKVError):
    """A trace file that cannot be read as requests of blocks (names the line and why)."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_token_counts(self, block_tokens: int) -> list[int]:
        """Tokens in each block: ``block_tokens``, the last one what is left."""
        counts = [block_tokens] * len(self.hash_ids)
        if counts:
            counts[-1] = self.input_length - block_tokens * (len(counts) - 1)
        return counts


def load_trace(path: str | Path, block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """The requests of a JSON-lines trace, in file order. Each line needs ``timestamp`` (ms),
    ``input_length``, ``hash_ids`` (``output_length`` is optional); ``hash_ids`` must cover
    ``input_length`` in blocks of ``block_tokens`` exactly, else `TraceError` naming the line
    (another block size would read the same ids as other prompts: say it)."""
    requests = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                timestamp = float(record["timestamp"])
                input_length = record["input_length"]
                hash_ids = record["hash_ids"]
                output_length = record.get("output_length", 0)
            except (ValueError, KeyError, TypeError) as exc:
                raise TraceError(f"{path}:{number}: not a trace record ({exc!r})") from None
            if (
                isinstance(input_length, bool)
                or not isinstance(input_length, int)
                or input_length < 1
                or not isinstance(hash_ids, list)
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in hash_ids)
            ):
                raise TraceError(
                    f"{path}:{number}: input_length must be an int >= 1 and hash_ids a list of ints"
                )
            if len(hash_ids) != math.ceil(input_length / block_tokens):
                raise TraceError(
                    f"{path}:{number}: {len(hash_ids)} blocks for {input_length} tokens do not "
                    f"match blocks of {block_tokens} tokens; pass the trace's block size"
                )
            requests.append(
                TraceRequest(timestamp, input_length, int(output_length), tuple(hash_ids))
            )
    return requests


@dataclasses.dataclass(frozen=True, slots=True)
class SimResult:
    policy: str
    capacity: int
    prompt_tokens: int
    hit_tokens: int

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _served(request: TraceRequest, held: Container[int], block_tokens: int) -> int:
    """Tokens of the longest leading run of ``request``'s blocks in ``held``."""
    served = 0
    for block, tokens in zip(
        request.hash_ids, request.block_token_counts(block_tokens), strict=True
    ):
        if block not in held:
            break
        served += tokens
    return served


def simulate_lru(
    requests: Sequence[TraceRequest], capacity: int, block_tokens: int = BLOCK_TOKENS
) -> SimResult:
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    prompt = hits = 0
    for request in requests:
        prompt += request.input_length
        hits += _served(request, cache, block_tokens)
        for block in request.hash_ids:
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return SimResult("LRU", capacity, prompt, hits)


def simulate_belady(
    requests: Sequence[TraceRequest], capacity: int, block_tokens: int = BLOCK_TOKENS
) -> SimResult:
    never = len(requests)  # "used again" after the last request: never
    # next_use[t][i]: the next request after t holding request t's block i.
    next_use: list[list[int]] = [[] for _ in requests]
    seen: dict[int, int] = {}
    for t in range(len(requests) - 1, -1, -1):
        next_use[t] = [seen.get(block, never) for block in requests[t].hash_ids]
        for block in requests[t].hash_ids:
            seen[block] = t
    cache: dict[int, int] = {}  # block -> its next use
    farthest: list[tuple[int, int]] = []  # (-next use, block), stale entries skipped
    prompt = hits = 0
    for t, request in enumerate(requests):
        prompt += request.input_length
        hits += _served(request, cache, block_tokens)
        for block, use in zip(request.hash_ids, next_use[t], strict=True):
            if block in cache:
                cache[block] = use
                heapq.heappush(farthest, (-use, block))
                continue
            if capacity < 1:
                continue
            if len(cache) >= capacity:
                while -farthest[0][0] != cache.get(farthest[0][1]):
                    heapq.heappop(farthest)  # stale: the block left or its next use moved
                if -farthest[0][0] <= use:
                    continue  # every cached block is used again sooner: this one stays out
                del cache[heapq.heappop(farthest)[1]]
            cache[block] = use
            heapq.heappush(farthest, (-use, block))
    return SimResult("Belady", capacity, prompt, hits)


def simulate_lru_oracle(
    requests: Sequence[TraceRequest], capacity: int, block_tokens: int = BLOCK_TOKENS
) -> SimResult:
    """LRU told which blocks are used again at all (not when): a block with no later use is
    never kept, the rest are LRU with a request's tail older than its head. What perfect
    admission with recency buys: the part of the optimum's lead that does not need to know
    *when* a block comes back (docs/eviction.md)."""
    remaining = collections.Counter(block for request in requests for block in request.hash_ids)
    cache: collections.OrderedDict[int, None] = collections.OrderedDict()
    prompt = hits = 0
    for request in requests:
        prompt += request.input_length
        hits += _served(request, cache, block_tokens)
        for block in reversed(request.hash_ids):
            remaining[block] -= 1
            cache.pop(block, None)
            if remaining[block] > 0:
                cache[block] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return SimResult("LRU+oracle", capacity, prompt, hits)


def simulate_order(
    requests: Sequence[TraceRequest],
    capacity: int,
    policy: str,
    block_tokens: int = BLOCK_TOKENS,
) -> SimResult:
    """A cache of ``capacity`` blocks evicting by the engine's own order ``policy``
    (`tiered_kv.eviction`), told what the engine tells it: the served blocks are read
    (``touch``), the missing ones stored (``insert``, evicting to make room as each comes in),
    then the request's blocks are reported (``use``)."""
    order: EvictionOrder[int] = make_order(policy)
    prompt = hits = 0
    for request in requests:
        prompt += request.input_length
        served = _served(request, order, block_tokens)
        hits += served
        held = -(-served // block_tokens)
        partial = request.input_length % block_tokens != 0
        for index, block in enumerate(request.hash_ids):
            if index < held:
                order.touch(block)
                continue
            if block in order or capacity < 1:
                continue
            while len(order) >= capacity:
                order.remove(next(order.victims()))
            order.insert(block, partial=partial and index == len(request.hash_ids) - 1)
        order.use(request.hash_ids)
    return SimResult(policy, capacity, prompt, hits)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--capacities", default="250,1000,4000,16000", help="%(default)s")
    parser.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS)
    args = parser.parse_args(argv)
    requests = load_trace(args.trace, args.block_tokens)
    print(f"{len(requests)} requests; share of prompt tokens served from cache")
    print(f"{'capacity (blocks)':>18}{'LRU':>9}{'reuse':>9}{'LRU+oracle':>12}{'Belady':>9}")
    for capacity in (int(c) for c in args.capacities.split(",")):
        figures = (
            simulate_lru(requests, capacity, args.block_tokens).ratio,
            simulate_order(requests, capacity, "reuse", args.block_tokens).ratio,
            simulate_lru_oracle(requests, capacity, args.block_tokens).ratio,
            simulate_belady(requests, capacity, args.block_tokens).ratio,
        )
        widths = (9, 9, 12, 9)
        print(
            f"{capacity:>18}"
            + "".join(f"{100 * f:>{w - 1}.1f}%" for f, w in zip(figures, widths, strict=True))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
