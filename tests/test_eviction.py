"""Eviction orders (`tiered_kv.eviction`): LRU as tiers always did; Reuse ranks age by reuse
class, the tail of a prompt before its head, and remembers counts across evictions. Through
the engine, a prompt used again outlives one-shot prompts that LRU would keep instead."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiered_kv.benchmarks.trace_sim import TraceRequest, simulate_lru, simulate_order
from tiered_kv.config import EngineConfig
from tiered_kv.engine import TieredKVEngine
from tiered_kv.errors import ConfigError
from tiered_kv.eviction import HISTORY_MIN, LRU, Reuse, make_order


def test_lru_is_least_recently_inserted_or_touched_first() -> None:
    order: LRU[str] = LRU()
    for key in "abc":
        order.insert(key)
    order.touch("a")
    order.use(["c", "b"])  # counts nothing, moves nothing
    assert list(order.victims()) == ["b", "c", "a"]
    order.remove("c")
    assert list(order.victims()) == ["b", "a"] and len(order) == 2 and "c" not in order


def test_a_reused_key_outlives_younger_first_seen_keys() -> None:
    order: Reuse[str] = Reuse()
    order.insert("sys")
    order.use(["sys"])
    order.use(["sys"])  # two requests: reused
    for key in ("x", "y"):
        order.insert(key)
        order.use([key])
    # "sys" is the oldest, but first-seen keys age four times as fast.
    assert next(order.victims()) == "x"
    stats = order.stats()
    assert (stats.keys_reused, stats.keys_first, stats.promotions) == (1, 2, 1)
    # Age enough and it goes too: scaled, not absolute, protection.
    for index in range(20):
        order.insert(f"n{index}")
        order.remove(f"n{index}")
    order.touch("y")
    assert list(order.victims())[:2] == ["x", "sys"]


def test_a_partial_chunk_goes_before_a_full_one_of_its_age() -> None:
    order: Reuse[str] = Reuse()
    order.insert("full")
    order.insert("tail", partial=True)
    order.use(["full", "tail"])
    assert list(order.victims()) == ["tail", "full"]
    assert order.stats().keys_partial == 1


def test_within_a_request_the_tail_goes_before_the_head() -> None:
    for order in (Reuse[int](),):
        for key in range(4):
            order.insert(key)  # inserted head first: the tail is the youngest insert
        order.use([0, 1, 2, 3])
        assert list(order.victims()) == [3, 2, 1, 0]


def test_counts_survive_eviction_and_a_use_before_the_insert() -> None:
    order: Reuse[str] = Reuse()
    order.insert("a")
    order.use(["a"])
    order.remove("a")  # evicted after one use: the history keeps the count
    order.insert("a")
    assert order.stats().returns == 1 and order.stats().keys_first == 1
    order.use(["a"])
    assert order.stats().keys_reused == 1
    # L2's case: the request is reported before its write lands.
    order.use(["b"])
    order.use(["b"])
    order.insert("b")
    assert order.stats().keys_reused == 2


def test_the_history_is_bounded() -> None:
    order: Reuse[int] = Reuse()
    for key in range(HISTORY_MIN + 100):
        order.use([key])
    assert order.stats().history_keys == HISTORY_MIN
    order.insert(0)  # the oldest count was dropped: first seen again
    order.insert(HISTORY_MIN + 99)
    assert order.stats().returns == 1


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="'mru'"):
        make_order("mru")
    with pytest.raises(ConfigError, match="l1_eviction"):
        EngineConfig(l1_eviction="mru")  # type: ignore[arg-type]


def _request(blocks: list[int], tokens: int | None = None) -> TraceRequest:
    return TraceRequest(0.0, tokens or 4 * len(blocks), 0, tuple(blocks))


def test_the_simulation_keeps_a_reused_prefix_through_one_shot_traffic() -> None:
    # A 2-block shared prompt, then a one-shot prompt of 3 blocks, twenty times; 4 blocks.
    requests = []
    for index in range(20):
        requests.append(_request([1, 2]))
        requests.append(_request([100 + 3 * index + b for b in range(3)]))
    # LRU: each one-shot prompt pushes block 1 out (then 2): the shared prompt never hits.
    lru = simulate_lru(requests, 4, block_tokens=4)
    assert lru.hit_tokens == 0
    assert simulate_order(requests, 4, "lru", block_tokens=4).hit_tokens == 0
    # Reuse: the tail (block 2) went first, so the second use is served block 1; from the
    # third use on both blocks are reused and outlive every one-shot block.
    reuse = simulate_order(requests, 4, "reuse", block_tokens=4)
    assert reuse.hit_tokens == 4 + 8 * 18


CHUNK = 16
PAGE = 16


async def _shared_prompt_hits(eviction: str, tmp_path: Path | None) -> tuple[list[int], object]:
    """A shared 2-chunk prompt, then three one-shot prompts of 3 chunks, twelve times, through
    an L1 of 8 chunks (or an L1 of 2 over an L2 of 8): the tokens served to each shared use."""
    caches = [torch.zeros((2, 64, PAGE, 1, 4), dtype=torch.bfloat16)]
    chunk_bytes = CHUNK * 2 * 4 * 2
    fields: dict[str, object] = {
        "chunk_size": CHUNK,
        "l1_size": 8 * chunk_bytes,
        "load_policy": "always",
        "l1_eviction": eviction,
        "io_plane": "threads",
    }
    if tmp_path is not None:
        fields.update(
            l1_size=2 * chunk_bytes,
            l2_path=str(tmp_path / eviction),
            l2_size=8 * (chunk_bytes + 4096),  # each file: a 4 KiB header page and the payload
            l2_eviction=eviction,
            l2_durability="none",
        )
    async with TieredKVEngine(EngineConfig(**fields)) as engine:  # type: ignore[arg-type]
        engine.register_kv_caches(
            caches, model_name="m", layout_hints={"block_size": PAGE, "kv_layout": "NHD"}
        )
        shared = list(range(1, 2 * CHUNK + 1))
        served = []
        for index in range(12):
            one_shots = [
                [10_000 + 1000 * index + 100 * j + t for t in range(3 * CHUNK)] for j in range(3)
            ]
            for tokens in [shared, *one_shots]:
                blocks = list(range(1, len(tokens) // PAGE + 1))
                got = 0
                if await engine.lookup(tokens):
                    got = (await engine.retrieve(tokens, blocks)).valid_tokens
                if tokens is shared:
                    served.append(got)
                await engine.store(tokens, blocks)
                await engine.flush()
        stats = engine.stats()
    return served, stats


@pytest.mark.parametrize("with_l2", [False, True], ids=["l1", "l1+l2"])
async def test_the_engine_keeps_a_reused_prompt_that_lru_lets_go(
    with_l2: bool, tmp_path: Path
) -> None:
    lru, _ = await _shared_prompt_hits("lru", tmp_path if with_l2 else None)
    reuse, stats = await _shared_prompt_hits("reuse", tmp_path if with_l2 else None)
    # LRU: nine one-shot chunks between two uses push the shared prompt out of 8 chunks.
    assert lru == [0] * 12
    # Reuse: from its third use (two requests used it), it outlives the one-shot chunks.
    assert reuse == [0, 0] + [2 * CHUNK] * 10
    tier = stats.l1 if not with_l2 else dict(stats.lower)["L2"]  # type: ignore[attr-defined]
    assert tier.keys_reused == 2 and tier.keys_first == 6


async def test_a_reopened_l2_starts_every_chunk_found_as_first_seen(tmp_path: Path) -> None:
    """Use counts are not on disk: after a restart the order is the files' last use, every
    chunk first-seen with no use counted (conservative), and two uses promote again."""
    await _shared_prompt_hits("reuse", tmp_path)
    chunk_bytes = CHUNK * 2 * 4 * 2
    config = EngineConfig(
        chunk_size=CHUNK,
        l1_size=2 * chunk_bytes,
        l2_path=str(tmp_path / "reuse"),
        l2_size=8 * (chunk_bytes + 4096),
        l2_eviction="reuse",
        load_policy="always",
        io_plane="threads",
    )
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(
            [torch.zeros((2, 64, PAGE, 1, 4), dtype=torch.bfloat16)],
            model_name="m",
            layout_hints={"block_size": PAGE, "kv_layout": "NHD"},
        )
        disk = dict(engine.stats().lower)["L2"]  # type: ignore[attr-defined]
        assert (disk.entries, disk.keys_reused, disk.keys_first, disk.history_keys) == (8, 0, 8, 0)
        shared = list(range(1, 2 * CHUNK + 1))
        assert await engine.lookup(shared) == 2 * CHUNK  # the last use survived the restart
        await engine.retrieve(shared, [1, 2])
        await engine.store(shared, [1, 2])
        assert dict(engine.stats().lower)["L2"].keys_first == 8  # type: ignore[attr-defined]
        await engine.store(shared, [1, 2])  # a second request since the restart
        assert dict(engine.stats().lower)["L2"].keys_reused == 2  # type: ignore[attr-defined]
