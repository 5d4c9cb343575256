"""The trace generators: determinism, the file format, Mooncake's prefix semantics, and the
structure each trace exists for (read back from the trace alone, as a cache would see it)."""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest

from tiered_kv.benchmarks.trace_gen import (
    DECODE_S_PER_TOKEN,
    TRACES,
    agents_trace,
    chat_trace,
    documents_trace,
    main,
    reusable_share,
    write_trace,
)
from tiered_kv.benchmarks.trace_sim import BLOCK_TOKENS, TraceRequest, load_trace
from tiered_kv.errors import ConfigError

SMALL = 600  # requests: enough for every structure, fast


def _common_prefix(prompts: list[tuple[int, ...]]) -> int:
    """How many leading blocks all ``prompts`` share."""
    shared = 0
    for blocks in zip(*prompts, strict=False):
        if len(set(blocks)) > 1:
            break
        shared += 1
    return shared


@pytest.fixture(scope="module")
def default_traces() -> dict[str, list[TraceRequest]]:
    return {name: generate() for name, generate in TRACES.items()}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_a_seed_gives_one_trace_and_another_seed_another(name: str) -> None:
    generate = TRACES[name]
    trace = generate(requests=SMALL, seed=1)
    assert len(trace) == SMALL
    assert generate(requests=SMALL, seed=1) == trace
    assert generate(requests=SMALL, seed=2) != trace


@pytest.mark.parametrize("name", sorted(TRACES))
def test_a_written_trace_reads_back_equal(name: str, tmp_path: Path) -> None:
    trace = TRACES[name](requests=SMALL, seed=3)
    write_trace(tmp_path / "t.jsonl", trace)
    assert load_trace(tmp_path / "t.jsonl") == trace


@pytest.mark.parametrize("name", sorted(TRACES))
def test_a_block_id_has_one_parent_one_depth_and_one_size(name: str) -> None:
    """Mooncake's semantics: an id names a block's content and its whole prefix, so it has
    one parent and one depth; a partial last block differs from the full block it would
    become, so an id also has one token count."""
    trace = TRACES[name](requests=SMALL, seed=4)
    place: dict[int, tuple[int | None, int, int]] = {}  # id -> (parent, depth, tokens)
    for request in trace:
        counts = request.block_token_counts(BLOCK_TOKENS)
        for depth, block in enumerate(request.hash_ids):
            parent = request.hash_ids[depth - 1] if depth else None
            seen = place.setdefault(block, (parent, depth, counts[depth]))
            assert seen == (parent, depth, counts[depth]), (request, depth)
    # Not vacuous: blocks are shared between requests and some last blocks are partial.
    assert sum(len(request.hash_ids) for request in trace) > 1.5 * len(place)
    assert any(request.input_length % BLOCK_TOKENS for request in trace)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_arrivals_are_in_order_and_lengths_fit_the_blocks(name: str) -> None:
    trace = TRACES[name](requests=SMALL, seed=5)
    times = [request.timestamp_ms for request in trace]
    assert times == sorted(times)
    assert times[-1] > times[0]
    for request in trace:
        assert len(request.hash_ids) == math.ceil(request.input_length / BLOCK_TOKENS)
        assert request.output_length >= 1
    # Ids count from 0 in order of first appearance, as Mooncake's do.
    first_seen = list(dict.fromkeys(block for request in trace for block in request.hash_ids))
    assert first_seen == list(range(len(first_seen)))


@pytest.mark.parametrize("name", sorted(TRACES))
def test_reuse_and_working_set_are_in_the_documented_range(
    name: str, default_traces: dict[str, list[TraceRequest]]
) -> None:
    """The module promises 40-80% of prompt tokens reusable with unlimited cache and a
    working set of 10k-60k blocks at the defaults."""
    trace = default_traces[name]
    assert 3000 <= len(trace) <= 4000
    assert 0.40 <= reusable_share(trace) <= 0.80
    distinct = len({block for request in trace for block in request.hash_ids})
    assert 10_000 <= distinct <= 60_000


