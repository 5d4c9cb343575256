"""Retrieve orchestration: deliver a request's cached prefix from L1 into its GPU blocks.

Owns one retrieve call from validated arguments to `RetrieveResult`: walking the request's
chunks in order, taking each from L1 or from the prefetch that loads it (waiting as the prefetch
policy allows, reserving a load for a chunk no prefetch covers), and handing the chunks to the
mover, either whole (scattered in batches as they become ready, so delivering a prefix never
needs more L1 room than one batch plus the loads in flight) or layerwise (every chunk resolved
first, then one layer-major scatter whose layers the caller waits for one by one). Must not
validate arguments (the engine does) nor touch bytes (the mover does).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, Protocol

from tiered_kv.config import PrefetchPolicy
from tiered_kv.errors import EngineStateError
from tiered_kv.gpu.base import ChunkTransfer, FinishedLayerLoad, KVMover, LayerLoad
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import KVCacheLayout
from tiered_kv.memory import MemoryObj
from tiered_kv.prefetch import PrefetchClaims, PrefetchController
from tiered_kv.storage import StorageManager

# Why a retrieve's delivered prefix ends (`RetrieveResult.stop_reason`).
StopReason = Literal["complete", "gap", "late", "failed", "no_space"]


@dataclasses.dataclass(frozen=True, slots=True)
class RetrieveResult:
    """What a retrieve delivered, and why it stopped.

    valid_tokens: end of the valid prefix in the request's blocks.
    cached_tokens: end of the prefix the tiers held when retrieve stopped (>= valid_tokens);
        ``cached_tokens - valid_tokens`` tokens were cached but not delivered: the serving
        engine recomputes them.
    stop_reason: "complete" (every chunk of the request), "gap" (the cached prefix ends),
        "late" (a chunk was still loading when the policy's budget ran out), "failed" (a
        load failed: a miss) or "no_space" (L1 had no unreferenced room for a load).
    late_chunks: chunk indexes not delivered because of the policy (the first late one and the
        cached chunks after it).
    failed_chunks: chunk indexes whose load failed.
    waited_s: time spent waiting for loads.
    """

    valid_tokens: int
    cached_tokens: int
    stop_reason: StopReason
    policy: PrefetchPolicy
    late_chunks: tuple[int, ...] = ()
    failed_chunks: tuple[int, ...] = ()
    waited_s: float = 0.0

    @property
    def recompute_tokens(self) -> int:
        """Cached tokens that were not delivered (late, failed or no room)."""
        return self.cached_tokens - self.valid_tokens


class LayerwiseRetrieve:
    """A layerwise retrieve whose chunks are decided (`result`) and whose copies are started.

    ``wait_layer(i)`` orders a stream after layer ``i`` of every delivered chunk (GPU-side; on
    CPU caches it blocks until that layer is copied); ``await wait()`` until every copy is done.
    On the GPU the retrieve returns once the first layers' copies are queued, and
    ``wait_layer(i)`` queues the copies it needs itself, on the calling thread (the model's,
    usually): no other thread has to keep up with the model. Copies nobody waits for are
    queued by ``enqueued``/``wait``, or by the engine's loop once they should have ended.
    Layers are the registration order of the caches (`KVCacheLayout.layer_names`).
    """

    def __init__(self, result: RetrieveResult, load: LayerLoad) -> None:
        self.result = result
        self._load = load

    @property
    def num_layers(self) -> int:
        return self._load.num_layers

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        self._load.wait_layer(layer, stream)

    def wait_all(self, stream: Any = None) -> None:
        self._load.wait_all(stream)

    def done(self) -> bool:
        return self._load.done()

    async def enqueued(self) -> None:
        """Until every layer's copies are queued (raises `TieredKVError` if queueing failed);
        `wait_layer` never needs it."""
        await self._load.enqueued()

    async def wait(self) -> None:
        await self._load.wait()


class RetrieveCounters(Protocol):
    """The engine counters a retrieve adds to."""

    retrieved_tokens: int
    retrieved_chunks: int
    retrieve_scatter_batches: int
    retrieve_waited_seconds: float
    retrieve_late_tokens: int
    retrieve_failed_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class RetrieveRequest:
    """A retrieve call's validated arguments. ``handle`` covers chunks from ``first`` on (the
    lookup's prefetch, or one started for this call), or is None when every chunk was in L1:
    ``open_handle()`` then makes an empty one, should a chunk need a load after all.
    ``chunk_tokens(i)`` is chunk i's length."""

    layout: KVCacheLayout
    keys: Sequence[ChunkKey]
    block_ids: Sequence[int]
    num_tokens: int
    skip_prefix_tokens: int
    first: int
    policy: PrefetchPolicy
    handle: PrefetchClaims | None
    open_handle: Callable[[], PrefetchClaims]
    chunk_size: int
    chunk_tokens: Callable[[int], int]
    timeout_base_s: float
    timeout_per_1k_tokens_s: float
    batch_chunks: int


