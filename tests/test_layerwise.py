"""Layerwise retrieve and store through the engine on CPU caches (the torch reference mover).

Retrieve: the same bytes as a whole retrieve (poisoned destinations, every format), copies
ordered layer by layer across chunks, a layer's wait holding until that layer is copied, and
late or failed chunks reported before any layer is released. Store: chunks invisible until
commit, nothing stored on abort, a missing layer or a close, every byte given back.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from tests.kvfactory import FORMATS, expect_copy, make_caches, poison_blocks
from tiered_kv import EngineConfig, EngineStateError, LayoutError, TieredKVEngine
from tiered_kv.gpu.base import ChunkTransfer, LayerLoad
from tiered_kv.gpu.reference import TorchMover
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import KVCacheLayout
from tiered_kv.memory import MemoryObj
from tiered_kv.tiers.testing import MemoryTier

CHUNK = 32
BLOCK = 16


def _tokens(n: int, seed: int = 3) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=gen).tolist()


def _config(tmp_path: Path | None = None, **kw: object) -> EngineConfig:
    l2 = {} if tmp_path is None else {"l2_path": str(tmp_path / "l2"), "l2_durability": "none"}
    return EngineConfig(chunk_size=CHUNK, l1_size="16MiB", **l2, **kw)  # type: ignore[arg-type]


class GatedMover(TorchMover):
    """Records the order of layer copies; a layerwise load stops before ``gated_layer`` until
    the test opens ``gate``."""

    def __init__(self, gated_layer: int | None = None) -> None:
        super().__init__()
        self.gated_layer = gated_layer
        self.gate = threading.Event()
        self.order: list[tuple[int, int]] = []  # (layer, token_start)

    def scatter_layer(
        self,
        layout: KVCacheLayout,
        block_ids: torch.Tensor,
        transfers: Sequence[ChunkTransfer],
        layer: int,
    ) -> None:
        if layer == self.gated_layer:
            assert self.gate.wait(10), "the test never opened the gate"
        for transfer in transfers:
            self.order.append((layer, transfer.token_start))
        super().scatter_layer(layout, block_ids, transfers, layer)


class FailingKeysTier(MemoryTier):
    """A memory tier whose reads of ``fail_keys`` fail (as a corrupt or vanished chunk)."""

    def __init__(self) -> None:
        super().__init__("L3")
        self.fail_keys: set[ChunkKey] = set()

    async def get_into(self, key: ChunkKey, obj: MemoryObj) -> bool:
        if key in self.fail_keys:
            return False
        return await super().get_into(key, obj)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("num_tokens", [96, 104])
async def test_layerwise_retrieve_writes_what_a_whole_retrieve_writes(
    tmp_path: Path, fmt: str, num_tokens: int
) -> None:
    blocks = math.ceil(num_tokens / BLOCK)
    caches = make_caches(fmt, torch.bfloat16, num_layers=3, num_blocks=2 * blocks + 2, seed=5)
    src = list(range(1, 1 + blocks))
    dst = [2 * blocks + 1 - i for i in range(blocks)]
    tokens = _tokens(num_tokens)
    async with TieredKVEngine(_config(tmp_path)) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(tokens, src) == num_tokens
        await engine.flush(timeout=30)
        reference = caches.snapshot()
        for skip, evict in ((0, False), (16, True), (48, False)):
            if evict:  # loads from L2 first: the prefetch is waited for before any layer
                assert await engine.evict_l1() > 0
            poison_blocks(caches, dst)
            expected = caches.snapshot()
            load = await engine.retrieve_layerwise(tokens, dst, skip_prefix_tokens=skip)
            assert load.num_layers == 3
            assert load.result.valid_tokens == num_tokens
            assert load.result.stop_reason == "complete"
            for layer in range(3):
                load.wait_layer(layer)
            await load.wait()
            assert load.done()
            expect_copy(caches, expected, reference, src, dst, range(skip, num_tokens), BLOCK)
            assert caches.bytes_equal(expected), f"skip={skip}"
        stats = engine.stats().engine
        assert stats.retrieve_layerwise_calls == 3
    assert engine.leaked_on_close == 0


async def test_copies_go_layer_by_layer_and_a_layer_wait_holds_until_it_is_copied() -> None:
    caches = make_caches("vllm_nhd", torch.float16, num_layers=4, num_blocks=16, seed=2)
    tokens = _tokens(80)
    src, dst = [0, 1, 2, 3, 4], [9, 10, 11, 12, 13]
    mover = GatedMover(gated_layer=2)
    async with TieredKVEngine(_config(), mover=mover) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(tokens, src) == 80
        reference = caches.snapshot()
        poison_blocks(caches, dst)
        poisoned = caches.snapshot()
        load = await engine.retrieve_layerwise(tokens, dst)
        assert load.result.valid_tokens == 80  # decided before any layer is ready
        load.wait_layer(0)
        load.wait_layer(1)
        # Layers 0 and 1 are in place; the gated layer 2 and layer 3 are still poison.
        for layer, ready in ((0, True), (1, True), (2, False), (3, False)):
            for t in range(80):
                got = caches.token_row(layer, 0, dst[t // BLOCK], t % BLOCK)
                want = caches.row(
                    reference[layer][0] if ready else poisoned[layer][0],
                    0,
                    (src if ready else dst)[t // BLOCK],
                    t % BLOCK,
                )
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layer, t)
        assert not load.done()
        loop = asyncio.get_running_loop()
        waiters = {layer: loop.run_in_executor(None, load.wait_layer, layer) for layer in (2, 3)}
        await asyncio.sleep(0.05)
        assert not any(w.done() for w in waiters.values())  # both wait for the gated copy
        mover.gate.set()
        await waiters[2]
        for t in range(80):  # layer 2 is whole once its wait returns
            got = caches.token_row(2, 1, dst[t // BLOCK], t % BLOCK)
            want = caches.row(reference[2][0], 1, src[t // BLOCK], t % BLOCK)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), t
        await waiters[3]
        await load.wait()
        expected = [[t.clone() for t in layer] for layer in poisoned]
        expect_copy(caches, expected, reference, src, dst, range(80), BLOCK)
        assert caches.bytes_equal(expected)
        chunks = [0, 32, 64]
        assert mover.order == [(layer, start) for layer in range(4) for start in chunks]


async def test_a_failed_chunk_is_reported_before_any_layer_and_nothing_past_it_is_written(
    tmp_path: Path,
) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_layers=2, num_blocks=16, seed=4)
    tokens = _tokens(96)
    src, dst = list(range(0, 6)), list(range(8, 14))
    faulty = FailingKeysTier()
    async with TieredKVEngine(_config(), lower_tiers=[faulty]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(tokens, src) == 96
        await engine.flush(timeout=30)
        assert await engine.evict_l1() > 0
        keys = engine.chunk_keys(tokens)
        faulty.fail_keys = {keys[1]}  # the second chunk's load fails
        reference = caches.snapshot()
        poison_blocks(caches, dst)
        expected = caches.snapshot()
        load = await engine.retrieve_layerwise(tokens, dst)
        assert load.result.stop_reason == "failed"
        assert load.result.failed_chunks == (1,)
        assert load.result.valid_tokens == 32
        assert load.result.recompute_tokens == 64
        load.wait_all()
        await load.wait()
        expect_copy(caches, expected, reference, src, dst, range(32), BLOCK)
        assert caches.bytes_equal(expected)  # chunks 1 and 2 stayed poisoned


async def test_best_effort_delivers_only_what_is_in_l1_and_says_what_is_late(
    tmp_path: Path,
) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_layers=2, num_blocks=16, seed=6)
    tokens = _tokens(96)
    async with TieredKVEngine(_config(tmp_path)) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(tokens, list(range(6))) == 96
        await engine.flush(timeout=30)
        assert await engine.evict_l1() > 0
        assert await engine.store(tokens[:32], [0, 1]) == 0  # chunk 0 is in L2: not re-stored
        load = await engine.retrieve_layerwise(tokens, list(range(8, 14)), policy="best_effort")
        assert load.result.stop_reason == "late"
        assert load.result.valid_tokens == 0
        assert load.result.late_chunks == (0, 1, 2)
        await load.wait()


async def test_layerwise_store_is_invisible_until_commit_and_round_trips() -> None:
    caches = make_caches("vllm_hnd_view", torch.float16, num_layers=3, num_blocks=16, seed=8)
    tokens = _tokens(72)
    src, dst = [3, 4, 5, 6, 7], [10, 11, 12, 13, 14]
    async with TieredKVEngine(_config()) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        saver = await engine.store_layerwise(tokens, src)
        assert saver.new_tokens == 72 and saver.num_layers == 3
        for layer in (2, 0):
            saver.save_layer(layer)
        assert await engine.lookup(tokens) == 0  # nothing visible before commit
        with pytest.raises(EngineStateError, match="already saved"):
            saver.save_layer(0)
        with pytest.raises(LayoutError, match="out of range"):
            saver.save_layer(3)
        # From another thread, as a model thread calls it.
        await asyncio.get_running_loop().run_in_executor(None, saver.save_layer, 1)
        assert await saver.commit() == 72
        assert await engine.lookup(tokens) == 72
        with pytest.raises(EngineStateError, match="committed or aborted"):
            saver.save_layer(1)
        reference = caches.snapshot()
        poison_blocks(caches, dst)
        expected = caches.snapshot()
        assert (await engine.retrieve(tokens, dst)).valid_tokens == 72
        expect_copy(caches, expected, reference, src, dst, range(72), BLOCK)
        assert caches.bytes_equal(expected)
        again = await engine.store_layerwise(tokens, src)
        assert again.new_tokens == 0
        assert await again.commit() == 0  # nothing new: no layer needs saving
        stats = engine.stats().engine
        assert stats.store_layerwise_calls == 2 and stats.stored_tokens == 72
    assert engine.leaked_on_close == 0


async def test_a_store_with_a_missing_layer_or_aborted_or_open_at_close_stores_nothing() -> None:
    caches = make_caches("mla", torch.bfloat16, num_layers=2, num_blocks=16, seed=9)
    tokens = _tokens(64)
    async with TieredKVEngine(_config()) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        baseline = engine.stats().arena.used
        saver = await engine.store_layerwise(tokens, [0, 1, 2, 3])
        saver.save_layer(0)
        with pytest.raises(EngineStateError, match=r"layers \[1\] were never saved"):
            await saver.commit()
        assert await engine.lookup(tokens) == 0
        assert engine.stats().arena.used == baseline
        aborted = await engine.store_layerwise(tokens, [0, 1, 2, 3])
        aborted.save_layer(0)
        aborted.save_layer(1)
        await aborted.abort()
        await aborted.abort()  # idempotent
        assert await engine.lookup(tokens) == 0
        assert engine.stats().arena.used == baseline
        left_open = await engine.store_layerwise(tokens, [0, 1, 2, 3])
        left_open.save_layer(1)
    assert engine.leaked_on_close == 0  # the open store was aborted at close
    with pytest.raises(EngineStateError):
        await left_open.commit()


def test_the_blocking_facade_loads_and_stores_layerwise() -> None:
    from tiered_kv import SyncTieredKVEngine

    caches = make_caches("vllm_nhd", torch.bfloat16, num_layers=2, num_blocks=16, seed=11)
    tokens = _tokens(64)
    src, dst = [0, 1, 2, 3], [8, 9, 10, 11]
    with SyncTieredKVEngine(_config()) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        saver = engine.store_layerwise(tokens, src)
        assert saver.new_tokens == 64
        for layer in range(saver.num_layers):
            saver.save_layer(layer)  # this thread is not the engine's loop thread
        assert saver.commit() == 64
        reference = caches.snapshot()
        poison_blocks(caches, dst)
        expected = caches.snapshot()
        load = engine.retrieve_layerwise(tokens, dst)
        assert load.result.valid_tokens == 64
        load.wait_all()
        load.wait()
        assert load.done()
        expect_copy(caches, expected, reference, src, dst, range(64), BLOCK)
        assert caches.bytes_equal(expected)


def test_the_engines_default_mover_forwards_every_mover_verb() -> None:
    """`DeviceMover` picks a mover per layout: a verb it inherits from `KVMover` instead of
    forwarding bypasses the chosen mover (its layerwise stores became one gather call per
    layer, each with its own block table upload and completion, instead of one call)."""
    from tiered_kv.gpu.base import KVMover
    from tiered_kv.gpu.dispatch import DeviceMover

    verbs = [name for name, value in vars(KVMover).items() if callable(value) and name[0] != "_"]
    assert {"gather", "scatter", "scatter_layerwise", "begin_gather"} <= set(verbs)
    inherited = [name for name in verbs if name not in vars(DeviceMover)]
    assert not inherited, f"DeviceMover inherits {inherited} instead of forwarding"


class RecordingMover(TorchMover):
    """Counts whole scatters and layer-major ones, and the chunks each moved."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    async def scatter(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        self.calls.append(("whole", len(transfers)))
        await super().scatter(layout, block_ids, transfers)

    async def scatter_layerwise(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> LayerLoad:
        self.calls.append(("layerwise", len(transfers)))
        return await super().scatter_layerwise(layout, block_ids, transfers)


async def test_a_layerwise_retrieve_of_loading_chunks_copies_each_batch_as_it_arrives(
    tmp_path: Path,
) -> None:
    """Chunks still loading from L2 are scattered in batches while later ones arrive (reads
    and copies overlap); a prefix all in L1 stays one layer-major copy. Both bit for bit."""
    num_tokens = CHUNK * 8
    blocks = num_tokens // BLOCK
    caches = make_caches("vllm_nhd", torch.bfloat16, num_layers=3, num_blocks=2 * blocks + 2)
    src = list(range(1, 1 + blocks))
    dst = [2 * blocks + 1 - i for i in range(blocks)]
    tokens = _tokens(num_tokens)
    mover = RecordingMover()
    config = _config(tmp_path, retrieve_batch_chunks=3)
    async with TieredKVEngine(config, mover=mover) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(tokens, src) == num_tokens
        await engine.flush(timeout=30)
        reference = caches.snapshot()
        for evict in (True, False):
            if evict:
                assert await engine.evict_l1() > 0
            mover.calls.clear()
            poison_blocks(caches, dst)
            expected = caches.snapshot()
            load = await engine.retrieve_layerwise(tokens, dst)
            assert load.result.valid_tokens == num_tokens
            for layer in range(3):
                load.wait_layer(layer)
            await load.wait()
            expect_copy(caches, expected, reference, src, dst, range(num_tokens), BLOCK)
            assert caches.bytes_equal(expected), f"evict={evict}"
            if evict:
                assert {kind for kind, _ in mover.calls} == {"whole"}
                assert sum(n for _, n in mover.calls) == 8
                assert all(n <= 3 for _, n in mover.calls) and len(mover.calls) >= 3
            else:
                assert mover.calls == [("layerwise", 8)]
