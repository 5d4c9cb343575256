"""Test tools shipped with the library: an in-memory lower tier and fault injectors.

`MemoryTier` keeps copies of chunks in plain Python bytes (no disk), `FaultyTier` wraps any
`LowerTier` and fails a seeded subset of keys and/or delays calls (per operation), so faults are
repeatable; its ``gate`` holds every read and write at a known await point until opened, which
is how tests cancel at each stage deterministically. Benchmarks use the delays to stand in for a
disk or network that the page cache hides. `FullDiskFileOps` gives a `DiskTier` a filesystem of
a chosen size, which fills up as a real one does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import random
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal

from tiered_kv.keys import ChunkKey
from tiered_kv.memory import MemoryObj
from tiered_kv.tiers.base import LowerTier, TierStats
from tiered_kv.tiers.l2 import FileOps


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MemoryTierStats(TierStats):
    puts: int = 0
    gets: int = 0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FaultyTierStats(TierStats):
    """The wrapped tier's statistics (``inner``, its occupancy repeated here) plus the faults."""

    inner: TierStats
    injected_failures: int = 0
    max_active: int = 0


class MemoryTier(LowerTier):
    def __init__(self, name: str = "L2") -> None:
        self.name = name
        self._data: dict[ChunkKey, tuple[str, int, bytes]] = {}
        self.puts = 0
        self.gets = 0
        self.closed = False

    async def open(self) -> None:
        self.closed = False

    def contains(self, key: ChunkKey) -> bool:
        return key in self._data

    async def put(self, key: ChunkKey, obj: MemoryObj) -> bool:
        self.puts += 1
        self._data[key] = (obj.layout.layout_id, obj.num_tokens, bytes(obj.raw().numpy()))
        return True

    async def get_into(self, key: ChunkKey, obj: MemoryObj) -> bool:
        self.gets += 1
        entry = self._data.get(key)
        if entry is None:
            return False
        layout_id, num_tokens, data = entry
        if layout_id != obj.layout.layout_id or num_tokens != obj.num_tokens:
            return False
        obj.arena.buffer(obj.offset, obj.nbytes)[:] = data
        return True

    async def remove(self, key: ChunkKey) -> bool:
        return self._data.pop(key, None) is not None

    def stats(self) -> MemoryTierStats:
        return MemoryTierStats(
            entries=len(self._data),
            bytes_used=sum(len(data) for _, _, data in self._data.values()),
            puts=self.puts,
            gets=self.gets,
        )

    async def aclose(self) -> None:
        self.closed = True


