"""`PrefetchController`: loads of L2/L3 chunks into L1 ahead of retrieve; `PrefetchClaims` (the
engine's side of one prefetch) and `PrefetchHandle` (the caller's).

Owns the in-flight loads (one per chunk key, shared by every request that wants it), the
per-tier concurrency limits, the L1 budget of prefetch reservations, and the outcome counters.
A load's L1 object is allocated from the requesting registration's `MemoryLayoutDesc` before any
byte arrives; when the bytes are in, the chunk is committed to L1. Must not touch KV bytes (tiers
do), import CUDA, or evict anything referenced (L1 allocation evicts unreferenced entries only);
when L1 has no room, or prefetch reservations would pass their budget, prefetching stops there
rather than thrash. Loop-only, except `PrefetchClaims`' finalizer, which hops to the loop.

Reference ownership: a load holds the staging object's first reference until its read ends; each
prefetch waiting for the chunk holds one more (its reservation), dropped by `take` (retrieve now
owns it), `cancel` (`PrefetchHandle.close`), or, for a handle its caller never closed, when it
is garbage-collected (counted as leaked). A prefetch may also pin chunks that were in L1 already
(`pin_l1`: one reference each, so no eviction takes a claimed chunk before its retrieve),
dropped by `unpin`, `cancel` or the collector likewise.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import weakref
from collections.abc import Generator, Mapping, Sequence
from typing import Any, Literal

from tiered_kv.keys import ChunkKey
from tiered_kv.layout import MemoryLayoutDesc
from tiered_kv.memory import MemoryObj
from tiered_kv.storage import IN_L1, StorageManager

logger = logging.getLogger(__name__)

ReserveStop = Literal["no_space", "budget"]  # why `reserve` reserved nothing
ReleaseOutcome = Literal["cancelled", "late"]  # how a prefetch's unused reservations end


@dataclasses.dataclass(slots=True)
class PrefetchCounters:
    """Outcomes of reservations (one per chunk a handle asked to load)."""

    handles: int = 0
    handles_leaked: int = 0  # collected by the garbage collector still holding something
    loads_started: int = 0
    loads_deduplicated: int = 0
    ready_in_time: int = 0  # loaded before retrieve needed it
    ready_after_wait: int = 0  # retrieve waited for it, within the policy's budget
    late: int = 0  # still loading when the policy's budget ran out (recomputed)
    cancelled: int = 0  # handle cancelled, dropped, or abandoned before use
    failed: int = 0  # the read failed (a miss)
    unused: int = 0  # loaded but not used (after a gap or a late chunk)
    stopped_no_space: int = 0  # chunks not reserved: L1 had no unreferenced room
    stopped_budget: int = 0  # chunks not reserved: prefetch budget of L1 reached
    bytes_loaded: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class PrefetchStats:
    """`PrefetchController.stats()`: the counters, and what is in flight now."""

    counters: PrefetchCounters  # a copy
    in_flight: int  # loads not finished (queued + running), cancelled ones included
    running: int  # loads holding a tier slot
    queued: int  # loads waiting for a tier slot
    reserved_bytes: int  # L1 bytes held by prefetch reservations
    budget_bytes: int
    live_handles: int
    read_slots: Mapping[str, int]  # loads in flight at most, per lower tier (lower-case name)


@dataclasses.dataclass(slots=True, eq=False)
class ChunkLoad:
    """One chunk's read from the lower tiers (``tier_indexes``, tried in order) into ``obj``,
    shared by every prefetch holding it (``holders``); `PrefetchController.reserve` gives it."""

    key: ChunkKey
    tier_indexes: tuple[int, ...]
    obj: MemoryObj
    task: asyncio.Task[bool] | None = None
    holders: int = 0
    running: bool = False  # holds a tier slot (its read is under way)
    settled: bool = False  # its bytes no longer count against the prefetch budget

    def succeeded(self) -> bool:
        task = self.task
        return task is not None and task.done() and not task.cancelled() and task.result() is True

    def finished(self) -> bool:
        return self.task is not None and self.task.done()


@dataclasses.dataclass(slots=True, eq=False)
class PrefetchSlot:
    """One chunk of a handle's prefix. ``load`` is None for chunks L1 held at lookup time and
    for chunks that could not be reserved (``reserved`` False)."""

    index: int
    key: ChunkKey
    num_tokens: int
    in_l1: bool
    load: ChunkLoad | None = None
    held: bool = False  # the handle holds a reference to load.obj


class PrefetchController:
    """Starts, deduplicates and bounds loads; see the module docstring for ownership."""

    def __init__(
        self, storage: StorageManager, *, concurrency: int | None, l1_budget_bytes: int
    ) -> None:
        """``concurrency``: loads in flight per lower tier; None takes each tier's own
        ``read_parallelism`` (its I/O threads or connections)."""
        self.storage = storage
        self.l1_budget_bytes = l1_budget_bytes
        self.reserved_bytes = 0
        self.counters = PrefetchCounters()
        self.read_slots = {
            tier.name.lower(): tier.read_parallelism if concurrency is None else concurrency
            for tier in storage.lower
        }
        self._limits = [asyncio.Semaphore(self.read_slots[t.name.lower()]) for t in storage.lower]
        self._loads: dict[ChunkKey, ChunkLoad] = {}
        # Loads cancelled and not yet ended: out of `_loads`, so a new reservation of the key
        # starts a load of its own instead of joining one that will fail.
        self._cancelling: set[ChunkLoad] = set()
        self._tasks: set[asyncio.Task[bool]] = set()
        self._handles: weakref.WeakSet[PrefetchClaims] = weakref.WeakSet()
        self._closed = False

    # -- loads ------------------------------------------------------------------------------
    def reserve(
        self,
        key: ChunkKey,
        tier_indexes: Sequence[int],
        layout: MemoryLayoutDesc,
        num_tokens: int,
        *,
        budgeted: bool = True,
    ) -> ChunkLoad | ReserveStop:
        """Join the in-flight load of ``key`` or start one; the caller becomes a holder (one
        reference to the object). Returns why nothing was reserved otherwise (`ReserveStop`)."""
        load = self._loads.get(key)
        if load is not None:
            self.counters.loads_deduplicated += 1
        else:
            nbytes = layout.nbytes(num_tokens)
            if budgeted and self.reserved_bytes + nbytes > self.l1_budget_bytes:
                self.counters.stopped_budget += 1
                return "budget"
            obj = self.storage.allocate(layout, num_tokens)
            if obj is None:
                self.counters.stopped_no_space += 1
                self.storage.record_promotion_failure()
                return "no_space"
            load = ChunkLoad(key, tuple(tier_indexes), obj)
            self.reserved_bytes += obj.nbytes
            self._loads[key] = load
            task = asyncio.get_running_loop().create_task(
                self._run(load), name=f"tkv-prefetch-{key.hex[:12]}"
            )
            load.task = task
            self._tasks.add(task)
            # A callback, not the coroutine's `finally`: a task cancelled before its first step
            # never runs its body, and the load's reference must still be dropped.
            task.add_done_callback(functools.partial(self._finish, load))
            self.counters.loads_started += 1
        load.obj.ref()
        load.holders += 1
        return load

    async def _run(self, load: ChunkLoad) -> bool:
        ok = False
        try:
            for index in load.tier_indexes:
                async with self._limits[index]:
                    load.running = True
                    ok = await self.storage.read_into(index, load.key, load.obj)
                    load.running = False
                if ok:
                    break
            if ok:
                self.counters.bytes_loaded += load.obj.nbytes
                self.storage.promote(load.key, load.obj)
            else:
                self.storage.record_miss()
            return ok
        finally:
            load.running = False

    def _finish(self, load: ChunkLoad, task: asyncio.Task[bool]) -> None:
        self._tasks.discard(task)
        self._cancelling.discard(load)
        if self._loads.get(load.key) is load:
            del self._loads[load.key]
        load.obj.unref()  # the load's own reference; holders and L1 keep theirs
        self._maybe_settle(load)

    def release(self, load: ChunkLoad, *, keep_running: bool) -> None:
        """A holder drops its reference. A load nobody holds any more is cancelled, unless
        ``keep_running``: it then finishes into L1 as an unreferenced (evictable) entry, still
        counted against the prefetch budget until it ends."""
        load.holders -= 1
        load.obj.unref()
        task = load.task
        if load.holders == 0 and task is not None and not task.done() and not keep_running:
            task.cancel()
            if self._loads.get(load.key) is load:
                del self._loads[load.key]
                self._cancelling.add(load)
        self._maybe_settle(load)

    def _maybe_settle(self, load: ChunkLoad) -> None:
        if not load.settled and load.holders == 0 and load.finished():
            load.settled = True
            self.reserved_bytes -= load.obj.nbytes

    # -- handles ----------------------------------------------------------------------------
    def start(
        self,
        slots: Sequence[tuple[ChunkKey, int, int]],
        layout: MemoryLayoutDesc,
        *,
        first_chunk: int = 0,
    ) -> PrefetchClaims:
        """The claims over a located prefix starting at chunk ``first_chunk``: per chunk (key,
        token count, location), the location as `StorageManager.locate` gives it: `IN_L1`, else
        the index of the first lower tier holding it. Chunks in lower tiers get a reservation
        until one cannot be made (L1 pressure stops prefetching there)."""
        handle_slots: list[PrefetchSlot] = []
        stopped = False
        for offset, (key, num_tokens, where) in enumerate(slots):
            slot = PrefetchSlot(first_chunk + offset, key, num_tokens, in_l1=where == IN_L1)
            handle_slots.append(slot)
            if where == IN_L1 or stopped:
                continue
            tiers = [where, *(i for i in self.storage.lower_holding(key) if i != where)]
            got = self.reserve(key, tiers, layout, num_tokens)
            if isinstance(got, str):
                stopped = True
                continue
            slot.load = got
            slot.held = True
        self.counters.handles += 1
        claims = PrefetchClaims(self, handle_slots, first_chunk)
        self._handles.add(claims)
        return claims

    def stats(self) -> PrefetchStats:
        loads = [*self._loads.values(), *self._cancelling]
        running = sum(1 for load in loads if load.running)
        return PrefetchStats(
            counters=dataclasses.replace(self.counters),
            in_flight=len(loads),
            running=running,
            queued=len(loads) - running,
            reserved_bytes=self.reserved_bytes,
            budget_bytes=self.l1_budget_bytes,
            live_handles=sum(1 for handle in self._handles if not handle.released),
            read_slots=dict(self.read_slots),
        )

    async def aclose(self) -> None:
        """Cancel every handle and load and wait for the loads to let go of their objects."""
        self._closed = True
        for handle in list(self._handles):
            handle.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _release_slots(
    controller: PrefetchController, slots: list[PrefetchSlot], outcome: ReleaseOutcome
) -> None:
    """Drop every reservation still held in ``slots``, counting ``outcome`` for each."""
    counters = controller.counters
    for slot in slots:
        load = slot.load
        if load is None or not slot.held:
            continue
        slot.held = False
        if load.finished() and not load.succeeded():
            counters.failed += 1
        elif outcome == "cancelled":
            counters.cancelled += 1
        elif load.succeeded():
            counters.unused += 1
        else:
            counters.late += 1
        controller.release(load, keep_running=outcome != "cancelled")


def _finalize(
    loop: asyncio.AbstractEventLoop,
    controller: PrefetchController,
    slots: list[PrefetchSlot],
    pins: list[MemoryObj],
) -> None:
    """A prefetch was garbage-collected without being closed (a caller's bug, counted in
    ``handles_leaked``): free its reservations and pins on the loop (the collector may run in
    any thread)."""
    if not any(slot.held for slot in slots) and not pins:
        return
    controller.counters.handles_leaked += 1
    # A closed loop raises RuntimeError: the engine is gone, and its arena with it.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(_release_slots, controller, slots, "cancelled")
        loop.call_soon_threadsafe(_unpin, pins)


def _unpin(pins: list[MemoryObj]) -> None:
    while pins:
        pins.pop().unref()


class PrefetchClaims:
    """The engine's side of one prefetch: its reservations and pins, which retrieve consumes
    chunk by chunk (`take`, `add_slot`, `extend`, `release_unused`). Callers see it through
    their `PrefetchHandle`; the engine's own prefetches (a retrieve's loads, cost probes) use
    it directly."""

    def __init__(
        self, controller: PrefetchController, slots: list[PrefetchSlot], first_chunk: int
    ) -> None:
        self._controller = controller
        self._slots = slots
        self.first_chunk = first_chunk
        self.released = False
        self.hit_tokens = sum(slot.num_tokens for slot in slots)
        self._pins: list[MemoryObj] = []
        self._finalizer = weakref.finalize(
            self, _finalize, asyncio.get_running_loop(), controller, slots, self._pins
        )
        self._finalizer.atexit = False

    @property
    def slots(self) -> Sequence[PrefetchSlot]:
        return self._slots

    @property
    def controller(self) -> PrefetchController:
        return self._controller

    def reserved_chunks(self) -> int:
        return sum(1 for slot in self._slots if slot.held)

    def done(self) -> bool:
        """True when no load of this handle is still running (or the handle was released)."""
        if self.released:
            return True
        return all(slot.load is None or slot.load.finished() for slot in self._slots)

    def ready_tokens(self) -> int:
        """Tokens of the prefix that are in host memory now (a chunk not ready ends it)."""
        storage = self._controller.storage
        ready = 0
        for slot in self._slots:
            if slot.load is not None and slot.held:
                if not slot.load.succeeded():
                    break
            elif not storage.in_l1(slot.key):
                break
            ready += slot.num_tokens
        return ready

    def failed_loads(self) -> bool:
        """Whether a load of this handle ended without its chunk (a tier failed or missed)."""
        return any(
            slot.load is not None and slot.load.finished() and not slot.load.succeeded()
            for slot in self.slots
        )

    def ready_chunks(self) -> list[bool]:
        """Per slot (chunk ``first_chunk + i``): whether it is in host memory now. Unlike
        `ready_tokens`, a chunk not ready does not end the answer (a sliding-window layer group
        needs only the chunks of its window)."""
        storage = self._controller.storage
        return [
            slot.load.succeeded()
            if slot.load is not None and slot.held
            else storage.in_l1(slot.key)
            for slot in self._slots
        ]

    async def wait(self, timeout: float | None = None) -> int:
        """Wait (at most ``timeout`` seconds) for the loads; returns `ready_tokens()`."""
        pending = [
            slot.load.task
            for slot in self._slots
            if slot.load is not None and slot.held and slot.load.task is not None
        ]
        pending = [task for task in pending if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        return self.ready_tokens()

    def __await__(self) -> Generator[Any, None, int]:
        return self.wait().__await__()

    def take(self, slot: PrefetchSlot, *, waited: bool) -> MemoryObj | None:
        """Hand the slot's loaded object to the caller (who must `unref` it), or None when the
        load failed or is not finished; the reservation then belongs to the caller. ``waited``:
        the caller had to wait for it (counted as ready after wait, else ready in time)."""
        load = slot.load
        if load is None or not slot.held or not load.succeeded():
            return None
        slot.held = False
        if waited:
            self._controller.counters.ready_after_wait += 1
        else:
            self._controller.counters.ready_in_time += 1
        load.holders -= 1
        self._controller._maybe_settle(load)
        return load.obj

    def cancel(self) -> None:
        """Free every reservation (loads nobody else wants are cancelled). Idempotent."""
        self._release("cancelled")

    def _release(self, outcome: ReleaseOutcome) -> None:
        if self.released:
            return
        self.released = True
        self._finalizer.detach()
        _release_slots(self._controller, self._slots, outcome)
        _unpin(self._pins)

    def pin_l1(self, num_chunks: int, max_bytes: int) -> tuple[int, bool]:
        """Hold a reference on each of the first ``num_chunks`` slots' chunks that sits in L1
        without a load of this handle, so that no eviction takes it until `unpin`, `cancel` or
        `release_unused`; stops before passing ``max_bytes``. Returns the bytes pinned now
        (pinning again pins nothing twice) and whether every such chunk is pinned."""
        if self.released:
            return 0, False
        l1 = self._controller.storage.l1
        pinned = {id(obj) for obj in self._pins}
        added = 0
        for slot in self._slots[:num_chunks]:
            if slot.load is not None and slot.held:
                continue  # the reservation holds it already
            obj = l1.peek(slot.key)
            if obj is None or id(obj) in pinned:
                continue
            if added + obj.nbytes > max_bytes:
                return added, False
            self._pins.append(obj.ref())
            added += obj.nbytes
        return added, True

    def pinned_bytes(self) -> int:
        return sum(obj.nbytes for obj in self._pins)

    def unpin(self) -> None:
        """Drop the references `pin_l1` took (the reservations stay)."""
        _unpin(self._pins)

    def release_unused(self) -> None:
        """After retrieve: drop what it did not take (late loads keep running into L1)."""
        self._release("late")

    def extend(self, chunks: Sequence[tuple[ChunkKey, int]]) -> None:
        """Append unreserved slots for the chunks (key, token count) after the handle's last: a
        retrieve of a prefix that grew since the lookup that made the handle."""
        start = self.first_chunk + len(self._slots)
        for offset, (key, num_tokens) in enumerate(chunks):
            self._slots.append(PrefetchSlot(start + offset, key, num_tokens, in_l1=False))

    def add_slot(
        self, index: int, key: ChunkKey, num_tokens: int, load: ChunkLoad | None
    ) -> PrefetchSlot:
        """Retrieve reserved a chunk whose slot holds no reservation (evicted since lookup, or
        not reserved because of L1 pressure then); the new slot replaces it."""
        position = index - self.first_chunk
        if not 0 <= position < len(self._slots) or self._slots[position].held:
            raise ValueError(
                f"PrefetchClaims.add_slot: chunk {index} is not an unreserved slot of chunks "
                f"[{self.first_chunk}, {self.first_chunk + len(self._slots)})"
            )
        slot = PrefetchSlot(index, key, num_tokens, in_l1=False, load=load, held=load is not None)
        self._slots[position] = slot
        return slot

    def slot(self, index: int) -> PrefetchSlot | None:
        """The slot of chunk ``index`` (absolute in the request), or None outside the handle."""
        position = index - self.first_chunk
        return self._slots[position] if 0 <= position < len(self._slots) else None


class PrefetchHandle:
    """A caller's prefetch of one request's cached prefix (`TieredKVEngine.prefetch`): the
    caller owns it and ends it, by `close` (or leaving ``async with handle:``) or by passing
    it to the retrieve of the same tokens, which uses its loads and closes it. Awaiting it
    waits for every load and returns `ready_tokens()`. Closing frees its reservations (loads
    nobody else wants are cancelled) and pins. A handle dropped unclosed is freed by the
    garbage collector and counted as leaked (``handles_leaked``)."""

    __slots__ = ("_claims",)

    def __init__(self, claims: PrefetchClaims) -> None:
        self._claims = claims

    @property
    def hit_tokens(self) -> int:
        """Tokens of the located prefix this prefetch covers (from `first_chunk` on)."""
        return self._claims.hit_tokens

    @property
    def first_chunk(self) -> int:
        return self._claims.first_chunk

    @property
    def closed(self) -> bool:
        return self._claims.released

    def done(self) -> bool:
        """True when no load is still running (or the handle is closed)."""
        return self._claims.done()

    def ready_tokens(self) -> int:
        """Tokens of the prefix that are in host memory now (a chunk not ready ends it)."""
        return self._claims.ready_tokens()

    def ready_chunks(self) -> list[bool]:
        """Per chunk (``first_chunk + i``): whether it is in host memory now."""
        return self._claims.ready_chunks()

    def failed_loads(self) -> bool:
        """Whether a load ended without its chunk (a tier failed or missed)."""
        return self._claims.failed_loads()

    def reserved_chunks(self) -> int:
        """Chunks this prefetch holds a reservation for (L1 pressure or the prefetch budget
        may have stopped it short of `hit_tokens`)."""
        return self._claims.reserved_chunks()

    async def wait(self, timeout: float | None = None) -> int:
        """Wait (at most ``timeout`` seconds) for the loads; returns `ready_tokens()`."""
        return await self._claims.wait(timeout)

    def __await__(self) -> Generator[Any, None, int]:
        return self.wait().__await__()

    def pin_l1(self, num_chunks: int, max_bytes: int) -> tuple[int, bool]:
        """Keep the first ``num_chunks`` chunks that were in L1 already from eviction until
        `unpin` or `close` (`PrefetchClaims.pin_l1`); returns (bytes pinned now, all pinned)."""
        return self._claims.pin_l1(num_chunks, max_bytes)

    def pinned_bytes(self) -> int:
        return self._claims.pinned_bytes()

    def unpin(self) -> None:
        self._claims.unpin()

    def close(self) -> None:
        """Free every reservation and pin. Idempotent."""
        self._claims.cancel()

    async def __aenter__(self) -> PrefetchHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


def claims_of(handle: PrefetchHandle) -> PrefetchClaims:
    """The engine's side of a caller's handle (for the retrieve it is passed to)."""
    return handle._claims
