"""bench/ttft.py's logic on CPU: a tiny Llama over CPU paged caches, through real engines.

transformers is a bench-only requirement; under CI (``CI`` set) its absence fails this module
instead of skipping it, so the TTFT bench's logic cannot drop out of CI unnoticed.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
from collections.abc import Callable, Iterator

import pytest
import torch

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    message = f"bench/ttft.py needs transformers (pip install -e '.[bench]'): {exc}"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)

from bench import ttft
from bench.ttft_model import (
    TINY,
    PagedKV,
    PrefillGraphs,
    build_model,
    prefill,
    prefix_sdpa_attention,
)
from tiered_kv.sync import new_event_loop

MODES = ("whole", "layerwise")


@pytest.fixture(scope="module")
def tiny_report() -> Iterator[ttft.Report]:
    opts = ttft.tiny_options(lengths=(64, 128), reps=1, cold_budget_s=5.0)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        yield runner.run(ttft.run_bench(opts))


@pytest.mark.slow
def test_every_case_is_measured_and_tabled(tiny_report: ttft.Report) -> None:
    report = tiny_report
    expected = {(n, 0, "recompute", "-") for n in (64, 128)}
    for n in (64, 128):
        for source in ("L1", "L2 warm", "L3"):
            expected.add((n, 0, source, "-"))
        for pct in (50, 100):
            expected.add((n, pct, "compute", "-"))
            for source in ("L1", "L2 warm", "L2 cold", "L3"):
                for mode in ("whole", "layerwise", "auto"):
                    expected.add((n, pct, source, mode))
    measured = {(c.tokens, c.cached_pct, c.tier, c.mode) for c in report.cases}
    assert measured == expected
    assert all(c.ttft_s > 0 and c.runs_s for c in report.cases)
    for case in report.cases:
        cached = case.tokens * case.cached_pct // 100
        if case.mode == "auto":
            # The cost policy's claim, within what was cached; bounded by the better of this
            # tier's own rows and recomputing, measured in the same run.
            assert case.claimed_tokens and all(0 <= c <= cached for c in case.claimed_tokens)
            assert case.loaded_tokens in case.claimed_tokens
            rows = [report.find(case.tokens, case.cached_pct, case.tier, m) for m in MODES]
            assert case.recompute_s is not None and None not in rows
            assert case.bound_s == min([r.ttft_s for r in rows if r] + [case.recompute_s])
        elif case.tier in ("L1", "L2 warm", "L2 cold", "L3") and case.cached_pct:
            # What was loaded is what the prompt had cached; the last token is computed.
            assert case.loaded_tokens == cached
            assert case.prefix_tokens == min(case.loaded_tokens, case.tokens - 1)
            assert case.load_bound_s is not None and case.bound_s is not None
    assert [row["tokens"] for row in report.slowdown] == [64, 128]
    table = ttft.table_lines(report)
    assert table[0].split()[:4] == ["tokens", "cached", "source", "mode"]
    assert len(table) == 1 + len(report.cases)
    summary = ttft.summary_lines(report)
    assert any(line.startswith("correctness, reproducibility") for line in summary)
    assert any(line.startswith("break-even L2 cold:") for line in summary)
    autos = [line for line in summary if line.startswith("target auto ")]
    assert len(autos) == sum(c.mode == "auto" for c in report.cases) == 2 * 2 * 4
    assert report.as_dict()["cases"]  # the JSON form serializes


@pytest.mark.slow
def test_each_lower_tier_is_bounded_by_its_own_ceiling(tiny_report: ttft.Report) -> None:
    """L2 warm and L3 loads are bounded by the slower of the H2D ceiling and the tier's own
    ceiling, measured in the run (page-cache reads, loopback TCP), with its sweep kept."""
    report = tiny_report
    warm, l3 = report.tier_ceilings["L2 warm"], report.tier_ceilings["L3"]
    assert set(warm["sweep"]) >= {1, 4, 8, 16} and set(l3["sweep"]) >= {1, 4, 8}
    assert warm["gbps"] > 0 and l3["gbps"] > 0
    for case in report.cases:
        if case.tier not in report.tier_ceilings or not case.loaded_tokens:
            continue
        ceiling = report.tier_ceilings[case.tier]["gbps"]
        rate = min(report.h2d_gbps, ceiling) * 1e9
        kv_bytes = case.loaded_tokens * report.kv_bytes_per_token
        assert case.load_bound_s == pytest.approx(kv_bytes / rate)


@pytest.mark.slow
def test_logits_agree_across_whole_layerwise_tiers_and_recompute(
    tiny_report: ttft.Report,
) -> None:
    report = tiny_report
    assert report.failed_checks == []
    kinds = {c["kind"] for c in report.checks}
    always = {"reproducibility", "bit-exact", "timed", "separation"}
    assert always <= kinds <= always | {"auto, partial claim"}
    # The references themselves first: the recompute and the resident-prefix prefill, twice.
    repro = [c for c in report.checks if c["kind"] == "reproducibility"]
    assert len(repro) == 2 * 3 and all(c["ok"] for c in repro)
    assert report.checks[0]["kind"] == "reproducibility"
    for n in (64, 128):
        for pct in (50, 100):
            resident = report.logits[(n, pct, "compute", "-")]
            assert torch.isfinite(resident).all()
            # Same prefix KV, same computation: every load gives the same bits.
            for source in ("L1", "L2 warm", "L2 cold", "L3"):
                auto = report.find(n, pct, source, "auto")
                assert auto is not None
                whole_claim = auto.claimed_tokens == [n * pct // 100]
                for mode in ("whole", "layerwise", "auto") if whole_claim else MODES:
                    assert torch.equal(report.logits[(n, pct, source, mode)], resident), (
                        n,
                        pct,
                        source,
                        mode,
                    )
            # Recomputing is close; another prompt's KV (the control) is not.
            recompute = report.logits[(n, pct, "recompute", "-")]
            control = report.logits[(n, pct, "control", "-")]
            cosine = torch.nn.functional.cosine_similarity
            assert cosine(resident, recompute, dim=0) >= 0.99
            assert cosine(control, recompute, dim=0) < 0.95
        assert torch.equal(
            report.logits[(n, 0, "L1", "-")], report.logits[(n, 0, "recompute", "-")]
        )
    separations = [c for c in report.checks if c["kind"] == "separation"]
    assert len(separations) == 4
    for check in separations:
        assert check["loads"] == 13  # 4 sources x 3 modes + the resident prefix
        assert check["control_cosine"] < check["cosine"]
    # Every timed run was checked against its deterministic reference.
    timed = [c for c in report.checks if c["kind"] == "timed"]
    timed_cases = [c for c in report.cases if c.tier not in ("recompute", "compute")]
    store_runs = 2 * len(report.slowdown)  # reps=1: one pair (with, without) per length
    prefill_runs = 3 * 2  # recompute, 100%, 50% resident, one timed run each, per length
    assert len(timed) == sum(len(c.runs_s) for c in timed_cases) + store_runs + prefill_runs
    assert {k["bit_identical"] for k in report.default_kernels} == {True}
    lines = ttft.correctness_lines(report)
    assert lines[0].startswith("correctness, reproducibility (bit-exact, deterministic kernels)")
    assert any(line.startswith("correctness, bit-exact (same math") for line in lines)
    assert sum(line.startswith("correctness, separation") for line in lines) == 4
    assert not any(line.startswith("FAILED") for line in lines)


class _NoModel:
    """For checks alone: Bench needs a runner with a paged cache and a device."""

    paged = None
    device = torch.device("cpu")


def _bench() -> ttft.Bench:
    report = ttft.Report(options={}, kv_bytes_per_token=1)
    return ttft.Bench(ttft.tiny_options(), report, _NoModel())  # type: ignore[arg-type]


def test_a_reference_that_is_not_reproducible_is_reported_and_checked_within_tolerance() -> None:
    bench = _bench()
    first = torch.linspace(-5.0, 5.0, 1000)
    second = first.clone()
    second[7] += 0.079  # another kernel's rounding
    bench.check_reproducible(
        "2048 tokens, 100% cached: resident prefix, twice", (2048, 100), first, second
    )
    # Reported, not failed; and what is compared with it is no longer bit-exact.
    assert bench.report.checks[-1]["kind"] == "reproducibility"
    assert not bench.report.checks[-1]["ok"]
    assert bench.report.failed_checks == []
    bench.check_against("load, other rounding", (2048, 100), first, second)
    assert bench.report.checks[-1]["kind"] == "tolerance (reference not reproducible)"
    assert bench.report.checks[-1]["ok"]
    poisoned = second.clone()
    poisoned[3] = math.nan  # a slot no load wrote
    bench.check_against("load, missing layer", (2048, 100), first, poisoned)
    assert not bench.report.checks[-1]["ok"]
    wrong = torch.flip(first, (0,))  # another prompt's logits
    bench.check_against("load, wrong prompt", (2048, 100), first, wrong)
    assert not bench.report.checks[-1]["ok"]
    assert [c["check"] for c in bench.report.failed_checks] == [
        "load, missing layer",
        "load, wrong prompt",
    ]
    # A reproducible reference keeps the bit-exact check.
    bench.check_reproducible("2048 tokens, 50% cached: twice", (2048, 50), first, first.clone())
    bench.check_against("load 50%", (2048, 50), first, second)
    assert bench.report.checks[-1]["kind"] == "bit-exact"
    assert not bench.report.checks[-1]["ok"]
    lines = ttft.correctness_lines(bench.report)
    assert "NOT reproducible: 2048 tokens, 100% cached: resident prefix, twice" in lines[0]
    assert any(
        line.startswith("correctness, tolerance (reference not reproducible") for line in lines
    )


def test_separation_needs_the_loads_far_closer_to_recompute_than_the_control() -> None:
    gen = torch.Generator().manual_seed(0)
    recompute = torch.randn(4096, generator=gen)
    noise = torch.randn(4096, generator=gen)
    for control_mix, load_mix, ok in ((1.0, 0.02, True), (1.0, 0.2, False), (0.1, 0.05, False)):
        bench = _bench()
        bench.recompute_logits[(2048, 100)] = recompute
        logits = bench.report.logits
        logits[(2048, 100, "control", "-")] = recompute + control_mix * noise
        logits[(2048, 100, "compute", "-")] = recompute + load_mix * noise
        logits[(2048, 100, "L1", "whole")] = recompute + load_mix * noise
        logits[(2048, 100, "recompute", "-")] = recompute
        bench.separation(2048, 100)
        check = bench.report.checks[-1]
        assert check["kind"] == "separation" and check["loads"] == 2
        assert check["ok"] is ok, (control_mix, load_mix, check)
    # A load with a NaN (a slot it never wrote) is the worst load, and fails.
    logits[(2048, 100, "L3", "layerwise")] = torch.full_like(recompute, math.nan)
    bench.separation(2048, 100)
    check = bench.report.checks[-1]
    assert not check["ok"] and check["worst_load"] == "L3 layerwise"


def test_deterministic_passes_restore_the_default_kernels() -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    with ttft.deterministic(torch.device("cpu")):
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def _tiny_request(
    paged: PagedKV, num_tokens: int, seed: int
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    ids = torch.randint(0, TINY.vocab, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    blocks = random.Random(seed).sample(range(paged.num_blocks), num_tokens // paged.block_size)
    return ids, blocks, paged.slots(blocks, num_tokens)


def test_prefill_reads_the_prefix_from_the_paged_cache() -> None:
    cpu = torch.device("cpu")
    model = build_model(TINY, cpu)
    paged = PagedKV(TINY, 32, 16, cpu)
    ids, blocks, slots = _tiny_request(paged, 96, seed=1)
    full = prefill(model, paged, ids, slots, 0)
    over_prefix = prefill(model, paged, ids, slots, 64)
    torch.testing.assert_close(over_prefix, full, rtol=0.0, atol=0.04 * float(full.abs().max()))
    # Slots outside the request do not matter; the request's own prefix slots do.
    others = sorted(set(range(paged.num_blocks)) - set(blocks))
    paged.poison(others)
    assert torch.equal(prefill(model, paged, ids, slots, 64), over_prefix)
    paged.poison(blocks[:1])
    assert torch.isnan(prefill(model, paged, ids, slots, 64)).all()


def _hook_recorder(
    paged: PagedKV, new_slots: torch.Tensor
) -> tuple[object, Callable[[int], None], list[tuple[str, int]]]:
    """A load whose ``wait_layer`` and a ``saved`` hook that record their order, each checking
    that layer's new slots: still the poison before the layer runs, K and V after it wrote."""
    events: list[tuple[str, int]] = []

    class RecordingLoad:
        def wait_layer(self, layer: int, stream: object = None) -> None:
            assert torch.isnan(paged.layers[layer][0].view(-1, 2, 32)[new_slots]).all()
            events.append(("wait", layer))

    def saved(layer: int) -> None:
        flat = paged.layers[layer].view(2, -1, TINY.kv_heads, TINY.head_dim)
        assert torch.isfinite(flat[:, new_slots]).all()
        events.append(("saved", layer))

    return RecordingLoad(), saved, events