class FaultyTier(LowerTier):
    """Fails ``put``/``get_into`` for a seeded subset of keys and sleeps per call: ``delay_s``
    for both, unless ``get_delay_s`` / ``put_delay_s`` say otherwise; ``contains_delay_s`` per
    `contains_many` call (one round trip). While ``gate`` is set to an unset `asyncio.Event`,
    reads and writes wait on it (after their delay)."""

    def __init__(
        self,
        inner: LowerTier,
        *,
        seed: int = 0,
        put_failure_rate: float = 0.0,
        get_failure_rate: float = 0.0,
        delay_s: float = 0.0,
        get_delay_s: float | None = None,
        put_delay_s: float | None = None,
        contains_delay_s: float = 0.0,
        raise_errors: bool = False,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.seed = seed
        self.put_failure_rate = put_failure_rate
        self.get_failure_rate = get_failure_rate
        self.delay_s = delay_s
        self.get_delay_s = get_delay_s
        self.put_delay_s = put_delay_s
        self.contains_delay_s = contains_delay_s
        self.raise_errors = raise_errors
        self.gate: asyncio.Event | None = None
        self.injected_failures = 0
        self.calls = {"get": 0, "put": 0, "contains_many": 0}
        self.active = 0  # reads and writes under way right now
        self.max_active = 0

    def fails(self, key: ChunkKey, op: Literal["get", "put"]) -> bool:
        """Whether the seeded fault hits ``op`` of ``key`` at the tier's rate now: a test picks
        its ``seed`` with this, so that the faults hit the chunks it means."""
        rate = self.get_failure_rate if op == "get" else self.put_failure_rate
        return rate > 0 and random.Random(f"{self.seed}:{op}:{key.hex}").random() < rate

    def _delay(self, op: str) -> float:
        specific = self.get_delay_s if op == "get" else self.put_delay_s
        return self.delay_s if specific is None else specific

    async def _inject(self, key: ChunkKey, op: Literal["get", "put"]) -> bool:
        self.calls[op] += 1
        delay = self._delay(op)
        if delay:
            await asyncio.sleep(delay)
        if self.gate is not None:
            await self.gate.wait()
        if self.fails(key, op):
            self.injected_failures += 1
            if self.raise_errors:
                raise OSError(f"injected {op} failure for {key.hex}")
            return True
        return False

    async def open(self) -> None:
        await self.inner.open()

    def contains(self, key: ChunkKey) -> bool:
        return self.inner.contains(key)

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self.calls["contains_many"] += 1
        if self.contains_delay_s:
            await asyncio.sleep(self.contains_delay_s)
        return await self.inner.contains_many(keys)

    async def put(self, key: ChunkKey, obj: MemoryObj) -> bool:
        return await self._faulty("put", self.inner.put, key, obj)

    async def get_into(self, key: ChunkKey, obj: MemoryObj) -> bool:
        return await self._faulty("get", self.inner.get_into, key, obj)

    async def _faulty(
        self,
        op: Literal["get", "put"],
        call: Callable[[ChunkKey, MemoryObj], Awaitable[bool]],
        key: ChunkKey,
        obj: MemoryObj,
    ) -> bool:
        """``call`` after the delay and gate, unless the seeded fault hits ``key``."""
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if await self._inject(key, op):
                return False
            return await call(key, obj)
        finally:
            self.active -= 1

    async def touch(self, keys: Sequence[ChunkKey]) -> None:
        await self.inner.touch(keys)

    async def remove(self, key: ChunkKey) -> bool:
        return await self.inner.remove(key)

    def stats(self) -> FaultyTierStats:
        inner = self.inner.stats()
        return FaultyTierStats(
            entries=inner.entries,
            bytes_used=inner.bytes_used,
            capacity=inner.capacity,
            inner=inner,
            injected_failures=self.injected_failures,
            max_active=self.max_active,
        )

    async def aclose(self) -> None:
        await self.inner.aclose()


class FullDiskFileOps(FileOps):
    """A filesystem of ``limit_bytes`` for the files under ``root`` (their sizes, summed).

    A write that would take them past the limit writes what fits and returns a short count, as
    the kernel does; the next one raises ``OSError(error_number)`` (``ENOSPC``, or ``EDQUOT`` for
    a quota). `free_bytes` answers from the same sums, so a tier sees one consistent disk. Change
    ``limit_bytes`` at any time (a disk that other files fill or free). Thread-safe; every write
    sums the directory, so keep it to a few hundred files.
    """

    def __init__(
        self, root: str | os.PathLike[str], limit_bytes: int, *, error_number: int = errno.ENOSPC
    ) -> None:
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        self.error_number = error_number
        self.failures = 0  # writes refused with error_number
        self.short_writes = 0
        self._mutex = threading.Lock()

    def used_bytes(self) -> int:
        total = 0
        for directory, _, names in os.walk(self.root):
            for name in names:
                try:
                    total += os.lstat(os.path.join(directory, name)).st_size
                except FileNotFoundError:
                    continue  # removed while we walked
        return total

    def pwrite(self, fd: int, data: memoryview, offset: int) -> int:
        with self._mutex:  # the check and the write as one step, so threads cannot overshoot
            room = max(0, self.limit_bytes - self.used_bytes())
            fits = min(len(data), os.fstat(fd).st_size + room - offset)
            if fits <= 0 and len(data):
                self.failures += 1
                raise OSError(self.error_number, os.strerror(self.error_number))
            if fits < len(data):
                self.short_writes += 1
                data = data[:fits]
            return super().pwrite(fd, data, offset)

    def free_bytes(self, directory: Path) -> int | None:
        with self._mutex:
            return max(0, self.limit_bytes - self.used_bytes())
