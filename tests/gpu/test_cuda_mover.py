"""`CudaMover` against the torch reference, bit for bit, on every path (GPU only).

Gather: both movers fill poisoned host objects from the same caches; the whole objects must be
equal. Scatter: two identical caches, same poisoned destination blocks, one mover each; every
byte of both caches must be equal afterwards (skipped slots and untouched blocks included).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.kvfactory import DTYPES, FORMATS, KVCaches, make_caches, poison_blocks
from tiered_kv.errors import LayoutError
from tiered_kv.gpu.base import ChunkTransfer, KVMover
from tiered_kv.gpu.dispatch import DeviceMover
from tiered_kv.gpu.events import INLINE_IDS
from tiered_kv.gpu.kernels import COPY_WIDTHS
from tiered_kv.gpu.launch import PARAMS_SIZE
from tiered_kv.gpu.mover import PATHS, CudaMover, MoverOptions
from tiered_kv.gpu.reference import TorchMover
from tiered_kv.layout import KVCacheLayout, build_layout
from tiered_kv.memory import HostArena, MemoryObj

pytestmark = pytest.mark.gpu

CHUNK = 32
BLOCK = 16


def _pair(fmt: str, dtype: torch.dtype, seed: int, **kw: int) -> tuple[KVCaches, KVCaches]:
    return (
        make_caches(fmt, dtype, seed=seed, device="cuda", **kw),
        make_caches(fmt, dtype, seed=seed, device="cuda", **kw),
    )


def _layout(caches: KVCaches, chunk: int = CHUNK) -> KVCacheLayout:
    return build_layout(caches.entries, chunk_size=chunk, layout_hints=caches.hints)


def _objects(
    arena: HostArena, layout: KVCacheLayout, num_tokens: int, chunk: int = CHUNK
) -> list[MemoryObj]:
    objs = []
    for start in range(0, num_tokens, chunk):
        obj = arena.allocate_obj(layout.layout_desc, min(chunk, num_tokens - start))
        assert obj is not None
        obj.raw().fill_(0xA5)
        objs.append(obj)
    return objs


def _transfers(objs: Sequence[MemoryObj], skip: int, chunk: int = CHUNK) -> list[ChunkTransfer]:
    out = []
    for i, obj in enumerate(objs):
        start = i * chunk
        out.append(ChunkTransfer(obj, start, min(obj.num_tokens, max(0, skip - start))))
    return out


def _blocks(num_tokens: int, num_blocks: int, seed: int) -> list[int]:
    needed = math.ceil(num_tokens / BLOCK)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(num_blocks, generator=gen)[:needed].tolist()


async def _round(
    mover: KVMover,
    oracle: KVMover,
    fmt: str,
    dtype: torch.dtype,
    num_tokens: int,
    skips: Sequence[int],
    seed: int,
    **kw: int,
) -> None:
    ours, theirs = _pair(fmt, dtype, seed, **kw)
    num_blocks = kw.get("num_blocks", 16)
    layout_ours, layout_theirs = _layout(ours), _layout(theirs)
    arena = HostArena(64 << 20, pin=True)
    try:
        src = _blocks(num_tokens, num_blocks, seed)
        a = _objects(arena, layout_ours, num_tokens)
        b = _objects(arena, layout_theirs, num_tokens)
        await mover.gather(layout_ours, src, _transfers(a, 0))
        await oracle.gather(layout_theirs, src, _transfers(b, 0))
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x.raw(), y.raw()), "gather differs from the reference"
        for skip in skips:
            dst = _blocks(num_tokens, num_blocks, seed + 100 + skip)
            poison_blocks(ours, dst)
            poison_blocks(theirs, dst)
            await mover.scatter(layout_ours, dst, _transfers(a, skip))
            await oracle.scatter(layout_theirs, dst, _transfers(b, skip))
            torch.cuda.synchronize()
            assert ours.bytes_equal(theirs.snapshot()), f"scatter differs (skip={skip})"
        for obj in (*a, *b):
            obj.unref()
    finally:
        assert arena.close() == 0


@pytest.fixture
async def movers() -> dict[str, KVMover]:
    out: dict[str, KVMover] = {path: CudaMover(MoverOptions(path=path)) for path in PATHS}
    out["torch"] = TorchMover()
    yield out  # type: ignore[misc]
    for mover in out.values():
        await mover.aclose()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("fmt", FORMATS)
async def test_every_path_matches_the_reference(
    movers: dict[str, KVMover], fmt: str, dtype_name: str, path: str
) -> None:
    # 80 tokens: two full chunks and a partial one; skips inside, on and past chunk edges.
    await _round(
        movers[path],
        movers["torch"],
        fmt,
        DTYPES[dtype_name],
        num_tokens=80,
        skips=(0, 5, 32, 40, 80),
        seed=len(fmt) + len(dtype_name),
        num_blocks=12,
    )


def _poison(tensors: Sequence[torch.Tensor], blocks: list[int]) -> None:
    index = torch.tensor(blocks, device="cuda")
    for t in tensors:
        raw = t.view(torch.uint8)
        if t.dim() == 5:  # [2, NB, ...]
            raw[:, index] = 0x5A
        else:
            raw[index] = 0x5A


@pytest.mark.parametrize("path", PATHS)
async def test_heterogeneous_groups_incl_132_byte_int8_rows(
    movers: dict[str, KVMover], path: str
) -> None:
    nb = 10

    def caches() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(5)

        def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen)
            return raw.to(torch.uint8).cuda().view(dtype)

        return [
            rand((2, nb, BLOCK, 4, 64), torch.bfloat16),
            rand((nb, BLOCK, 132), torch.int8),  # indexer cache: 132-byte rows
            rand((2, nb, BLOCK, 4, 64), torch.bfloat16),
            rand((nb, BLOCK, 132), torch.int8),
            rand((nb, BLOCK, 72), torch.float16),  # 144-byte MLA-like rows
        ]

    ours, theirs = caches(), caches()
    hints = {"block_size": BLOCK, "kv_layout": "NHD"}
    lo = build_layout(ours, chunk_size=CHUNK, layout_hints=hints)
    lt = build_layout(theirs, chunk_size=CHUNK, layout_hints=hints)
    assert len(lo.groups) == 3
    arena = HostArena(16 << 20, pin=True)
    try:
        src, dst = [3, 7, 1, 9, 0], [8, 2, 6, 4, 5]
        a, b = _objects(arena, lo, 70), _objects(arena, lt, 70)
        await movers[path].gather(lo, src, _transfers(a, 0))
        await movers["torch"].gather(lt, src, _transfers(b, 0))
        assert all(torch.equal(x.raw(), y.raw()) for x, y in zip(a, b, strict=True))
        _poison(ours, dst)
        _poison(theirs, dst)
        await movers[path].scatter(lo, dst, _transfers(a, 19))
        await movers["torch"].scatter(lt, dst, _transfers(b, 19))
        torch.cuda.synchronize()
        for x, y in zip(ours, theirs, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for obj in (*a, *b):
            obj.unref()
    finally:
        assert arena.close() == 0


@pytest.mark.parametrize("path", ["staging", "mapped"])
@pytest.mark.parametrize("skip", [0, 5, 48])
async def test_whole_blocks_of_narrow_rows_copy_as_wide_rows(path: str, skip: int) -> None:
    """132-byte int8 rows in chunks of whole blocks go through the block-row plan (16-byte
    vectors); a skip inside a block falls back to rows. Both must match the reference."""
    mover, oracle = CudaMover(MoverOptions(path=path)), TorchMover()

    def caches() -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(17)
        raw = [torch.randint(0, 256, (24, BLOCK, 132), generator=gen) for _ in range(3)]
        return [r.to(torch.uint8).cuda().view(torch.int8) for r in raw]

    ours, theirs = caches(), caches()
    lo, lt = build_layout(ours, chunk_size=64), build_layout(theirs, chunk_size=64)
    arena = HostArena(8 << 20, pin=True)
    try:
        src, dst = [20, 3, 11, 7, 0, 15, 9, 1], [2, 18, 6, 22, 13, 4, 17, 8]
        a, b = _objects(arena, lo, 128, 64), _objects(arena, lt, 128, 64)
        await mover.gather(lo, src, _transfers(a, 0, 64))
        await oracle.gather(lt, src, _transfers(b, 0, 64))
        assert all(torch.equal(x.raw(), y.raw()) for x, y in zip(a, b, strict=True))
        assert mover.stats()["kernel_launches_block_rows"] == mover.stats()["kernel_launches"]
        before = mover.stats()["kernel_launches_block_rows"]
        _poison(ours, dst)
        _poison(theirs, dst)
        await mover.scatter(lo, dst, _transfers(a, skip, 64))
        await oracle.scatter(lt, dst, _transfers(b, skip, 64))
        torch.cuda.synchronize()
        for x, y in zip(ours, theirs, strict=True):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        block_rows = mover.stats()["kernel_launches_block_rows"] > before
        assert block_rows == (skip % BLOCK == 0)
        for obj in (*a, *b):
            obj.unref()
    finally:
        await mover.aclose()
        assert arena.close() == 0


@pytest.mark.parametrize("path", PATHS)
async def test_many_chunks_in_one_call(movers: dict[str, KVMover], path: str) -> None:
    # 70 chunks of 16 tokens: more jobs than one launch carries, several staging fills.
    num_tokens = 70 * 16 - 9
    ours, theirs = _pair(
        "vllm_hnd_view", torch.bfloat16, 11, num_blocks=80, num_heads=4, head_size=32
    )
    lo = build_layout(ours.entries, chunk_size=16, layout_hints=ours.hints)
    lt = build_layout(theirs.entries, chunk_size=16, layout_hints=theirs.hints)
    arena = HostArena(64 << 20, pin=True)
    try:
        src = _blocks(num_tokens, 80, 1)
        dst = _blocks(num_tokens, 80, 2)
        a, b = _objects(arena, lo, num_tokens, 16), _objects(arena, lt, num_tokens, 16)
        await movers[path].gather(lo, src, _transfers(a, 0, 16))
        await movers["torch"].gather(lt, src, _transfers(b, 0, 16))
        assert all(torch.equal(x.raw(), y.raw()) for x, y in zip(a, b, strict=True))
        poison_blocks(ours, dst)
        poison_blocks(theirs, dst)
        await movers[path].scatter(lo, dst, _transfers(a, 200, 16))
        await movers["torch"].scatter(lt, dst, _transfers(b, 200, 16))
        torch.cuda.synchronize()
        assert ours.bytes_equal(theirs.snapshot())
        for obj in (*a, *b):
            obj.unref()
    finally:
        assert arena.close() == 0


@pytest.mark.parametrize("path", PATHS)
async def test_block_tables_inline_and_uploaded(path: str) -> None:
    """A call whose chunks touch at most `INLINE_IDS` blocks carries its ids in the launches
    (even far into the request: the window's base), a wider one uploads the table; both match
    the reference bit for bit, and a table shorter than the chunks is refused."""
    far = INLINE_IDS + 60  # request block of the far chunk
    num_blocks = far + 2
    shape = {"num_blocks": num_blocks, "num_heads": 4, "head_size": 32}
    ours, theirs = _pair("vllm_nhd", torch.bfloat16, 31, **shape)
    lo, lt = _layout(ours, 16), _layout(theirs, 16)
    mover, oracle = CudaMover(MoverOptions(path=path)), TorchMover()
    arena = HostArena(16 << 20, pin=True)
    gen = torch.Generator().manual_seed(5)
    table = torch.randperm(num_blocks, generator=gen)[: far + 1].tolist()
    try:
        for starts in ([far * 16], [0, far * 16]):  # one far chunk: inline; both: uploaded
            n = 16 * len(starts)
            a, b = _objects(arena, lo, n, 16), _objects(arena, lt, n, 16)

            def at(
                objs: list[MemoryObj], skip: int, starts: list[int] = starts
            ) -> list[ChunkTransfer]:
                return [ChunkTransfer(o, t, skip) for o, t in zip(objs, starts, strict=True)]

            uploads = mover.stats()["block_table_uploads"]
            await mover.gather(lo, table, at(a, 0))
            await oracle.gather(lt, table, at(b, 0))
            assert all(torch.equal(x.raw(), y.raw()) for x, y in zip(a, b, strict=True))
            dst = table[::-1]  # other blocks, same length
            poison_blocks(ours, dst)
            poison_blocks(theirs, dst)
            await mover.scatter(lo, dst, at(a, 3))
            await oracle.scatter(lt, dst, at(b, 3))
            torch.cuda.synchronize()
            assert ours.bytes_equal(theirs.snapshot()), starts
            uploaded = 0 if path == "dma" or len(starts) == 1 else 2
            assert mover.stats()["block_table_uploads"] - uploads == uploaded
            for obj in (*a, *b):
                obj.unref()
        short = _objects(arena, lo, 16, 16)
        with pytest.raises(LayoutError, match=f"reach block {far}"):
            await mover.gather(lo, table[:far], [ChunkTransfer(short[0], far * 16)])
        short[0].unref()
    finally:
        await mover.aclose()
        assert arena.close() == 0


def test_kernel_parameters_are_the_packed_block() -> None:
    """The launcher packs `PARAMS_SIZE` bytes: the kernels' one parameter is that size."""
    from cuda.bindings import driver

    mover = CudaMover()
    state = mover.device_state(torch.device("cuda"))
    for direction in ("gather", "scatter"):
        for width in COPY_WIDTHS:
            err, offset, size = driver.cuFuncGetParamInfo(
                state.kernels.function(direction, width), 0
            )
            assert err == driver.CUresult.CUDA_SUCCESS
            assert (offset, size) == (0, PARAMS_SIZE), (direction, width)
    asyncio.run(mover.aclose())


@pytest.mark.parametrize("path", PATHS)
async def test_concurrent_store_and_retrieve_on_their_streams(
    movers: dict[str, KVMover], path: str
) -> None:
    """A store from blocks A and a retrieve into blocks B at once, repeated: the store sees A's
    bytes, and B ends up holding exactly what was retrieved."""
    shape = {"num_blocks": 64, "num_heads": 8, "head_size": 128}
    caches = make_caches("vllm_nhd", torch.bfloat16, seed=21, device="cuda", **shape)
    other = make_caches("vllm_nhd", torch.bfloat16, seed=22, device="cuda", **shape)
    layout, other_layout = _layout(caches, 128), _layout(other, 128)
    arena = HostArena(256 << 20, pin=True)
    mover, oracle = movers[path], movers["torch"]
    blocks_a, blocks_b = list(range(0, 32)), list(range(63, 31, -1))
    try:
        incoming = _objects(arena, other_layout, 512, 128)
        await oracle.gather(other_layout, blocks_b, _transfers(incoming, 0, 128))
        for round_ in range(4):
            stored = _objects(arena, layout, 512, 128)
            await asyncio.gather(
                mover.gather(layout, blocks_a, _transfers(stored, 0, 128)),
                mover.scatter(layout, blocks_b, _transfers(incoming, 0, 128)),
            )
            check_a = _objects(arena, layout, 512, 128)
            check_b = _objects(arena, layout, 512, 128)
            await oracle.gather(layout, blocks_a, _transfers(check_a, 0, 128))
            await oracle.gather(layout, blocks_b, _transfers(check_b, 0, 128))
            for x, y in zip(stored, check_a, strict=True):
                assert torch.equal(x.raw(), y.raw()), f"round {round_}: store"
            for x, y in zip(incoming, check_b, strict=True):
                assert torch.equal(x.raw(), y.raw()), f"round {round_}: retrieve"
            for obj in (*stored, *check_a, *check_b):
                obj.unref()
            await oracle.gather(other_layout, blocks_a, _transfers(incoming, 0, 128))  # new data
        for obj in incoming:
            obj.unref()
    finally:
        assert arena.close() == 0


async def test_gather_waits_for_the_callers_stream() -> None:
    """KV written by a kernel still queued on the caller's stream is what gets stored."""
    caches = make_caches(
        "vllm_nhd", torch.bfloat16, seed=2, device="cuda", num_blocks=8, num_heads=8, head_size=128
    )
    layout = _layout(caches, 64)
    arena = HostArena(8 << 20, pin=True)
    mover = CudaMover(MoverOptions(path="staging"))
    try:
        obj = _objects(arena, layout, 64, 64)[0]
        big = torch.randn(4096, 4096, device="cuda")
        torch.cuda.synchronize()
        for _ in range(8):  # keep the caller's stream busy
            big = big @ big
            big /= big.norm()
        for layer in caches.physical:
            layer.view(torch.uint8).fill_(0x3C)
        await mover.gather(layout, [0, 1, 2, 3], [ChunkTransfer(obj, 0)])
        data = obj.group_bytes(0)
        assert bool((data == 0x3C).all())
        obj.unref()
    finally:
        await mover.aclose()
        assert arena.close() == 0


async def test_engine_uses_the_cuda_mover_for_cuda_caches(tmp_path: object) -> None:
    from tiered_kv import EngineConfig, TieredKVEngine

    caches = make_caches("vllm_nhd", torch.bfloat16, seed=4, device="cuda", num_blocks=8)
    config = EngineConfig(chunk_size=32, l1_size="8MiB")
    device_mover = DeviceMover()  # the engine's default, built here to look inside
    async with TieredKVEngine(config, mover=device_mover) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        # Registration prepared the CUDA mover: kernels loaded, slots and buffers allocated.
        cuda = device_mover.cuda
        assert isinstance(cuda, CudaMover)
        state = cuda.device_state(caches.physical[0].device)
        assert state.store.slots and state.load.slots
        assert len(state.buffers) >= 2 and all(b.capacity >= 8 for b in state.buffers)
        tokens = list(range(64))
        assert await engine.store(tokens, [0, 1, 2, 3]) == 64
        poison_blocks(caches, [4, 5, 6, 7])
        assert (await engine.retrieve(tokens, [4, 5, 6, 7])).valid_tokens == 64
        torch.cuda.synchronize()
        for layer in range(2):
            for k in range(2):
                for t in range(64):
                    src = caches.token_row(layer, k, t // 16, t % 16)
                    dst = caches.token_row(layer, k, 4 + t // 16, t % 16)
                    assert torch.equal(src.view(torch.uint8), dst.view(torch.uint8))
        mover = engine.stats().mover
        calls = mover.extra
        for direction in ("gather", "scatter"):
            assert sum(calls[f"cuda_{direction}_{path}_calls"] for path in PATHS) == 1
        assert mover.bytes_gathered == engine.layout_desc().nbytes(32) * 2


@pytest.mark.parametrize("case", ["small", "large", "unpinned", "layerwise"])
async def test_auto_runs_small_whole_calls_as_mapped_kernels_of_few_ctas(case: str) -> None:
    """Under ``auto``, a whole call of at most ``small_call_bytes`` on a staging layout with
    pinned objects is one mapped launch of ``small_call_ctas`` CTAs; a larger call, unpinned
    objects or a layerwise load keep the staging path. Bytes match the reference each way."""
    ours, theirs = _pair("vllm_hnd_view", torch.bfloat16, 41, num_blocks=16)
    lo, lt = _layout(ours), _layout(theirs)
    chunk_bytes = lo.layout_desc.nbytes(CHUNK)
    limit = chunk_bytes if case != "large" else chunk_bytes // 2  # a scatter skips 5 tokens
    mover = CudaMover(MoverOptions(small_call_bytes=limit, small_call_ctas=7))
    assert mover.device_state(lo.device).plan(lo).path == "staging"
    oracle = TorchMover()
    ctas: list[int] = []
    launch = mover.launcher.launch

    def recording(*args: Any) -> None:
        ctas.append(args[-1])
        launch(*args)

    mover.launcher.launch = recording  # type: ignore[method-assign]
    arena = HostArena(8 << 20, pin=case != "unpinned")
    try:
        src, dst = _blocks(CHUNK, 16, 1), _blocks(CHUNK, 16, 2)
        a, b = _objects(arena, lo, CHUNK), _objects(arena, lt, CHUNK)
        if case == "layerwise":
            save = mover.begin_gather(lo, src, _transfers(a, 0))
            for layer in range(lo.num_layers):
                save.save(layer)
            await save.finish()
        else:
            await mover.gather(lo, src, _transfers(a, 0))
        await oracle.gather(lt, src, _transfers(b, 0))
        assert torch.equal(a[0].raw(), b[0].raw())
        poison_blocks(ours, dst)
        poison_blocks(theirs, dst)
        await mover.scatter(lo, dst, _transfers(a, 5))
        await oracle.scatter(lt, dst, _transfers(b, 5))
        torch.cuda.synchronize()
        assert ours.bytes_equal(theirs.snapshot())
        stats = mover.stats()
        # (gather, scatter) as mapped kernels of small_call_ctas: one launch each
        mapped = {"small": (1, 1), "large": (0, 0), "unpinned": (0, 0), "layerwise": (0, 1)}
        gather, scatter = mapped[case]
        assert (stats["gather_mapped_calls"], stats["scatter_mapped_calls"]) == (gather, scatter)
        assert (stats["gather_staging_calls"], stats["scatter_staging_calls"]) == (
            1 - gather,
            1 - scatter,
        )
        assert ctas.count(7) == gather + scatter
        for obj in (*a, *b):
            obj.unref()
    finally:
        await mover.aclose()
        assert arena.close() == 0


async def test_caller_cancelled_while_enqueueing_still_gets_the_whole_call_run() -> None:
    """Small slots make a staging call yield between fills; cancelling the caller at such a
    yield raises CancelledError in it, yet every chunk is still copied (the call is enqueued
    whole) and the objects stay held until the GPU is done."""
    shape = {"num_blocks": 64, "num_heads": 8, "head_size": 128}
    caches = make_caches("vllm_nhd", torch.bfloat16, seed=9, device="cuda", **shape)
    layout = _layout(caches, 128)
    arena = HostArena(64 << 20, pin=True)
    mover = CudaMover(MoverOptions(path="staging", staging_slot_bytes=256 << 10))
    oracle = TorchMover()
    try:
        # 8 chunks of 2 layers x 512 KiB: the slot grows to one layer, 16 fills (one launch
        # each), yielding between fills after the first two.
        objs = _objects(arena, layout, 1024, 128)
        task = asyncio.ensure_future(
            mover.gather(layout, list(range(64)), _transfers(objs, 0, 128))
        )
        for _ in range(3):  # into the enqueue and past its first yields
            await asyncio.sleep(0)
        assert 0 < mover.stats()["kernel_launches"] < 16  # cancelled mid-enqueue
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert mover.stats()["kernel_launches"] == 16  # ... and still enqueued whole
        assert all(obj.refcount == 2 for obj in objs)
        await mover.aclose()
        assert all(obj.refcount == 1 for obj in objs)
        check = _objects(arena, layout, 1024, 128)
        await oracle.gather(layout, list(range(64)), _transfers(check, 0, 128))
        for x, y in zip(objs, check, strict=True):
            assert torch.equal(x.raw(), y.raw())
        for obj in (*objs, *check):
            obj.unref()
    finally:
        await oracle.aclose()
        assert arena.close() == 0


@pytest.mark.parametrize("path", PATHS)
async def test_cancelled_caller_leaves_objects_held_until_the_gpu_is_done(path: str) -> None:
    shape = {"num_blocks": 64, "num_heads": 8, "head_size": 128}
    caches = make_caches("vllm_nhd", torch.bfloat16, seed=8, device="cuda", **shape)
    layout = _layout(caches, 128)
    arena = HostArena(64 << 20, pin=True)
    mover, oracle = CudaMover(MoverOptions(path=path)), TorchMover()
    try:
        objs = _objects(arena, layout, 1024, 128)
        # Planned first: planning uploads tables, which would wait for the matmuls below.
        mover.prepare(layout)
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # the caller's stream is busy: the gather cannot have run yet
            big = big @ big
            big /= big.norm()
        task = asyncio.ensure_future(
            mover.gather(layout, list(range(64)), _transfers(objs, 0, 128))
        )
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert all(obj.refcount == 2 for obj in objs)  # still the mover's as well
        await mover.aclose()
        assert all(obj.refcount == 1 for obj in objs)
        check = _objects(arena, layout, 1024, 128)
        await oracle.gather(layout, list(range(64)), _transfers(check, 0, 128))
        assert all(torch.equal(x.raw(), y.raw()) for x, y in zip(objs, check, strict=True))
        for obj in (*objs, *check):
            obj.unref()
    finally:
        await oracle.aclose()
        assert arena.close() == 0


async def test_re_registration_and_close_give_back_the_engines_gpu_memory() -> None:
    """The mover's plan of a replaced registration held its KV tensors for good; re-registering
    must let the old caches go, and close must give back everything the engine allocated."""
    import gc

    from tiered_kv import EngineConfig, TieredKVEngine
    from tiered_kv.gpu import kernels

    def allocated() -> int:
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    baseline = allocated()
    device = torch.cuda.current_device()
    users_before = kernels.kernel_users(device)
    sizes = []
    async with TieredKVEngine(EngineConfig(chunk_size=32, l1_size="16MiB")) as engine:
        for seed in range(3):
            caches = make_caches(
                "vllm_nhd", torch.bfloat16, seed=seed, device="cuda", num_blocks=256
            )
            engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
            tokens = list(range(seed * 1000, seed * 1000 + 64))
            assert await engine.store(tokens, [0, 1, 2, 3]) == 64
            del caches  # the engine's registration is now the only owner
            sizes.append(allocated())
    assert sizes[1] == sizes[0] and sizes[2] == sizes[0], sizes
    assert allocated() == baseline
    assert kernels.kernel_users(device) == users_before  # released with the mover
