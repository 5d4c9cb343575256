"""`StorageManager`: L1 in front of the lower tiers (L2 disk, later L3 remote).

Owns which tier holds what, write-through into lower tiers on bounded background queues,
longest-prefix lookup across tiers, and promotion of lower-tier hits into L1. Never touches KV
bytes itself (tiers and movers do) and never imports CUDA. Loop-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence

from tiered_kv.keys import ChunkKey
from tiered_kv.layout import MemoryLayoutDesc
from tiered_kv.memory import MemoryObj
from tiered_kv.tiers.base import LowerTier
from tiered_kv.tiers.l1 import L1Tier

logger = logging.getLogger(__name__)

WRITERS_PER_TIER = 2


@dataclasses.dataclass(slots=True)
class _WriteQueue:
    tier: LowerTier
    queue: asyncio.Queue[tuple[ChunkKey, MemoryObj]]
    pending: set[ChunkKey]
    workers: list[asyncio.Task[None]]
    dropped_full: int = 0
    dropped_close: int = 0
    written: int = 0
    failed: int = 0


class StorageManager:
    """Chains L1 and the lower tiers.

    Object ownership: `allocate` hands the caller a staging object with one reference; `commit`
    makes L1 and every write queue take their own, so the caller always drops its reference after
    committing. `get` returns an object with a reference for the caller.
    """

    def __init__(self, l1: L1Tier, lower: Sequence[LowerTier], *, write_queue: int = 256) -> None:
        self.l1 = l1
        self.lower = tuple(lower)
        self._write_queue_size = write_queue
        self._queues: list[_WriteQueue] = []
        self._opened = False
        self.hits = {name: 0 for name in (l1.name, *(tier.name for tier in self.lower))}
        self.misses = 0
        self.promotions = 0
        self.promotion_failures = 0
        self.lower_read_seconds = 0.0

    async def open(self) -> None:
        for tier in self.lower:
            await tier.open()
            queue: asyncio.Queue[tuple[ChunkKey, MemoryObj]] = asyncio.Queue(self._write_queue_size)
            wq = _WriteQueue(tier, queue, set(), [])
            wq.workers = [
                asyncio.create_task(self._writer(wq), name=f"tkv-{tier.name}-writer{i}")
                for i in range(WRITERS_PER_TIER)
            ]
            self._queues.append(wq)
        self._opened = True

    # -- bookkeeping ------------------------------------------------------------------------
    def tier_of(self, key: ChunkKey) -> str | None:
        """Name of the highest tier holding ``key`` (from indexes, no I/O), or None."""
        if self.l1.contains(key):
            return self.l1.name
        for tier in self.lower:
            if tier.contains(key):
                return tier.name
        return None

    def prefix_hits(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys some tier holds; a miss ends the prefix."""
        for index, key in enumerate(keys):
            if self.tier_of(key) is None:
                return index
        return len(keys)

    # -- store ------------------------------------------------------------------------------
    def allocate(self, layout: MemoryLayoutDesc, num_tokens: int) -> MemoryObj | None:
        return self.l1.allocate(layout, num_tokens)

    def commit(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Publish a filled staging object in L1 and queue its write-through to lower tiers."""
        if not self.l1.commit(key, obj):
            return False
        for wq in self._queues:
            if key in wq.pending or wq.tier.contains(key):
                continue
            try:
                wq.queue.put_nowait((key, obj.ref()))
            except asyncio.QueueFull:
                obj.unref()
                wq.dropped_full += 1
                continue
            wq.pending.add(key)
        return True

    async def _writer(self, wq: _WriteQueue) -> None:
        while True:
            key, obj = await wq.queue.get()
            try:
                if await wq.tier.put(key, obj):
                    wq.written += 1
                else:
                    wq.failed += 1
            except asyncio.CancelledError:
                wq.dropped_close += 1  # only aclose cancels writers
                raise
            except Exception:  # tier boundary: a broken tier must not kill the writer
                logger.warning("%s write of %s failed", wq.tier.name, key.hex, exc_info=True)
                wq.failed += 1
            finally:
                wq.pending.discard(key)
                obj.unref()
                wq.queue.task_done()

    # -- read -------------------------------------------------------------------------------
    def get_l1(self, key: ChunkKey) -> MemoryObj | None:
        """The chunk if L1 holds it (caller's reference), without awaiting."""
        obj = self.l1.get(key)
        if obj is not None:
            self.hits[self.l1.name] += 1
        return obj

    async def get(
        self, key: ChunkKey, layout: MemoryLayoutDesc, num_tokens: int
    ) -> MemoryObj | None:
        """The chunk in host memory (caller's reference), promoting a lower-tier hit into L1."""
        obj = self.get_l1(key)
        if obj is not None:
            return obj
        return await self.get_lower(key, layout, num_tokens)

    async def get_lower(
        self, key: ChunkKey, layout: MemoryLayoutDesc, num_tokens: int
    ) -> MemoryObj | None:
        """Read ``key`` from the first lower tier that has it into a new L1 object (promotion)."""
        for tier in self.lower:
            if not tier.contains(key):
                continue
            staging = self.l1.allocate(layout, num_tokens)
            if staging is None:
                self.promotion_failures += 1
                return None
            start = time.perf_counter()
            try:
                found = await tier.get_into(key, staging)
            except BaseException:
                staging.unref()
                raise
            self.lower_read_seconds += time.perf_counter() - start
            if not found:
                staging.unref()
                continue
            self.hits[tier.name] += 1
            if self.l1.commit(key, staging):
                self.promotions += 1
            return staging
        self.misses += 1
        return None

    # -- shutdown ---------------------------------------------------------------------------
    async def flush(self, timeout: float | None = None) -> int:
        """Wait for queued lower-tier writes. Returns how many were still pending at the timeout
        (those stay queued; `aclose` drops them)."""
        joins = [wq.queue.join() for wq in self._queues]
        if not joins:
            return 0
        try:
            await asyncio.wait_for(asyncio.gather(*joins), timeout)
        except TimeoutError:
            return sum(len(wq.pending) for wq in self._queues)
        return 0

    async def aclose(self, timeout: float) -> int:
        """Flush (bounded by ``timeout``), then drop what is left, stop writers, close tiers.
        Returns the number of writes dropped."""
        if not self._opened:
            return 0
        dropped = 0
        try:
            if self._queues:
                pending = await self.flush(timeout)
                if pending:
                    logger.warning(
                        "closing with %d lower-tier writes still pending after %.1fs; dropping",
                        pending,
                        timeout,
                    )
        finally:
            for wq in self._queues:
                for task in wq.workers:
                    task.cancel()
                for task in wq.workers:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                while not wq.queue.empty():
                    key, obj = wq.queue.get_nowait()
                    obj.unref()
                    wq.pending.discard(key)
                    wq.dropped_close += 1
                wq.workers.clear()
                dropped += wq.dropped_close
            for tier in self.lower:
                await tier.aclose()
            self.l1.clear()
            self._opened = False
        return dropped

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {
            f"hits_{name.lower()}": count for name, count in self.hits.items()
        }
        out["misses"] = self.misses
        out["promotions"] = self.promotions
        out["promotion_failures"] = self.promotion_failures
        for wq in self._queues:
            prefix = f"{wq.tier.name.lower()}_write"
            out[f"{prefix}_queue_depth"] = wq.queue.qsize()
            out[f"{prefix}_pending"] = len(wq.pending)
            out[f"{prefix}_done"] = wq.written
            out[f"{prefix}_failed"] = wq.failed
            out[f"{prefix}_dropped_full"] = wq.dropped_full
            out[f"{prefix}_dropped_close"] = wq.dropped_close
        return out
