"""Soak: concurrent store / lookup / prefetch+cancel / retrieve under L1 and lower-tier eviction.

Two lower tiers, each on its threaded data plane: L2 (a disk directory, its read and write
threads) and L3 (``tiered-kv serve`` on loopback, the client's receiving threads). Every
retrieved row is checked against the prefix it belongs to; at the end, host bytes, prefetch
reservations, tasks, threads and file descriptors are back at their baseline (L3's pooled
connections aside). Runs ``TIERED_KV_SOAK_S`` seconds in all (default 20), half per tier.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import pytest

from tests.faults.model import BLOCK_SIZE, HINTS, PagedModel
from tests.remote_fixtures import tkv_server  # noqa: F401 - the fixture
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.tiers.remote.server import RemoteCacheServer

CHUNK = 64
WORKERS = 6
L3_CONNECTIONS = 4


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("tier", ["L2", "L3"])
@pytest.mark.slow
async def test_soak_under_eviction_serves_only_correct_rows(
    tmp_path: Path,
    tier: str,
    tkv_server: RemoteCacheServer,  # noqa: F811 - the fixture
) -> None:
    seconds = float(os.environ.get("TIERED_KV_SOAK_S", "20")) / 2
    rng = random.Random(11)
    systems = [
        [rng.randrange(1, 30_000) for _ in range(rng.choice((64, 128, 200)))] for _ in range(4)
    ]
    row_bytes = 2 * 2 * 2 * 16 * 4  # layers x K/V x heads x head_size x float32, per token
    lower: dict[str, object] = (
        {
            "l2_path": str(tmp_path / "l2"),
            "l2_size": 160 * (CHUNK * row_bytes + 4096),  # about 160 chunks on disk
            "l2_durability": "none",
        }
        if tier == "L2"
        else {"l3_url": tkv_server.url, "l3_pool_size": L3_CONNECTIONS}
    )
    config = EngineConfig(
        chunk_size=CHUNK,
        l1_size=48 * CHUNK * row_bytes,  # about 48 chunks: evicts all the time
        prefetch_policy="timeout",
        **lower,  # type: ignore[arg-type]
    )
    model = PagedModel(num_blocks=WORKERS * 40)
    counts = dict.fromkeys(
        (
            "requests",
            "lookups",
            "prefetches",
            "cancelled",
            "retrieves",
            "rows_verified",
            "hit_tokens",
            "stores",
            "evictions",
        ),
        0,
    )
    wrong: list[str] = []
    baseline_tasks = baseline_fds = 0

    async def request(engine: TieredKVEngine, worker_rng: random.Random) -> None:
        prompt = list(worker_rng.choice(systems))
        prompt += [worker_rng.randrange(1, 30_000) for _ in range(worker_rng.randrange(1, 300))]
        if worker_rng.random() < 0.3:  # a follow-up turn of an earlier conversation
            prompt = prompt[: worker_rng.randrange(1, len(prompt) + 1)]
        blocks = model.allocate(len(prompt), worker_rng)
        if blocks is None:
            await asyncio.sleep(0.001)
            return
        try:
            counts["requests"] += 1
            await engine.lookup(prompt)
            counts["lookups"] += 1
            if worker_rng.random() < 0.3:
                handle = await engine.prefetch(prompt)
                counts["prefetches"] += 1
                await asyncio.sleep(worker_rng.random() * 0.002)
                if worker_rng.random() < 0.5:
                    handle.close()
                    counts["cancelled"] += 1
                else:
                    await handle
            await asyncio.sleep(worker_rng.random() * 0.002)  # the scheduler's lead time
            skip = 0
            if worker_rng.random() < 0.2:  # the engine's own prefix cache had some blocks
                skip = BLOCK_SIZE * worker_rng.randrange(0, len(prompt) // BLOCK_SIZE + 1)
                model.prefill(prompt[:skip], blocks, 0)
            valid = (await engine.retrieve(prompt, blocks, skip_prefix_tokens=skip)).valid_tokens
            counts["retrieves"] += 1
            counts["hit_tokens"] += valid - skip
            bad = model.wrong_rows(prompt, blocks, valid)
            counts["rows_verified"] += valid
            if bad:
                wrong.append(f"{bad} of {valid} rows wrong (prompt of {len(prompt)}, skip {skip})")
            model.prefill(prompt, blocks, valid)
            await engine.store(prompt, blocks)
            counts["stores"] += 1
            if worker_rng.random() < 0.05:
                counts["evictions"] += 1
                await engine.evict_l1(worker_rng.randrange(1, 64) * CHUNK * row_bytes)
        finally:
            model.release(blocks)

    async def worker(engine: TieredKVEngine, seed: int, deadline: float) -> None:
        worker_rng = random.Random(seed)
        while time.monotonic() < deadline:
            await request(engine, worker_rng)

    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(model.caches, model_name="soak", layout_hints=HINTS)
        baseline_tasks, baseline_fds = len(asyncio.all_tasks()), _open_fds()
        started = time.monotonic()
        deadline = started + seconds
        await asyncio.gather(*(worker(engine, seed, deadline) for seed in range(WORKERS)))
        elapsed = time.monotonic() - started
        assert await engine.flush(timeout=30) == 0
        # Let cancelled loads (their worker threads) and the toucher settle: on a loaded
        # machine that takes longer than one short sleep. Bounded: a real leak still fails.
        for _ in range(100):
            await asyncio.sleep(0.05)
            await engine.evict_l1()
            stats = engine.stats()
            if not stats.arena.used and not stats.prefetch.in_flight:
                break
        tasks, fds = len(asyncio.all_tasks()), _open_fds()
        names = sorted(t.get_name() for t in asyncio.all_tasks())
        plane = engine.io_plane
        plane_workers = 0 if plane is None else plane.stats().workers
    lower_hits = stats.storage.tier(tier).reads.hits
    print(
        f"\nsoak {tier} {elapsed:.1f}s: {counts}; l1 hits {stats.storage.l1_hits}, "
        f"{tier} hits {lower_hits}; tasks {baseline_tasks}->{tasks}, fds {baseline_fds}->{fds}"
    )
    assert not wrong, wrong[:5]
    assert counts["rows_verified"] > 0 and lower_hits > 0, counts
    assert stats.arena.used == 0, "host bytes still referenced"
    assert stats.prefetch.reserved_bytes == 0 and stats.prefetch.in_flight == 0
    assert tasks <= baseline_tasks, f"tasks {baseline_tasks} -> {tasks}: {names}"
    # L3's pooled connections stay open until close: both ends are in this process; so do the
    # server's ends of the I/O workers' own connections (one per worker at most).
    pooled = 2 * L3_CONNECTIONS + plane_workers if tier == "L3" else 0
    assert fds <= baseline_fds + 2 + pooled, f"file descriptors {baseline_fds} -> {fds}"
    assert engine.leaked_on_close == 0