def test_cache_waits_for_each_layer_before_reading_and_saves_after_writing() -> None:
    cpu = torch.device("cpu")
    model = build_model(TINY, cpu)
    paged = PagedKV(TINY, 32, 16, cpu)
    ids, blocks, slots = _tiny_request(paged, 64, seed=2)
    prefill(model, paged, ids, slots, 0)  # the prefix's KV in place
    load, saved, events = _hook_recorder(paged, slots[32:])
    paged.poison([blocks[2], blocks[3]])  # the blocks of tokens 32..63
    logits = prefill(model, paged, ids, slots, 32, load=load, on_layer_written=saved)
    assert torch.isfinite(logits).all()
    assert events == [("wait", 0), ("saved", 0), ("wait", 1), ("saved", 1)]


@pytest.mark.gpu
def test_graphs_replay_the_eager_prefill_bit_for_bit_with_the_hooks_in_order() -> None:
    cuda = torch.device("cuda")
    model = build_model(TINY, cuda)
    paged = PagedKV(TINY, 32, 16, cuda)
    ids, blocks, slots = _tiny_request(paged, 96, seed=3)
    ids = ids.to(cuda)
    other = torch.randint(0, TINY.vocab, (96,), generator=torch.Generator().manual_seed(4)).to(cuda)
    # Prefix 0 first: it writes the whole prompt's KV, which the other shapes read.
    captured = {}
    for prefix in (0, 64, 95):
        eager = prefill(model, paged, ids, slots, prefix)
        captured[prefix] = graphs = PrefillGraphs(model, paged, slots, 96, prefix)
        assert torch.equal(graphs.run(ids), eager), prefix
    # The graphs read the tokens given to `run`, not those they were captured with.
    assert torch.equal(captured[0].run(other), prefill(model, paged, other, slots, 0))
    assert not torch.equal(captured[0].run(ids), captured[0].run(other))
    with pytest.raises(ValueError, match="captured for 96 tokens"):
        captured[0].run(ids[:64])

    prefill(model, paged, ids, slots, 0)
    expected = prefill(model, paged, ids, slots, 64)
    load, saved, events = _hook_recorder(paged, slots[64:])
    paged.poison(blocks[4:])  # the blocks of tokens 64..95
    logits = captured[64].run(ids, load=load, on_layer_written=saved)
    assert torch.equal(logits, expected)
    assert events == [("wait", 0), ("saved", 0), ("wait", 1), ("saved", 1)]