class Retriever:
    """Runs retrieve calls against one engine's storage, prefetch controller and mover."""

    def __init__(
        self,
        storage: StorageManager,
        controller: PrefetchController,
        mover: KVMover,
        counters: RetrieveCounters,
    ) -> None:
        self._storage = storage
        self._controller = controller
        self._mover = mover
        self._counters = counters

    async def whole(self, request: RetrieveRequest) -> RetrieveResult:
        """Scatter chunks in batches as they become ready; the caller's stream is ordered after
        every copy when this returns."""
        batches = _Batches(self._mover, self._counters, request)
        try:
            walk = await self._walk(request, batches.add, batches.flush)
            await batches.flush()
        finally:
            batches.drop()
        return self._finish(request, walk, batches.delivered)

    async def layerwise(self, request: RetrieveRequest) -> LayerwiseRetrieve:
        """Decide every chunk first (waiting for loads per the policy), then enqueue one
        layer-major scatter of them all; returns with the result before any layer is ready.

        A prefix whose chunks must be waited for (loads from L2/L3) is delivered as `whole`
        delivers it instead: each batch is scattered while the next chunks still arrive, so
        the host reads and the copies overlap, and the result's layers are all ready (its
        caller's stream ordered after every copy) when this returns. Layer-major copies could
        start only once every chunk had arrived."""
        batches = _Batches(self._mover, self._counters, request)
        streaming = False

        def take(transfer: ChunkTransfer) -> Awaitable[None] | None:
            if streaming:
                return batches.add(transfer)
            batches.pending.append(transfer)
            return None

        async def before_wait() -> None:
            nonlocal streaming
            streaming = True
            await batches.flush()

        load: LayerLoad = FinishedLayerLoad(request.layout.num_layers)
        try:
            walk = await self._walk(request, take, before_wait)
            if streaming:
                await batches.flush()
            elif batches.pending:
                taken = list(batches.pending)  # the mover may keep the list it is given
                load = await self._mover.scatter_layerwise(request.layout, request.block_ids, taken)
                batches.count(taken)
        finally:
            batches.drop()  # the mover holds its own references while it copies
        return LayerwiseRetrieve(self._finish(request, walk, batches.delivered), load)

    async def _walk(
        self,
        request: RetrieveRequest,
        add: Callable[[ChunkTransfer], Awaitable[None] | None],
        make_room: Callable[[], Awaitable[None]],
    ) -> _Walk:
        """Take chunks from ``request.first`` on, in order, until one is missing, late, failed
        or has no room; each taken chunk (a held L1 object) goes to ``add``, whose awaitable,
        if it returns one, is awaited (a plain append costs no coroutine per chunk).
        ``make_room`` is awaited before waiting for or reserving a load, so the caller can drop
        references."""
        storage, controller, handle = self._storage, self._controller, request.handle
        keys = request.keys
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline: float | None
        if request.policy == "best_effort":
            deadline = started
        elif request.policy == "wait_complete":
            deadline = None
        else:
            first = request.first
            loading = sum(
                request.chunk_tokens(i)
                for i in range(first, first + storage.prefix_hits(keys[first:]))
                if not storage.in_l1(keys[i])
            )
            deadline = started + (
                request.timeout_base_s + request.timeout_per_1k_tokens_s * loading / 1000
            )
        walk = _Walk(index=request.first)
        desc = request.layout.layout_desc
        try:
            while walk.index < len(keys):
                index = walk.index
                key = keys[index]
                slot = None if handle is None else handle.slot(index)
                obj: MemoryObj | None = None
                if slot is None or not slot.held:
                    obj = storage.get_l1(key)
                    if obj is None:
                        tiers = storage.lower_holding(key)
                        if not tiers:
                            walk.stop_reason = "gap"
                            break
                        if deadline is not None and loop.time() >= deadline:
                            walk.stop_reason = "late"
                            break
                        await make_room()  # our own references must not crowd out the load
                        if handle is None:  # the chunk left L1 since it was located
                            handle = request.open_handle()
                        tokens = request.chunk_tokens(index)
                        got = controller.reserve(key, tiers, desc, tokens, budgeted=False)
                        if isinstance(got, str):
                            walk.stop_reason = "no_space"
                            break
                        slot = handle.add_slot(index, key, tokens, got)
                if obj is None:
                    load = None if slot is None else slot.load
                    # Unreachable: the handle held the chunk's slot, or it was reserved above.
                    if handle is None or slot is None or load is None:
                        raise EngineStateError(f"retrieve: chunk {index} has no reservation")
                    had_to_wait = False
                    if not load.finished() and load.task is not None:
                        remaining = None if deadline is None else deadline - loop.time()
                        if remaining is not None and remaining <= 0:
                            walk.stop_reason = "late"
                            break
                        await make_room()
                        before = loop.time()
                        await asyncio.wait([load.task], timeout=remaining)
                        walk.waited += loop.time() - before
                        had_to_wait = True
                        if not load.finished():
                            walk.stop_reason = "late"
                            break
                    obj = handle.take(slot, waited=had_to_wait)
                    if obj is None:
                        walk.stop_reason = "failed"
                        walk.failed = (index,)
                        break
                storage.record_hit(key, obj)
                start = index * request.chunk_size
                skip = max(0, request.skip_prefix_tokens - start)
                walk.index += 1
                pending = add(ChunkTransfer(obj, start, skip))
                if pending is not None:
                    await pending
        finally:
            if handle is not None:
                if walk.stop_reason == "failed":
                    handle.cancel()  # loading past a miss is wasted work
                else:
                    handle.release_unused()  # late loads finish into L1 for the next request
        return walk

    def _finish(self, request: RetrieveRequest, walk: _Walk, delivered: int) -> RetrieveResult:
        storage, keys = self._storage, request.keys
        chunk_size, num_tokens = request.chunk_size, request.num_tokens
        if walk.stop_reason in ("complete", "gap"):
            cached_end = delivered
        else:
            cached_chunks = walk.index + max(1, storage.prefix_hits(keys[walk.index :]))
            cached_end = max(delivered, min(cached_chunks * chunk_size, num_tokens))
        late: tuple[int, ...] = ()
        if walk.stop_reason == "late":
            late = tuple(range(walk.index, -(-cached_end // chunk_size)))
            self._counters.retrieve_late_tokens += cached_end - delivered
        elif walk.stop_reason == "failed":
            self._counters.retrieve_failed_tokens += cached_end - delivered
        self._counters.retrieved_tokens += delivered - request.skip_prefix_tokens
        self._counters.retrieve_waited_seconds += walk.waited
        return RetrieveResult(
            delivered,
            cached_end,
            walk.stop_reason,
            request.policy,
            late,
            walk.failed,
            walk.waited,
        )


class _Batches:
    """The chunks a retrieve has taken and not yet handed to the mover, and what it delivered.
    Owns one reference to each pending chunk's object until `flush` or `drop`."""

    def __init__(
        self, mover: KVMover, counters: RetrieveCounters, request: RetrieveRequest
    ) -> None:
        self._mover = mover
        self._counters = counters
        self._request = request
        self.pending: list[ChunkTransfer] = []
        self.delivered = request.skip_prefix_tokens

    def add(self, transfer: ChunkTransfer) -> Awaitable[None] | None:
        """Keep ``transfer``; a full batch is scattered (the awaitable, for the caller)."""
        self.pending.append(transfer)
        return self.flush() if len(self.pending) >= self._request.batch_chunks else None

    async def flush(self) -> None:
        """Scatter the pending chunks (one whole copy) and drop their references."""
        if not self.pending:
            return
        request = self._request
        await self._mover.scatter(request.layout, request.block_ids, list(self.pending))
        self.count(self.pending)
        self.drop()

    def count(self, transfers: Sequence[ChunkTransfer]) -> None:
        """``transfers`` were handed to the mover, in one call."""
        last = transfers[-1]
        self.delivered = max(self.delivered, last.token_start + last.obj.num_tokens)
        counters = self._counters
        counters.retrieved_chunks += len(transfers)
        counters.retrieve_scatter_batches += 1

    def drop(self) -> None:
        for transfer in self.pending:
            transfer.obj.unref()
        self.pending.clear()


@dataclasses.dataclass(slots=True)
class _Walk:
    """Where a walk over a request's chunks stopped: the first chunk not taken, and why."""

    index: int
    stop_reason: StopReason = "complete"
    failed: tuple[int, ...] = ()
    waited: float = 0.0
