"""DiskTier on real files: round trips, restart, corruption, capacity, lock, faults, cancel."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import io
import logging
import os
import re
import shutil
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path

import pytest
import torch

from tiered_kv.codec import (
    PAYLOAD_ALIGN,
    CodecLimits,
    GroupSpec,
    decode_chunk,
    decode_header,
    encode_chunk,
    encoded_header_len,
)
from tiered_kv.errors import EngineStateError, L2DirectoryInUseError, TieredKVError
from tiered_kv.io import pagecache
from tiered_kv.keys import ChunkKey, KeyScope, chunk_keys
from tiered_kv.layout import GroupLayout, MemoryLayoutDesc
from tiered_kv.memory import HostArena, MemoryObj
from tiered_kv.threads import write_threads
from tiered_kv.tiers import l2
from tiered_kv.tiers.l2 import DiskStats, DiskTier, FileOps, scan_directory
from tiered_kv.tiers.testing import FullDiskFileOps

CHUNK = 16
LAYOUT = MemoryLayoutDesc(
    (
        GroupLayout(torch.bfloat16, num_layers=2, kv_count=2, row_elems=64),
        GroupLayout(torch.int8, num_layers=1, kv_count=1, row_elems=132),  # 132-byte rows
        GroupLayout(torch.float32, num_layers=3, kv_count=1, row_elems=5),
    ),
    CHUNK,
)
SCOPE = KeyScope("tenant", "test-model", "v1", 1, 0, LAYOUT.layout_id)
POISON = 0xA5
BIG = 1 << 24


# -- helpers ------------------------------------------------------------------------------------
def make_keys(count: int, *, salt: int = 0) -> list[ChunkKey]:
    tokens = [salt * 100_003 + i for i in range(count * CHUNK)]
    return chunk_keys(SCOPE, tokens, CHUNK)


def make_obj(arena: HostArena, num_tokens: int = CHUNK, seed: int = 0) -> MemoryObj:
    obj = arena.allocate_obj(LAYOUT, num_tokens)
    assert obj is not None
    gen = torch.Generator().manual_seed(seed)
    obj.raw().copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def poisoned_obj(arena: HostArena, num_tokens: int = CHUNK) -> MemoryObj:
    obj = arena.allocate_obj(LAYOUT, num_tokens)
    assert obj is not None
    obj.raw().fill_(POISON)
    return obj


def same_groups(a: MemoryObj, b: MemoryObj) -> bool:
    return all(torch.equal(a.group_bytes(g), b.group_bytes(g)) for g in range(len(LAYOUT.groups)))


def gaps_untouched(obj: MemoryObj) -> bool:
    """The alignment gaps between groups still hold the poison (get_into wrote groups only)."""
    raw = obj.raw()
    offsets = LAYOUT.group_offsets(obj.num_tokens)
    ends = [off + g.nbytes(obj.num_tokens) for off, g in zip(offsets, LAYOUT.groups, strict=True)]
    return all(
        bool((raw[end:start] == POISON).all())
        for end, start in zip(ends[:-1], offsets[1:], strict=True)
    )


def file_size(key: ChunkKey, num_tokens: int = CHUNK) -> int:
    specs = tuple(
        GroupSpec(name, g.shape(num_tokens))
        for name, g in zip(("bfloat16", "int8", "float32"), LAYOUT.groups, strict=True)
    )
    return encoded_header_len(len(key.to_bytes()), specs) + LAYOUT.payload_nbytes(num_tokens)


async def store_and_close(root: Path, chunks: Iterable[tuple[ChunkKey, MemoryObj]]) -> None:
    """A tier on ``root`` stores every chunk, then closes: what a process leaves for a restart."""
    tier = DiskTier(root, BIG)
    await tier.open()
    try:
        for key, obj in chunks:
            assert await tier.put(key, obj)
    finally:
        await tier.aclose()


def path_of(root: Path, key: ChunkKey) -> Path:
    return root / key.hex[:2] / key.hex


def files_under(root: Path) -> list[str]:
    """Every file below ``root`` except the lock, as sorted relative paths."""
    return sorted(
        str(path.relative_to(root))
        for path in root.rglob("*")
        if path.is_file() and path.name != l2.LOCK_NAME
    )


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture
def arena() -> Iterator[HostArena]:
    arena = HostArena(1 << 22, pin=False)
    yield arena
    assert arena.used == 0, "a test leaked MemoryObj references"
    assert arena.close() == 0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "l2"


@pytest.fixture
def key() -> ChunkKey:
    return make_keys(1)[0]


@pytest.fixture
def source(arena: HostArena) -> Iterator[MemoryObj]:
    """A full chunk of random bytes, released after the test."""
    obj = make_obj(arena)
    yield obj
    obj.unref()


@pytest.fixture
def target(arena: HostArena) -> Iterator[MemoryObj]:
    """A full chunk of poison to read into, released after the test."""
    obj = poisoned_obj(arena)
    yield obj
    obj.unref()


@pytest.fixture
async def tier(root: Path) -> AsyncIterator[DiskTier]:
    tier = DiskTier(root, BIG)
    await tier.open()
    yield tier
    await tier.aclose()


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("num_tokens", [CHUNK, 5, 1])
async def test_round_trip_is_bit_exact(
    tier: DiskTier, arena: HostArena, root: Path, num_tokens: int
) -> None:
    key = make_keys(1)[0]
    source = make_obj(arena, num_tokens, seed=num_tokens)
    target = poisoned_obj(arena, num_tokens)
    try:
        assert await tier.put(key, source)
        assert tier.contains(key)
        assert files_under(root) == [f"{key.hex[:2]}/{key.hex}"]
        assert path_of(root, key).stat().st_size == file_size(key, num_tokens)

        assert await tier.get_into(key, target)
        assert same_groups(source, target)
        assert gaps_untouched(target)
        stats = tier.stats()
        assert stats.entries == 1
        assert stats.bytes_used == file_size(key, num_tokens)
        assert stats.puts == stats.hits == 1
        assert stats.bytes_written == file_size(key, num_tokens)
        assert stats.bytes_read == LAYOUT.payload_nbytes(num_tokens)
        assert stats.misses == stats.put_failures == 0
    finally:
        source.unref()
        target.unref()


async def test_partial_last_chunk_of_a_prompt(tier: DiskTier, arena: HostArena) -> None:
    keys = chunk_keys(SCOPE, list(range(CHUNK + 5)), CHUNK)
    full, partial = make_obj(arena, CHUNK, 1), make_obj(arena, 5, 2)
    targets = [poisoned_obj(arena, CHUNK), poisoned_obj(arena, 5)]
    try:
        assert await tier.put(keys[0], full)
        assert await tier.put(keys[1], partial)
        assert await tier.get_into(keys[0], targets[0])
        assert await tier.get_into(keys[1], targets[1])
        assert same_groups(full, targets[0])
        assert same_groups(partial, targets[1])
        assert [tokens for _, tokens, _ in tier.entries()] == [CHUNK, 5]
    finally:
        for obj in (full, partial, *targets):
            obj.unref()


async def test_file_is_a_codec_frame(
    tier: DiskTier, key: ChunkKey, source: MemoryObj, root: Path
) -> None:
    assert await tier.put(key, source)
    header, payloads = decode_chunk(path_of(root, key).read_bytes())
    assert header.key_bytes == key.to_bytes()
    assert header.num_tokens == CHUNK
    assert header.groups == source.group_specs()
    assert header.groups[1] == GroupSpec("int8", (1, 1, CHUNK, 132))
    assert [bytes(p) for p in payloads] == [bytes(b) for b in source.group_buffers()]


async def test_payload_is_page_aligned_in_the_file(
    tier: DiskTier, key: ChunkKey, source: MemoryObj, root: Path
) -> None:
    assert await tier.put(key, source)
    data = path_of(root, key).read_bytes()
    header = decode_header(data)
    assert header.header_len % PAYLOAD_ALIGN == 0
    first = bytes(source.group_buffers()[0])
    assert data[header.header_len : header.header_len + len(first)] == first


@pytest.mark.parametrize("slice_bytes", [1, 100, 2048, 4096])
async def test_sliced_reads_and_payload_first_writes_are_bit_exact(
    arena: HostArena,
    root: Path,
    slice_bytes: int,
) -> None:
    """Read slices that split groups anywhere still verify the whole payload's checksum."""
    offsets: list[tuple[int, int]] = []

    class RecordingWrites(FileOps):
        read_slice_bytes = slice_bytes

        def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
            offsets.append((offset, len(data)))
            return super().pwrite(fd, data, offset)

    tier = DiskTier(root, BIG, file_ops=RecordingWrites())
    await tier.open()
    key = make_keys(1)[0]
    source, target = make_obj(arena, 5, seed=3), poisoned_obj(arena, 5)
    try:
        assert await tier.put(key, source)
        header_len = file_size(key, 5) - LAYOUT.payload_nbytes(5)
        # One write per group, in order from the header's end, then the header at offset 0.
        group_sizes = [len(b) for b in source.group_buffers()]
        assert [size for _, size in offsets] == [*group_sizes, header_len]
        assert [offset for offset, _ in offsets] == [
            header_len + sum(group_sizes[:index]) for index in range(len(group_sizes))
        ] + [0]
        _, payloads = decode_chunk(path_of(root, key).read_bytes())
        assert [bytes(p) for p in payloads] == [bytes(b) for b in source.group_buffers()]
        assert await tier.get_into(key, target)
        assert same_groups(source, target)
        assert gaps_untouched(target)
    finally:
        source.unref()
        target.unref()
        await tier.aclose()