def test_graphs_are_the_default_on_cuda_and_refused_elsewhere() -> None:
    assert ttft.parse_args([])[0].launch == "graphs"
    assert ttft.parse_args(["--tiny"])[0].launch == "eager"
    assert ttft.parse_args(["--device", "cpu"])[0].launch == "eager"
    assert ttft.parse_args(["--launch", "eager"])[0].launch == "eager"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ttft.tiny_options(launch="graphs")
    with pytest.raises(ValueError, match="'graphs' or 'eager'"):
        ttft.Options(launch="compiled")


def test_the_pause_after_filling_l2_l3_is_an_option() -> None:
    assert ttft.parse_args([])[0].settle_s == 5.0
    assert ttft.parse_args(["--settle-s", "0.5"])[0].settle_s == 0.5
    assert ttft.parse_args(["--tiny"])[0].settle_s == 0.0  # CPU runs time nothing that matters
    with pytest.raises(ValueError, match="settle_s"):
        ttft.Options(settle_s=-1.0)


def test_a_gpu_run_keeps_torch_host_ops_on_one_thread() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        ttft.host_threads_for(torch.device("cpu"))  # the model computes on the host's cores
        assert torch.get_num_threads() == 2
        ttft.host_threads_for(torch.device("cuda"))  # no CUDA call: a device name alone
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_short_cases_take_more_timed_runs_up_to_a_cap() -> None:
    report = ttft.Report(options={}, kv_bytes_per_token=1)
    opts = ttft.Options(reps=5, min_timed_s=1.0, max_reps=21)
    bench = ttft.Bench(opts, report, _NoModel())  # type: ignore[arg-type]

    def runs(seconds: float, reps: int | None = None) -> int:
        times: list[float] = []
        while bench.more_runs(times, reps):
            times.append(seconds)
        return len(times)

    assert runs(0.011) == 21  # 2k layerwise: capped
    assert runs(0.08) == 13  # 32k L1: until 1 s of runs
    assert runs(0.35) == 5  # at least reps
    assert runs(1.4) == 5
    assert runs(0.011, reps=1) == 1  # a cold-L2 case: exactly what its budget allows
    assert ttft.parse_args(["--reps", "30"])[0].max_reps == 30
    assert ttft.parse_args(["--min-timed-s", "0"])[0].min_timed_s == 0.0
    assert ttft.parse_args(["--tiny"])[0].min_timed_s == 0.0
    with pytest.raises(ValueError, match="max_reps"):
        ttft.Options(reps=5, max_reps=4)
    with pytest.raises(ValueError, match="min_timed_s"):
        ttft.Options(min_timed_s=-1.0)


