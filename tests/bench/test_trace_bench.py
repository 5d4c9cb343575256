"""`tiered-kv bench trace` on a hand-worked trace (CPU): the simulations' figures as worked out
below, the engine's LRU equal to the LRU simulation with L1 alone, hits and bytes split by tier
consistently, the option errors, ``--time-scale``'s delays (a fake clock) and a sweep's figures
the same in parallel as in series.

The trace (blocks of 512 tokens; r3's last block holds 76 tokens; 4,684 prompt tokens):
    r0 t=0 s    [1, 2]      1024 tokens
    r1 t=1 s    [3]          512
    r2 t=1 s    [1, 2]      1024
    r3 t=3.5 s  [1, 2, 4]   1100
    r4 t=4 s    [3, 5]      1024
Capacity 2. LRU: r1's 3 pushes 1 out, so r2 misses (no leading block) and brings back 1 and 2,
pushing 3 out; r3 is served 1 and 2 (1024), then 4 pushes 1 out; r4 misses 3: 1024 in all.
Optimum: at r1, 3 (next used at r4) stays out, 1 and 2 being used sooner (r2); r2 and r3 are
served 1024 each; 4 and 5 are never used again and stay out: 2048. Gap closed by LRU: 0%.
Capacity 3. LRU: 1, 2, 3 all fit until r3's 4 pushes out 3 (the least recent); r2 and r3 are
served 1024 each, r4 misses: 2048. Optimum: 4 stays out (never used again), so 3 is still
held at r4, served 512 more: 2560.
Capacity 8 (L1 2 over L2 8: the tiers hold the larger together, the hierarchy being
inclusive): everything fits; both serve every repeated prefix: r2 1024, r3 1024,
r4 512: 2560 (optimum = LRU: no gap to close). In the engine r2's block 1 and r4's block 3 are
not in L1 (each pushed out of its two blocks) and come from L2; r3's blocks are in L1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tiered_kv.benchmarks import trace_replay
from tiered_kv.benchmarks.trace import main
from tiered_kv.benchmarks.trace_replay import paged_cache_shape, replay
from tiered_kv.benchmarks.trace_sim import load_trace

TRACE = [
    {"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2]},
    {"timestamp": 1000, "input_length": 512, "hash_ids": [3]},
    {"timestamp": 1000, "input_length": 1024, "hash_ids": [1, 2]},
    {"timestamp": 3500, "input_length": 1100, "hash_ids": [1, 2, 4]},
    {"timestamp": 4000, "input_length": 1024, "hash_ids": [3, 5]},
]
PROMPT_TOKENS = 4684
# capacity -> (LRU, optimum) tokens served, as worked out in the module docstring
HAND = {2: (1024, 2048), 3: (2048, 2560), 8: (2560, 2560)}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in TRACE))
    return path


def _run(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "figures.json"
    assert main([*argv, "--json", str(out), "--no-plot"], prog="tiered-kv bench trace") == 0
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def _check_row(row: dict[str, Any], kv_bytes_per_token: int) -> None:
    """The simulations' hand figures; per policy, hits split by tier and bytes consistent."""
    assert row["prompt_tokens"] == PROMPT_TOKENS
    lru, optimum = HAND[row["capacity"]]
    assert (row["lru_sim"]["hit_tokens"], row["optimum_sim"]["hit_tokens"]) == (lru, optimum)
    for ours in row["engine"].values():
        assert ours["prompt_tokens"] == PROMPT_TOKENS
        assert ours["l1_hit_tokens"] + ours["l2_hit_tokens"] == ours["hit_tokens"]
        assert ours["l1_bytes_delivered"] == ours["l1_hit_tokens"] * kv_bytes_per_token
        assert ours["l2_bytes_read"] == ours["l2_hit_tokens"] * kv_bytes_per_token
        assert ours["share"] == ours["hit_tokens"] / PROMPT_TOKENS


def test_l1_alone_the_engine_lru_is_the_lru_simulation(trace: Path, tmp_path: Path) -> None:
    figures = _run(tmp_path, str(trace), "--l1-blocks", "2", "--policies", "lru")
    assert figures["arguments"]["l1_blocks"] == 2 and figures["requests"] == len(TRACE)
    (row,) = figures["rows"]
    _check_row(row, 16)
    ours = row["engine"]["lru"]
    assert ours["hit_tokens"] == row["lru_sim"]["hit_tokens"] == 1024
    assert (ours["l1_hit_tokens"], ours["l2_hit_tokens"], ours["l1_chunks"]) == (1024, 0, 2)
    assert ours["l2_bytes_written"] == ours["l2_writes"] == 0
    assert row["engine"]["lru"]["gap_closed_pct"] == 0.0


