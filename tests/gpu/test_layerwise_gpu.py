"""Layerwise loads and stores on the GPU, against the torch reference, bit for bit (GPU only).

Loads: `CudaMover.scatter_layerwise` on every path writes exactly what the reference writes,
for every format and a model of three interleaved groups; a layer whose copy is held back (a
sleep queued before it on the load stream) is not visible to a stream that waits for it until
it lands, while earlier layers are released before it. Stores: a layer's copy-out waits for the
producer's queued write. Engine: layerwise retrieve equals whole retrieve through the default
mover, and a layerwise store round-trips.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import torch

from tests.kvfactory import FORMATS, expect_copy, make_caches, poison_blocks
from tiered_kv import EngineConfig, TieredKVEngine, TieredKVError
from tiered_kv.gpu import layerwise
from tiered_kv.gpu.base import ChunkTransfer, KVMover
from tiered_kv.gpu.events import CudaLayerLoad
from tiered_kv.gpu.mover import PATHS, CudaMover, MoverOptions
from tiered_kv.gpu.reference import TorchMover
from tiered_kv.gpu.staging import Job
from tiered_kv.layout import KVCacheLayout, build_layout
from tiered_kv.memory import HostArena, MemoryObj

pytestmark = pytest.mark.gpu

CHUNK = 32
BLOCK = 16
SLEEP_CYCLES = 400_000_000  # about 0.2 s at Hopper clocks (measured 0.20 s on an H100)
SLEEP_MS = 150  # the least that sleep takes on any clock up to 2.6 GHz


def _layout(entries: Any, hints: Any) -> KVCacheLayout:
    return build_layout(entries, chunk_size=CHUNK, layout_hints=hints)


def _objects(arena: HostArena, layout: KVCacheLayout, num_tokens: int) -> list[MemoryObj]:
    objs = []
    for start in range(0, num_tokens, CHUNK):
        obj = arena.allocate_obj(layout.layout_desc, min(CHUNK, num_tokens - start))
        assert obj is not None
        objs.append(obj)
    return objs


def _transfers(objs: Sequence[MemoryObj], skip: int) -> list[ChunkTransfer]:
    return [
        ChunkTransfer(obj, i * CHUNK, min(obj.num_tokens, max(0, skip - i * CHUNK)))
        for i, obj in enumerate(objs)
    ]


def _queued(load: CudaLayerLoad) -> list[bool]:
    """Per layer, whether its copies are queued."""
    return [load.has_event(layer) for layer in range(load.num_layers)]


@pytest.fixture
async def movers() -> Any:
    out: dict[str, KVMover] = {path: CudaMover(MoverOptions(path=path)) for path in PATHS}
    out["torch"] = TorchMover()
    yield out
    for mover in out.values():
        await mover.aclose()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("skip", [0, 21])
async def test_layerwise_scatter_matches_the_reference(
    movers: dict[str, KVMover], path: str, fmt: str, skip: int
) -> None:
    num_tokens = 100
    ours = make_caches(fmt, torch.bfloat16, num_layers=3, num_blocks=24, seed=3, device="cuda")
    theirs = make_caches(fmt, torch.bfloat16, num_layers=3, num_blocks=24, seed=3, device="cuda")
    lo, lt = _layout(ours.entries, ours.hints), _layout(theirs.entries, theirs.hints)
    arena = HostArena(16 << 20, pin=True)
    try:
        src = list(range(0, 7))
        dst = [23, 9, 17, 12, 8, 20, 15]
        a, b = _objects(arena, lo, num_tokens), _objects(arena, lt, num_tokens)
        await movers["torch"].gather(lo, src, _transfers(a, 0))
        await movers["torch"].gather(lt, src, _transfers(b, 0))
        poison_blocks(ours, dst)
        poison_blocks(theirs, dst)
        load = await movers[path].scatter_layerwise(lo, dst, _transfers(a, skip))
        await load.enqueued()  # wait_layer on the loop's own thread: after the enqueue
        load.wait_all()
        await movers["torch"].scatter(lt, dst, _transfers(b, skip))
        torch.cuda.synchronize()
        await load.wait()
        assert load.done()
        assert ours.bytes_equal(theirs.snapshot())
        for obj in (*a, *b):
            assert obj.refcount == 1  # the mover gave its references back
            obj.unref()
    finally:
        leaked = arena.close()
    assert leaked == 0


@pytest.mark.parametrize("path", PATHS)
async def test_layerwise_scatter_of_interleaved_groups(
    movers: dict[str, KVMover], path: str
) -> None:
    def caches(seed: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)

        def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen)
            return raw.to(torch.uint8).cuda().view(dtype)

        return [
            rand((2, 10, BLOCK, 4, 64), torch.bfloat16),
            rand((10, BLOCK, 132), torch.int8),
            rand((2, 10, BLOCK, 4, 64), torch.bfloat16),
            rand((10, BLOCK, 72), torch.float16),
        ]

    hints = {"block_size": BLOCK, "kv_layout": "NHD"}
    ours, theirs = caches(7), caches(7)
    lo, lt = _layout(ours, hints), _layout(theirs, hints)
    assert len(lo.groups) == 3
    arena = HostArena(16 << 20, pin=True)
    try:
        a, b = _objects(arena, lo, 70), _objects(arena, lt, 70)
        await movers["torch"].gather(lo, [3, 7, 1, 9, 0], _transfers(a, 0))
        await movers["torch"].gather(lt, [3, 7, 1, 9, 0], _transfers(b, 0))
        dst = [8, 2, 6, 4, 5]
        for tensors in (ours, theirs):
            for t in tensors:
                if t.dim() == 5:
                    t.view(torch.uint8)[:, dst] = 0xA5
                else:
                    t.view(torch.uint8)[dst] = 0xA5
        load = await movers[path].scatter_layerwise(lo, dst, _transfers(a, 19))
        await movers["torch"].scatter(lt, dst, _transfers(b, 19))
        await load.enqueued()
        load.wait_all()
        torch.cuda.synchronize()
        await load.wait()
        for x, y in zip(ours, theirs, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for obj in (*a, *b):
            obj.unref()
    finally:
        leaked = arena.close()
    assert leaked == 0


@contextlib.asynccontextmanager
async def _one_layer_per_fill(
    mover: CudaMover, seed: int, num_layers: int = 4
) -> AsyncIterator[Any]:
    """``num_layers`` layers of three stored chunks (blocks 0-5) and the mover, whose staging
    slots the test sizes (6 KiB: one layer's worth, 3 chunks x 2 KiB, one fill per layer);
    yields (caches, layout, objs, src, dst, reference) with ``dst`` poisoned; checks that
    nothing leaked."""
    caches = make_caches(
        "vllm_nhd", torch.bfloat16, num_layers=num_layers, num_blocks=16, seed=seed, device="cuda"
    )
    layout = _layout(caches.entries, caches.hints)
    arena = HostArena(16 << 20, pin=True)
    try:
        src, dst = [0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13]
        objs = _objects(arena, layout, 96)
        await mover.gather(layout, src, _transfers(objs, 0))
        reference = caches.snapshot()
        poison_blocks(caches, dst)
        yield caches, layout, objs, src, dst, reference
        for obj in objs:
            obj.unref()
    finally:
        await mover.aclose()
        leaked = arena.close()
    assert leaked == 0


async def _landed_whole(
    load: Any, caches: Any, expected: Any, reference: Any, src: list[int], dst: list[int]
) -> None:
    """Once every copy of ``load`` has landed (the device synchronized after its completion):
    the blocks ``dst`` hold what ``src`` held, bit for bit, and nothing else changed."""
    await load.wait()
    assert load.done()
    torch.cuda.synchronize()
    expect_copy(caches, expected, reference, src, dst, range(96), BLOCK)
    assert caches.bytes_equal(expected)


class HookedMover(CudaMover):
    """Calls ``before_launch`` on the launching thread before each staging fill's kernel is
    enqueued (the launcher's ``before_fill_launch`` seam)."""

    def __init__(self, options: MoverOptions) -> None:
        super().__init__(options)
        self.launcher.before_fill_launch = self.before_launch

    def before_launch(self, side: Any, to_host: bool, jobs: Sequence[Job]) -> None:
        pass


class DelayedLayerMover(HookedMover):
    """Queues a long sleep on the load kernel stream before the launch that copies
    ``delayed_layer`` (a single-group layout: local layer == model layer)."""

    delayed_layer = 2

    def __init__(self, options: MoverOptions) -> None:
        super().__init__(options)
        self.sleep_end = torch.cuda.Event(enable_timing=True)

    def before_launch(self, side: Any, to_host: bool, jobs: Sequence[Job]) -> None:
        if not to_host and any(job[4] == self.delayed_layer for job in jobs):
            with torch.cuda.stream(side.kernel_stream):
                torch.cuda._sleep(SLEEP_CYCLES)
                self.sleep_end.record()


async def test_a_delayed_layer_is_waited_for_and_earlier_layers_are_not_held_back() -> None:
    mover = DelayedLayerMover(
        MoverOptions(path="staging", staging_slot_bytes=6 << 10, mapped_front_layers=0)
    )
    async with _one_layer_per_fill(mover, 9) as (caches, layout, objs, src, dst, reference):
        src_index = torch.tensor(src, device="cuda")
        dst_index = torch.tensor(dst, device="cuda")
        waiting = torch.cuda.Stream()
        waited_copy = torch.empty_like(caches.physical[2][:, dst_index])
        reader_started = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(waiting):
            # Load the reader's copy kernel now: CUDA loads modules lazily, and loading one
            # while the delayed load's sleep kernel runs waits for that kernel to end.
            for i, block in enumerate(dst):
                waited_copy[:, i].copy_(caches.physical[2][:, block])
            reader_started.record()
        torch.cuda.synchronize()
        load = await mover.scatter_layerwise(layout, dst, _transfers(objs, 0))
        await load.enqueued()
        load.wait_layer(2, waiting)
        with torch.cuda.stream(waiting):  # views and copy_ only: nothing allocates (and syncs)
            reader_started.record()
            for i, block in enumerate(dst):
                waited_copy[:, i].copy_(caches.physical[2][:, block])
        # Earlier layers are released before the delayed one: their events complete first.
        assert isinstance(load, CudaLayerLoad)
        load.events[1].synchronize()
        released = time.perf_counter()
        load.events[2].synchronize()
        held_ms = (time.perf_counter() - released) * 1e3
        assert held_ms > SLEEP_MS / 2, f"layer 2 landed {held_ms:.1f} ms after layer 1"
        torch.cuda.synchronize()
        await load.wait()
        # The reader of layer 2 started only once the delayed copy's sleep was over.
        assert mover.sleep_end.elapsed_time(reader_started) >= 0
        early_copy = caches.physical[1][:, dst_index]
        for layer, copy in ((1, early_copy), (2, waited_copy)):
            want = reference[layer][0][:, src_index]
            assert torch.equal(copy.view(torch.uint8), want.view(torch.uint8)), layer


class RecordingMover(HookedMover):
    """Records, per scatter launch, the thread that queued it and the layers it copies; raises
    before the launch of ``fail_layer`` (a fault while enqueueing)."""

    fail_layer: int | None = None

    def __init__(self, options: MoverOptions) -> None:
        super().__init__(options)
        self.launches: list[tuple[int, set[int]]] = []

    def before_launch(self, side: Any, to_host: bool, jobs: Sequence[Job]) -> None:
        if to_host:
            return
        layers = {job[4] for job in jobs}
        if self.fail_layer in layers:
            raise RuntimeError(f"injected fault before layer {self.fail_layer}'s launch")
        self.launches.append((threading.get_ident(), layers))

    def threads_of(self, layer: int) -> set[int]:
        return {thread for thread, layers in self.launches if layer in layers}


def _one_fill_per_layer_mover(**kw: Any) -> RecordingMover:
    # 6 KiB slots: one fill per layer; the lead (two slots) is two layers ahead of a wait.
    # Every layer staged (no mapped front): what these tests watch is the pull.
    mover = RecordingMover(
        MoverOptions(path="staging", staging_slot_bytes=6 << 10, mapped_front_layers=0)
    )
    for name, value in kw.items():
        setattr(mover, name, value)
    return mover


async def test_the_model_thread_queues_the_layers_it_waits_for() -> None:
    mover = _one_fill_per_layer_mover()
    async with _one_layer_per_fill(mover, 5) as (caches, layout, objs, src, dst, reference):
        expected = caches.snapshot()
        loop_thread = threading.get_ident()
        load = await mover.scatter_layerwise(layout, dst, _transfers(objs, 0))
        assert isinstance(load, CudaLayerLoad)
        # Returned with layers 0 to 2 queued (by the loop: MIN_LEAD_LAYERS), not the rest.
        assert _queued(load) == [True, True, True, False]
        assert mover.threads_of(2) == {loop_thread}
        stream = torch.cuda.Stream()
        queued: list[list[bool]] = []

        def model_thread() -> int:
            for layer in range(4):
                load.wait_layer(layer, stream)
                queued.append(_queued(load))
            return threading.get_ident()

        model = await asyncio.to_thread(model_thread)
        assert model != loop_thread
        # The first wait queues nothing beyond its layer (the model has not started yet); the
        # next two, their layer queued already but fewer than two layers beyond it, add one
        # fill each: the first two of layer 3's three (the last slot's worth ramps down: 2 KiB
        # fills); the wait of layer 3 queues what that layer still lacks.
        assert queued == [
            [True, True, True, False],
            [True, True, True, False],
            [True, True, True, False],
            [True, True, True, True],
        ]
        assert mover.threads_of(3) == {model}  # the waiter's, not the loop's
        assert len([1 for thread, layers in mover.launches if 3 in layers]) == 3
        await _landed_whole(load, caches, expected, reference, src, dst)


async def test_a_wait_queues_a_lead_fill_only_while_the_gpu_has_model_work_to_cover_it() -> None:
    # 12 KiB slots: two layers a fill (after the first two), a lead of four layers. Fills are
    # 0.1-0.3 ms of Python; queued while the GPU runs the last layer launched, they idle it.
    mover = RecordingMover(
        MoverOptions(path="staging", staging_slot_bytes=12 << 10, mapped_front_layers=0)
    )
    async with _one_layer_per_fill(mover, 11, num_layers=8) as parts:
        caches, layout, objs, src, dst, reference = parts
        expected = caches.snapshot()
        load = await mover.scatter_layerwise(layout, dst, _transfers(objs, 0))
        assert isinstance(load, CudaLayerLoad)
        returned = _queued(load)
        assert returned == [True] * 4 + [False] * 4  # fills of layers 0, 1, then 2-3
        stream = torch.cuda.Stream()
        queued: list[list[bool]] = []

        def model_thread() -> None:
            for layer in range(2):  # an idle GPU, two layers queued beyond layer 1
                stream.synchronize()  # the last wait's mark reached
                load.wait_layer(layer, stream)
                queued.append(_queued(load))
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SLEEP_CYCLES)  # "the model's layer 1", still running ...
            load.wait_layer(2, stream)  # ... beyond a short lead: a fill regardless
            queued.append(_queued(load))
            load.wait_layer(3, stream)  # two layers beyond, but layer 2's mark not reached
            queued.append(_queued(load))
            for layer in range(4, 8):
                load.wait_layer(layer, stream)

        await asyncio.to_thread(model_thread)
        assert queued[0] == queued[1] == returned  # the GPU idle and the lead long: no fill
        assert queued[2] == [True] * 6 + [False] * 2
        assert queued[3][6], "a wait with the model's work still ahead queued nothing"
        await _landed_whole(load, caches, expected, reference, src, dst)


@pytest.mark.parametrize("small", [True, False])
async def test_a_small_loads_first_layers_are_mapped_launches_queued_before_it_returns(
    monkeypatch: pytest.MonkeyPatch, small: bool
) -> None:
    # Layers of 6 KiB; the front takes layers up to MAPPED_FRONT_LAYER_BYTES each.
    if not small:
        monkeypatch.setattr(layerwise, "MAPPED_FRONT_LAYER_BYTES", 4 << 10)
    mover = RecordingMover(MoverOptions(path="staging", staging_slot_bytes=6 << 10))
    async with _one_layer_per_fill(mover, 13, num_layers=8) as parts:
        caches, layout, objs, src, dst, reference = parts
        expected = caches.snapshot()
        launches = mover.stats()["kernel_launches"]
        loop_thread = threading.get_ident()
        load = await mover.scatter_layerwise(layout, dst, _transfers(objs, 0))
        assert isinstance(load, CudaLayerLoad)
        front = 4 if small else 0
        # Queued before returning: the front's layers, one mapped launch each and no staging
        # fill; without a front, staging fills through layer MIN_LEAD_LAYERS (by the loop).
        assert _queued(load) == [True] * max(front, 3) + [False] * (8 - max(front, 3))
        staged_early = [layer for layer in range(8) if mover.threads_of(layer)]
        assert staged_early == ([] if small else [0, 1, 2])
        assert mover.stats()["kernel_launches"] - launches == (4 if small else 3)
        stream = torch.cuda.Stream()

        def model_thread() -> int:
            for layer in range(8):
                load.wait_layer(layer, stream)
            return threading.get_ident()

        model = await asyncio.to_thread(model_thread)
        assert mover.threads_of(7) == {model}  # the rest staged by the pull, as ever
        assert not any(mover.threads_of(layer) & {loop_thread} for layer in range(3, 8))
        await _landed_whole(load, caches, expected, reference, src, dst)


async def test_a_load_nobody_waits_for_is_queued_by_the_loop_and_completes() -> None:
    mover = _one_fill_per_layer_mover()
    async with _one_layer_per_fill(mover, 6) as (caches, layout, objs, src, dst, reference):
        expected = caches.snapshot()
        load = await mover.scatter_layerwise(layout, dst, _transfers(objs, 0))
        assert isinstance(load, CudaLayerLoad) and load.pulled is not None
        assert not load.has_event(3)
        # No wait_layer, no wait(): the loop queues the rest once the copies should be over.
        await asyncio.wait_for(asyncio.shield(load.pulled), timeout=30)
        assert mover.threads_of(3) == {threading.get_ident()}
        await _landed_whole(load, caches, expected, reference, src, dst)


async def test_a_fault_while_the_model_thread_enqueues_fails_that_layer_and_leaks_nothing() -> None:
    mover = _one_fill_per_layer_mover(fail_layer=3)
    async with _one_layer_per_fill(mover, 7) as (caches, layout, objs, src, dst, reference):
        poisoned = caches.snapshot()
        expected = caches.snapshot()
        expect_copy(caches, expected, reference, src, dst, range(96), BLOCK)
        load = await mover.scatter_layerwise(layout, dst, _transfers(objs, 0))
        stream = torch.cuda.Stream()

        def model_thread() -> None:
            for layer in range(3):
                load.wait_layer(layer, stream)
            with pytest.raises(TieredKVError, match=r"before layer 3.*injected fault"):
                load.wait_layer(3, stream)

        await asyncio.to_thread(model_thread)
        with pytest.raises(TieredKVError, match="injected fault"):
            await load.wait()
        assert load.done()
        stream.synchronize()
        # The layers queued before the fault landed whole; layer 3 was never written.
        after = caches.snapshot()
        for layer in range(3):
            assert torch.equal(
                after[layer][0].view(torch.uint8), expected[layer][0].view(torch.uint8)
            )
        assert torch.equal(after[3][0].view(torch.uint8), poisoned[3][0].view(torch.uint8))


async def test_a_freed_object_fails_a_layerwise_call_before_it_takes_a_pooled_buffer() -> None:
    """A layerwise load or store given an object already freed raises before it takes anything:
    the pool keeps its call buffers and the live objects keep their reference counts."""
    mover = CudaMover(MoverOptions(path="staging"))
    caches = make_caches("vllm_nhd", torch.bfloat16, num_layers=4, num_blocks=16, device="cuda")
    layout = _layout(caches.entries, caches.hints)
    arena = HostArena(16 << 20, pin=True)
    try:
        objs = _objects(arena, layout, 96)
        await mover.gather(layout, [0, 1, 2, 3, 4, 5], _transfers(objs, 0))  # fills the pool
        state = mover.device_state(layout.device)
        pooled = len(state.buffers)
        assert pooled >= 1
        objs[1].unref()  # freed: its transfer is stale
        transfers = _transfers(objs, 0)
        with pytest.raises(TieredKVError, match="freed"):
            await mover.scatter_layerwise(layout, [8, 9, 10, 11, 12, 13], transfers)
        save = mover.begin_gather(layout, [0, 1, 2, 3, 4, 5], transfers)
        with pytest.raises(TieredKVError, match="freed"):
            save.save(0)
        assert len(state.buffers) == pooled
        assert [objs[0].refcount, objs[2].refcount] == [1, 1]
        for obj in (objs[0], objs[2]):
            obj.unref()
    finally:
        await mover.aclose()
        leaked = arena.close()
    assert leaked == 0


async def _retrieves_what_was_stored(
    engine: TieredKVEngine, caches: Any, tokens: list[int], src: list[int], dst: list[int]
) -> None:
    """A whole retrieve of ``tokens`` into the poisoned ``dst`` blocks writes what ``src``
    holds and nothing else."""
    reference = caches.snapshot()
    poison_blocks(caches, dst)
    expected = caches.snapshot()
    assert (await engine.retrieve(tokens, dst)).valid_tokens == len(tokens)
    torch.cuda.synchronize()
    expect_copy(caches, expected, reference, src, dst, range(len(tokens)), BLOCK)
    assert caches.bytes_equal(expected)


@pytest.mark.parametrize("path", PATHS)
async def test_a_layers_store_waits_for_its_producer(path: str) -> None:
    """save_layer after a write still queued behind a sleep on the producer's stream: the
    stored bytes are the written ones."""
    caches = make_caches(
        "vllm_nhd", torch.bfloat16, num_layers=3, num_blocks=16, seed=1, device="cuda"
    )
    tokens = list(range(1000, 1096))
    src, dst = [0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13]
    config = EngineConfig(chunk_size=CHUNK, l1_size="16MiB")
    producer = torch.cuda.Stream()
    async with TieredKVEngine(config, mover=CudaMover(MoverOptions(path=path))) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        torch.cuda.synchronize()
        saver = await engine.store_layerwise(tokens, src)
        for layer in range(3):
            with torch.cuda.stream(producer):
                torch.cuda._sleep(SLEEP_CYCLES // 4)
                caches.physical[layer].view(torch.uint8)[:, src] = 0x10 + layer
            saver.save_layer(layer, producer)
        assert await saver.commit() == 96
        await _retrieves_what_was_stored(engine, caches, tokens, src, dst)
        for layer in range(3):
            assert bool((caches.physical[layer].view(torch.uint8)[:, dst] == 0x10 + layer).all())
    assert engine.leaked_on_close == 0


async def test_the_engines_layerwise_store_is_one_mover_call() -> None:
    """Through the default mover, a layerwise store of several layers and chunks is one gather
    call (one block table upload, one completion), and its bytes round-trip."""
    caches = make_caches(
        "vllm_nhd", torch.bfloat16, num_layers=4, num_blocks=16, seed=2, device="cuda"
    )
    tokens = list(range(3000, 3096))
    src, dst = [0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13]

    def gather_calls(engine: TieredKVEngine) -> int:
        mover = engine.stats().mover
        return sum(
            int(v)
            for k, v in mover.extra.items()
            if k.startswith("cuda_gather_") and k.endswith("_calls")
        )

    async with TieredKVEngine(EngineConfig(chunk_size=CHUNK, l1_size="16MiB")) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        before = gather_calls(engine)
        gathered = engine.stats().mover.bytes_gathered
        saver = await engine.store_layerwise(tokens, src)
        for layer in range(4):
            saver.save_layer(layer)
        assert await saver.commit() == 96
        assert gather_calls(engine) - before == 1, engine.stats().mover
        # Counted like any gather: 96 tokens x 4 layers x K and V x 2 heads x 8 x bf16.
        assert engine.stats().mover.bytes_gathered - gathered == 96 * 4 * 2 * 2 * 8 * 2
        await _retrieves_what_was_stored(engine, caches, tokens, src, dst)
    assert engine.leaked_on_close == 0


@pytest.mark.parametrize("io_plane", ["threads", "processes"])
@pytest.mark.parametrize("fmt", ["vllm_nhd", "vllm_hnd_view", "flashinfer_hnd", "mla"])
async def test_engine_layerwise_retrieve_equals_whole_retrieve(
    tmp_path: Any, fmt: str, io_plane: str
) -> None:
    """Whole and layerwise, from L1 and after L2 (its reads on threads, or in worker processes
    straight into the pinned, shared arena)."""
    num_tokens = 200
    blocks = math.ceil(num_tokens / BLOCK)
    caches = make_caches(
        fmt, torch.bfloat16, num_layers=4, num_blocks=2 * blocks + 2, seed=12, device="cuda"
    )
    tokens = list(range(5000, 5000 + num_tokens))
    src = list(range(1, 1 + blocks))
    dst = [2 * blocks + 1 - i for i in range(blocks)]
    config = EngineConfig(
        chunk_size=CHUNK,
        l1_size="64MiB",
        l2_path=str(tmp_path / "l2"),
        l2_durability="none",
        io_plane=io_plane,  # type: ignore[arg-type]
    )
    async with TieredKVEngine(config) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert engine.storage.l1.arena.pinned
        assert await engine.store(tokens, src) == num_tokens
        await engine.flush(timeout=30)
        reference = caches.snapshot()
        for skip, evict in ((0, False), (48, True)):
            if evict:
                assert await engine.evict_l1() > 0
            poison_blocks(caches, dst)
            expected = caches.snapshot()
            load = await engine.retrieve_layerwise(tokens, dst, skip_prefix_tokens=skip)
            assert load.result.valid_tokens == num_tokens
            if skip == 0:  # from the model's thread: each wait holds until its layer is queued
                stream = torch.cuda.current_stream()
                await asyncio.get_running_loop().run_in_executor(None, load.wait_all, stream)
            else:  # on the loop's thread: after the enqueue
                await load.enqueued()
                load.wait_all()
            torch.cuda.current_stream().synchronize()
            await load.wait()
            expect_copy(caches, expected, reference, src, dst, range(skip, num_tokens), BLOCK)
            assert caches.bytes_equal(expected), f"skip={skip}"
        if io_plane == "processes":
            plane = engine.io_plane
            assert plane is not None and plane.stats().reads > 0  # L2's bytes came through it
    assert engine.leaked_on_close == 0
