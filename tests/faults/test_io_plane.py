"""L2 reads and writes through I/O worker processes (``io_plane="processes"``) under faults:
bit-exact loads, a corrupt file a miss, a worker SIGKILLed mid-read costing exactly its chunks
and replaced, a read or write cancelled on a stuck worker returning once that worker is dead,
write workers writing the codec's exact frame and leaving no file when they fail or die, and no
worker outliving its engine, whether it closed or was SIGKILLed."""

from __future__ import annotations

import asyncio
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash

from tests.kvfactory import KVCaches, expect_copy, make_caches, poison_blocks
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.benchmarks.ceilings import drop_cached_pages
from tiered_kv.codec import (
    STRIPE_BYTES,
    GroupSpec,
    encode_header,
    header_template,
    payload_checksums,
    seal_header,
)
from tiered_kv.io.plane import STUCK_GRACE_S, WorkerPlane
from tiered_kv.memory import HostArena

REPO = Path(__file__).resolve().parents[2]
CHUNK = 32
TOKENS = list(range(5000, 5000 + 8 * CHUNK))  # 8 chunks of 256 KiB
SRC, DST = list(range(1, 17)), list(range(17, 33))


def _caches() -> KVCaches:
    return make_caches("vllm_nhd", torch.bfloat16, num_blocks=40, num_heads=8, head_size=128)


def _config(tmp_path: Path, **overrides: object) -> EngineConfig:
    fields: dict[str, object] = {
        "chunk_size": CHUNK,
        "l1_size": "8MiB",
        "l2_path": str(tmp_path / "l2"),
        "io_plane": "processes",
        "io_workers": 2,
    }
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: only its parent's wait is missing.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


async def _stored(engine: TieredKVEngine, caches: KVCaches) -> WorkerPlane:
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    assert await engine.store(TOKENS, SRC) == len(TOKENS)
    assert await engine.flush(timeout=30) == 0
    assert await engine.evict_l1() > 0
    plane = engine.io_plane
    assert plane is not None
    return plane


def _chunk_file(engine: TieredKVEngine, index: int) -> Path:
    key = engine.chunk_keys(TOKENS)[index]
    return Path(engine.storage.lower[0].root) / key.hex[:2] / key.hex  # type: ignore[attr-defined]


async def test_loads_through_worker_processes_are_bit_exact_and_a_corrupt_file_is_a_miss(
    tmp_path: Path,
) -> None:
    caches = _caches()
    async with TieredKVEngine(_config(tmp_path)) as engine:
        plane = await _stored(engine, caches)
        reference = caches.snapshot()
        poison_blocks(caches, DST)
        expected = caches.snapshot()
        assert (await engine.retrieve(TOKENS, DST)).valid_tokens == len(TOKENS)
        expect_copy(caches, expected, reference, SRC, DST, range(len(TOKENS)), 16)
        assert caches.bytes_equal(expected)
        assert plane.stats().reads == 8  # every chunk's bytes came through a worker
        # A flipped payload byte in chunk 5: the digests disagree, the chunk is a miss and its
        # file goes; the prefix before it loads.
        await engine.evict_l1()
        path = _chunk_file(engine, 5)
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
        assert (await engine.retrieve(TOKENS, DST)).valid_tokens == 5 * CHUNK
        assert engine.stats().tier("L2").corrupt_removed == 1
        assert not path.exists()
        pids = plane.worker_pids()
    assert _gone_within(pids, 5)  # aclose stopped every worker


