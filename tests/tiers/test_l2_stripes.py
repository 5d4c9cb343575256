"""DiskTier reads of chunks larger than one checksum stripe: the stripes of one chunk are read on
several threads at once, each verified on its own, and a fault in one stripe fails the chunk."""

from __future__ import annotations

import io
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from tiered_kv.codec import STRIPE_BYTES, decode_header
from tiered_kv.keys import ChunkKey, KeyScope, chunk_keys
from tiered_kv.layout import GroupLayout, MemoryLayoutDesc
from tiered_kv.memory import HostArena, MemoryObj
from tiered_kv.tiers.l2 import DiskTier, FileOps
from tiered_kv.tiers.l2.files import READ_SLICE_BYTES

CHUNK = 160
# 10 MiB of bf16 rows, then 132-byte int8 rows: three stripes, the last one across both groups.
LAYOUT = MemoryLayoutDesc(
    (
        GroupLayout(torch.bfloat16, num_layers=4, kv_count=2, row_elems=4096),
        GroupLayout(torch.int8, num_layers=1, kv_count=1, row_elems=132),
    ),
    CHUNK,
)
SCOPE = KeyScope("tenant", "test-model", "v1", 1, 0, LAYOUT.layout_id)
PAYLOAD = LAYOUT.payload_nbytes(CHUNK)
STRIPES = -(-PAYLOAD // STRIPE_BYTES)


def make_key(salt: int = 0) -> ChunkKey:
    return chunk_keys(SCOPE, [salt * 7919 + i for i in range(CHUNK)], CHUNK)[0]


def make_obj(arena: HostArena, seed: int) -> MemoryObj:
    obj = arena.allocate_obj(LAYOUT, CHUNK)
    assert obj is not None
    gen = torch.Generator().manual_seed(seed)
    obj.raw().copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def same(a: MemoryObj, b: MemoryObj) -> bool:
    return all(torch.equal(a.group_bytes(g), b.group_bytes(g)) for g in range(2))


def chunk_path(root: Path, key: ChunkKey) -> Path:
    return root / key.hex[:2] / key.hex


class StripeReads(FileOps):
    """Reads one stripe per part; notes which thread read at which payload offset. ``meet``
    parties must be inside a read at once before any returns; ``short_at`` (a payload offset)
    reads as the end of the file."""

    read_slice_bytes = STRIPE_BYTES

    def __init__(self, header_len: int, meet: int = 0, short_at: int | None = None) -> None:
        self.header_len = header_len
        self.barrier = threading.Barrier(meet, timeout=10) if meet else None
        self.short_at = short_at
        self.reads: list[tuple[int, str]] = []
        self.lock = threading.Lock()

    def readinto(self, file: io.FileIO, buffer: memoryview) -> int:
        offset = file.tell() - self.header_len
        with self.lock:
            self.reads.append((offset, threading.current_thread().name))
            first_ones = len(self.reads) <= (self.barrier.parties if self.barrier else 0)
        if first_ones and self.barrier is not None:
            self.barrier.wait()
        if offset == self.short_at:
            return 0
        return super().readinto(file, buffer)


@pytest.fixture
def arena() -> Iterator[HostArena]:
    arena = HostArena(4 * LAYOUT.nbytes(CHUNK) + (1 << 20), pin=False)
    yield arena
    assert arena.used == 0, "a test leaked MemoryObj references"
    assert arena.close() == 0


@pytest.fixture
async def stored(tmp_path: Path, arena: HostArena) -> AsyncIterator[tuple[ChunkKey, MemoryObj]]:
    """A chunk written by a tier (then closed), and the source it was written from."""
    tier = DiskTier(tmp_path / "l2", 1 << 30)
    await tier.open()
    key, source = make_key(), make_obj(arena, seed=5)
    assert await tier.put(key, source)
    await tier.aclose()
    yield key, source
    source.unref()


@pytest.fixture
def target(arena: HostArena) -> Iterator[MemoryObj]:
    """A chunk of poison to read into, released after the test."""
    obj = arena.allocate_obj(LAYOUT, CHUNK)
    assert obj is not None
    obj.raw().fill_(0xA5)
    yield obj
    obj.unref()


def header_len_of(path: Path) -> int:
    return decode_header(path.read_bytes()[: 64 << 10]).header_len


def test_the_layout_spans_three_stripes_and_the_default_part_two() -> None:
    assert STRIPES == 3 and PAYLOAD % STRIPE_BYTES  # the last stripe is a short one
    assert READ_SLICE_BYTES == 2 * STRIPE_BYTES


async def test_the_stripes_of_one_chunk_are_read_at_once_and_verified(
    tmp_path: Path,
    stored: tuple[ChunkKey, MemoryObj],
    target: MemoryObj,
) -> None:
    key, source = stored
    root = tmp_path / "l2"
    file_ops = StripeReads(header_len_of(chunk_path(root, key)), meet=STRIPES)
    tier = DiskTier(root, 1 << 30, io_threads=4, file_ops=file_ops)
    await tier.open()
    try:
        assert await tier.get_into(key, target)  # the barrier breaks unless all three meet
        assert same(source, target)
        offsets = sorted(offset for offset, _ in file_ops.reads)
        group0 = LAYOUT.groups[0].nbytes(CHUNK)
        # Each stripe starts a part; the third crosses from group 0 into group 1.
        assert offsets == [0, STRIPE_BYTES, 2 * STRIPE_BYTES, group0]
        assert len({name for _, name in file_ops.reads}) == STRIPES
        assert tier.stats().hits == 1
    finally:
        await tier.aclose()


@pytest.mark.parametrize("stripe", range(STRIPES))
async def test_a_flipped_byte_in_any_stripe_fails_the_chunk(
    tmp_path: Path,
    stored: tuple[ChunkKey, MemoryObj],
    stripe: int,
    caplog: pytest.LogCaptureFixture,
    target: MemoryObj,
) -> None:
    key, _ = stored
    root = tmp_path / "l2"
    path = chunk_path(root, key)
    data = bytearray(path.read_bytes())
    data[header_len_of(path) + min(stripe * STRIPE_BYTES + 12345, PAYLOAD - 1)] ^= 0x04
    path.write_bytes(bytes(data))
    tier = DiskTier(root, 1 << 30, io_threads=4)
    await tier.open()
    try:
        assert not await tier.get_into(key, target)
        assert f"mismatch in stripe {stripe} " in caplog.text
        assert not path.exists()
        assert tier.stats().corrupt_removed == 1
    finally:
        await tier.aclose()


async def test_a_stripe_that_reads_short_fails_the_chunk(
    tmp_path: Path,
    stored: tuple[ChunkKey, MemoryObj],
    target: MemoryObj,
) -> None:
    key, _ = stored
    root = tmp_path / "l2"
    path = chunk_path(root, key)
    file_ops = StripeReads(header_len_of(path), short_at=STRIPE_BYTES)
    tier = DiskTier(root, 1 << 30, io_threads=4, file_ops=file_ops)
    await tier.open()
    try:
        assert not await tier.get_into(key, target)
        assert tier.stats().corrupt_removed == 1 and not path.exists()
    finally:
        await tier.aclose()


async def test_a_file_of_another_key_is_refused_by_its_header(
    tmp_path: Path,
    arena: HostArena,
    stored: tuple[ChunkKey, MemoryObj],
    target: MemoryObj,
) -> None:
    """A file holding another key under this key's name: its stripes may have been read into
    the buffers, but the header's check decides and nothing is served."""
    key, _ = stored
    root = tmp_path / "l2"
    other = make_key(salt=1)
    tier = DiskTier(root, 1 << 30, io_threads=4)
    await tier.open()
    source = make_obj(arena, seed=9)
    try:
        assert await tier.put(other, source)
        chunk_path(root, other).replace(chunk_path(root, key))
        assert not await tier.get_into(key, target)
        assert tier.stats().hits == 0
    finally:
        source.unref()
        await tier.aclose()
