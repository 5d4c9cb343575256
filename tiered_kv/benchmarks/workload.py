"""Multi-turn conversation workload against L1 + L2 (+ L3): hit rates, restore rate, TTFT proxy.

Many users share one system prompt; each turn appends a user message to a user's history, the
request (the whole history) is served, and the reply is appended. Requests are served in
concurrent batches, like a scheduler would: ``prefetch`` when the request is scheduled, a lead
time (the scheduler's gap before the model runs), ``retrieve``, then ``store`` of the prompt.

Measured per scenario (prefetch on / off x lead time), on the same request sequence:
- hit rate: prompt tokens restored from the cache / prompt tokens, and chunks per tier;
- tokens restored per second of retrieve (the time the model waits on the cache);
- TTFT proxy: time from prefetch to retrieve complete (mean, p50, p90), and the stall (retrieve
  alone). With prefetch, loads run during the lead time; without, they start in retrieve.

This VM's page cache makes a re-read of a just-written file a memcpy, so the L2 (the real
`DiskTier`) is wrapped in `FaultyTier` with a per-read delay (``--l2-read-delay-ms``) standing in
for a cold NVMe read; the same for L3 (``--l3-url``, ``--l3-read-delay-ms``). The delay models
latency, not bandwidth: reads overlap up to ``prefetch_concurrency`` per tier.

The ceiling, measured in the same run: a host memcpy of 256 MiB (best of five), as tokens of
this KV per second: no restore through host memory can beat it. The best restore rate is printed
as a ratio to it.

Usage: ``tiered-kv bench workload [--quick] [--out DIR] [--l3-url URL] [--no-plot]`` (or
``python bench/workload.py`` in a clone). The table is printed last and written to
``DIR/workload.md``; the plot (needs the ``bench`` extra: matplotlib) to
``DIR/workload_ttft.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import statistics
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.benchmarks import ceilings
from tiered_kv.benchmarks.common import (
    DEFAULT_OUT,
    load_pyplot,
    percentile,
    run_on_engine_loop,
    save_figure,
)
from tiered_kv.benchmarks.progress import Progress
from tiered_kv.config import L2_DURABILITIES, parse_size
from tiered_kv.metrics import EngineStats
from tiered_kv.prefetch import PrefetchCounters
from tiered_kv.tiers.base import LowerTier
from tiered_kv.tiers.l2 import DiskTier
from tiered_kv.tiers.testing import FaultyTier

BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    users: int
    turns: int
    system_tokens: int
    concurrency: int
    seed: int
    user_tokens: tuple[int, int]
    reply_tokens: tuple[int, int]


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    prefetch: bool
    lead_ms: float

    @property
    def label(self) -> str:
        return f"prefetch {'on' if self.prefetch else 'off'}, lead {self.lead_ms:g} ms"


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    scenario: Scenario
    requests: int
    prompt_tokens: int
    restored_tokens: int
    chunks_by_tier: dict[str, int]
    retrieve_seconds: float
    ttft_ms: tuple[float, ...]
    stall_ms: tuple[float, ...]
    late_tokens: int
    stats: EngineStats  # the engine's at the scenario's end
    wall_s: float

    @property
    def prefetch(self) -> PrefetchCounters:
        prefetch = self.stats.prefetch
        return PrefetchCounters() if prefetch is None else prefetch.counters

    @property
    def hit_rate(self) -> float:
        return self.restored_tokens / max(self.prompt_tokens, 1)

    @property
    def restore_rate(self) -> float:
        return self.restored_tokens / self.retrieve_seconds if self.retrieve_seconds else 0.0


def conversation_plan(workload: Workload) -> list[list[list[int]]]:
    """Rounds of concurrent requests (each a prompt), identical for every scenario."""
    rng = random.Random(workload.seed)
    system = [rng.randrange(1, 32000) for _ in range(workload.system_tokens)]
    histories = [list(system) for _ in range(workload.users)]
    rounds: list[list[list[int]]] = []
    for _ in range(workload.turns):
        order = list(range(workload.users))
        rng.shuffle(order)
        for start in range(0, len(order), workload.concurrency):
            batch = []
            for user in order[start : start + workload.concurrency]:
                asked = rng.randint(*workload.user_tokens)
                histories[user] += [rng.randrange(1, 32000) for _ in range(asked)]
                batch.append(list(histories[user]))
                replied = rng.randint(*workload.reply_tokens)
                histories[user] += [rng.randrange(1, 32000) for _ in range(replied)]
            rounds.append(batch)
    return rounds


async def run_scenario(
    args: argparse.Namespace, scenario: Scenario, rounds: list[list[list[int]]]
) -> Result:
    max_tokens = max(len(prompt) for batch in rounds for prompt in batch)
    blocks_per_request = -(-max_tokens // BLOCK_SIZE)
    num_blocks = blocks_per_request * max(len(batch) for batch in rounds)
    shape = (2, num_blocks, BLOCK_SIZE, args.kv_heads, args.head_size)
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(args.layers)]
    # A namespace of its own: an L3 server outlives the scenario and must not serve it the
    # chunks an earlier scenario stored.
    namespace = f"workload-{os.getpid()}-{time.time_ns()}"
    config = EngineConfig(
        namespace=namespace,
        chunk_size=args.chunk_size,
        l1_size=args.l1_size,
        prefetch_policy="wait_complete",
        prefetch_concurrency=args.concurrency_per_tier,
        pin_memory=False,
    )
    with tempfile.TemporaryDirectory(prefix="tkv-workload-", dir=args.dir) as l2_dir:
        tiers: list[LowerTier] = [
            FaultyTier(
                DiskTier(l2_dir, parse_size(args.l2_size), durability=args.l2_durability),
                get_delay_s=args.l2_read_delay_ms / 1000,
                put_delay_s=0.0,
            )
        ]
        if args.l3_url:
            from tiered_kv.tiers.factory import remote_tier

            remote = remote_tier(EngineConfig(l3_url=args.l3_url, namespace=namespace))
            tiers.append(
                FaultyTier(remote, get_delay_s=args.l3_read_delay_ms / 1000, put_delay_s=0.0)
            )
        ttft: list[float] = []
        stall: list[float] = []
        restored = prompt_tokens = late = 0
        retrieve_seconds = 0.0
        started = time.perf_counter()
        async with TieredKVEngine(config, lower_tiers=tiers) as engine:
            engine.register_kv_caches(
                caches,
                model_name="workload",
                layout_hints={"block_size": BLOCK_SIZE, "kv_layout": "NHD"},
            )

            async def serve(prompt: list[int], slot: int) -> None:
                nonlocal restored, prompt_tokens, late, retrieve_seconds
                blocks = list(range(slot * blocks_per_request, (slot + 1) * blocks_per_request))
                t0 = time.perf_counter()
                # As the request arrives (prefetch on), or not at all: retrieve loads then.
                handle = await engine.prefetch(prompt) if scenario.prefetch else None
                if scenario.lead_ms:
                    await asyncio.sleep(scenario.lead_ms / 1000)
                t1 = time.perf_counter()
                result = await engine.retrieve(prompt, blocks, prefetch=handle)
                t2 = time.perf_counter()
                ttft.append((t2 - t0) * 1000)
                stall.append((t2 - t1) * 1000)
                retrieve_seconds += t2 - t1
                restored += result.valid_tokens
                prompt_tokens += len(prompt)
                late += result.recompute_tokens
                await engine.store(prompt, blocks)  # the computed rest joins the cache

            for batch in rounds:
                await asyncio.gather(*(serve(prompt, i) for i, prompt in enumerate(batch)))
            stats = engine.stats()
        wall = time.perf_counter() - started
    chunks = {} if stats.storage is None else {"L1": stats.storage.l1_hits}
    for tier in () if stats.storage is None else stats.storage.tiers:
        chunks[tier.name.upper()] = tier.reads.hits
    return Result(
        scenario,
        sum(len(batch) for batch in rounds),
        prompt_tokens,
        restored,
        chunks,
        retrieve_seconds,
        tuple(ttft),
        tuple(stall),
        late,
        stats,
        wall,
    )


def format_table(results: Sequence[Result]) -> str:
    tiers = sorted({tier for r in results for tier in r.chunks_by_tier})
    head = (
        "| prefetch | lead ms | TTFT proxy mean / p50 / p90 ms | stall mean ms | hit rate | "
        + " | ".join(f"{t} chunks" for t in tiers)
        + " | restored tok/s | in time / after wait / late |"
    )
    rule = "|" + "---|" * (head.count("|") - 1)
    lines = [head, rule]
    for r in results:
        p = r.prefetch
        outcomes = f"{p.ready_in_time} / {p.ready_after_wait} / {p.late}"
        lines.append(
            f"| {'on' if r.scenario.prefetch else 'off'} | {r.scenario.lead_ms:g} | "
            f"{statistics.fmean(r.ttft_ms):.2f} / {percentile(r.ttft_ms, 0.5):.2f} / "
            f"{percentile(r.ttft_ms, 0.9):.2f} | {statistics.fmean(r.stall_ms):.2f} | "
            f"{100 * r.hit_rate:.1f}% | "
            + " | ".join(str(r.chunks_by_tier.get(t, 0)) for t in tiers)
            + f" | {r.restore_rate:,.0f} | {outcomes} |"
        )
    return "\n".join(lines)


def plot(plt: Any, results: Sequence[Result], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for prefetch, style in ((False, "o--"), (True, "s-")):
        points = sorted(
            (r.scenario.lead_ms, statistics.fmean(r.ttft_ms))
            for r in results
            if r.scenario.prefetch is prefetch
        )
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, style, label=f"prefetch {'on' if prefetch else 'off'}")
    leads = sorted({r.scenario.lead_ms for r in results})
    ax.plot(leads, leads, ":", color="grey", label="lead time alone (lower bound)")
    ax.set_xlabel("lead time: prefetch -> retrieve (ms)")
    ax.set_ylabel("TTFT proxy: prefetch -> retrieve complete (ms, mean)")
    ax.set_title(textwrap.fill(title, 95), fontsize=8)
    ax.grid(True, alpha=0.3)
    ax.legend()
    save_figure(plt, fig, path)


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="fewer users, turns and lead times")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where the table and plot go (%(default)s)"
    )
    parser.add_argument("--no-plot", action="store_true", help="the table alone (no matplotlib)")
    parser.add_argument("--dir", help="parent directory of the L2 directories (default: tmp)")
    parser.add_argument("--users", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--concurrency", type=int, default=4, help="requests served together")
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument(
        "--user-tokens", type=int, nargs=2, default=(256, 1024), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--reply-tokens", type=int, nargs=2, default=(128, 512), metavar=("MIN", "MAX")
    )
    parser.add_argument("--lead-ms", type=float, nargs="+")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--l1-size", default=None, help="default: 24MiB quick, 48MiB full")
    parser.add_argument("--l2-size", default="4GiB")
    parser.add_argument(
        "--l2-durability",
        choices=L2_DURABILITIES,
        default="none",
        help="when L2 writes reach the disk itself (%(default)s; the engine's default is batched)",
    )
    parser.add_argument("--l2-read-delay-ms", type=float, default=10.0)
    parser.add_argument("--l3-url", help="also use an L3 remote tier (tkv://, redis://)")
    parser.add_argument("--l3-read-delay-ms", type=float, default=20.0)
    parser.add_argument("--concurrency-per-tier", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    plt = None if args.no_plot else load_pyplot()
    args.users = args.users or (16 if args.quick else 32)
    args.turns = args.turns or (4 if args.quick else 6)
    args.lead_ms = args.lead_ms or ([0, 10, 40] if args.quick else [0, 5, 10, 20, 40, 80])
    args.l1_size = args.l1_size or ("24MiB" if args.quick else "48MiB")
    workload = Workload(
        args.users,
        args.turns,
        args.system_tokens,
        args.concurrency,
        args.seed,
        tuple(args.user_tokens),
        tuple(args.reply_tokens),
    )
    rounds = conversation_plan(workload)
    scenarios = [Scenario(p, lead) for lead in args.lead_ms for p in (False, True)]
    progress = Progress(1 + len(scenarios), "workload", plain_lines=1 + len(scenarios))
    memcpy_gbps = ceilings.copy_gbps()
    progress.advance("ceiling measured")
    results: list[Result] = []
    for scenario in scenarios:
        results.append(run_on_engine_loop(run_scenario(args, scenario, rounds)))
        progress.advance(f"{scenario.label} done")
    progress.close()
    token_bytes = 2 * args.layers * args.kv_heads * args.head_size * 2
    ceiling_tokens = memcpy_gbps * 1e9 / token_bytes
    best = max(results, key=lambda r: r.restore_rate)
    tiers = "L1 + L2" + (" + L3" if args.l3_url else "")
    title = (
        f"{tiers}: {workload.users} users x {workload.turns} turns, system prompt "
        f"{workload.system_tokens} tok, messages {args.user_tokens[0]}-{args.user_tokens[1]} "
        f"+ replies {args.reply_tokens[0]}-{args.reply_tokens[1]} tok, batches of "
        f"{workload.concurrency}, L1 {args.l1_size}, "
        f"L2 read delay {args.l2_read_delay_ms:g} ms"
        + (f", L3 read delay {args.l3_read_delay_ms:g} ms" if args.l3_url else "")
    )
    notes = [
        f"workload: {title}",
        f"requests per scenario: {results[0].requests}, prompt tokens "
        f"{results[0].prompt_tokens}, KV {token_bytes} B/token "
        f"({args.layers} layers x {args.kv_heads} KV heads x {args.head_size}, bf16), chunk "
        f"{args.chunk_size} tokens, reads per tier in flight <= {args.concurrency_per_tier}",
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
        f"torch threads, CPU mover (torch reference), L2 durability {args.l2_durability}",
        f"ceiling (this run): host memcpy {memcpy_gbps:.2f} GB/s = {ceiling_tokens:,.0f} tok/s "
        f"of this KV; best restore rate {best.restore_rate:,.0f} tok/s "
        f"({100 * best.restore_rate / ceiling_tokens:.1f}% of it, {best.scenario.label})",
    ]
    table = format_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    png = args.out / "workload_ttft.png"
    if plt is not None:
        plot(plt, results, png, title)
    (args.out / "workload.md").write_text(
        "\n".join(f"- {n}" for n in notes)
        + "\n\n"
        + table
        + ("\n\n![TTFT proxy vs lead time](workload_ttft.png)\n" if plt is not None else "\n")
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "ceilings": {"memcpy_gbps": memcpy_gbps, "tokens_per_s": ceiling_tokens},
                    "rows": [
                        {
                            "prefetch": r.scenario.prefetch,
                            "lead_ms": r.scenario.lead_ms,
                            "ttft_ms_mean": statistics.fmean(r.ttft_ms),
                            "ttft_ms_p50": percentile(r.ttft_ms, 0.5),
                            "ttft_ms_p90": percentile(r.ttft_ms, 0.9),
                            "stall_ms_mean": statistics.fmean(r.stall_ms),
                            "hit_rate": r.hit_rate,
                            "chunks_by_tier": r.chunks_by_tier,
                            "restored_tokens_per_s": r.restore_rate,
                            "late_tokens": r.late_tokens,
                            "prefetch_outcomes": r.stats.as_dict().get("prefetch", {}),
                            "wall_s": r.wall_s,
                        }
                        for r in results
                    ],
                },
                indent=1,
            )
        )
    for note in notes:
        print(note)
    if plt is not None:
        print(f"plot: {png}")
    print()
    print(table)
    return 0