def test_a_chat_turn_starts_with_an_earlier_turn_and_its_answer(
    default_traces: dict[str, list[TraceRequest]],
) -> None:
    """A prefix of more than 4 blocks (the longest system prompt) belongs to one session, and
    an id names its whole prefix: a request holding an earlier request's last full block
    starts with all that request's full blocks: an earlier turn of its session. The turn
    after it holds its answer too, and comes after the answer was generated."""
    trace = default_traces["chat"]
    by_last_full_block: dict[int, TraceRequest] = {}
    later_turns = 0
    for request in trace:
        earlier = [by_last_full_block[b] for b in request.hash_ids[4:] if b in by_last_full_block]
        if earlier:
            turn = earlier[-1]  # the longest: the latest turn before
            later_turns += 1
            assert request.input_length > turn.input_length + turn.output_length
            generated_ms = turn.output_length * DECODE_S_PER_TOKEN * 1000
            assert request.timestamp_ms >= turn.timestamp_ms + generated_ms - 1
        full_blocks = request.input_length // BLOCK_TOKENS
        if full_blocks > 4:
            by_last_full_block[request.hash_ids[full_blocks - 1]] = request
    assert later_turns >= 0.15 * len(trace)


def test_agents_share_a_tool_prompt_and_one_shots_never_recur(
    default_traces: dict[str, list[TraceRequest]],
) -> None:
    trace = default_traces["agents"]
    leaders = collections.Counter(request.hash_ids[0] for request in trace)
    shared = [block for block, count in leaders.items() if count > 1]
    assert len(shared) <= 4  # one tool prompt per agent type
    assert sum(leaders[block] for block in shared) >= 0.7 * len(trace)
    # The most used tool prompt: at least 8 full blocks lead every request of its runs.
    top_tool_block = leaders.most_common(1)[0][0]
    runs = [request.hash_ids for request in trace if request.hash_ids[0] == top_tool_block]
    assert 8 <= _common_prefix(runs) < min(len(blocks) for blocks in runs)
    # One-shots: about one request in six, 20-80 blocks, none of them in another request.
    one_shots = [request for request in trace if leaders[request.hash_ids[0]] == 1]
    assert 0.1 * len(trace) <= len(one_shots) <= 0.3 * len(trace)
    uses = collections.Counter(block for request in trace for block in set(request.hash_ids))
    for request in one_shots:
        assert 20 <= len(request.hash_ids) <= 80
        assert all(uses[block] == 1 for block in request.hash_ids)


def test_one_shot_agent_traffic_alone_never_repeats_a_block() -> None:
    trace = agents_trace(requests=200, run_rate_per_s=0.0, seed=6)
    blocks = [block for request in trace for block in request.hash_ids]
    assert len(set(blocks)) == len(blocks)
    assert reusable_share(trace) == 0.0


def _document_requests(trace: list[TraceRequest]) -> collections.Counter[int]:
    # 600 system tokens: block 1 holds the system prompt's tail and the document's head, so it
    # names the document (a one-shot upload's is seen once).
    return collections.Counter(request.hash_ids[1] for request in trace)


def test_popular_documents_recur_more_than_unpopular_ones(
    default_traces: dict[str, list[TraceRequest]],
) -> None:
    trace = default_traces["documents"]
    ranked = _document_requests(trace).most_common()
    top_document, top_requests = ranked[0]
    assert top_requests >= 0.05 * len(trace)  # Zipf over 300: about 12% of requests
    # The top tenth of the documents asked about more than once draws most of their requests.
    shared = [count for _, count in ranked if count > 1]
    assert sum(shared[: len(shared) // 10]) >= 0.5 * sum(shared)
    # Its requests share all blocks but the (at most 3) that hold their question.
    asked = [request.hash_ids for request in trace if request.hash_ids[1] == top_document]
    assert _common_prefix(asked) >= min(len(blocks) for blocks in asked) - 3
    # Without the skew no document stands out: the checks above read the popularity.
    flat = documents_trace(popularity_exponent=0.0)
    assert _document_requests(flat).most_common(1)[0][1] < 0.02 * len(flat)


def test_bad_options_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="requests"):
        chat_trace(requests=0)
    with pytest.raises(ConfigError, match="one_shot_rate_per_s"):
        agents_trace(run_rate_per_s=0.0, one_shot_rate_per_s=0.0)
    with pytest.raises(ConfigError, match=r"one_shot_share: must be in \[0, 1\], got 1.5"):
        documents_trace(one_shot_share=1.5)


def test_the_command_writes_the_trace_and_sums_it_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chat.jsonl"
    assert main(["chat", "--out", str(out), "--seed", "1", "--requests", "300"]) == 0
    trace = load_trace(out)
    assert trace == chat_trace(requests=300, seed=1)
    distinct = len({block for request in trace for block in request.hash_ids})
    summary = capsys.readouterr().out
    assert summary.startswith(f"chat: 300 requests, {distinct} distinct blocks, ")
    assert f"{100 * reusable_share(trace):.1f}% of prompt tokens reusable" in summary