def test_break_even_interpolates_in_log_length() -> None:
    report = ttft.Report(options={}, kv_bytes_per_token=1)
    for tokens, recompute, cold in ((2048, 0.1, 0.2), (8192, 0.4, 0.2)):
        report.cases.append(ttft.Case(tokens, 0, "recompute", "-", recompute, [recompute]))
        for mode in ("whole", "layerwise"):
            report.cases.append(
                ttft.Case(tokens, 100, "L2 cold", mode, cold, [cold], recompute_s=recompute)
            )
        report.cases.append(
            ttft.Case(tokens, 100, "L1", "whole", 0.01, [0.01], recompute_s=recompute)
        )
    found = ttft.break_even(report)
    # TTFT / recompute: 2.0 at 2048, 0.5 at 8192: crosses 1 halfway in log length.
    assert found["L2 cold"].startswith("pays off above about 4096 tokens")
    assert found["L1"].startswith("pays off at every measured length")


def test_fitted_break_even_extrapolates_past_the_measured_lengths() -> None:
    a, b, c, d = 2.7e-5, 4e-10, 0.005, 2.6e-4  # recompute a N + b N^2; a slow load c + d N
    lengths = (2048, 8192, 32768)
    recompute = [(n, a * n + b * n * n) for n in lengths]
    load = [(n, c + d * n) for n in lengths]
    expected = (-(a - d) + math.sqrt((a - d) ** 2 + 4 * b * c)) / (2 * b)
    found = ttft.fitted_break_even(recompute, load)
    assert found is not None and abs(found - expected) <= 1e-6 * expected
    assert 5e5 < found < 7e5  # beyond every measured length
    # A load slower per token than a linear recompute never catches up.
    assert ttft.fitted_break_even([(n, a * n) for n in lengths], load) is None


