"""Request traces of our own, in Mooncake's FAST'25 format, to compare eviction policies on.
Each generator models a workload that stresses eviction differently:
- `chat_trace`: multi-turn chat. Each turn resends the whole conversation, so a session's
  blocks come back after the user's think time (tens of seconds, sometimes many minutes);
  a cache must keep idle sessions across that gap while new ones arrive.
- `agents_trace`: agent runs that share a long tool prompt per agent type and extend their
  context every few seconds, interleaved with long one-shot prompts that are never seen
  again: one of those flushes a small LRU cache of everything worth keeping.
- `documents_trace`: questions about documents of a shared corpus with Zipf-like
  popularity, plus one-shot uploads: frequency, not recency, tells what to keep.

Owns the prompts' structure and timing only; replaying a trace through a cache is
`trace_sim`'s, and this module imports nothing but it and the stdlib. Ids follow Mooncake's
prefix semantics: an id names a block's content and its whole prefix (one parent, one
depth), a partial last block has an id of its own, and ids are numbered from 0 in order of
first appearance. Pure Python (``random.Random(seed)``): the same options give the same
trace on every machine.

``python -m tiered_kv.benchmarks.trace_gen chat --out chat.jsonl [--seed 1] [--requests N]``
writes a trace and prints its size and the share of prompt tokens reusable with unlimited
cache (``python -m tiered_kv.benchmarks.trace_sim chat.jsonl`` then replays it).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tiered_kv.benchmarks.trace_sim import BLOCK_TOKENS, TraceRequest, simulate_lru
from tiered_kv.errors import ConfigError

DECODE_S_PER_TOKEN = 0.03  # time to generate one output token: answers take seconds
DEFAULT_REQUESTS = 3600


@dataclasses.dataclass(frozen=True, slots=True)
class _Text:
    """A run of ``tokens`` tokens; equal ``content`` means the same tokens."""

    content: int
    tokens: int


# A block's content: the (text content, start, end) token ranges it holds, in order.
_BlockContent = tuple[tuple[int, int, int], ...]


class _TraceBuilder:
    """Turns prompts (sequences of texts) into requests of block ids and keeps them until
    `first` orders them by arrival. Generators add requests in groups (a session, a run)
    whose arrivals are at or after the group's start; groups start in time order."""

    def __init__(self, block_tokens: int) -> None:
        self._block_tokens = block_tokens
        self._contents = itertools.count()
        self._block_ids: dict[tuple[int, _BlockContent], int] = {}  # (parent id, content) -> id
        self._requests: list[tuple[int, int, TraceRequest]] = []  # (ms, order added, request)
        self._unsettled: list[int] = []  # heap of arrivals (ms) not yet counted by `settled`
        self._settled = 0

    def text(self, tokens: int) -> _Text:
        """Tokens seen nowhere else (until this text is reused)."""
        return _Text(next(self._contents), tokens)

    def add(self, time_s: float, prompt: Sequence[_Text], output_length: int) -> None:
        timestamp_ms = round(time_s * 1000)
        input_length = sum(text.tokens for text in prompt)
        request = TraceRequest(
            float(timestamp_ms), input_length, output_length, self._hash_ids(prompt)
        )
        self._requests.append((timestamp_ms, len(self._requests), request))
        heapq.heappush(self._unsettled, timestamp_ms)

    def settled(self, time_s: float) -> int:
        """Requests added that arrive before ``time_s``: once every group starting before
        ``time_s`` is added, no later group can add one."""
        now_ms = round(time_s * 1000)
        while self._unsettled and self._unsettled[0] < now_ms:
            heapq.heappop(self._unsettled)
            self._settled += 1
        return self._settled

    def first(self, count: int) -> list[TraceRequest]:
        """The ``count`` earliest requests, ids renumbered by first appearance among them."""
        self._requests.sort(key=lambda item: item[:2])
        renumbered: dict[int, int] = {}
        trace = []
        for _, _, request in self._requests[:count]:
            hash_ids = tuple(renumbered.setdefault(i, len(renumbered)) for i in request.hash_ids)
            trace.append(dataclasses.replace(request, hash_ids=hash_ids))
        return trace

    def _hash_ids(self, prompt: Sequence[_Text]) -> tuple[int, ...]:
        hash_ids: list[int] = []
        parent = -1  # the root: no block before the first
        content: list[tuple[int, int, int]] = []
        room = self._block_tokens
        for text in prompt:
            start = 0
            while start < text.tokens:
                end = min(text.tokens, start + room)
                content.append((text.content, start, end))
                room -= end - start
                start = end
                if room == 0:
                    parent = self._block_id(parent, tuple(content))
                    hash_ids.append(parent)
                    content, room = [], self._block_tokens
        if content:  # a partial last block: its content differs from any full block's
            hash_ids.append(self._block_id(parent, tuple(content)))
        return tuple(hash_ids)

    def _block_id(self, parent: int, content: _BlockContent) -> int:
        return self._block_ids.setdefault((parent, content), len(self._block_ids))


