"""HostArena (aligned first-fit, coalescing, stats) and MemoryObj (group views, refcounts)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_kv.errors import TieredKVError
from tiered_kv.layout import GroupLayout, MemoryLayoutDesc
from tiered_kv.memory import ALIGN, HostArena, MemoryObj

KiB, MiB, GiB = 1024, 1024**2, 1024**3


def round_up(value: int) -> int:
    return (value + ALIGN - 1) // ALIGN * ALIGN


@pytest.fixture
def arena() -> HostArena:
    return HostArena(64 * KiB, pin=False)


# -- construction ----------------------------------------------------------------------------
def test_new_arena_stats() -> None:
    arena = HostArena(10 * KiB + 100, pin=False)  # capacity is rounded down to the alignment
    stats = arena.stats()
    assert stats.capacity == arena.capacity == 10 * KiB
    assert stats.used == 0 and arena.used == 0
    assert stats.free == stats.largest_free == 10 * KiB
    assert stats.allocations == 0 and stats.failed_allocations == 0
    assert stats.pinned is False and arena.pinned is False


@pytest.mark.parametrize(("capacity", "align"), [(100, 256), (0, 256), (4096, 100), (4096, 3)])
def test_bad_construction(capacity: int, align: int) -> None:
    with pytest.raises(ValueError):
        HostArena(capacity, pin=False, align=align)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_pin_without_cuda_is_refused() -> None:
    with pytest.raises(TieredKVError, match="CUDA"):
        HostArena(4096, pin=True)
    assert HostArena(4096, pin=None).pinned is False


# -- allocation ------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [1, 255, 256, 257, 1000, 4096, 5000])
def test_allocations_are_aligned_and_rounded(arena: HostArena, nbytes: int) -> None:
    offsets = [arena.allocate(nbytes) for _ in range(4)]
    assert all(o is not None for o in offsets)
    assert all(o % ALIGN == 0 for o in offsets if o is not None)
    assert arena.used == 4 * round_up(nbytes)
    assert len(set(offsets)) == 4
    stats = arena.stats()
    assert stats.allocations == 4
    assert stats.used + stats.free == stats.capacity


@pytest.mark.parametrize("capacity", [64 * KiB, 3 * MiB])
def test_allocations_are_aligned_in_memory(capacity: int) -> None:
    # Groups are 256-byte aligned in host memory (DESIGN.md), so the address, not only the
    # offset, must be aligned: that is what the vectorized copies and DMA see.
    arena = HostArena(capacity, pin=False)
    for nbytes in (1, 300, 1000):
        offset = arena.allocate(nbytes)
        assert offset is not None
        assert (arena.base_ptr + offset) % ALIGN == 0
        assert arena.view(offset, nbytes).data_ptr() % ALIGN == 0


def test_first_fit_reuses_lowest_hole(arena: HostArena) -> None:
    a = arena.allocate(1000)
    b = arena.allocate(1000)
    c = arena.allocate(1000)
    assert (a, b, c) == (0, 1024, 2048)
    arena.free(b)
    assert arena.allocate(512) == 1024  # fits in b's hole
    assert arena.allocate(512) == 1536  # rest of the hole
    assert arena.allocate(1) == 3072  # hole full: after c


@pytest.mark.parametrize("nbytes", [0, -1])
def test_allocate_rejects_non_positive_sizes(arena: HostArena, nbytes: int) -> None:
    with pytest.raises(ValueError):
        arena.allocate(nbytes)


def test_allocate_returns_none_when_full_and_counts_it(arena: HostArena) -> None:
    offsets = []
    while (offset := arena.allocate(4 * KiB)) is not None:
        offsets.append(offset)
    assert len(offsets) == 16
    assert arena.used == arena.capacity
    assert arena.stats().failed_allocations == 1
    assert arena.allocate(1) is None
    assert arena.allocate(10 * arena.capacity) is None
    stats = arena.stats()
    assert stats.failed_allocations == 3
    assert stats.allocations == 16
    assert stats.free == 0 and stats.largest_free == 0


def test_fragmented_arena_refuses_a_run_larger_than_any_hole(arena: HostArena) -> None:
    offsets = [arena.allocate(4 * KiB) for _ in range(16)]
    for offset in offsets[::2]:
        assert offset is not None
        arena.free(offset)
    stats = arena.stats()
    assert stats.free == 32 * KiB
    assert stats.largest_free == 4 * KiB
    assert arena.allocate(4 * KiB + 1) is None
    assert arena.allocate(4 * KiB) == 0


def test_oversized_request_does_not_raise() -> None:
    arena = HostArena(4096, pin=False)
    assert arena.allocate(4097) is None
    assert arena.allocate(2**62) is None
    assert arena.stats().failed_allocations == 2
    assert arena.used == 0


def test_double_free_raises(arena: HostArena) -> None:
    offset = arena.allocate(300)
    assert offset is not None
    arena.free(offset)
    with pytest.raises(TieredKVError, match="not allocated"):
        arena.free(offset)
    assert arena.used == 0
    assert arena.stats().largest_free == arena.capacity


def test_free_of_unknown_offset_raises(arena: HostArena) -> None:
    offset = arena.allocate(1024)
    assert offset is not None
    for bogus in (offset + 256, arena.capacity, -256, 12345):
        with pytest.raises(TieredKVError):
            arena.free(bogus)
    assert arena.used == 1024


@pytest.mark.parametrize("seed", range(8))
def test_freeing_in_any_order_coalesces_to_one_run(arena: HostArena, seed: int) -> None:
    rng = random.Random(seed)
    offsets = []
    while True:
        offset = arena.allocate(rng.randint(1, 3 * KiB))
        if offset is None:
            break
        offsets.append(offset)
    rng.shuffle(offsets)
    for offset in offsets:
        arena.free(offset)
    stats = arena.stats()
    assert stats.used == 0
    assert stats.largest_free == stats.capacity
    assert arena.allocate(arena.capacity) == 0


@pytest.mark.parametrize(
    "order",
    [(0, 1, 2), (0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)],
)
def test_coalescing_with_both_neighbours(arena: HostArena, order: tuple[int, int, int]) -> None:
    offsets = [arena.allocate(1024) for _ in range(3)]
    guard = arena.allocate(arena.capacity - 3 * 1024)  # fill the rest: no free tail to merge
    assert guard is not None and arena.stats().largest_free == 0
    for i in order:
        offset = offsets[i]
        assert offset is not None
        arena.free(offset)
    assert arena.stats().largest_free == 3 * 1024
    assert arena.allocate(3 * 1024) == 0


def test_close_reports_leaks_and_blocks_use(arena: HostArena) -> None:
    offset = arena.allocate(100)
    assert offset is not None
    assert arena.close() == ALIGN
    assert arena.closed
    with pytest.raises(TieredKVError, match="closed"):
        arena.allocate(1)
    with pytest.raises(TieredKVError, match="closed"):
        arena.view(offset, 100)
    with pytest.raises(TieredKVError, match="closed"):
        arena.buffer(offset, 100)


def test_close_of_empty_arena_reports_no_leak() -> None:
    arena = HostArena(4096, pin=False)
    assert arena.close() == 0


def test_view_and_buffer_share_memory(arena: HostArena) -> None:
    offset = arena.allocate(512)
    assert offset is not None
    buf = arena.buffer(offset, 512)
    assert len(buf) == 512 and not buf.readonly
    buf[:] = bytes(range(256)) * 2
    view = arena.view(offset, 512)
    assert view.dtype == torch.uint8 and view.shape == (512,)
    assert view.tolist() == list(range(256)) * 2
    view.fill_(7)
    assert bytes(buf) == b"\x07" * 512


def test_arena_larger_than_2_gib() -> None:
    # torch.empty does not touch the pages, so only the pages written below are committed.
    capacity = 5 * GiB // 2
    arena = HostArena(capacity, pin=False)
    assert arena.capacity == capacity
    low = arena.allocate(2 * GiB - 4096)
    assert low == 0
    crossing = arena.allocate(1 * MiB)  # spans the 2**31 byte offset
    assert crossing == 2 * GiB - 4096
    assert crossing + MiB > 2**31
    high = arena.allocate(256 * MiB)
    assert high is not None and high > 2**31
    pattern = bytes((i * 37 + 11) % 256 for i in range(8192))
    for offset in (crossing, 2**31 - 100, 2**31 + 12_345 * 256, high, capacity - 8192):
        arena.buffer(offset, len(pattern))[:] = pattern
        assert bytes(arena.view(offset, len(pattern)).numpy()) == pattern
        assert arena.view(offset, len(pattern)).data_ptr() == arena.base_ptr + offset
    assert arena.stats().used == round_up(2 * GiB - 4096) + MiB + 256 * MiB
    for offset in (low, crossing, high):
        assert offset is not None
        arena.free(offset)
    assert arena.stats().largest_free == capacity


# -- hypothesis: random allocate/free sequences ---------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(1, 6 * KiB), st.integers(0, 10**6)),
        max_size=80,
    )
)
def test_random_allocate_free_keeps_invariants(ops: list[tuple[bool, int, int]]) -> None:
    arena = HostArena(32 * KiB, pin=False)
    live: dict[int, int] = {}  # offset -> rounded size
    failed = 0
    for do_alloc, nbytes, pick in ops:
        if do_alloc or not live:
            offset = arena.allocate(nbytes)
            if offset is None:
                failed += 1
                # None only when no free run is big enough.
                assert arena.stats().largest_free < round_up(nbytes)
                continue
            assert offset % ALIGN == 0
            assert offset >= 0 and offset + round_up(nbytes) <= arena.capacity
            live[offset] = round_up(nbytes)
        else:
            offset = sorted(live)[pick % len(live)]
            arena.free(offset)
            del live[offset]
        spans = sorted(live.items())
        for (start_a, size_a), (start_b, _) in itertools.pairwise(spans):
            assert start_a + size_a <= start_b, "live allocations overlap"
        stats = arena.stats()
        assert stats.used == sum(live.values())
        assert stats.used + stats.free == stats.capacity
        assert stats.allocations == len(live)
        assert stats.failed_allocations == failed
        assert stats.largest_free <= stats.free
    for offset in list(live):
        arena.free(offset)
    stats = arena.stats()
    assert stats.used == 0
    assert stats.largest_free == stats.capacity


# -- MemoryObj --------------------------------------------------------------------------------
LAYOUT = MemoryLayoutDesc(
    groups=(
        GroupLayout(torch.bfloat16, num_layers=3, kv_count=2, row_elems=24),
        GroupLayout(torch.float8_e4m3fn, num_layers=2, kv_count=2, row_elems=40),
        GroupLayout(torch.int8, num_layers=2, kv_count=1, row_elems=132),
        GroupLayout(torch.float32, num_layers=1, kv_count=2, row_elems=8),
    ),
    chunk_size=16,
)


@pytest.mark.parametrize("num_tokens", [1, 5, 7, 16])
def test_memory_obj_group_views(num_tokens: int) -> None:
    arena = HostArena(MiB, pin=False)
    first = arena.allocate(100)  # so the object does not start at offset 0
    assert first is not None
    obj = arena.allocate_obj(LAYOUT, num_tokens)
    assert obj is not None
    assert obj.num_tokens == num_tokens
    assert obj.refcount == 1
    assert obj.nbytes == LAYOUT.nbytes(num_tokens)  # logical size, not the rounded one
    assert arena.used == ALIGN + round_up(obj.nbytes)
    assert obj.raw().shape == (obj.nbytes,)

    offsets = LAYOUT.group_offsets(num_tokens)
    spans = []
    for index, group in enumerate(LAYOUT.groups):
        tensor = obj.group_tensor(index)
        assert tensor.shape == (group.num_layers, group.kv_count, num_tokens, group.row_elems)
        assert tensor.dtype == group.dtype
        assert tensor.is_contiguous()
        raw = obj.group_bytes(index)
        assert raw.dtype == torch.uint8
        assert raw.shape == (group.num_layers, group.kv_count, num_tokens, group.row_bytes)
        start = tensor.data_ptr() - arena.base_ptr
        assert start == obj.offset + offsets[index]
        assert raw.data_ptr() == tensor.data_ptr()
        assert (obj.offset + offsets[index]) % ALIGN == 0
        spans.append((start, start + group.nbytes(num_tokens)))
    spans.sort()
    for (_, end_a), (start_b, _) in itertools.pairwise(spans):
        assert end_a <= start_b, "groups overlap"
    assert spans[0][0] >= obj.offset
    assert spans[-1][1] == obj.offset + obj.nbytes

    buffers = obj.group_buffers()
    assert [len(b) for b in buffers] == [g.nbytes(num_tokens) for g in LAYOUT.groups]
    assert sum(len(b) for b in buffers) == LAYOUT.payload_nbytes(num_tokens)


def test_int8_group_has_132_byte_rows() -> None:
    arena = HostArena(MiB, pin=False)
    obj = arena.allocate_obj(LAYOUT, 3)
    assert obj is not None
    raw = obj.group_bytes(2)
    assert raw.shape[-1] == 132
    assert raw.stride() == (132 * 3, 132 * 3, 132, 1)


def test_group_buffers_and_tensors_see_the_same_bytes() -> None:
    arena = HostArena(MiB, pin=False)
    obj = arena.allocate_obj(LAYOUT, 5)
    assert obj is not None
    obj.raw().fill_(0xEE)  # poison, including the alignment gaps
    for index, buf in enumerate(obj.group_buffers()):
        buf[:] = bytes([index + 1]) * len(buf)
    for index in range(len(LAYOUT.groups)):
        assert torch.all(obj.group_bytes(index) == index + 1)
    # Gap bytes between groups stay untouched by group writes.
    raw = obj.raw()
    offsets = LAYOUT.group_offsets(5)
    for index, group in enumerate(LAYOUT.groups[:-1]):
        gap = raw[offsets[index] + group.nbytes(5) : offsets[index + 1]]
        assert torch.all(gap == 0xEE)

    values = torch.arange(3 * 2 * 5 * 24, dtype=torch.float32).to(torch.bfloat16)
    obj.group_tensor(0).copy_(values.view(3, 2, 5, 24))
    assert torch.equal(obj.group_tensor(0).flatten(), values)
    fp8 = torch.linspace(-4, 4, 2 * 2 * 5 * 40).to(torch.float8_e4m3fn)
    obj.group_tensor(1).copy_(fp8.view(2, 2, 5, 40))
    assert torch.equal(obj.group_bytes(1).flatten(), fp8.view(torch.uint8))
    assert torch.all(obj.group_bytes(2) == 3)  # neighbours untouched
    assert torch.all(obj.group_bytes(3) == 4)


def test_partial_chunk_layout_is_packed_for_its_token_count() -> None:
    arena = HostArena(MiB, pin=False)
    full = arena.allocate_obj(LAYOUT, 16)
    partial = arena.allocate_obj(LAYOUT, 3)
    assert full is not None and partial is not None
    assert partial.nbytes == LAYOUT.nbytes(3) < full.nbytes
    assert partial.offset == full.offset + round_up(full.nbytes)


def test_allocate_obj_returns_none_when_full() -> None:
    arena = HostArena(4096, pin=False)
    assert LAYOUT.nbytes(16) > 4096
    assert arena.allocate_obj(LAYOUT, 16) is None
    assert arena.stats().failed_allocations == 1
    assert arena.used == 0


def test_refcounts_return_memory_at_zero_only() -> None:
    arena = HostArena(MiB, pin=False)
    obj = arena.allocate_obj(LAYOUT, 4)
    assert obj is not None
    size = round_up(obj.nbytes)
    assert obj.ref() is obj
    assert obj.ref() is obj
    assert obj.refcount == 3
    obj.unref()
    obj.unref()
    assert obj.refcount == 1
    assert arena.used == size
    obj.unref()
    assert obj.refcount == 0
    assert arena.used == 0
    assert arena.stats().largest_free == arena.capacity
    with pytest.raises(TieredKVError):
        obj.unref()
    with pytest.raises(TieredKVError):
        obj.ref()
    assert arena.used == 0


def test_memory_obj_repr_names_its_state() -> None:
    arena = HostArena(MiB, pin=False)
    obj = arena.allocate_obj(LAYOUT, 2)
    assert isinstance(obj, MemoryObj)
    text = repr(obj)
    assert "tokens=2" in text and "refs=1" in text and f"nbytes={obj.nbytes}" in text