async def test_put_beyond_the_codec_limits_fails_without_a_file(
    root: Path, key: ChunkKey, source: MemoryObj
) -> None:
    tier = DiskTier(root, BIG, limits=CodecLimits(max_key_bytes=8))
    await tier.open()
    try:
        assert not await tier.put(key, source)
        assert files_under(root) == []
        assert tier.stats().put_failures == 1
        assert tier.stats().bytes_reserved == 0
    finally:
        await tier.aclose()


async def test_put_of_a_present_key_does_not_rewrite(
    tier: DiskTier, key: ChunkKey, source: MemoryObj, root: Path
) -> None:
    assert await tier.put(key, source)
    inode = path_of(root, key).stat().st_ino
    assert await tier.put(key, source)
    assert path_of(root, key).stat().st_ino == inode
    assert tier.stats().puts == 1


async def test_concurrent_puts_of_one_key_write_once(
    tier: DiskTier, key: ChunkKey, source: MemoryObj, root: Path
) -> None:
    assert await asyncio.gather(*(tier.put(key, source) for _ in range(4))) == [True] * 4
    assert tier.stats().puts == 1
    assert tier.stats().bytes_used == file_size(key)
    assert files_under(root) == [f"{key.hex[:2]}/{key.hex}"]


async def test_without_fsync(
    root: Path, key: ChunkKey, source: MemoryObj, target: MemoryObj
) -> None:
    tier = DiskTier(root, BIG, durability="none")
    await tier.open()
    try:
        assert await tier.put(key, source)
        assert await tier.get_into(key, target)
        assert same_groups(source, target)
    finally:
        await tier.aclose()


class SyncRecording(FileOps):
    """Counts the filesystem syncs and directory fsyncs the tier asks for; ``fail_syncs`` makes
    the filesystem syncs raise (an I/O error at write-back)."""

    def __init__(self) -> None:
        self.filesystem_syncs = 0
        self.directory_fsyncs = 0
        self.fail_syncs = False

    def sync_filesystem(self, directory: Path) -> None:
        self.filesystem_syncs += 1
        if self.fail_syncs:
            raise OSError(errno.EIO, "injected write-back error")
        super().sync_filesystem(directory)

    def fsync_directory(self, directory: Path) -> None:
        self.directory_fsyncs += 1
        super().fsync_directory(directory)


