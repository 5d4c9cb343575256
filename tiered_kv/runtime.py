"""`EngineRuntime`: the parts an open engine runs, made together at open and closed together.

Owns the host arena, the storage manager over L1 and the lower tiers, the prefetch controller,
the mover and the retriever over them, the background reads that probe declined tiers, and the
layerwise stores begun and not yet ended; `open` builds them (freeing what it made when a part
refuses to start) and `aclose` takes them down in order (stores aborted, probes and prefetches
cancelled, pending writes flushed within the time left, the mover drained, then the arena freed).
Must not validate requests nor keep the engine's counters or registrations: the engine owns
those and passes them in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterable, Sequence

from tiered_kv.config import EngineConfig
from tiered_kv.gpu.base import KVMover
from tiered_kv.gpu.dispatch import DeviceMover
from tiered_kv.io.plane import WorkerPlane, default_io_workers, shared_memory_works
from tiered_kv.layerwise_store import LayerwiseStore
from tiered_kv.memory import HostArena
from tiered_kv.metrics import EngineCounters
from tiered_kv.prefetch import PrefetchController
from tiered_kv.request import Registration
from tiered_kv.retrieval import Retriever
from tiered_kv.storage import StorageManager
from tiered_kv.threads import write_threads
from tiered_kv.tiers import factory as tier_factory
from tiered_kv.tiers.base import LowerTier
from tiered_kv.tiers.l1 import L1Tier

logger = logging.getLogger(__name__)

# Bytes of chunks that may wait for one lower tier's writes, as a share of L1 (they hold L1
# memory until written; the rest stays free for loads and stores).
WRITE_QUEUE_L1_SHARE = 0.5


@dataclasses.dataclass(eq=False)
class EngineRuntime:
    """An open engine's running parts. Loop-only: everything here belongs to the loop that
    opened it."""

    arena: HostArena
    storage: StorageManager
    prefetch: PrefetchController
    mover: KVMover
    retriever: Retriever
    plane: WorkerPlane | None = None  # io_plane "processes": L2 reads in worker processes
    probes: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)
    layerwise_stores: set[LayerwiseStore] = dataclasses.field(default_factory=set)
    # Set by `aclose`: lower-tier writes dropped at close, and host bytes still referenced when
    # the arena closed (a bug).
    dropped_writes: int = 0
    leaked_bytes: int = 0

    @classmethod
    async def open(
        cls,
        config: EngineConfig,
        *,
        mover: KVMover | None,
        extra_tiers: Sequence[LowerTier],
        counters: EngineCounters,
    ) -> EngineRuntime:
        """Allocate the arena, open the tiers, and make the prefetch controller, the mover
        (``mover``, else the device's) and the retriever. When a tier refuses to open, what was
        made is freed again and the error raised."""
        processes = config.io_plane == "processes" or (
            config.io_plane == "auto" and shared_memory_works()
        )
        arena = HostArena(config.l1_bytes, pin=config.pin_memory, shared=processes)
        storage: StorageManager | None = None
        plane: WorkerPlane | None = None
        try:
            lower = [*tier_factory.lower_tiers(config), *extra_tiers]
            if processes:
                workers = config.io_workers or default_io_workers()
                plane = WorkerPlane(arena, workers, write_threads(workers))
                # Every tier is offered the plane (no short-circuit): each keeps its answer.
                users = [tier for tier in lower if tier.use_plane(plane)]
                if users:
                    plane.start()
                else:  # no tier reads through it: no worker to start
                    plane = None
            storage = StorageManager(
                L1Tier(arena, eviction=config.l1_eviction),
                lower,
                write_queue=config.lower_write_queue,
                write_queue_bytes=int(arena.capacity * WRITE_QUEUE_L1_SHARE),
                write_policies={t.name: config.write_policy_for(t.name) for t in lower},
                selective_min_hits=config.selective_min_hits,
            )
            await storage.open()
        except BaseException:  # a refused tier set or a tier that did not open: free the arena
            if storage is not None:
                await storage.aclose(0)
            if plane is not None:
                await plane.aclose()
            arena.close()
            raise
        prefetch = PrefetchController(
            storage,
            concurrency=config.prefetch_concurrency,
            l1_budget_bytes=int(arena.capacity * config.prefetch_l1_fraction),
        )
        mover = mover or DeviceMover()
        retriever = Retriever(storage, prefetch, mover, counters)
        return cls(arena, storage, prefetch, mover, retriever, plane=plane)

    def track_probe(self, task: asyncio.Task[None]) -> None:
        """A background read of a declined tier's chunk: cancelled at close if still running."""
        self.probes.add(task)
        task.add_done_callback(self.probes.discard)

    async def abort_layerwise_stores(self) -> None:
        """Abort every layerwise store not yet ended: nothing of it becomes visible."""
        for store in list(self.layerwise_stores):
            await store.abort()

    async def aclose(self, timeout: float, registrations: Iterable[Registration]) -> None:
        """Cancel probes and prefetches, flush pending lower-tier writes within ``timeout``
        seconds (the rest are dropped, ``dropped_writes``), let the mover forget
        ``registrations`` and drain, then free the arena (``leaked_bytes``: still referenced).
        Frees the arena even when a step raises."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            for probe in list(self.probes):
                probe.cancel()
            if self.probes:
                await asyncio.wait(list(self.probes))
            await self.prefetch.aclose()
            dropped = self.dropped_writes = await self.storage.aclose(
                max(0.0, deadline - loop.time())
            )
            if dropped:
                logger.warning(
                    "tiered_kv: %d chunk writes to lower tiers were dropped at close", dropped
                )
        finally:
            try:
                for registration in registrations:
                    self.mover.forget(registration.layout)
                await self.mover.aclose()
            finally:
                if self.plane is not None:
                    await self.plane.aclose()  # no worker writes into the arena any more
                leaked = self.leaked_bytes = self.arena.close()
                if leaked:
                    logger.error("tiered_kv: %d host bytes still referenced at close", leaked)