def test_with_l2_the_tiers_split_the_hits(trace: Path, tmp_path: Path) -> None:
    """L2 holds everything: every repeated prefix is served; 6 bytes a token (float8 K, V)."""
    figures = _run(
        tmp_path,
        *(str(trace), "--l1-blocks", "2", "--l2-blocks", "8", "--policies", "lru"),
        *("--kv-bytes-per-token", "6"),
    )
    assert figures["paged_cache"] == {"dtype": "float8_e4m3fn", "heads": 1, "head_size": 3}
    (row,) = figures["rows"]
    _check_row(row, 6)
    ours = row["engine"]["lru"]
    assert ours["hit_tokens"] == row["lru_sim"]["hit_tokens"] == 2560
    assert row["engine"]["lru"]["gap_closed_pct"] is None  # optimum = LRU here
    # From L2 at least r2's block 1 and r4's block 3; from L1 at least r3's 1 and 2.
    assert ours["l2_hit_tokens"] >= 1024 and ours["l1_hit_tokens"] >= 1024
    assert ours["l2_chunks"] == ours["l2_hit_tokens"] // 512
    # Each distinct chunk written once (blocks 1, 2, 3, 5 and r3's 76-token 4), none dropped.
    assert (ours["l2_writes"], ours["l2_writes_dropped"]) == (5, 0)
    assert ours["l2_bytes_written"] == (4 * 512 + 76) * 6


def test_smaller_chunks_serve_the_same_blocks(trace: Path, tmp_path: Path) -> None:
    figures = _run(tmp_path, str(trace), "--l1-blocks", "3", "--policies", "lru")
    chunked = _run(
        tmp_path, str(trace), "--l1-blocks", "3", "--policies", "lru", "--chunk-tokens", "128"
    )
    (row,), (chunked_row,) = figures["rows"], chunked["rows"]
    _check_row(chunked_row, 16)
    assert chunked_row["engine"]["lru"]["hit_tokens"] == row["engine"]["lru"]["hit_tokens"]
    assert chunked_row["engine"]["lru"]["l1_chunks"] == 4 * row["engine"]["lru"]["l1_chunks"]


def test_a_sweep_in_parallel_gives_the_figures_of_one_in_series(
    trace: Path, tmp_path: Path
) -> None:
    argv = (str(trace), "--sweep", "2,3", "--policies", "lru,reuse")
    series = _run(tmp_path, *argv, "--jobs", "1")
    parallel = _run(tmp_path, *argv, "--jobs", "2")
    assert [row["capacity"] for row in series["rows"]] == [2, 3]
    for row in series["rows"]:
        _check_row(row, 16)
        assert row["engine"]["lru"]["hit_tokens"] == row["lru_sim"]["hit_tokens"]
    assert parallel["rows"] == series["rows"]


def test_option_errors_name_the_bad_values(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--chunk-tokens", "300"], "chunk_tokens=300 must divide block_tokens=512"),
        (["--kv-bytes-per-token", "7"], "kv_bytes_per_token must be an even int >= 4"),
        (["--kv-bytes-per-token", "2"], "got 2"),
        (["--policies", "lru,mru"], "expected eviction policies from lru, reuse"),
        (["--l2"], "--l2 sizes a sweep"),
        (["--sweep", "1,2", "--l2"], "sizes must be >= 4"),
    ):
        with pytest.raises(SystemExit) as exited:
            main([str(trace), *argv, "--no-plot"], prog="tiered-kv bench trace")
        assert exited.value.code == 2
        assert message in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        main(["no-such-trace", "--no-plot"], prog="tiered-kv bench trace")
    assert "'no-such-trace' is no file and no generated trace" in capsys.readouterr().err


async def test_replay_refuses_what_it_cannot_make(trace: Path) -> None:
    requests = load_trace(trace)
    with pytest.raises(ValueError, match="chunk_tokens=100 must divide block_tokens=512"):
        await replay(requests, l1_blocks=2, chunk_tokens=100)
    with pytest.raises(ValueError, match=r"even int >= 4 .*, got 5"):
        await replay(requests, l1_blocks=2, kv_bytes_per_token=5)
    assert paged_cache_shape(16).nbytes_per_token == 16
    assert paged_cache_shape(6).nbytes_per_token == 6
    big = paged_cache_shape(2 * 2 * 8 * 128 * 32)  # 32 layers' worth of 8 heads of 128, bf16
    assert (big.dtype, big.heads, big.head_size) == (torch.bfloat16, 128, 256)  # head size <= 256


class FakeClock:
    """Time that moves only when the replay sleeps."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay


def test_time_scale_spaces_requests_by_their_arrival(
    trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(trace_replay, "_monotonic", clock.monotonic)
    monkeypatch.setattr(trace_replay, "_sleep", clock.sleep)
    scaled = _run(
        tmp_path, str(trace), "--l1-blocks", "2", "--policies", "lru", "--time-scale", "0.5"
    )
    # Arrivals 0, 1, 1, 3.5, 4 s at half speed: 0.5 s, none (same time), 1.25 s, 0.25 s.
    assert clock.sleeps == pytest.approx([0.5, 1.25, 0.25])
    assert clock.now == pytest.approx(102.0)
    clock.sleeps.clear()
    back_to_back = _run(tmp_path, str(trace), "--l1-blocks", "2", "--policies", "lru")
    assert clock.sleeps == []
    assert scaled["rows"] == back_to_back["rows"]  # pacing alone changes no figure here


def test_the_plot_is_written(trace: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot" / "trace.png"
    argv = [str(trace), "--sweep", "2,3", "--policies", "lru", "--jobs", "1", "--png", str(png)]
    assert main(argv, prog="tiered-kv bench trace") == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