async def test_a_worker_killed_mid_read_costs_exactly_its_chunks_and_is_replaced(
    tmp_path: Path,
) -> None:
    """One worker, four reads in flight. Chunk 5's file is a FIFO, so the worker blocks inside
    its open; killed there, it costs exactly the chunks it held unanswered (5-7, and 4 unless
    its answer went out before the worker blocked: answers leave at most every 2 ms while jobs
    remain): misses, their blocks untouched; the prefix before them loads, and a new worker
    takes its place."""
    caches = _caches()
    async with TieredKVEngine(_config(tmp_path, io_workers=1)) as engine:
        plane = await _stored(engine, caches)
        path = _chunk_file(engine, 5)
        original = path.read_bytes()
        path.unlink()
        os.mkfifo(path)
        (victim,) = plane.worker_pids("read")
        poison_blocks(caches, DST)
        before = caches.snapshot()
        load = asyncio.create_task(engine.retrieve(TOKENS, DST))
        deadline = time.monotonic() + 10
        while plane.stats().reads < 8:  # every chunk's read is out
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # the worker is inside chunk 5's open
        os.kill(victim, signal.SIGKILL)
        result = await load
        delivered = result.valid_tokens // CHUNK
        assert result.valid_tokens % CHUNK == 0 and delivered in (4, 5)  # a prefix, no part
        assert result.stop_reason == "failed"
        after = caches.snapshot()
        for block in DST[2 * delivered :]:  # the chunks not delivered (two blocks each)
            assert all(
                torch.equal(b[:, block], a[:, block])
                for layer_b, layer_a in zip(before, after, strict=True)
                for b, a in zip(layer_b, layer_a, strict=True)
            )
        # Exactly the worker's unanswered chunks failed: every one not delivered.
        assert engine.stats().tier("L2").read_failures == 8 - delivered
        stats = plane.stats()
        assert stats.worker_deaths == 1 and stats.workers - stats.write_workers == 1
        assert plane.worker_pids("read") != [victim]
        # The replacement serves: with chunk 5's file back, everything loads.
        path.unlink()
        path.write_bytes(original)
        await engine.evict_l1()
        assert (await engine.retrieve(TOKENS, DST)).valid_tokens == len(TOKENS)
        assert plane.stats().worker_deaths == 1


async def test_a_read_cancelled_on_a_stuck_worker_returns_once_the_worker_is_killed(
    tmp_path: Path,
) -> None:
    """The plane's side of a load's deadline: a read whose caller is cancelled while its worker
    is stuck (a FIFO's open never returns) returns after the grace, its worker killed, so
    nothing writes its buffers afterwards; a new worker takes its place."""
    arena = HostArena(1 << 20, pin=False, shared=True)
    plane = WorkerPlane(arena, 1)
    fifo = tmp_path / "stuck"
    os.mkfifo(fifo)
    plane.start()
    try:
        (stuck,) = plane.worker_pids("read")
        read = asyncio.create_task(plane.read(str(fifo), 64, 4096, [(0, 4096)], 4096, 1))
        await asyncio.sleep(0.3)
        started = time.monotonic()
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        waited = time.monotonic() - started
        assert STUCK_GRACE_S <= waited < STUCK_GRACE_S + 2.0, waited
        assert not _alive(stuck)  # dead before the read returned
        stats = plane.stats()
        assert (stats.stuck_killed, stats.workers - stats.write_workers, stats.in_flight) == (
            1,
            1,
            0,
        )
        # The new worker reads a real file straight into the arena, and says whether its
        # payload was in the page cache before (just written: yes; dropped: no).
        data = os.urandom(4096 + 4096)
        path = tmp_path / "file"
        path.write_bytes(data)
        answer = await plane.read(str(path), 4096, 4096, [(8192, 4096)], 4096, 1)
        assert (answer.status, answer.header, answer.file_size) == ("read", data[:4096], 8192)
        assert bytes(arena.buffer(8192, 4096)) == data[4096:]
        assert answer.digests == [xxhash.xxh3_64_intdigest(data[4096:])]
        assert answer.cached is True
        drop_cached_pages(path)
        assert (await plane.read(str(path), 4096, 4096, [(0, 4096)], 4096, 1)).cached is False
    finally:
        await plane.aclose()
        arena.close()