@dataclasses.dataclass(frozen=True, slots=True)
class _LogNormal:
    """A lognormal count (tokens) or duration (seconds): ``median``, ``sigma``, at most
    ``most``."""

    median: float
    sigma: float
    most: float = math.inf

    def draw(self, rng: random.Random) -> float:
        return min(self.most, self.median * rng.lognormvariate(0.0, self.sigma))

    def tokens(self, rng: random.Random) -> int:
        return max(1, round(self.draw(rng)))


# The draws behind the generators' docstrings.
_CHAT_USER_TOKENS = _LogNormal(250, 1.8, 32768)  # one in twenty over 4,800 tokens: pastes
_CHAT_ANSWER_TOKENS = _LogNormal(400, 0.8, 4096)
_CHAT_THINK_SIGMA = 1.4  # one turn in twenty waits over ten times the median
_CHAT_TURNS_ALPHA = 1.1  # Pareto: 53% of sessions one turn, 70% at most two, 7% over ten
_AGENT_TASK_TOKENS = _LogNormal(200, 1.0, 8192)
_AGENT_OUTPUT_TOKENS = _LogNormal(150, 0.8, 2048)  # a tool call, some reasoning
_AGENT_RESULT_TOKENS = _LogNormal(500, 1.2, 16384)  # one in twenty over 3,600 tokens: a file
_AGENT_TOOL_SECONDS = _LogNormal(4.0, 1.2)
_AGENT_STEPS_MEAN = 10.0  # steps: 2 + Exp(mean 10), at most 60
_AGENT_STEPS_MOST = 60
_ONE_SHOT_ANSWER_TOKENS = _LogNormal(200, 0.8, 2048)
_QUESTION_TOKENS = _LogNormal(60, 0.8, 1024)
_DOCUMENT_ANSWER_TOKENS = _LogNormal(250, 0.7, 2048)


def _zipf_cum_weights(count: int, exponent: float) -> list[float]:
    """Cumulative weights of ranks 0..count-1, rank r weighing 1 / (r + 1) ** exponent."""
    return list(itertools.accumulate(1 / (rank + 1) ** exponent for rank in range(count)))


def _pick(rng: random.Random, cum_weights: list[float]) -> int:
    return rng.choices(range(len(cum_weights)), cum_weights=cum_weights)[0]