async def test_batched_durability_syncs_the_filesystem_once_for_many_puts_and_at_close(
    root: Path, arena: HostArena
) -> None:
    ops = SyncRecording()
    tier = DiskTier(root, BIG, durability="batched", sync_interval_s=0.2, file_ops=ops)
    await tier.open()
    keys = make_keys(6)
    sources = [make_obj(arena, seed=i) for i in range(6)]
    try:
        puts = (tier.put(k, o) for k, o in zip(keys, sources, strict=True))
        assert all(await asyncio.gather(*puts))
        # The puts returned before anything was synced, and no put fsynced its directory.
        assert (ops.filesystem_syncs, ops.directory_fsyncs) == (0, 0)
        assert tier.stats().unsynced_puts == 6
        deadline = asyncio.get_running_loop().time() + 10
        while tier.stats().filesystem_syncs == 0:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        assert ops.filesystem_syncs == 1 and tier.stats().unsynced_puts == 0  # one for all six
        assert await tier.put(make_keys(1, salt=5)[0], sources[0])
        assert tier.stats().unsynced_puts == 1
    finally:
        await tier.aclose()  # syncs the last put at once, not an interval later
        for obj in sources:
            obj.unref()
    assert ops.filesystem_syncs == 2 and ops.directory_fsyncs == 0


@pytest.mark.parametrize("durability", ["none", "per_write"])
async def test_durability_none_never_syncs_and_per_write_syncs_every_put(
    root: Path, arena: HostArena, durability: str
) -> None:
    ops = SyncRecording()
    tier = DiskTier(
        root,
        BIG,
        durability=durability,  # type: ignore[arg-type]
        sync_interval_s=0.01,
        file_ops=ops,
    )
    await tier.open()
    source = make_obj(arena, seed=1)
    try:
        for key in make_keys(3):
            assert await tier.put(key, source)
        await asyncio.sleep(0.1)
    finally:
        await tier.aclose()
        source.unref()
    assert ops.filesystem_syncs == 0
    # per_write: each put's rename is made durable by a directory fsync before it returns.
    assert (ops.directory_fsyncs >= 3) is (durability == "per_write")


async def test_a_failed_batched_sync_is_counted_and_the_chunks_still_read_back(
    root: Path, arena: HostArena, caplog: pytest.LogCaptureFixture
) -> None:
    ops = SyncRecording()
    ops.fail_syncs = True
    tier = DiskTier(root, BIG, durability="batched", sync_interval_s=0.01, file_ops=ops)
    await tier.open()
    key, source, target = make_keys(1)[0], make_obj(arena, seed=2), poisoned_obj(arena)
    try:
        assert await tier.put(key, source)
        deadline = asyncio.get_running_loop().time() + 10
        while tier.stats().sync_failures == 0:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        assert "L2 sync of" in caplog.text
        assert await tier.get_into(key, target)  # every read is checked: a good file serves
        assert same_groups(source, target)
    finally:
        await tier.aclose()
        for obj in (source, target):
            obj.unref()


def test_durability_is_checked() -> None:
    with pytest.raises(TieredKVError, match="durability must be one of"):
        DiskTier("/tmp/unused", BIG, durability="fsync")  # type: ignore[arg-type]
    with pytest.raises(TieredKVError, match="sync_interval_s must be > 0"):
        DiskTier("/tmp/unused", BIG, sync_interval_s=0)


# -- restart ------------------------------------------------------------------------------------
async def test_restart_reuses_the_directory(root: Path, arena: HostArena) -> None:
    keys = make_keys(3)
    sources = [make_obj(arena, seed=i) for i in range(3)]
    await store_and_close(root, zip(keys, sources, strict=True))

    second = DiskTier(root, BIG)
    await second.open()
    target = poisoned_obj(arena)
    try:
        assert all(second.contains(key) for key in keys)
        assert sorted(k.hex for k, _, _ in second.entries()) == sorted(k.hex for k in keys)
        assert second.stats().bytes_used == 3 * file_size(keys[0])
        for key, obj in zip(keys, sources, strict=True):
            target.raw().fill_(POISON)
            assert await second.get_into(key, target)
            assert same_groups(obj, target)
    finally:
        for obj in (*sources, target):
            obj.unref()
        await second.aclose()


async def test_restart_orders_lru_by_mtime(root: Path, source: MemoryObj) -> None:
    keys = make_keys(3)
    await store_and_close(root, ((key, source) for key in keys))
    # Oldest first: keys[2], keys[0], keys[1].
    for key, mtime in zip(keys, (2_000, 3_000, 1_000), strict=True):
        os.utime(path_of(root, key), ns=(mtime * 10**9, mtime * 10**9))
    size = file_size(keys[0])
    second = DiskTier(root, 2 * size)
    await second.open()
    try:
        assert [k for k, _, _ in second.entries()] == [keys[0], keys[1]]
        assert not (path_of(root, keys[2])).exists()
        assert second.stats().evictions == 1
    finally:
        await second.aclose()


# -- corruption ---------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["header", "payload_start", "payload_end"])
async def test_corrupt_file_is_a_miss_and_removed(
    tier: DiskTier, key: ChunkKey, source: MemoryObj, target: MemoryObj, root: Path, where: str
) -> None:
    assert await tier.put(key, source)
    path = path_of(root, key)
    data = bytearray(path.read_bytes())
    header_len = file_size(key) - LAYOUT.payload_nbytes(CHUNK)
    offset = {"header": 30, "payload_start": header_len, "payload_end": len(data) - 1}[where]
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))

    assert not await tier.get_into(key, target)
    assert not path.exists()
    assert not tier.contains(key)
    stats = tier.stats()
    assert stats.corrupt_removed == 1
    assert stats.misses == 1
    assert stats.entries == stats.bytes_used == 0
    # Stored again, it is served again.
    assert await tier.put(key, source)
    assert await tier.get_into(key, target)
    assert same_groups(source, target)