def test_workers_die_with_a_killed_engine_process(tmp_path: Path) -> None:
    """SIGKILL of the engine's process: its workers exit (PR_SET_PDEATHSIG), and the arena, a
    memfd with no name, goes with the last mapping: nothing is left behind."""
    script = (
        "import asyncio, sys\n"
        "from tiered_kv import EngineConfig, TieredKVEngine\n"
        "async def main():\n"
        f"    config = EngineConfig(l1_size='8MiB', l2_path={str(tmp_path / 'l2')!r},\n"
        "                          io_plane='processes', io_workers=3)\n"
        "    engine = await TieredKVEngine(config).open()\n"
        "    print(*engine.io_plane.worker_pids(), flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        pids = [int(pid) for pid in child.stdout.readline().split()]
        assert len(pids) == 3 + 2 and all(_alive(pid) for pid in pids)  # readers, writers
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert _gone_within(pids, 10)


async def test_a_worker_writes_the_frame_encode_header_would_and_leaves_nothing_on_failure(
    tmp_path: Path,
) -> None:
    """A chunk written by a write worker from two arena runs (a payload of 3 stripes, the last
    short) is byte for byte the frame `encode_header` + payload make; a write whose rename
    fails leaves no file; a write on a stopped worker, its caller cancelled, returns once the
    worker is killed, and the caller is told nothing came."""
    stripe = STRIPE_BYTES
    arena = HostArena(16 << 20, pin=False, shared=True)
    plane = WorkerPlane(arena, 1, 1)
    plane.start()
    try:
        payload = os.urandom(2 * stripe + 1000)
        arena.buffer(0, 6000)[:] = payload[:6000]
        arena.buffer(65536, len(payload) - 6000)[:] = payload[6000:]
        runs = [(0, 6000), (65536, len(payload) - 6000)]
        specs = (GroupSpec("uint8", (6000,)), GroupSpec("uint8", (len(payload) - 6000,)))
        template = header_template(b"key", 7, specs)
        final = tmp_path / "ab" / "chunk"  # its directory does not exist yet
        write = plane.submit_write(
            str(tmp_path / "ab" / ".chunk.tmp"),
            str(final),
            template.data,
            template.checksums_at,
            runs,
            stripe,
            123_000_000_000,
            True,
            True,
        )
        done = await write.done()
        assert (done.status, done.errno) == ("written", 0)
        assert done.free_bytes is not None and done.free_bytes > 0
        digests = [
            xxhash.xxh3_64_intdigest(payload[start : start + stripe])
            for start in range(0, len(payload), stripe)
        ]
        frame = encode_header(b"key", 7, specs, payload_checksums([payload])) + payload
        assert final.read_bytes() == frame
        assert seal_header(template, digests) == frame[: len(template.data)]
        assert os.listdir(final.parent) == ["chunk"]
        assert final.stat().st_mtime_ns == 123_000_000_000
        # A job whose header has no room for its stripes' checksums: an error answer, and the
        # worker lives on.
        (writer,) = plane.worker_pids("write")
        wrong = await plane.submit_write(
            str(tmp_path / "ab" / ".w.tmp"),
            str(tmp_path / "ab" / "w"),
            template.data,
            template.checksums_at,
            runs,
            4096,
            1,
            False,
            False,
        ).done()
        assert wrong.status == "error" and "no room" in wrong.detail
        assert plane.worker_pids("write") == [writer] and plane.stats().worker_deaths == 0
        # A rename onto a directory fails: an error, no temp file left behind.
        (tmp_path / "ab" / "taken").mkdir()
        (tmp_path / "ab" / "taken" / "x").write_bytes(b"x")
        failed = await plane.submit_write(
            str(tmp_path / "ab" / ".taken.tmp"),
            str(tmp_path / "ab" / "taken"),
            template.data,
            template.checksums_at,
            runs,
            stripe,
            1,
            False,
            False,
        ).done()
        assert failed.status == "error" and failed.errno != 0, failed
        assert sorted(os.listdir(final.parent)) == ["chunk", "taken"]
        # A stopped worker: the caller leaves, the worker is killed after the grace.
        (writer,) = plane.worker_pids("write")
        os.kill(writer, signal.SIGSTOP)
        stuck = plane.submit_write(
            str(tmp_path / "ab" / ".late.tmp"),
            str(tmp_path / "ab" / "late"),
            template.data,
            template.checksums_at,
            runs,
            stripe,
            1,
            False,
            False,
        )
        waiter = asyncio.create_task(stuck.done())
        await asyncio.sleep(0.1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        started = time.monotonic()
        assert await stuck.settle() is None
        assert STUCK_GRACE_S <= time.monotonic() - started < STUCK_GRACE_S + 2.0
        assert not _alive(writer)
        assert plane.stats().stuck_killed == 1 and plane.worker_pids("write") != [writer]
    finally:
        await plane.aclose()
        arena.close()


async def test_writes_through_the_plane_survive_a_killed_write_worker(tmp_path: Path) -> None:
    """An engine's L2 writes go through write workers; one SIGKILLed while writes wait on it
    (stopped first, so they cannot finish): those writes fail (counted), leave no file, and the
    replacement writes the rest, which read back bit-exact."""
    caches = _caches()
    async with TieredKVEngine(_config(tmp_path, io_workers=1)) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        plane = engine.io_plane
        assert plane is not None and plane.write_size == 2
        writers = plane.worker_pids("write")
        for pid in writers:
            os.kill(pid, signal.SIGSTOP)
        assert await engine.store(TOKENS, SRC) == len(TOKENS)
        deadline = time.monotonic() + 10
        while plane.stats().writes < 8:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        for pid in writers:
            os.kill(pid, signal.SIGKILL)
        assert await engine.flush(timeout=30) == 0
        l2 = engine.stats().tier("L2")
        assert (l2.puts, l2.put_failures) == (0, 8)
        assert plane.stats().worker_deaths == 2
        root = str(engine.storage.lower[0].root)  # type: ignore[attr-defined]
        files = [name for _, _, names in os.walk(root) for name in names if name != ".lock"]
        assert files == []
        # Stored again (the chunks are still in L1: the same store is a no-op for L1, so
        # evict first), the new workers write them; they read back bit-exact.
        await engine.evict_l1()
        assert await engine.store(TOKENS, SRC) == len(TOKENS)
        assert await engine.flush(timeout=30) == 0
        assert engine.stats().tier("L2").puts == 8
        await engine.evict_l1()
        reference = caches.snapshot()
        poison_blocks(caches, DST)
        expected = caches.snapshot()
        assert (await engine.retrieve(TOKENS, DST)).valid_tokens == len(TOKENS)
        expect_copy(caches, expected, reference, SRC, DST, range(len(TOKENS)), 16)
        assert caches.bytes_equal(expected)


class _RecordingMapping:
    """A mapping that records `madvise` calls, or refuses them (an older kernel)."""

    def __init__(self, refuse: bool = False) -> None:
        self.calls: list[tuple[int, int, int]] = []
        self.refuse = refuse

    def madvise(self, advice: int, start: int, length: int) -> None:
        if self.refuse:
            raise OSError(22, "Invalid argument")
        self.calls.append((advice, start, length))


def test_a_job_maps_exactly_the_pages_it_fills_and_an_old_kernel_turns_that_off() -> None:
    from tiered_kv.io import worker

    populate = worker._Populate()
    mapping = _RecordingMapping()
    populate.mapping = mapping  # type: ignore[assignment]
    page = mmap.PAGESIZE
    # A payload in two arena runs; bytes [100, 3 pages + 50) of it span both runs.
    extents = [(5 * page + 10, 2 * page), (20 * page, 4 * page)]
    populate(extents, 100, 3 * page + 50)
    advice = worker._Populate.ADVICE
    assert mapping.calls == [
        (advice, 5 * page, 2 * page + 10),  # payload [100, 2 pages): from its first page
        (advice, 20 * page, page + 50),  # payload [2 pages, 3 pages + 50)
    ]
    # The calls do what they claim on a real shared mapping: no error, and bytes land.
    fd = os.memfd_create("tkv-populate-test")
    try:
        os.ftruncate(fd, 8 * page)
        with mmap.mmap(fd, 8 * page) as real:
            populate.mapping = real
            populate([(page + 1, 3 * page)], 0, 3 * page)
            assert populate.mapping is real  # the kernel here supports it (5.14+)
            real[page + 1 : 2 * page] = b"x" * (page - 1)
            assert os.pread(fd, 3, page + 1) == b"xxx"
            populate.mapping = None  # lets the mapping close
    finally:
        os.close(fd)
    refusing = _RecordingMapping(refuse=True)
    populate.mapping = refusing  # type: ignore[assignment]
    populate(extents, 0, page)
    assert populate.mapping is None  # refused once: off for good
    populate(extents, 0, page)  # and a no-op