def _check(name: str, value: float, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: must be {allowed}, got {value!r}")


def _check_common(requests: int, block_tokens: int) -> None:
    _check("requests", requests, requests >= 1, ">= 1")
    _check("block_tokens", block_tokens, block_tokens >= 1, ">= 1")


def chat_trace(
    *,
    requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
    session_rate_per_s: float = 3.0,
    system_prompts: int = 4,
    think_median_s: float = 30.0,
    max_turns: int = 64,
    block_tokens: int = BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Multi-turn chat sessions: the first ``requests`` requests by arrival.

    Sessions arrive as a Poisson process of ``session_rate_per_s`` (3 a second: some 1,800
    sessions over 10 minutes by default) and open with one of ``system_prompts`` system prompts
    (1-4 blocks of tokens, uniform; the first is the most used, popularity 1/rank). Turns per
    session are Pareto (alpha 1.1, at most ``max_turns``): 53% of sessions have one turn,
    70% at most two, 7% more than ten. A turn's prompt is the previous turn's prompt, its
    answer and a new user message (lognormal: median 250 tokens, sigma 1.8, at most 32,768);
    answers are lognormal (median 400 tokens, sigma 0.8, at most 4,096). The next turn
    arrives once the answer is generated (`DECODE_S_PER_TOKEN` a token) and the user has
    thought (lognormal: median ``think_median_s``, sigma 1.4; one in twenty waits over ten
    times the median).
    """
    _check_common(requests, block_tokens)
    _check("session_rate_per_s", session_rate_per_s, session_rate_per_s > 0, "> 0")
    _check("system_prompts", system_prompts, system_prompts >= 1, ">= 1")
    _check("think_median_s", think_median_s, think_median_s >= 0, ">= 0")
    _check("max_turns", max_turns, max_turns >= 1, ">= 1")
    rng = random.Random(seed)
    builder = _TraceBuilder(block_tokens)
    systems = [
        builder.text(rng.randint(block_tokens, 4 * block_tokens)) for _ in range(system_prompts)
    ]
    system_weights = _zipf_cum_weights(system_prompts, 1.0)
    think = _LogNormal(think_median_s, _CHAT_THINK_SIGMA)
    start_s = 0.0
    while builder.settled(start_s) < requests:
        start_s += rng.expovariate(session_rate_per_s)
        turns = min(max_turns, int(rng.paretovariate(_CHAT_TURNS_ALPHA)))
        prompt = [systems[_pick(rng, system_weights)]]
        time_s = start_s
        for turn in range(turns):
            prompt.append(builder.text(_CHAT_USER_TOKENS.tokens(rng)))
            answer_tokens = _CHAT_ANSWER_TOKENS.tokens(rng)
            builder.add(time_s, prompt, answer_tokens)
            if turn + 1 < turns:
                prompt.append(builder.text(answer_tokens))
                time_s += answer_tokens * DECODE_S_PER_TOKEN + think.draw(rng)
    return builder.first(requests)


def agents_trace(
    *,
    requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
    run_rate_per_s: float = 0.5,
    one_shot_rate_per_s: float = 1.2,
    agent_types: int = 4,
    block_tokens: int = BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Agent runs among one-shot prompts: the first ``requests`` requests by arrival.

    Runs arrive as a Poisson process of ``run_rate_per_s`` (one every two seconds: some 300
    runs over 10 minutes by default), each of one of ``agent_types`` agent types (popularity
    1/rank) whose tool prompt (8-30 blocks of tokens, uniform) all its runs share. A run's
    first prompt is the tool prompt and a task (lognormal: median 200 tokens, sigma 1.0); it
    takes 2 + Exp(mean 10) steps (at most 60), each step's prompt the previous one plus the
    model's output (lognormal: median 150 tokens, sigma 0.8, at most 2,048) and the tool's
    result (lognormal: median 500 tokens, sigma 1.2, at most 16,384). A step follows the one
    before once its output is generated (`DECODE_S_PER_TOKEN` a token) and the tool has run
    (lognormal: median 4 s, sigma 1.2). One-shot prompts arrive as a Poisson process of
    their own, ``one_shot_rate_per_s`` (1.2 a second: about one request in five and a
    quarter of the prompt tokens): 20-80 blocks of tokens (uniform) seen nowhere else,
    answers lognormal (median 200 tokens, sigma 0.8).
    """
    _check_common(requests, block_tokens)
    _check("run_rate_per_s", run_rate_per_s, run_rate_per_s >= 0, ">= 0")
    _check("one_shot_rate_per_s", one_shot_rate_per_s, one_shot_rate_per_s >= 0, ">= 0")
    rate_per_s = run_rate_per_s + one_shot_rate_per_s
    _check("run_rate_per_s + one_shot_rate_per_s", rate_per_s, rate_per_s > 0, "> 0")
    _check("agent_types", agent_types, agent_types >= 1, ">= 1")
    rng = random.Random(seed)
    builder = _TraceBuilder(block_tokens)
    tool_prompts = [
        builder.text(rng.randint(8 * block_tokens, 30 * block_tokens)) for _ in range(agent_types)
    ]
    agent_weights = _zipf_cum_weights(agent_types, 1.0)
    start_s = 0.0
    while builder.settled(start_s) < requests:
        # Two Poisson processes merged: arrivals at the joint rate, each a run or a one-shot.
        start_s += rng.expovariate(rate_per_s)
        if rng.random() * rate_per_s >= run_rate_per_s:
            one_shot = builder.text(rng.randint(20 * block_tokens, 80 * block_tokens))
            builder.add(start_s, [one_shot], _ONE_SHOT_ANSWER_TOKENS.tokens(rng))
            continue
        prompt = [tool_prompts[_pick(rng, agent_weights)]]
        prompt.append(builder.text(_AGENT_TASK_TOKENS.tokens(rng)))
        steps = min(_AGENT_STEPS_MOST, 2 + int(rng.expovariate(1 / _AGENT_STEPS_MEAN)))
        time_s = start_s
        for step in range(steps):
            output_tokens = _AGENT_OUTPUT_TOKENS.tokens(rng)
            builder.add(time_s, prompt, output_tokens)
            if step + 1 < steps:
                prompt.append(builder.text(output_tokens))
                prompt.append(builder.text(_AGENT_RESULT_TOKENS.tokens(rng)))
                time_s += output_tokens * DECODE_S_PER_TOKEN + _AGENT_TOOL_SECONDS.draw(rng)
    return builder.first(requests)


def documents_trace(
    *,
    requests: int = DEFAULT_REQUESTS,
    seed: int = 0,
    request_rate_per_s: float = 2.0,
    documents: int = 300,
    popularity_exponent: float = 1.0,
    one_shot_share: float = 0.25,
    system_tokens: int = 600,
    block_tokens: int = BLOCK_TOKENS,
) -> list[TraceRequest]:
    """Questions about the documents of a shared corpus: ``requests`` requests.

    Requests arrive as a Poisson process of ``request_rate_per_s`` (2 a second: 30 minutes
    by default). Each is a system prompt all share (``system_tokens``), a document and a
    question of its own (lognormal: median 60 tokens, sigma 0.8, at most 1,024), so the last
    block is partial and never seen again. The document is one of a corpus of ``documents``
    (4-60 blocks of tokens, uniform) picked with Zipf popularity (document r, from 0, in
    proportion to 1 / (r + 1) ** ``popularity_exponent``) or, for a ``one_shot_share`` of
    requests, an upload of the same size range seen nowhere else. Answers are lognormal
    (median 250 tokens, sigma 0.7, at most 2,048).
    """
    _check_common(requests, block_tokens)
    _check("request_rate_per_s", request_rate_per_s, request_rate_per_s > 0, "> 0")
    _check("documents", documents, documents >= 1, ">= 1")
    _check("popularity_exponent", popularity_exponent, popularity_exponent >= 0, ">= 0")
    _check("one_shot_share", one_shot_share, 0 <= one_shot_share <= 1, "in [0, 1]")
    _check("system_tokens", system_tokens, system_tokens >= 0, ">= 0")
    rng = random.Random(seed)
    builder = _TraceBuilder(block_tokens)
    system = [builder.text(system_tokens)] if system_tokens else []
    corpus = [
        builder.text(rng.randint(4 * block_tokens, 60 * block_tokens)) for _ in range(documents)
    ]
    document_weights = _zipf_cum_weights(documents, popularity_exponent)
    time_s = 0.0
    for _ in range(requests):
        time_s += rng.expovariate(request_rate_per_s)
        if rng.random() < one_shot_share:
            document = builder.text(rng.randint(4 * block_tokens, 60 * block_tokens))
        else:
            document = corpus[_pick(rng, document_weights)]
        question = builder.text(_QUESTION_TOKENS.tokens(rng))
        builder.add(time_s, [*system, document, question], _DOCUMENT_ANSWER_TOKENS.tokens(rng))
    return builder.first(requests)


class TraceGenerator(Protocol):
    """What every generator takes (each has options of its own besides)."""

    def __call__(
        self, *, requests: int = ..., seed: int = ..., block_tokens: int = ...
    ) -> list[TraceRequest]: ...


TRACES: dict[str, TraceGenerator] = {
    "chat": chat_trace,
    "agents": agents_trace,
    "documents": documents_trace,
}


def write_trace(path: str | Path, requests: Sequence[TraceRequest]) -> None:
    """Write ``requests`` as JSON lines that `trace_sim.load_trace` reads back equal
    (timestamps in whole milliseconds are written as ints, as Mooncake's are)."""
    with open(path, "w", encoding="utf-8") as file:
        for request in requests:
            timestamp = request.timestamp_ms
            record = {
                "timestamp": int(timestamp) if timestamp.is_integer() else timestamp,
                "input_length": request.input_length,
                "output_length": request.output_length,
                "hash_ids": list(request.hash_ids),
            }
            file.write(json.dumps(record) + "\n")


def reusable_share(requests: Sequence[TraceRequest], block_tokens: int = BLOCK_TOKENS) -> float:
    """Share of prompt tokens in a prefix seen before: what a cache of unlimited size serves."""
    distinct = len({block for request in requests for block in request.hash_ids})
    return simulate_lru(requests, max(distinct, 1), block_tokens).ratio


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("trace", choices=sorted(TRACES))
    parser.add_argument("--out", type=Path, required=True, help="the JSON-lines file to write")
    parser.add_argument("--seed", type=int, default=0, help="%(default)s")
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="%(default)s")
    args = parser.parse_args(argv)
    try:
        trace = TRACES[args.trace](requests=args.requests, seed=args.seed)
    except ConfigError as exc:
        parser.error(str(exc))
    write_trace(args.out, trace)
    distinct = len({block for request in trace for block in request.hash_ids})
    print(
        f"{args.trace}: {len(trace)} requests, {distinct} distinct blocks, "
        f"{100 * reusable_share(trace):.1f}% of prompt tokens reusable -> {args.out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