async def test_truncated_file_is_removed_at_read(
    tier: DiskTier, key: ChunkKey, source: MemoryObj, target: MemoryObj, root: Path
) -> None:
    assert await tier.put(key, source)
    os.truncate(path_of(root, key), file_size(key) - 100)
    assert not await tier.get_into(key, target)
    assert not path_of(root, key).exists()
    assert tier.stats().corrupt_removed == 1


async def test_open_removes_torn_garbage_misnamed_and_temp_files(
    root: Path, source: MemoryObj
) -> None:
    keys = make_keys(3)
    await store_and_close(root, ((key, source) for key in keys))
    good, torn, moved = keys
    os.truncate(path_of(root, torn), 50)
    misnamed = root / moved.hex[:2] / ("0" * len(moved.hex))
    path_of(root, moved).rename(misnamed)
    (root / "ab").mkdir(exist_ok=True)
    (root / "ab" / "abcdef").write_bytes(b"not a chunk at all")
    (root / good.hex[:2] / f".{good.hex}.123.deadbeef.tmp").write_bytes(b"half a chunk")
    (root / "README").write_text("not ours: left alone")

    tier = DiskTier(root, BIG)
    await tier.open()
    try:
        assert [k for k, _, _ in tier.entries()] == [good]
        assert files_under(root) == sorted(["README", f"{good.hex[:2]}/{good.hex}"])
        assert tier.stats().corrupt_removed == 3
    finally:
        await tier.aclose()


async def test_file_replaced_with_another_layout_is_kept(
    tier: DiskTier, arena: HostArena, root: Path
) -> None:
    key = make_keys(1)[0]
    source, small, target = make_obj(arena), make_obj(arena, 5), poisoned_obj(arena)
    try:
        assert await tier.put(key, source)
        # Same key, 5 tokens: a valid frame, but not what the index (or the reader) expects.
        parts = encode_chunk(key.to_bytes(), 5, small.group_specs(), small.group_buffers())
        path_of(root, key).write_bytes(b"".join(parts))
        assert not await tier.get_into(key, target)
        assert path_of(root, key).exists()
        assert tier.stats().layout_mismatch == 1
        assert tier.stats().corrupt_removed == 0
    finally:
        for obj in (source, small, target):
            obj.unref()


async def test_file_deleted_behind_our_back_is_a_miss(
    tier: DiskTier, key: ChunkKey, source: MemoryObj, target: MemoryObj, root: Path
) -> None:
    assert await tier.put(key, source)
    path_of(root, key).unlink()
    assert tier.contains(key)  # the index is stale only towards a later miss
    assert not await tier.get_into(key, target)
    assert not tier.contains(key)
    assert tier.stats().bytes_used == 0
    assert tier.stats().misses == 1


# -- layout -------------------------------------------------------------------------------------
async def test_layout_mismatch_is_a_miss_and_keeps_the_file(
    tier: DiskTier, arena: HostArena, root: Path
) -> None:
    key = make_keys(1)[0]
    source, other = make_obj(arena, CHUNK), poisoned_obj(arena, 7)
    try:
        assert await tier.put(key, source)
        assert not await tier.get_into(key, other)
        assert tier.contains(key)
        assert path_of(root, key).exists()
        assert tier.stats().layout_mismatch == 1
        assert bool((other.raw() == POISON).all())  # nothing was read into it
    finally:
        source.unref()
        other.unref()


async def test_miss(tier: DiskTier, arena: HostArena) -> None:
    target = poisoned_obj(arena)
    try:
        assert not await tier.get_into(make_keys(1)[0], target)
        assert tier.stats().misses == 1
    finally:
        target.unref()