def test_prefix_attention_is_causal_aligned_to_the_end_without_a_mask() -> None:
    """`prefix_sdpa_attention` (GQA: 4 query heads over 2 KV heads) equals SDPA with the
    explicit end-aligned causal mask for a prefix prefill, plain causal SDPA from scratch, and
    full attention for one token; the top-left mask SDPA's ``is_causal`` would apply is far off."""
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 24, 32, generator=gen, dtype=torch.float64)
    key = torch.randn(1, 2, 80, 32, generator=gen, dtype=torch.float64)
    value = torch.randn(1, 2, 80, 32, generator=gen, dtype=torch.float64)
    module = torch.nn.Module()

    def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
        rows = torch.arange(q.shape[2]).unsqueeze(1) + offset
        allowed = torch.arange(k.shape[2]).unsqueeze(0) <= rows
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=allowed
        )
        return out.transpose(1, 2)

    for q, k, v in (
        (query, key, value),  # 24 new tokens over 56 cached
        (query, key[:, :, :24], value[:, :, :24]),  # from scratch
        (query[:, :, -1:], key, value),  # one token over 79 cached
    ):
        out, weights = prefix_sdpa_attention(module, q, k, v, None)
        assert weights is None and out.shape == (1, q.shape[2], 4, 32)
        offset = k.shape[2] - q.shape[2]
        torch.testing.assert_close(out, reference(q, k, v, offset), rtol=1e-12, atol=1e-12)
    top_left = reference(query, key, value, 0)
    assert not torch.allclose(prefix_sdpa_attention(module, query, key, value, None)[0], top_left)
    with pytest.raises(ValueError, match="builds its own causal mask"):
        prefix_sdpa_attention(module, query, key, value, torch.ones(1))
