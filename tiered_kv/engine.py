"""`TieredKVEngine`, the facade serving stacks call (its blocking twin is in `tiered_kv.sync`).

Owns the request verbs (store / lookup / prefetch / retrieve and their layerwise forms), the
choices they make (which chunks to stage, the claim worth loading, which prefetch a retrieve
uses), the engine's counters, and its lifetime: calls in flight, open and close. Everything else
is delegated: arguments and registrations to `request`, the running parts (arena, tiers,
prefetch controller, mover) to `runtime`, keys to `keys`, formats to `layout`, bytes to the
mover, placement and write policies to the `StorageManager`, loads ahead of retrieve to the
`PrefetchController`, retrieve's walk to `retrieval`, the statistics snapshot's views to
`metrics`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

from tiered_kv import metrics
from tiered_kv.config import (
    LOAD_POLICIES,
    PREFETCH_POLICIES,
    EngineConfig,
    LoadPolicy,
    PrefetchPolicy,
)
from tiered_kv.cost import RecomputeCost, choose_claim
from tiered_kv.errors import ConfigError, EngineStateError, LayoutError
from tiered_kv.gpu.base import ChunkTransfer, FinishedLayerLoad, KVMover, MoverStats
from tiered_kv.io.plane import WorkerPlane
from tiered_kv.keys import ChunkKey, KeyMemo, KeySalt, KeyScope, TokenIds
from tiered_kv.layerwise_store import LayerwiseStore
from tiered_kv.layout import MemoryLayoutDesc, build_layout
from tiered_kv.metrics import EngineCounters
from tiered_kv.prefetch import PrefetchClaims, PrefetchHandle, claims_of
from tiered_kv.request import Registration, Registrations, Request, int_argument
from tiered_kv.retrieval import LayerwiseRetrieve, RetrieveRequest, RetrieveResult
from tiered_kv.runtime import EngineRuntime
from tiered_kv.storage import IN_L1, StorageManager
from tiered_kv.tiers.base import LowerTier, TierEventLog

logger = logging.getLogger(__name__)

T = TypeVar("T")
_P = ParamSpec("_P")


def _call(
    method: Callable[Concatenate[TieredKVEngine, _P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[TieredKVEngine, _P], Coroutine[Any, Any, T]]:
    """A public verb: refused once close has begun, and waited for by `aclose` while it runs."""

    @functools.wraps(method)
    async def verb(engine: TieredKVEngine, /, *args: _P.args, **kwargs: _P.kwargs) -> T:
        if engine._closed:
            raise EngineStateError("TieredKVEngine is closed or closing")
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - always called from a task
            return await method(engine, *args, **kwargs)
        engine._calls[task] = engine._calls.get(task, 0) + 1
        try:
            return await method(engine, *args, **kwargs)
        finally:
            depth = engine._calls.pop(task) - 1
            if depth:
                engine._calls[task] = depth

    return verb


class TieredKVEngine:
    """Async engine. Use ``async with TieredKVEngine(config) as engine:`` (or `open` / `aclose`).

    All methods must be called from the loop that opened the engine; `register_kv_caches` may be
    called before opening.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        mover: KVMover | None = None,
        lower_tiers: Sequence[LowerTier] = (),
        recompute_seconds: Callable[[int, int], float] | None = None,
    ) -> None:
        """``mover`` replaces the default mover; ``lower_tiers`` are extra tiers below L2 (or
        below L1 without one), searched in order: custom backends and fault-injection tests.
        ``recompute_seconds(new_tokens, prefix_tokens)``: what the model's prefill of
        ``new_tokens`` over a resident prefix costs, for ``load_policy="cost"``; without it
        the engine learns it from `observe_prefill`."""
        self.config = config or EngineConfig()
        self.recompute = RecomputeCost(recompute_seconds)
        self._mover_override = mover
        self._extra_tiers = tuple(lower_tiers)
        self._registrations = Registrations()
        self._counters = EngineCounters()
        # The keys of recent token sequences: a request's lookup and retrieve hash them once.
        self._keys = KeyMemo()
        self._runtime: EngineRuntime | None = None  # from open until close begins
        self._closing_runtime: EngineRuntime | None = None  # while close takes it down: `stats`
        self._closed = False
        # Tasks inside a public verb (with nesting depth): aclose lets them finish first.
        self._calls: dict[asyncio.Task[Any], int] = {}
        self.dropped_on_close = 0
        self.leaked_on_close = 0  # host bytes still referenced when the arena closed (a bug)

    # -- lifetime ---------------------------------------------------------------------------
    async def open(self) -> TieredKVEngine:
        if self._closed:
            raise EngineStateError("TieredKVEngine: cannot reopen a closed engine")
        if self._runtime is not None:
            return self
        runtime = self._runtime = await EngineRuntime.open(
            self.config,
            mover=self._mover_override,
            extra_tiers=self._extra_tiers,
            counters=self._counters,
        )
        try:
            for registration in self._registrations:
                runtime.mover.prepare(registration.layout)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aenter__(self) -> TieredKVEngine:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @_call
    async def flush(self, timeout: float | None = None) -> int:
        """Wait until queued lower-tier writes finish; returns how many were still pending."""
        return await self._running().storage.flush(timeout)

    @_call
    async def evict_l1(self, max_bytes: int | None = None) -> int:
        """Evict unreferenced L1 chunks, least recently used first; returns bytes freed.

        Chunks still waiting for their lower-tier write are referenced by the write queue and stay.
        """
        return self._running().storage.l1.evict_unreferenced(max_bytes)

    def watch_tiers(self, capacity: int = 8192) -> TierEventLog:
        """A bounded `TierEventLog` of chunks entering and leaving every tier from now on (a
        router's KV events are made from it); one listener: a new call replaces the old log."""
        log = TierEventLog(capacity)
        self._running().storage.watch(log)
        return log

    async def aclose(self) -> None:
        """Refuse new calls, let the calls in flight finish and flush pending writes (together
        bounded by ``close_timeout_s``; calls still running then are cancelled and waited for),
        then free every host byte. What a store reported stored is written before close returns,
        unless the timeout ran out first (counted in ``dropped_on_close``)."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.close_timeout_s
        current = asyncio.current_task()
        calls = [task for task in self._calls if task is not current]
        if calls:
            _, running = await asyncio.wait(calls, timeout=self.config.close_timeout_s)
            for task in running:
                task.cancel()
            if running:
                # A cancelled call gives back its reservations at once; movers keep their own
                # references until their copies end (they wait for that in their aclose).
                await asyncio.wait(running)
                logger.warning(
                    "tiered_kv: %d calls still running at close were cancelled", len(running)
                )
        runtime, self._runtime = self._runtime, None
        self._closing_runtime = runtime
        try:
            if runtime is not None:
                await runtime.abort_layerwise_stores()  # never committed: none of it visible
                try:
                    remaining = max(0.0, deadline - loop.time())
                    await runtime.aclose(remaining, self._registrations)
                finally:
                    self.dropped_on_close = runtime.dropped_writes
                    self.leaked_on_close = runtime.leaked_bytes
        finally:
            self._closing_runtime = None
            # A closed engine cannot reopen: let go of the engine's KV tensors.
            self._registrations.clear()

    def _running(self) -> EngineRuntime:
        if self._runtime is None:
            state = "closed" if self._closed else "not open"
            raise EngineStateError(f"TieredKVEngine is {state}; use 'async with' or open()")
        return self._runtime

    # -- registration -----------------------------------------------------------------------
    def register_kv_caches(
        self,
        kv_caches: Sequence[Any] | Mapping[str, Any],
        *,
        model_name: str,
        world_size: int = 1,
        worker_id: int = 0,
        layout_hints: Mapping[str, Any] | None = None,
    ) -> MemoryLayoutDesc:
        """Detect the caches' format and record them; returns the host layout of a chunk.

        Registering the same ``model_name`` again replaces the earlier registration.
        """
        if not isinstance(model_name, str) or not model_name:
            raise LayoutError(f"model_name: expected a non-empty str, got {model_name!r}")
        layout = build_layout(
            kv_caches, chunk_size=self.config.chunk_size, layout_hints=layout_hints
        )
        try:
            scope = KeyScope(
                namespace=self.config.namespace,
                model=model_name,
                fingerprint=self.config.fingerprint,
                world_size=world_size,
                worker_id=worker_id,
                layout_id=layout.layout_desc.layout_id,
            )
        except (TypeError, ValueError) as exc:
            raise LayoutError(str(exc)) from None
        mover = None if self._runtime is None else self._runtime.mover
        if mover is not None:
            mover.prepare(layout)
        previous = self._registrations.put(
            Registration(model_name, world_size, worker_id, layout, scope)
        )
        if previous is not None and mover is not None:
            mover.forget(previous.layout)  # the old caches must not stay allocated
        return layout.layout_desc

    def chunk_keys(
        self,
        token_ids: TokenIds,
        *,
        model_name: str | None = None,
        salt: KeySalt | None = None,
    ) -> list[ChunkKey]:
        """The keys this engine uses for ``token_ids`` (one per chunk, a partial last included).

        Every request verb takes ``salt`` too: what changes the request's KV beyond its tokens
        (`KeySalt`); requests share chunks only where their salts agree."""
        return self._request(token_ids, model_name, salt).keys

    def tier_of(self, key: ChunkKey) -> str | None:
        """The highest tier whose index holds ``key`` (no I/O: a remote tier answers from the
        keys it has seen), or None."""
        return self._running().storage.tier_of(key)

    def layout_desc(self, model_name: str | None = None) -> MemoryLayoutDesc:
        return self._registrations.get(model_name).layout.layout_desc

    def _request(
        self, token_ids: TokenIds, model_name: str | None, salt: KeySalt | None
    ) -> Request:
        return Request.of(
            self._registrations.get(model_name),
            token_ids,
            salt,
            memo=self._keys,
            chunk_size=self.config.chunk_size,
        )

    # -- request verbs ----------------------------------------------------------------------
    @_call
    async def store(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        model_name: str | None = None,
        salt: KeySalt | None = None,
        skip_prefix_tokens: int = 0,
    ) -> int:
        """Copy the request's KV into the cache, chunk by chunk; returns tokens newly stored.

        Chunks some tier already holds are skipped. The store keeps pace with the lower tiers
        it writes through: when their write queues are full, or L1 has no room left (a prompt
        larger than L1 streams through it), it waits for lower-tier writes to end,
        ``store_wait_s`` in all, while they make progress (`StorageManager.wait_for_room`).
        When that time runs out, or the writes are stalled, what L1 takes is committed anyway
        (a full queue drops its oldest write whose chunk is still in L1, counted) and the
        chunks L1 has no room for are skipped (counted), not an error.
        ``skip_prefix_tokens`` (a whole number of chunks) leaves the chunks before it out: their
        blocks need not hold their KV (a sliding-window layer group has dropped them).
        """
        runtime = self._running()
        request = self._request(token_ids, model_name, salt)
        ids = request.block_ids(block_ids)
        skip_prefix_tokens = int_argument("skip_prefix_tokens", skip_prefix_tokens)
        if skip_prefix_tokens < 0 or skip_prefix_tokens % self.config.chunk_size:
            raise LayoutError(
                f"store: skip_prefix_tokens={skip_prefix_tokens} must be a whole number >= 0 of "
                f"chunks of {self.config.chunk_size}"
            )
        self._counters.store_calls += 1
        storage = runtime.storage
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.store_wait_s
        first = skip_prefix_tokens // self.config.chunk_size
        # For lower-tier writes, until the time runs out or they stall.
        waiting = self.config.store_wait_s > 0
        stored = 0
        try:
            # Each window is what L1 and the write_through queues take now (a dropped write of
            # a streamed chunk would lose it when the next window evicts it); lower-tier writes
            # free room for the next.
            desc = request.layout.layout_desc
            sizes = [desc.nbytes(request.chunk_tokens(i)) for i in range(len(request.keys))]
            while True:
                waiting = waiting and not storage.writes_stalled
                room = None  # chunks the write queues take now (staging stops there)
                if waiting:
                    room = storage.write_room(sizes[first:])
                staged, stopped = self._stage(runtime, request, first=first, limit=room)
                truncated = room is not None and len(staged) == room and stopped is not None
                stored += await self._store_window(runtime, request, ids, staged)
                if stopped is None:
                    break
                remaining = deadline - loop.time()
                room_came = waiting and remaining > 0 and await storage.wait_for_room(remaining)
                if not room_came:
                    if not truncated:  # L1 keeps the prefix it took; the rest is skipped
                        self._counters.store_skipped_no_space += len(request.keys) - stopped
                        break
                    waiting = False  # one more window, as much as L1 takes: queues drop
                first = stopped
        finally:
            self._counters.stored_tokens += stored
            storage.note_use(request.keys)
        return stored

    async def _store_window(
        self,
        runtime: EngineRuntime,
        request: Request,
        block_ids: Sequence[int],
        staged: list[tuple[ChunkKey, ChunkTransfer]],
    ) -> int:
        """Gather ``staged`` (the caller's objects, released here) and commit them; the tokens
        newly stored."""
        try:
            if not staged:
                return 0
            await runtime.mover.gather(
                request.layout, block_ids, [transfer for _, transfer in staged]
            )
            stored = 0
            for key, transfer in staged:
                if runtime.storage.commit(key, transfer.obj):
                    stored += transfer.obj.num_tokens
                    self._counters.stored_chunks += 1
            return stored
        finally:
            for _, transfer in staged:
                transfer.obj.unref()

    def observe_prefill(self, new_tokens: int, prefix_tokens: int, seconds: float) -> None:
        """Report a prefill the model ran: ``new_tokens`` computed over a resident prefix of
        ``prefix_tokens``, in ``seconds``. The recompute model of ``load_policy="cost"`` learns
        from these (unless the engine was given ``recompute_seconds``)."""
        self.recompute.observe(new_tokens, prefix_tokens, seconds)

    @_call
    async def lookup(
        self,
        token_ids: TokenIds,
        *,
        model_name: str | None = None,
        salt: KeySalt | None = None,
        load_policy: LoadPolicy | None = None,
    ) -> int:
        """Tokens of the longest cached prefix across all tiers (a miss ends the prefix), cut
        (``load_policy="cost"``) to the part whose expected load time beats recomputing it.
        ``load_policy`` overrides ``config.load_policy`` for this call ("cost" or "always").

        Starts no load the caller must know about: `prefetch` starts loading (a handle the
        caller owns), and `retrieve` loads what it needs. Under ``"cost"``, a tier whose hits
        are declined gets one of its chunks read into L1 in the background at most every
        `tiered_kv.cost.PROBE_INTERVAL_S` (the engine's own read, so that its estimate follows
        the tier).
        """
        runtime = self._running()
        request = self._request(token_ids, model_name, salt)
        policy = self.config.load_policy if load_policy is None else load_policy
        if policy not in LOAD_POLICIES:
            raise ConfigError(f"load_policy: expected one of {LOAD_POLICIES}, got {policy!r}")
        where = await runtime.storage.locate(request.keys)
        if policy == "cost":
            where = self._worth_loading(runtime, request, where)
        tokens = min(len(where) * self.config.chunk_size, request.num_tokens)
        self._counters.lookup_calls += 1
        self._counters.lookup_hit_tokens += tokens
        for key, location in zip(request.keys, where, strict=False):
            if location == IN_L1:
                runtime.storage.l1.touch(key)  # about to be used: evict it last
        return tokens

    def _worth_loading(
        self, runtime: EngineRuntime, request: Request, where: list[int]
    ) -> list[int]:
        """``where`` (a located prefix) cut to the claim worth loading (`choose_claim`, the
        ``"cost"`` policy), counting what is declined and probing its tiers."""
        if not where:
            return where
        storage = runtime.storage
        storage.expect_costs(request.keys, where)
        claim = choose_claim(
            where,
            chunk_tokens=self.config.chunk_size,
            chunk_bytes=request.layout.layout_desc.nbytes(self.config.chunk_size),
            total_tokens=request.num_tokens,
            tiers=storage.costs,
            recompute=self.recompute,
        )
        storage.note_declined(claim)
        if claim.declined:
            self._probe_declined(runtime, request, where, claim.chunks)
        return where[: claim.chunks]

    def _probe_declined(
        self, runtime: EngineRuntime, request: Request, where: Sequence[int], claimed: int
    ) -> None:
        """Read the first declined chunk of each declined tier whose probe is due into L1 in
        the background (`tiered_kv.cost.TierCost.probe_due`)."""
        now = asyncio.get_running_loop().time()
        seen: set[int] = set()
        for index in range(claimed, len(where)):
            tier = where[index]
            if tier == IN_L1 or tier in seen:
                continue
            seen.add(tier)
            if not runtime.storage.costs[tier].probe_due(now):
                continue
            handle = self._start_prefetch(runtime, request, [tier], first_chunk=index)
            runtime.track_probe(
                asyncio.create_task(self._finish_probe(handle), name="tkv-cost-probe")
            )
            self._counters.cost_probes += 1

    @staticmethod
    async def _finish_probe(handle: PrefetchClaims) -> None:
        """The probe's read lands in L1 (and in its tier's cost); the handle lets go of it."""
        try:
            await handle.wait()
        finally:
            handle.cancel()

    @staticmethod
    def _start_prefetch(
        runtime: EngineRuntime, request: Request, where: Sequence[int], *, first_chunk: int
    ) -> PrefetchClaims:
        slots = [
            (key, request.chunk_tokens(first_chunk + i), location)
            for i, (key, location) in enumerate(
                zip(request.keys[first_chunk:], where, strict=False)
            )
        ]
        return runtime.prefetch.start(slots, request.layout.layout_desc, first_chunk=first_chunk)

    @_call
    async def prefetch(
        self,
        token_ids: TokenIds,
        *,
        model_name: str | None = None,
        salt: KeySalt | None = None,
        from_token: int = 0,
        worth_loading: bool = False,
    ) -> PrefetchHandle:
        """Start loading the cached prefix of ``token_ids`` into L1 and return its handle.

        The handle is the caller's to end: ``async with handle:`` or `PrefetchHandle.close`
        frees its reservations; passed as ``retrieve(..., prefetch=handle)`` it gives that
        retrieve its loads, and the retrieve closes it. Await it (or `wait`) for the loads.
        ``from_token`` starts the prefix at the chunk holding that token (the handle's
        ``first_chunk``): a sliding-window layer group keeps only the chunks of its window.
        ``worth_loading``: the prefix is cut as `lookup` cuts it under ``load_policy="cost"``
        (a serving stack's lookup that prefetches what it claims); with ``from_token`` > 0 the
        caller has decided already and it is ignored.
        """
        runtime = self._running()
        request = self._request(token_ids, model_name, salt)
        from_token = int_argument("from_token", from_token)
        if from_token < 0:
            raise LayoutError(f"prefetch: from_token must be >= 0, got {from_token}")
        first = min(from_token // self.config.chunk_size, len(request.keys))
        where = await runtime.storage.locate(request.keys[first:])
        if worth_loading and first == 0 and self.config.load_policy == "cost":
            where = self._worth_loading(runtime, request, where)
        self._counters.prefetch_calls += 1
        claims = self._start_prefetch(runtime, request, where, first_chunk=first)
        return PrefetchHandle(claims)

    @_call
    async def retrieve(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        skip_prefix_tokens: int = 0,
        model_name: str | None = None,
        policy: PrefetchPolicy | None = None,
        salt: KeySalt | None = None,
        prefetch: PrefetchHandle | None = None,
    ) -> RetrieveResult:
        """Load the cached prefix into the request's blocks; ``valid_tokens`` of the result is
        the end of the valid prefix (``skip_prefix_tokens`` when nothing more could be loaded),
        and the rest of it says what was cached but not delivered, and why.

        The first ``skip_prefix_tokens`` tokens are the engine's own (their slots are never
        written, and chunks wholly inside them are not loaded). ``policy`` overrides
        ``config.prefetch_policy`` for this call. ``prefetch``: a handle from `prefetch` of the
        same tokens, whose loads this retrieve uses; it is closed when the retrieve ends, however
        it ends (an error or a cancellation included).
        Chunks are scattered in batches of ``config.retrieve_batch_chunks``, and each batch's
        L1 references are dropped before waiting for or starting further loads, so delivering
        a prefix never needs more L1 room than one batch plus the loads in flight.
        """
        try:
            retrieve = await self._retrieve_request(
                token_ids, block_ids, skip_prefix_tokens, model_name, policy, salt, prefetch
            )
            if isinstance(retrieve, RetrieveResult):
                return retrieve
            return await self._running().retriever.whole(retrieve)
        finally:
            if isinstance(prefetch, PrefetchHandle):
                prefetch.close()  # handed over: ended however the retrieve ends

    @_call
    async def retrieve_layerwise(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        skip_prefix_tokens: int = 0,
        model_name: str | None = None,
        policy: PrefetchPolicy | None = None,
        salt: KeySalt | None = None,
        prefetch: PrefetchHandle | None = None,
    ) -> LayerwiseRetrieve:
        """Start loading the cached prefix layer by layer; returns once it is decided and its
        first layers' copies are queued, before any layer is ready.

        Which chunks are delivered is settled first, as `retrieve` settles it (loads
        from L2/L3 waited for per the prefetch policy): ``result`` is final when this returns,
        so a late or failed chunk is known before any layer is used. Then every delivered
        chunk's layer 0 is copied, then layer 1, ...: call ``wait_layer(i)`` before the model's
        layer ``i`` reads the cache (a GPU-side wait on the current stream), and ``await
        wait()`` before retrieving into the same blocks again. Every delivered chunk is held in
        L1 until its copies end, so the whole prefix must fit in L1 at once. ``prefetch`` as
        for `retrieve`.
        """
        try:
            retrieve = await self._retrieve_request(
                token_ids, block_ids, skip_prefix_tokens, model_name, policy, salt, prefetch
            )
            self._counters.retrieve_layerwise_calls += 1
            if isinstance(retrieve, RetrieveResult):
                num_layers = self._registrations.get(model_name).layout.num_layers
                return LayerwiseRetrieve(retrieve, FinishedLayerLoad(num_layers))
            return await self._running().retriever.layerwise(retrieve)
        finally:
            if isinstance(prefetch, PrefetchHandle):
                prefetch.close()  # handed over: ended however the retrieve ends

    async def _retrieve_request(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        skip_prefix_tokens: int,
        model_name: str | None,
        policy: PrefetchPolicy | None,
        salt: KeySalt | None,
        prefetch: PrefetchHandle | None,
    ) -> RetrieveRequest | RetrieveResult:
        """Validate a retrieve's arguments and take the caller's prefetch (or start one); a
        `RetrieveResult` when nothing past ``skip_prefix_tokens`` is to be loaded."""
        runtime = self._running()
        registration = self._registrations.get(model_name)
        policy = self.config.prefetch_policy if policy is None else policy
        if policy not in PREFETCH_POLICIES:
            raise ConfigError(f"policy: expected one of {PREFETCH_POLICIES}, got {policy!r}")
        given_tokens = len(token_ids)
        skip_prefix_tokens = int_argument("skip_prefix_tokens", skip_prefix_tokens)
        if not 0 <= skip_prefix_tokens <= given_tokens:
            raise LayoutError(
                f"skip_prefix_tokens must be in [0, {given_tokens}], got {skip_prefix_tokens!r}"
            )
        multiple = registration.layout.layout_desc.token_multiple
        if skip_prefix_tokens % multiple:
            raise LayoutError(
                f"skip_prefix_tokens={skip_prefix_tokens} is not a whole number of blocks of "
                f"{multiple}: these caches are moved as whole blocks"
            )
        request = self._request(token_ids, model_name, salt)
        num_tokens = request.num_tokens
        skip_prefix_tokens = min(skip_prefix_tokens, num_tokens)
        ids = request.block_ids(block_ids)
        keys = request.keys
        first = skip_prefix_tokens // self.config.chunk_size
        # The caller's prefetch ends with this retrieve, whatever it copies.
        handle = None if prefetch is None else self._claims_for(runtime, prefetch, keys)
        self._counters.retrieve_calls += 1  # its arguments are accepted (as every verb counts)
        if first >= len(keys):
            if handle is not None:
                handle.release_unused()
            return RetrieveResult(skip_prefix_tokens, skip_prefix_tokens, "complete", policy)
        storage = runtime.storage
        if handle is None or handle.released:
            # A prefix wholly in L1 needs no prefetch (nor a `locate`, which would ask the
            # lower tiers about nothing): the walk takes it from L1, and opens a handle if a
            # chunk has left L1 since.
            handle = None
            if not all(map(storage.in_l1, keys[first:])):
                where = await storage.locate(keys[first:])
                if any(location != IN_L1 for location in where):
                    handle = self._start_prefetch(runtime, request, where, first_chunk=first)
        if handle is not None:
            _extend_handle(handle, request)
        return RetrieveRequest(
            layout=request.layout,
            keys=keys,
            block_ids=ids,
            num_tokens=num_tokens,
            skip_prefix_tokens=skip_prefix_tokens,
            first=first,
            policy=policy,
            handle=handle,
            open_handle=functools.partial(self._open_handle, runtime, request, first),
            chunk_size=self.config.chunk_size,
            chunk_tokens=request.chunk_tokens,
            timeout_base_s=self.config.prefetch_timeout_base_s,
            timeout_per_1k_tokens_s=self.config.prefetch_timeout_per_1k_tokens_s,
            batch_chunks=self.config.retrieve_batch_chunks,
        )

    @staticmethod
    def _claims_for(
        runtime: EngineRuntime, prefetch: PrefetchHandle, keys: Sequence[ChunkKey]
    ) -> PrefetchClaims:
        """The claims of a caller's handle given to a retrieve: of this engine, and over the
        same chunks as the request's tokens where they overlap (another prompt's loads would be
        another's KV); chunks past the request's are released when it ends."""
        if not isinstance(prefetch, PrefetchHandle):
            raise ConfigError(
                f"retrieve: prefetch must be a PrefetchHandle from prefetch(), got "
                f"{type(prefetch).__name__}"
            )
        claims = claims_of(prefetch)
        if claims.controller is not runtime.prefetch:
            raise ConfigError("retrieve: the prefetch handle belongs to another engine")
        for slot in claims.slots:
            if slot.index < len(keys) and keys[slot.index] != slot.key:
                claims.release_unused()
                raise LayoutError(
                    f"retrieve: the prefetch handle covers chunk {slot.index} of other tokens "
                    "than this retrieve's (a handle serves the retrieve of the tokens it was "
                    "made for, or a longer prompt that starts with them)"
                )
        return claims

    def _open_handle(self, runtime: EngineRuntime, request: Request, first: int) -> PrefetchClaims:
        """A handle over chunks ``first`` on with nothing reserved yet (`RetrieveRequest`)."""
        handle = self._start_prefetch(runtime, request, [], first_chunk=first)
        _extend_handle(handle, request)
        return handle

    @_call
    async def store_layerwise(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        model_name: str | None = None,
        salt: KeySalt | None = None,
    ) -> LayerwiseStore:
        """Begin a store whose layers are copied out as the prefill makes them.

        Stages L1 room for the chunks no tier holds yet (skipping the rest, as `store` does);
        then ``save_layer(i)`` after the model's layer ``i`` wrote its KV, and ``await
        commit()`` once every layer is saved: only then do the chunks become visible to lookups.
        ``abort()`` (or an engine close before commit) stores nothing.
        """
        runtime = self._running()
        request = self._request(token_ids, model_name, salt)
        ids = request.block_ids(block_ids)
        self._counters.store_calls += 1
        self._counters.store_layerwise_calls += 1
        # Layer by layer, every chunk's object must exist before the first layer lands: a
        # prompt larger than L1 keeps what fits (streaming it would commit chunks before their
        # last layer).
        staged, stopped = self._stage(runtime, request)
        if stopped is not None:
            self._counters.store_skipped_no_space += len(request.keys) - stopped
        store = LayerwiseStore(
            runtime.storage,
            runtime.mover,
            request.layout,
            ids,
            staged,
            on_end=functools.partial(self._layerwise_store_ended, runtime, request.keys),
        )
        runtime.layerwise_stores.add(store)
        return store

    def _layerwise_store_ended(
        self, runtime: EngineRuntime, keys: Sequence[ChunkKey], store: LayerwiseStore
    ) -> None:
        runtime.layerwise_stores.discard(store)
        runtime.storage.note_use(keys)
        self._counters.stored_chunks += store.stored_chunks
        self._counters.stored_tokens += store.stored_tokens

    def _stage(
        self,
        runtime: EngineRuntime,
        request: Request,
        *,
        first: int = 0,
        limit: int | None = None,
    ) -> tuple[list[tuple[ChunkKey, ChunkTransfer]], int | None]:
        """Allocate L1 objects for the chunks from ``first`` on that no tier holds, in order,
        until L1 is full or ``limit`` are staged. Returns them (the caller owns them) and the
        index of the first chunk left out (None when none was)."""
        storage = runtime.storage
        staged: list[tuple[ChunkKey, ChunkTransfer]] = []
        desc = request.layout.layout_desc
        keys = request.keys
        try:
            for index in range(first, len(keys)):
                key = keys[index]
                if storage.tier_of(key) is not None:
                    self._counters.store_skipped_present += 1
                    continue
                if limit is not None and len(staged) == limit:
                    return staged, index
                obj = storage.allocate(desc, request.chunk_tokens(index))
                if obj is None:
                    return staged, index
                staged.append((key, ChunkTransfer(obj, index * self.config.chunk_size)))
        except BaseException:
            for _, transfer in staged:
                transfer.obj.unref()
            raise
        return staged, None

    # -- introspection ----------------------------------------------------------------------
    @property
    def storage(self) -> StorageManager:
        """The open engine's `StorageManager`: its tiers (``lower``), their read-cost estimates
        (``costs``) and books, for inspection and fault injection; `EngineStateError` when not
        open. Its verbs bypass the engine's counters: requests go through the engine."""
        return self._running().storage

    @property
    def io_plane(self) -> WorkerPlane | None:
        """The open engine's I/O worker processes (``io_plane="processes"``), else None; for
        inspection and fault injection. `EngineStateError` when not open."""
        return self._running().plane

    def stats(self) -> metrics.EngineStats:
        """Every component's typed statistics now, as one snapshot; `EngineStats.to_prometheus`
        renders it for Prometheus, `EngineStats.as_dict` as plain dicts. While `aclose` drains
        (pending writes flushed, loads cancelled) every section is still reported; from the end
        of close on, only ``engine``. A verb's ``*_calls`` counter counts the calls whose
        arguments it accepted: one refused for a bad argument is not counted."""
        runtime = self._runtime or self._closing_runtime
        if runtime is None:
            return metrics.EngineStats(engine=dataclasses.replace(self._counters))
        storage, arena = runtime.storage, runtime.arena
        return metrics.EngineStats(
            engine=dataclasses.replace(self._counters),
            l1=storage.l1.stats(),
            arena=None if arena.closed else arena.stats(),
            storage=storage.stats(),
            prefetch=runtime.prefetch.stats(),
            lower=tuple((t.name, t.stats()) for t in storage.lower),
            mover=MoverStats.from_counters(runtime.mover.stats()),
        )


def _extend_handle(handle: PrefetchClaims, request: Request) -> None:
    """Unreserved slots for the chunks past the handle's last (the prefix grew since the
    prefetch that made it, or the handle was opened empty)."""
    covered = handle.first_chunk + len(handle.slots)
    if covered < len(request.keys):
        handle.extend(
            [(request.keys[i], request.chunk_tokens(i)) for i in range(covered, len(request.keys))]
        )