# -- capacity -----------------------------------------------------------------------------------
async def test_capacity_evicts_least_recently_used(root: Path, arena: HostArena) -> None:
    keys = make_keys(4)
    size = file_size(keys[0])
    tier = DiskTier(root, 3 * size + size // 2)
    await tier.open()
    obj, target = make_obj(arena), poisoned_obj(arena)
    try:
        for key in keys[:3]:
            assert await tier.put(key, obj)
        assert await tier.get_into(keys[0], target)  # keys[0] becomes most recent
        assert await tier.put(keys[3], obj)
        assert [k for k, _, _ in tier.entries()] == [keys[2], keys[0], keys[3]]
        assert not tier.contains(keys[1])
        assert not path_of(root, keys[1]).exists()
        stats = tier.stats()
        assert stats.evictions == 1
        assert stats.bytes_used == 3 * size <= tier.capacity
        assert len(files_under(root)) == 3
    finally:
        obj.unref()
        target.unref()
        await tier.aclose()


async def test_chunk_larger_than_capacity_is_refused(
    root: Path, key: ChunkKey, source: MemoryObj
) -> None:
    tier = DiskTier(root, file_size(key) - 1)
    await tier.open()
    try:
        assert not await tier.put(key, source)
        assert tier.stats().put_refused == 1
        assert files_under(root) == []
    finally:
        await tier.aclose()


async def test_remove(tier: DiskTier, key: ChunkKey, source: MemoryObj, root: Path) -> None:
    assert await tier.put(key, source)
    assert await tier.remove(key)
    assert not tier.contains(key)
    assert not path_of(root, key).exists()
    assert not await tier.remove(key)
    assert tier.stats().bytes_used == 0


# -- the directory lock -------------------------------------------------------------------------
async def test_second_tier_on_the_same_directory_is_refused(tier: DiskTier, root: Path) -> None:
    other = DiskTier(root, BIG)
    with pytest.raises(L2DirectoryInUseError, match=str(root)):
        await other.open()
    await tier.aclose()
    await tier.aclose()  # idempotent
    await other.open()  # the lock is free again
    await other.aclose()


async def test_use_outside_open_raises(root: Path, arena: HostArena) -> None:
    tier = DiskTier(root, BIG)
    obj = make_obj(arena)
    try:
        with pytest.raises(EngineStateError, match="open"):
            await tier.put(make_keys(1)[0], obj)
        await tier.open()
        with pytest.raises(EngineStateError, match="open"):
            await tier.open()
        await tier.aclose()
        with pytest.raises(EngineStateError):
            await tier.get_into(make_keys(1)[0], obj)
    finally:
        obj.unref()


# -- faults and cancellation --------------------------------------------------------------------
@pytest.mark.parametrize("failing_call", [1, 3, 4])
async def test_put_failure_leaves_nothing(
    key: ChunkKey,
    source: MemoryObj,
    root: Path,
    caplog: pytest.LogCaptureFixture,
    failing_call: int,
) -> None:
    class FailingWrites(FileOps):
        calls = 0
        failing = True

        def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
            self.calls += 1
            # Calls 1-3 write the three groups, call 4 the header; the disk fills up in the middle.
            if self.failing and self.calls == failing_call:
                os.pwrite(fd, data[:100], offset)
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().pwrite(fd, data, offset)

    file_ops = FailingWrites()
    tier = DiskTier(root, BIG, durability="per_write", file_ops=file_ops)
    await tier.open()
    try:
        with caplog.at_level(logging.WARNING, logger=l2.__name__):
            assert not await tier.put(key, source)
        assert files_under(root) == []
        assert not tier.contains(key)
        stats = tier.stats()
        assert stats.put_failures == 1
        assert stats.bytes_used == stats.bytes_reserved == 0
        failure = [r for r in caplog.records if r.exc_info]
        assert failure and failure[0].exc_info and failure[0].exc_info[0] is OSError

        file_ops.failing = False
        assert await tier.put(key, source)
    finally:
        await tier.aclose()


async def test_put_cancelled_mid_write_leaves_nothing(
    key: ChunkKey, source: MemoryObj, root: Path
) -> None:
    started, release = threading.Event(), threading.Event()

    class SlowWrites(FileOps):
        calls = 0
        slow = True

        def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
            self.calls += 1
            written = super().pwrite(fd, data, offset)
            if self.slow and self.calls == 2:
                started.set()
                release.wait(10)
            return written

    file_ops = SlowWrites()
    tier = DiskTier(root, BIG, durability="per_write", file_ops=file_ops)
    await tier.open()
    try:
        task = asyncio.create_task(tier.put(key, source))
        assert await asyncio.to_thread(started.wait, 10)
        assert [name for name in files_under(root) if name.endswith(".tmp")]
        task.cancel()
        await asyncio.sleep(0.05)
        assert not task.done()  # the thread still reads source's bytes: put must not return yet
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert file_ops.calls == 2  # stopped at the next step
        assert files_under(root) == []
        assert not tier.contains(key)
        assert tier.stats().bytes_reserved == 0
        assert tier.stats().put_failures == 0

        file_ops.slow = False
        assert await tier.put(key, source)
    finally:
        await tier.aclose()


class FaultyFileOps(FileOps):
    """The L2 I/O seam with faults: directory syncs and reads pass through ``on_fsync_directory``
    and ``on_readinto`` (which may block, record or raise) before the real call."""

    def __init__(self, *, read_slice_bytes: int | None = None) -> None:
        if read_slice_bytes is not None:
            self.read_slice_bytes = read_slice_bytes
        self.on_fsync_directory: Callable[[Path], None] | None = None
        self.on_readinto: Callable[[], None] | None = None

    def fsync_directory(self, directory: Path) -> None:
        if self.on_fsync_directory is not None:
            self.on_fsync_directory(directory)
        super().fsync_directory(directory)

    def readinto(self, file: io.FileIO, buffer: memoryview) -> int:
        count = super().readinto(file, buffer)
        if self.on_readinto is not None:
            self.on_readinto()
        return count


@pytest.fixture
async def faulty_tier(root: Path) -> AsyncIterator[tuple[DiskTier, FaultyFileOps]]:
    file_ops = FaultyFileOps(read_slice_bytes=64)  # several slices per group
    tier = DiskTier(root, BIG, durability="per_write", file_ops=file_ops)
    await tier.open()
    yield tier, file_ops
    await tier.aclose()


async def test_put_cancelled_after_the_rename_keeps_a_complete_chunk(
    faulty_tier: tuple[DiskTier, FaultyFileOps],
    key: ChunkKey,
    source: MemoryObj,
    target: MemoryObj,
    root: Path,
) -> None:
    tier, file_ops = faulty_tier
    started, release = threading.Event(), threading.Event()

    def slow_fsync_dir(directory: Path) -> None:
        if directory == path_of(root, key).parent:  # after the rename, not the new shard's
            started.set()
            release.wait(10)

    file_ops.on_fsync_directory = slow_fsync_dir
    task = asyncio.create_task(tier.put(key, source))
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert tier.contains(key)
    assert files_under(root) == [f"{key.hex[:2]}/{key.hex}"]
    assert await tier.get_into(key, target)
    assert same_groups(source, target)


@pytest.mark.parametrize("failing", ["root", "shard"])
async def test_failed_directory_fsync_unpublishes_the_file(
    faulty_tier: tuple[DiskTier, FaultyFileOps],
    key: ChunkKey,
    source: MemoryObj,
    root: Path,
    failing: str,
) -> None:
    tier, file_ops = faulty_tier
    failing_dir = {"root": root, "shard": path_of(root, key).parent}[failing]

    def failing_fsync_dir(directory: Path) -> None:
        if directory == failing_dir:
            raise OSError(errno.EIO, "Input/output error")

    file_ops.on_fsync_directory = failing_fsync_dir
    assert not await tier.put(key, source)
    assert files_under(root) == []
    assert not tier.contains(key)
    assert tier.stats().put_failures == 1
    # A shard directory whose entry may not be durable is not kept for the next put.
    assert path_of(root, key).parent.exists() == (failing == "shard")


async def test_a_new_shard_directory_is_made_durable_once(
    faulty_tier: tuple[DiskTier, FaultyFileOps], key: ChunkKey, source: MemoryObj, root: Path
) -> None:
    tier, file_ops = faulty_tier
    synced: list[Path] = []
    file_ops.on_fsync_directory = synced.append
    shard = path_of(root, key).parent
    assert await tier.put(key, source)
    assert synced == [root, shard]  # the new shard's entry, then the chunk's rename
    assert await tier.remove(key)
    synced.clear()
    assert await tier.put(key, source)
    assert synced == [shard]


async def test_get_cancelled_mid_read_waits_for_the_thread(
    faulty_tier: tuple[DiskTier, FaultyFileOps], key: ChunkKey, source: MemoryObj, target: MemoryObj
) -> None:
    tier, file_ops = faulty_tier
    started, release = threading.Event(), threading.Event()
    calls = 0

    def slow_readinto() -> None:
        nonlocal calls
        calls += 1
        started.set()
        release.wait(10)

    assert await tier.put(key, source)
    file_ops.on_readinto = slow_readinto
    task = asyncio.create_task(tier.get_into(key, target))
    assert await asyncio.to_thread(started.wait, 10)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # the thread still writes into target: no return yet
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert calls == 1  # stopped before the next slice
    assert tier.contains(key)  # a cancelled read is not corruption
    file_ops.on_readinto = None
    assert await tier.get_into(key, target)
    assert same_groups(source, target)


async def test_read_error_is_a_miss_and_keeps_the_file(
    faulty_tier: tuple[DiskTier, FaultyFileOps],
    key: ChunkKey,
    source: MemoryObj,
    target: MemoryObj,
    root: Path,
) -> None:
    tier, file_ops = faulty_tier

    def failing_readinto() -> None:
        raise OSError(errno.EIO, "Input/output error")

    assert await tier.put(key, source)
    file_ops.on_readinto = failing_readinto
    assert not await tier.get_into(key, target)
    assert tier.contains(key)
    assert path_of(root, key).exists()
    assert tier.stats().read_failures == 1


# -- a full disk, a removed directory ------------------------------------------------------------
def temp_files(root: Path) -> list[str]:
    return [name for name in files_under(root) if name.endswith(".tmp")]


async def assert_every_entry_reads_back(
    tier: DiskTier, arena: HostArena, seeds: dict[ChunkKey, int]
) -> int:
    """Every indexed chunk reads back bit-exact; returns how many were checked."""
    target = poisoned_obj(arena)
    try:
        for key, _, _ in tier.entries():
            expected = make_obj(arena, seed=seeds[key])
            try:
                target.raw().fill_(POISON)
                assert await tier.get_into(key, target), key.hex
                assert same_groups(expected, target), key.hex
            finally:
                expected.unref()
    finally:
        target.unref()
    return len(tier.entries())


@pytest.mark.parametrize("error_number", [errno.ENOSPC, errno.EDQUOT], ids=["ENOSPC", "EDQUOT"])
async def test_full_disk_evicts_and_writes_resume(
    root: Path, arena: HostArena, error_number: int
) -> None:
    """The filesystem holds 10 chunks, far below ``capacity``: puts go on by evicting."""
    keys = make_keys(30)
    size = file_size(keys[0])
    disk = FullDiskFileOps(root, 10 * size + size // 2, error_number=error_number)
    tier = DiskTier(root, BIG, file_ops=disk)
    await tier.open()
    seeds = {key: index % 3 for index, key in enumerate(keys)}
    objs = [make_obj(arena, seed=seed) for seed in range(3)]
    try:
        stored = [await tier.put(key, objs[seeds[key]]) for key in keys]
        assert all(stored)
        assert disk.failures >= 1  # the disk really was full
        stats = tier.stats()
        assert stats.no_space_errors >= 1
        assert stats.put_failures == 0
        assert stats.puts == 30
        assert stats.evictions >= 20
        assert stats.capacity == BIG
        assert stats.bytes_used <= stats.effective_capacity <= 10 * size + size // 2
        assert [k for k, _, _ in tier.entries()] == keys[-len(tier.entries()) :]
        assert len(tier.entries()) >= 8
        assert temp_files(root) == []
        assert len(files_under(root)) == len(tier.entries())
        assert await assert_every_entry_reads_back(tier, arena, seeds) == len(tier.entries())
    finally:
        for obj in objs:
            obj.unref()
        await tier.aclose()


async def test_effective_capacity_comes_back_when_space_frees(root: Path, arena: HostArena) -> None:
    keys = make_keys(40)
    size = file_size(keys[0])
    disk = FullDiskFileOps(root, 10 * size + size // 2)
    tier = DiskTier(root, BIG, file_ops=disk)
    await tier.open()
    obj = make_obj(arena)
    try:
        for key in keys[:20]:
            assert await tier.put(key, obj)
        lowered = tier.stats().effective_capacity
        assert lowered <= 10 * size + size // 2
        disk.limit_bytes = 40 * size  # another program freed space
        for key in keys[20:]:
            assert await tier.put(key, obj)
        stats = tier.stats()
        assert lowered < stats.effective_capacity <= 40 * size
        assert stats.entries > 20
        assert stats.put_failures == 0
        disk.limit_bytes = 2 * BIG  # more than capacity: the full capacity is back
        assert await tier.put(make_keys(1, salt=7)[0], obj)
        assert tier.stats().effective_capacity == BIG
    finally:
        obj.unref()
        await tier.aclose()


async def test_disk_full_of_other_files_refuses_without_writing_then_recovers(
    root: Path, arena: HostArena
) -> None:
    keys = make_keys(3)
    size = file_size(keys[0])
    disk = FullDiskFileOps(root, size // 2)  # not even one chunk fits, and none is ours
    tier = DiskTier(root, BIG, file_ops=disk)
    await tier.open()
    obj = make_obj(arena)
    try:
        assert not await tier.put(keys[0], obj)  # tried, failed: nothing to evict
        assert disk.failures == 1
        assert tier.stats().effective_capacity < size
        assert not await tier.put(keys[1], obj)  # measured, refused, not tried
        assert disk.failures == 1
        stats = tier.stats()
        assert stats.put_failures == stats.put_refused == stats.no_space_errors == 1
        assert temp_files(root) == []
        disk.limit_bytes = 5 * size  # the other files went away
        assert await tier.put(keys[2], obj)
        assert tier.stats().effective_capacity >= 4 * size
    finally:
        obj.unref()
        await tier.aclose()


async def test_removed_directory_is_recreated_with_its_lock(root: Path, arena: HostArena) -> None:
    keys = make_keys(2)
    tier = DiskTier(root, BIG)
    await tier.open()
    source, target = make_obj(arena), poisoned_obj(arena)
    try:
        assert await tier.put(keys[0], source)
        shutil.rmtree(root)
        assert await tier.put(keys[1], source)
        assert files_under(root) == [f"{keys[1].hex[:2]}/{keys[1].hex}"]
        assert not tier.contains(keys[0])  # its file went with the directory
        stats = tier.stats()
        assert stats.directory_recreated == 1
        assert stats.bytes_used == file_size(keys[1])
        assert await tier.get_into(keys[1], target)
        assert same_groups(source, target)
        other = DiskTier(root, BIG)
        with pytest.raises(L2DirectoryInUseError, match=str(root)):
            await other.open()  # the recreated directory is still ours alone
    finally:
        source.unref()
        target.unref()
        await tier.aclose()


async def test_removed_directory_taken_by_another_tier_is_left_to_it(
    root: Path, arena: HostArena
) -> None:
    keys = make_keys(2)
    tier = DiskTier(root, BIG)
    await tier.open()
    obj = make_obj(arena)
    other = DiskTier(root, BIG)
    try:
        assert await tier.put(keys[0], obj)
        shutil.rmtree(root)
        await other.open()  # a new process takes the new directory
        assert not await tier.put(keys[1], obj)
        assert files_under(root) == []  # nothing written into the other tier's directory
        assert tier.stats().put_failures == 1
        assert not await tier.put(keys[1], obj)  # and it stays that way
        assert files_under(root) == []
        assert tier.entries() == []  # nothing there is ours to read, evict or remove
        assert await other.put(keys[0], obj)
        assert not await tier.remove(keys[0])
        assert path_of(root, keys[0]).exists()
    finally:
        obj.unref()
        await other.aclose()
        await tier.aclose()


@pytest.mark.parametrize("how", ["parent_is_a_file", "root_is_a_file", "read_only"])
async def test_unusable_directory_at_open_raises_tiered_kv_error(tmp_path: Path, how: str) -> None:
    if how == "parent_is_a_file":
        (tmp_path / "file").write_bytes(b"")
        root = tmp_path / "file" / "l2"
    elif how == "root_is_a_file":
        root = tmp_path / "l2"
        root.write_bytes(b"")
    else:
        if os.geteuid() == 0:
            pytest.skip("root ignores directory permissions; the other variants cover the error")
        root = tmp_path / "l2"
        root.mkdir()
        (root / l2.LOCK_NAME).write_bytes(b"")  # a writable lock file in a read-only dir
        root.chmod(0o555)
    tier = DiskTier(root, BIG)
    try:
        with pytest.raises(TieredKVError, match=re.escape(str(root))) as raised:
            await tier.open()
        assert isinstance(raised.value.__cause__, OSError)
        assert not isinstance(raised.value, OSError)
    finally:
        if how == "read_only":
            root.chmod(0o755)
        await tier.aclose()


# -- recency ------------------------------------------------------------------------------------
async def test_touch_keeps_hot_chunks_through_eviction_and_restart(
    root: Path, arena: HostArena
) -> None:
    keys = make_keys(14)
    size = file_size(keys[0])
    obj = make_obj(arena)
    try:
        first = DiskTier(root, 8 * size, durability="none")  # fast writes: many share a clock tick
        await first.open()
        try:
            for key in keys[:8]:
                assert await first.put(key, obj)
            await first.touch([keys[0], keys[1]])
            for key in keys[8:12]:
                assert await first.put(key, obj)  # evicts keys[2:6], not the touched ones
            survivors = [k for k, _, _ in first.entries()]
            assert survivors == [keys[6], keys[7], keys[0], keys[1], *keys[8:12]]
            # Files carry the order, without ties, even where writes share a clock tick.
            mtimes = [path_of(root, key).stat().st_mtime_ns for key in survivors]
            assert mtimes == sorted(set(mtimes))
        finally:
            await first.aclose()

        second = DiskTier(root, 8 * size, durability="none")
        await second.open()
        try:
            assert [k for k, _, _ in second.entries()] == survivors  # recency survived restart
            for key in keys[12:]:
                assert await second.put(key, obj)
            assert second.contains(keys[0]) and second.contains(keys[1])
            assert not second.contains(keys[6]) and not second.contains(keys[7])
            assert not path_of(root, keys[6]).exists()
        finally:
            await second.aclose()
    finally:
        obj.unref()


async def test_touch_skips_unknown_and_vanished_keys(root: Path, arena: HostArena) -> None:
    keys = make_keys(3)
    tier = DiskTier(root, BIG)
    await tier.open()
    obj = make_obj(arena)
    try:
        for key in keys[:2]:
            assert await tier.put(key, obj)
        path_of(root, keys[0]).unlink()  # behind our back
        await tier.touch([keys[2], keys[1], keys[0]])
        # Still indexed: the read that finds the file missing drops it.
        assert [k for k, _, _ in tier.entries()] == [keys[1], keys[0]]
        assert tier.stats().touch_failures == 0
    finally:
        obj.unref()
        await tier.aclose()
    await tier.touch(keys)  # after close: nothing to do, no error


# -- inspection ---------------------------------------------------------------------------------
async def test_scan_directory_reads_headers_without_lock_or_deletion(
    tier: DiskTier, arena: HostArena, root: Path
) -> None:
    keys = chunk_keys(SCOPE, list(range(CHUNK + 3)), CHUNK)
    objs = [make_obj(arena, CHUNK), make_obj(arena, 3)]
    try:
        for key, obj in zip(keys, objs, strict=True):
            assert await tier.put(key, obj)
    finally:
        for obj in objs:
            obj.unref()
    (root / "ff").mkdir(exist_ok=True)
    (root / "ff" / "ffff").write_bytes(b"garbage")
    (root / "ff" / ".ffff.1.2.tmp").write_bytes(b"partial")

    scanned = {item.path.name: item for item in scan_directory(root)}  # the tier holds the lock
    assert set(scanned) == {keys[0].hex, keys[1].hex, "ffff", ".ffff.1.2.tmp"}
    for key, tokens in zip(keys, (CHUNK, 3), strict=True):
        item = scanned[key.hex]
        assert item.error is None
        assert item.key == key
        assert item.num_tokens == tokens
        assert item.size == file_size(key, tokens)
        assert [g.dtype for g in item.groups] == ["bfloat16", "int8", "float32"]
    assert scanned["ffff"].error is not None and "bad header" in scanned["ffff"].error
    assert scanned[".ffff.1.2.tmp"].error is not None
    assert (root / "ff" / "ffff").exists()
    assert (root / "ff" / ".ffff.1.2.tmp").exists()


async def test_stats_are_a_frozen_snapshot_of_numbers(tier: DiskTier) -> None:
    stats = tier.stats()
    assert isinstance(stats, DiskStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 1  # type: ignore[misc]
    fields = {field.name: getattr(stats, field.name) for field in dataclasses.fields(stats)}
    expected = {
        "entries",
        "bytes_used",
        "capacity",
        "hits",
        "misses",
        "puts",
        "put_failures",
        "bytes_written",
        "bytes_read",
        "evictions",
        "corrupt_removed",
        "layout_mismatch",
        "write_seconds",
        "read_seconds",
    }
    assert expected <= set(fields)
    assert all(isinstance(value, int | float) for value in fields.values())


class StalledWrites(FileOps):
    """Writes wait for ``release`` (a disk stuck on writes); reads go through."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.stalled = threading.Semaphore(0)

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        self.stalled.release()
        assert self.release.wait(30), "the test never released the writes"
        return super().pwrite(fd, data, offset)


async def test_reads_are_never_queued_behind_writes(root: Path, arena: HostArena) -> None:
    """Writes stuck on the disk fill every write thread; a read still runs on the read
    threads, bit for bit."""
    ops = StalledWrites()
    tier = DiskTier(root, BIG, file_ops=ops, io_threads=4)
    await tier.open()
    keys = make_keys(6)
    sources = [make_obj(arena, seed=i) for i in range(6)]
    target = poisoned_obj(arena)
    try:
        ops.release.set()
        assert await tier.put(keys[0], sources[0])
        ops.release.clear()
        pairs = zip(keys[1:], sources[1:], strict=True)
        writes = [asyncio.ensure_future(tier.put(key, obj)) for key, obj in pairs]
        for _ in range(write_threads(4)):  # every write thread is stuck now
            assert await asyncio.to_thread(ops.stalled.acquire, True, 10)
        assert await asyncio.wait_for(tier.get_into(keys[0], target), 10)
        assert same_groups(sources[0], target)
        assert not any(write.done() for write in writes)
        ops.release.set()
        assert all(await asyncio.gather(*writes))
    finally:
        ops.release.set()
        for obj in (*sources, target):
            obj.unref()
        await tier.aclose()


# -- page-cache residency -----------------------------------------------------------------------
def test_cached_fraction_asks_the_page_cache_and_reads_nothing_in(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(8 << 20))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        assert pagecache.cached_fraction(fd, 8 << 20) == 1.0  # just written
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert pagecache.cached_fraction(fd, 8 << 20) == 0.0
        assert pagecache.cached_fraction(fd, 8 << 20) == 0.0  # asking read nothing in
        os.pread(fd, 4 << 20, 0)
        share = pagecache.cached_fraction(fd, 8 << 20)
        assert share is not None and share >= 0.5  # the half read (and its readahead)
        assert pagecache.cached_fraction(fd, 0) is None
    finally:
        os.close(fd)


async def test_a_hit_reports_whether_its_file_was_in_the_page_cache(
    tier: DiskTier, arena: HostArena, root: Path
) -> None:
    keys = make_keys(2)
    sources = [make_obj(arena, seed=i) for i in range(2)]
    target = poisoned_obj(arena)
    try:
        for key, source in zip(keys, sources, strict=True):
            assert await tier.put(key, source)
        assert tier.cached_share(keys) == 1.0
        fd = os.open(path_of(root, keys[0]), os.O_RDONLY)
        try:
            os.fsync(fd)  # written back first (batched durability): dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        assert tier.cached_share(keys) == 0.5
        assert tier.cached_share([make_keys(1, salt=9)[0]]) is None  # not held
        assert await tier.get_into(keys[0], target)
        assert tier.was_page_cached(keys[0]) is False
        assert tier.was_page_cached(keys[0]) is None  # asked once
        assert await tier.get_into(keys[1], target)
        assert tier.was_page_cached(keys[1]) is True
    finally:
        for obj in (*sources, target):
            obj.unref()
