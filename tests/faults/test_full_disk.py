"""L2 on a full filesystem: writes go on by evicting, the tier reports the capacity the disk
really has, follows it back up when space is freed, never serves a corrupt chunk and leaves no
temp file.

Two disks: a real 8 MiB tmpfs (when running as root and ``mount`` works; unmounted at the end)
and, everywhere, `FullDiskFileOps`, which fails writes past its limit as a full disk does. Other
programs' files take 2 MiB of the disk at first and are removed half way.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.indexed_chunks import CHUNK, IndexedChunks, chunk_files, temp_files
from tiered_kv.memory import HostArena
from tiered_kv.tiers.l2 import DiskTier
from tiered_kv.tiers.testing import FullDiskFileOps

MiB = 1 << 20
DISK = 8 * MiB
OTHER_FILES = 2 * MiB
CAPACITY = 64 * MiB  # far more than the disk holds: only the disk stops us
CONCURRENT_PUTS = 4  # as the engine's background writer keeps several in flight
PUTS_WHILE_FULL = 120  # about 140 KiB each: the 6 MiB left hold about 45
PUTS_AFTER_FREEING = 40


def num_tokens_of(index: int) -> int:
    return CHUNK if index % 3 else 1 + (index * 7919) % CHUNK  # partial chunks too


CHUNKS = IndexedChunks("full", num_tokens_of)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MiB tmpfs, unmounted afterwards; skipped where it cannot be mounted."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root; the injected full disk runs instead")
    mount_point = tmp_path / "tmpfs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK // MiB}m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


class Disk:
    """The disk under test: ``root`` for the tier, ``file_ops`` for it, other programs' files."""

    def __init__(self, kind: str, base: Path) -> None:
        self.kind = kind
        self.root = base / "l2"
        self.other_file = base / "other-programs-file"
        self.injected = (
            FullDiskFileOps(self.root, DISK - OTHER_FILES) if kind == "injected" else None
        )
        if self.injected is None:
            self.other_file.write_bytes(bytes(OTHER_FILES))

    def tier(self) -> DiskTier:
        if self.injected is None:
            return DiskTier(self.root, CAPACITY)
        return DiskTier(self.root, CAPACITY, file_ops=self.injected)

    def free_other_files(self) -> None:
        if self.injected is None:
            self.other_file.unlink()
        else:
            self.injected.limit_bytes = DISK


async def put_all(tier: DiskTier, arena: HostArena, indices: range) -> list[bool]:
    stored: list[bool] = []
    for start in range(indices.start, indices.stop, CONCURRENT_PUTS):
        batch = range(start, min(start + CONCURRENT_PUTS, indices.stop))
        objs = [CHUNKS.chunk_of(arena, index) for index in batch]
        try:
            stored += await asyncio.gather(
                *(
                    tier.put(CHUNKS.key_of(index), obj)
                    for index, obj in zip(batch, objs, strict=True)
                )
            )
        finally:
            for obj in objs:
                obj.unref()
    return stored


async def verify_every_entry(tier: DiskTier, arena: HostArena, written: range) -> int:
    """Every chunk the tier holds reads back bit-exact; returns how many."""
    by_key = {CHUNKS.key_of(index): index for index in written}
    for key, _, _ in tier.entries():
        await CHUNKS.assert_reads_back(tier, arena, key, by_key[key])
    return len(tier.entries())


@pytest.fixture(params=["tmpfs", "injected"])
def disk(request: pytest.FixtureRequest, tmp_path: Path) -> Disk:
    if request.param == "tmpfs":
        return Disk("tmpfs", request.getfixturevalue("tmpfs"))
    return Disk("injected", tmp_path)


async def test_full_disk_evicts_resumes_and_recovers(disk: Disk) -> None:
    started = time.perf_counter()
    arena = HostArena(4 * MiB, pin=False)
    tier = disk.tier()
    await tier.open()
    try:
        # Fill the disk and keep writing: every put lands, by evicting the oldest chunks.
        stored = await put_all(tier, arena, range(PUTS_WHILE_FULL))
        full = tier.stats()
        assert all(stored), f"{stored.count(False)} puts failed on the full disk"
        assert full.no_space_errors >= 1
        assert full.evictions >= PUTS_WHILE_FULL // 2
        assert full.put_failures == 0
        assert full.bytes_used <= full.effective_capacity <= DISK - OTHER_FILES
        assert temp_files(disk.root) == []
        assert len(chunk_files(disk.root)) == full.entries
        recent = [CHUNKS.key_of(index) for index in range(PUTS_WHILE_FULL - 8, PUTS_WHILE_FULL)]
        assert all(tier.contains(key) for key in recent)
        verified = await verify_every_entry(tier, arena, range(PUTS_WHILE_FULL))

        # The other files go: the tier's capacity follows the disk back up.
        disk.free_other_files()
        later = range(PUTS_WHILE_FULL, PUTS_WHILE_FULL + PUTS_AFTER_FREEING)
        assert all(await put_all(tier, arena, later))
        freed = tier.stats()
        # Up by what the other files held, less a little (block rounding, chunks in flight).
        assert freed.effective_capacity >= full.effective_capacity + OTHER_FILES - MiB // 4
        assert freed.entries > full.entries
        assert temp_files(disk.root) == []
        written = range(PUTS_WHILE_FULL + PUTS_AFTER_FREEING)
        verified += await verify_every_entry(tier, arena, written)
    finally:
        await tier.aclose()

    # A restart finds the same chunks, every one whole.
    again = disk.tier()
    await again.open()
    try:
        assert again.stats().entries == freed.entries
        assert again.stats().corrupt_removed == 0
        verified += await verify_every_entry(again, arena, written)
    finally:
        await again.aclose()
        assert arena.close() == 0
    print(
        f"\nfull disk ({disk.kind}, {DISK // MiB} MiB, {OTHER_FILES // MiB} MiB of other files, "
        f"capacity {CAPACITY // MiB} MiB): {PUTS_WHILE_FULL} puts, all stored; "
        f"{full.no_space_errors} no-space errors, {full.no_space_retries} retries, "
        f"{full.evictions} evictions; effective capacity {full.effective_capacity / MiB:.2f}"
        f" MiB, {freed.effective_capacity / MiB:.2f} MiB after the other files went "
        f"({freed.no_space_errors} no-space errors by then); {verified} reads verified, "
        f"no temp files; {time.perf_counter() - started:.1f} s"
    )
