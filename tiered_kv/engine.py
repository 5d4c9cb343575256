"""`TieredKVEngine`, the facade serving stacks call (its blocking twin is in `tiered_kv.sync`).

Owns: registrations of KV caches (model, world size, worker → layout + key scope), the request
verbs (store / lookup / prefetch / retrieve), the prefetch policies of retrieve, argument
validation, and the lifetime of the arena, tiers, prefetch controller and mover. Everything else
is delegated: keys to `keys`, formats to `layout`, bytes to the mover, placement and write
policies to the `StorageManager`, loads ahead of retrieve to the `PrefetchController`, the
statistics snapshot's views to `metrics`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import operator
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
from tiered_kv.gpu.dispatch import DeviceMover
from tiered_kv.keys import ChunkKey, KeyMemo, KeySalt, KeyScope, TokenIds
from tiered_kv.layerwise_store import LayerwiseStore
from tiered_kv.layout import KVCacheLayout, MemoryLayoutDesc, build_layout
from tiered_kv.memory import HostArena
from tiered_kv.metrics import EngineCounters
from tiered_kv.prefetch import PrefetchClaims, PrefetchController, PrefetchHandle, claims_of
from tiered_kv.retrieval import LayerwiseRetrieve, Retriever, RetrieveRequest, RetrieveResult
from tiered_kv.storage import IN_L1, StorageManager
from tiered_kv.tiers import factory as tier_factory
from tiered_kv.tiers.base import LowerTier, TierEventLog
from tiered_kv.tiers.l1 import L1Tier

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Registration:
    model_name: str
    world_size: int
    worker_id: int
    layout: KVCacheLayout
    scope: KeyScope


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
        self._registrations: dict[str, Registration] = {}
        self._counters = EngineCounters()
        self._arena: HostArena | None = None
        self._storage: StorageManager | None = None
        self._prefetch: PrefetchController | None = None
        self._probes: set[asyncio.Task[None]] = set()  # reads of declined tiers' chunks
        # The keys of recent token sequences: a request's lookup and retrieve hash them once.
        self._keys = KeyMemo()
        self._mover: KVMover | None = None
        self._retriever: Retriever | None = None
        self._layerwise_stores: set[LayerwiseStore] = set()  # begun, not yet committed/aborted
        self._closed = False
        # Tasks inside a public verb (with nesting depth): aclose lets them finish first.
        self._calls: dict[asyncio.Task[Any], int] = {}
        self.dropped_on_close = 0
        self.leaked_on_close = 0  # host bytes still referenced when the arena closed (a bug)

    # -- lifetime ---------------------------------------------------------------------------
    async def open(self) -> TieredKVEngine:
        if self._closed:
            raise EngineStateError("TieredKVEngine: cannot reopen a closed engine")
        if self._storage is not None:
            return self
        self._arena = HostArena(self.config.l1_bytes, pin=self.config.pin_memory)
        storage: StorageManager | None = None
        try:
            l1 = L1Tier(self._arena)
            lower = [*tier_factory.lower_tiers(self.config), *self._extra_tiers]
            storage = StorageManager(
                l1,
                lower,
                write_queue=self.config.lower_write_queue,
                write_policies={t.name: self.config.write_policy_for(t.name) for t in lower},
                selective_min_hits=self.config.selective_min_hits,
            )
            await storage.open()
        except BaseException:  # a refused tier set or a tier that did not open: free the arena
            if storage is not None:
                await storage.aclose(0)
            self._arena.close()
            self._arena = None
            raise
        self._storage = storage
        self._prefetch = PrefetchController(
            storage,
            concurrency=self.config.prefetch_concurrency,
            l1_budget_bytes=int(self._arena.capacity * self.config.prefetch_l1_fraction),
        )
        self._mover = self._mover_override or DeviceMover()
        self._retriever = Retriever(storage, self._prefetch, self._mover, self._counters)
        try:
            for registration in self._registrations.values():
                self._mover.prepare(registration.layout)
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
        return await self._require_storage().flush(timeout)

    @_call
    async def evict_l1(self, max_bytes: int | None = None) -> int:
        """Evict unreferenced L1 chunks, least recently used first; returns bytes freed.

        Chunks still waiting for their lower-tier write are referenced by the write queue and stay.
        """
        return self._require_storage().l1.evict_unreferenced(max_bytes)

    def watch_tiers(self, capacity: int = 8192) -> TierEventLog:
        """A bounded `TierEventLog` of chunks entering and leaving every tier from now on (a
        router's KV events are made from it); one listener: a new call replaces the old log."""
        log = TierEventLog(capacity)
        self._require_storage().watch(log)
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
        for store in list(self._layerwise_stores):
            await store.abort()  # never committed: nothing of it becomes visible
        storage, mover, arena = self._storage, self._mover, self._arena
        prefetch, self._prefetch = self._prefetch, None
        self._storage = self._mover = None
        self._retriever = None
        try:
            for probe in list(self._probes):
                probe.cancel()
            if self._probes:
                await asyncio.wait(list(self._probes))
            if prefetch is not None:
                await prefetch.aclose()
            if storage is not None:
                remaining = max(0.0, deadline - loop.time())
                self.dropped_on_close = await storage.aclose(remaining)
                if self.dropped_on_close:
                    logger.warning(
                        "tiered_kv: %d chunk writes to lower tiers were dropped at close",
                        self.dropped_on_close,
                    )
        finally:
            if mover is not None:
                for registration in self._registrations.values():
                    mover.forget(registration.layout)
                await mover.aclose()
            # A closed engine cannot reopen: let go of the engine's KV tensors.
            self._registrations.clear()
            if arena is not None:
                leaked = self.leaked_on_close = arena.close()
                if leaked:
                    logger.error("tiered_kv: %d host bytes still referenced at close", leaked)

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
        if self._mover is not None:
            self._mover.prepare(layout)
        previous = self._registrations.get(model_name)
        self._registrations[model_name] = Registration(
            model_name, world_size, worker_id, layout, scope
        )
        if previous is not None and self._mover is not None:
            self._mover.forget(previous.layout)  # the old caches must not stay allocated
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
        reg = self._registration(model_name)
        return self._key_list(reg, _whole_blocks(reg, token_ids), salt)

    def tier_of(self, key: ChunkKey) -> str | None:
        """The highest tier whose index holds ``key`` (no I/O: a remote tier answers from the
        keys it has seen), or None."""
        return self._require_storage().tier_of(key)

    def _key_list(
        self, reg: Registration, token_ids: TokenIds, salt: KeySalt | None = None
    ) -> list[ChunkKey]:
        if salt is not None and not isinstance(salt, KeySalt):
            raise TypeError(f"salt: expected a KeySalt or None, got {type(salt).__name__}")
        return self._keys.chunk_keys(reg.scope, token_ids, self.config.chunk_size, salt)

    def layout_desc(self, model_name: str | None = None) -> MemoryLayoutDesc:
        return self._registration(model_name).layout.layout_desc

    def _registration(self, model_name: str | None) -> Registration:
        if model_name is None:
            if len(self._registrations) == 1:
                return next(iter(self._registrations.values()))
            if not self._registrations:
                raise EngineStateError("no KV caches registered; call register_kv_caches first")
            raise EngineStateError(
                f"several models registered {sorted(self._registrations)}; pass model_name="
            )
        try:
            return self._registrations[model_name]
        except KeyError:
            raise EngineStateError(
                f"model {model_name!r} is not registered; registered: {sorted(self._registrations)}"
            ) from None

    def _require_storage(self) -> StorageManager:
        if self._storage is None:
            state = "closed" if self._closed else "not open"
            raise EngineStateError(f"TieredKVEngine is {state}; use 'async with' or open()")
        return self._storage

    def _require_mover(self) -> KVMover:
        self._require_storage()
        assert self._mover is not None  # set together with the storage manager
        return self._mover

    def _require_retriever(self) -> Retriever:
        if self._retriever is None:
            state = "closed" if self._closed else "not open"
            raise EngineStateError(f"TieredKVEngine is {state}; use 'async with' or open()")
        return self._retriever

    def _require_prefetch(self) -> PrefetchController:
        self._require_storage()
        assert self._prefetch is not None  # set together with the storage manager
        return self._prefetch

    # -- request verbs ----------------------------------------------------------------------
    def _chunk_tokens(self, index: int, total: int) -> int:
        return min(self.config.chunk_size, total - index * self.config.chunk_size)

    def _check_blocks(
        self, reg: Registration, block_ids: Sequence[int], num_tokens: int
    ) -> list[int]:
        needed = -(-num_tokens // reg.layout.block_size)
        ids = _block_id_list(block_ids)
        if len(ids) < needed:
            raise LayoutError(
                f"block_ids: {num_tokens} tokens need {needed} blocks of "
                f"{reg.layout.block_size}, got {len(ids)}"
            )
        ids = ids[:needed]
        if ids and not 0 <= min(ids) <= max(ids) < reg.layout.num_blocks:
            bad = [b for b in ids if not 0 <= b < reg.layout.num_blocks]
            raise LayoutError(f"block_ids: {bad[:8]} out of range [0, {reg.layout.num_blocks})")
        return ids

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

        Chunks some tier already holds are skipped. When L1 has no room even after evicting
        everything unreferenced, the remaining chunks are skipped (counted), not an error.
        ``skip_prefix_tokens`` (a whole number of chunks) leaves the chunks before it out: their
        blocks need not hold their KV (a sliding-window layer group has dropped them).
        """
        storage = self._require_storage()
        mover = self._require_mover()
        reg = self._registration(model_name)
        token_ids = _whole_blocks(reg, token_ids)
        keys = self._key_list(reg, token_ids, salt)
        num_tokens = _count(token_ids)
        ids = self._check_blocks(reg, block_ids, num_tokens)
        skip_prefix_tokens = _int_argument("skip_prefix_tokens", skip_prefix_tokens)
        if skip_prefix_tokens < 0 or skip_prefix_tokens % self.config.chunk_size:
            raise LayoutError(
                f"store: skip_prefix_tokens={skip_prefix_tokens} must be a whole number >= 0 of "
                f"chunks of {self.config.chunk_size}"
            )
        self._counters.store_calls += 1
        staged: list[tuple[ChunkKey, ChunkTransfer]] = []
        try:
            first = skip_prefix_tokens // self.config.chunk_size
            staged = self._stage(storage, reg, keys, num_tokens, first=first)
            if not staged:
                return 0
            await mover.gather(reg.layout, ids, [transfer for _, transfer in staged])
            stored = 0
            for key, transfer in staged:
                if storage.commit(key, transfer.obj):
                    stored += transfer.obj.num_tokens
                    self._counters.stored_chunks += 1
            self._counters.stored_tokens += stored
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
        storage = self._require_storage()
        reg = self._registration(model_name)
        token_ids = _whole_blocks(reg, token_ids)
        keys = self._key_list(reg, token_ids, salt)
        num_tokens = _count(token_ids)
        policy = self.config.load_policy if load_policy is None else load_policy
        if policy not in LOAD_POLICIES:
            raise ConfigError(f"load_policy: expected one of {LOAD_POLICIES}, got {policy!r}")
        where = await storage.locate(keys)
        if policy == "cost":
            where = self._worth_loading(reg, keys, where, num_tokens)
        tokens = min(len(where) * self.config.chunk_size, num_tokens)
        self._counters.lookup_calls += 1
        self._counters.lookup_hit_tokens += tokens
        for key, location in zip(keys, where, strict=False):
            if location == IN_L1:
                storage.l1.touch(key)  # about to be used: evict it last
        return tokens

    def _worth_loading(
        self,
        reg: Registration,
        keys: Sequence[ChunkKey],
        where: list[int],
        num_tokens: int,
    ) -> list[int]:
        """``where`` (a located prefix) cut to the claim worth loading (`choose_claim`, the
        ``"cost"`` policy), counting what is declined and probing its tiers."""
        if not where:
            return where
        storage = self._require_storage()
        storage.expect_costs(keys, where)
        claim = choose_claim(
            where,
            chunk_tokens=self.config.chunk_size,
            chunk_bytes=reg.layout.layout_desc.nbytes(self.config.chunk_size),
            total_tokens=num_tokens,
            tiers=storage.costs,
            recompute=self.recompute,
        )
        storage.note_declined(claim)
        if claim.declined:
            self._probe_declined(reg, keys, where, claim.chunks, num_tokens)
        return where[: claim.chunks]

    def _probe_declined(
        self,
        reg: Registration,
        keys: Sequence[ChunkKey],
        where: Sequence[int],
        claimed: int,
        num_tokens: int,
    ) -> None:
        """Read the first declined chunk of each declined tier whose probe is due into L1 in
        the background (`tiered_kv.cost.TierCost.probe_due`)."""
        storage = self._require_storage()
        now = asyncio.get_running_loop().time()
        seen: set[int] = set()
        for index in range(claimed, len(where)):
            tier = where[index]
            if tier == IN_L1 or tier in seen:
                continue
            seen.add(tier)
            if not storage.costs[tier].probe_due(now):
                continue
            handle = self._start_prefetch(reg, keys, [tier], num_tokens, first_chunk=index)
            task = asyncio.create_task(self._finish_probe(handle), name="tkv-cost-probe")
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
            self._counters.cost_probes += 1

    @staticmethod
    async def _finish_probe(handle: PrefetchClaims) -> None:
        """The probe's read lands in L1 (and in its tier's cost); the handle lets go of it."""
        try:
            await handle.wait()
        finally:
            handle.cancel()

    def _start_prefetch(
        self,
        reg: Registration,
        keys: Sequence[ChunkKey],
        where: Sequence[int],
        num_tokens: int,
        *,
        first_chunk: int,
    ) -> PrefetchClaims:
        slots = [
            (key, self._chunk_tokens(first_chunk + i, num_tokens), location)
            for i, (key, location) in enumerate(zip(keys[first_chunk:], where, strict=False))
        ]
        return self._require_prefetch().start(
            slots, reg.layout.layout_desc, first_chunk=first_chunk
        )

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
        storage = self._require_storage()
        reg = self._registration(model_name)
        token_ids = _whole_blocks(reg, token_ids)
        keys = self._key_list(reg, token_ids, salt)
        from_token = _int_argument("from_token", from_token)
        if from_token < 0:
            raise LayoutError(f"prefetch: from_token must be >= 0, got {from_token}")
        first = min(from_token // self.config.chunk_size, len(keys))
        where = await storage.locate(keys[first:])
        if worth_loading and first == 0 and self.config.load_policy == "cost":
            where = self._worth_loading(reg, keys, where, _count(token_ids))
        self._counters.prefetch_calls += 1
        claims = self._start_prefetch(reg, keys, where, _count(token_ids), first_chunk=first)
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
            request = await self._retrieve_request(
                token_ids, block_ids, skip_prefix_tokens, model_name, policy, salt, prefetch
            )
            if isinstance(request, RetrieveResult):
                return request
            return await self._require_retriever().whole(request)
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
            request = await self._retrieve_request(
                token_ids, block_ids, skip_prefix_tokens, model_name, policy, salt, prefetch
            )
            self._counters.retrieve_layerwise_calls += 1
            if isinstance(request, RetrieveResult):
                reg = self._registration(model_name)
                return LayerwiseRetrieve(request, FinishedLayerLoad(reg.layout.num_layers))
            return await self._require_retriever().layerwise(request)
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
        storage = self._require_storage()
        reg = self._registration(model_name)
        policy = self.config.prefetch_policy if policy is None else policy
        if policy not in PREFETCH_POLICIES:
            raise ConfigError(f"policy: expected one of {PREFETCH_POLICIES}, got {policy!r}")
        num_tokens = _count(token_ids)
        skip_prefix_tokens = _int_argument("skip_prefix_tokens", skip_prefix_tokens)
        if not 0 <= skip_prefix_tokens <= num_tokens:
            raise LayoutError(
                f"skip_prefix_tokens must be in [0, {num_tokens}], got {skip_prefix_tokens!r}"
            )
        multiple = reg.layout.layout_desc.token_multiple
        if skip_prefix_tokens % multiple:
            raise LayoutError(
                f"skip_prefix_tokens={skip_prefix_tokens} is not a whole number of blocks of "
                f"{multiple}: these caches are moved as whole blocks"
            )
        token_ids = _whole_blocks(reg, token_ids)
        num_tokens = _count(token_ids)
        skip_prefix_tokens = min(skip_prefix_tokens, num_tokens)
        ids = self._check_blocks(reg, block_ids, num_tokens)
        self._counters.retrieve_calls += 1
        chunk_size = self.config.chunk_size
        keys = self._key_list(reg, token_ids, salt)
        first = skip_prefix_tokens // chunk_size
        # The caller's prefetch ends with this retrieve, whatever it copies.
        handle = None if prefetch is None else self._claims_for(prefetch, keys)
        if first >= len(keys):
            if handle is not None:
                handle.release_unused()
            return RetrieveResult(skip_prefix_tokens, skip_prefix_tokens, "complete", policy)
        if handle is None or handle.released:
            # A prefix wholly in L1 needs no prefetch (nor a `locate`, which would ask the
            # lower tiers about nothing): the walk takes it from L1, and opens a handle if a
            # chunk has left L1 since.
            handle = None
            if not all(map(storage.in_l1, keys[first:])):
                where = await storage.locate(keys[first:])
                if any(location != IN_L1 for location in where):
                    handle = self._start_prefetch(reg, keys, where, num_tokens, first_chunk=first)
        if handle is not None:
            self._extend_handle(handle, keys, num_tokens)
        return RetrieveRequest(
            layout=reg.layout,
            keys=keys,
            block_ids=ids,
            num_tokens=num_tokens,
            skip_prefix_tokens=skip_prefix_tokens,
            first=first,
            policy=policy,
            handle=handle,
            open_handle=functools.partial(self._open_handle, reg, keys, num_tokens, first),
            chunk_size=chunk_size,
            chunk_tokens=functools.partial(self._chunk_tokens, total=num_tokens),
            timeout_base_s=self.config.prefetch_timeout_base_s,
            timeout_per_1k_tokens_s=self.config.prefetch_timeout_per_1k_tokens_s,
            batch_chunks=self.config.retrieve_batch_chunks,
        )

    def _claims_for(self, prefetch: PrefetchHandle, keys: Sequence[ChunkKey]) -> PrefetchClaims:
        """The claims of a caller's handle given to a retrieve: of this engine, and over the
        same chunks as the request's tokens where they overlap (another prompt's loads would be
        another's KV); chunks past the request's are released when it ends."""
        if not isinstance(prefetch, PrefetchHandle):
            raise ConfigError(
                f"retrieve: prefetch must be a PrefetchHandle from prefetch(), got "
                f"{type(prefetch).__name__}"
            )
        claims = claims_of(prefetch)
        if claims.controller is not self._prefetch:
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

    def _extend_handle(
        self, handle: PrefetchClaims, keys: Sequence[ChunkKey], num_tokens: int
    ) -> None:
        """Unreserved slots for the chunks past the handle's last (the prefix grew since the
        lookup that made it, or the handle was opened empty)."""
        covered = handle.first_chunk + len(handle.slots)
        if covered < len(keys):
            handle.extend(
                [(keys[i], self._chunk_tokens(i, num_tokens)) for i in range(covered, len(keys))]
            )

    def _open_handle(
        self, reg: Registration, keys: Sequence[ChunkKey], num_tokens: int, first: int
    ) -> PrefetchClaims:
        """A handle over chunks ``first`` on with nothing reserved yet (`RetrieveRequest`)."""
        handle = self._start_prefetch(reg, keys, [], num_tokens, first_chunk=first)
        self._extend_handle(handle, keys, num_tokens)
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
        storage = self._require_storage()
        mover = self._require_mover()
        reg = self._registration(model_name)
        token_ids = _whole_blocks(reg, token_ids)
        keys = self._key_list(reg, token_ids, salt)
        num_tokens = _count(token_ids)
        ids = self._check_blocks(reg, block_ids, num_tokens)
        self._counters.store_calls += 1
        self._counters.store_layerwise_calls += 1
        staged = self._stage(storage, reg, keys, num_tokens)
        store = LayerwiseStore(
            storage,
            mover,
            reg.layout,
            ids,
            staged,
            on_end=self._layerwise_store_ended,
        )
        self._layerwise_stores.add(store)
        return store

    def _layerwise_store_ended(self, store: LayerwiseStore) -> None:
        self._layerwise_stores.discard(store)
        self._counters.stored_chunks += store.stored_chunks
        self._counters.stored_tokens += store.stored_tokens

    def _stage(
        self,
        storage: StorageManager,
        reg: Registration,
        keys: Sequence[ChunkKey],
        num_tokens: int,
        *,
        first: int = 0,
    ) -> list[tuple[ChunkKey, ChunkTransfer]]:
        """Allocate L1 objects for the chunks from ``first`` on that no tier holds, in order,
        until L1 is full (the rest are skipped and counted, not an error). The caller owns the
        objects."""
        staged: list[tuple[ChunkKey, ChunkTransfer]] = []
        desc = reg.layout.layout_desc
        try:
            for index, key in enumerate(keys):
                if index < first:
                    continue
                if storage.tier_of(key) is not None:
                    self._counters.store_skipped_present += 1
                    continue
                obj = storage.allocate(desc, self._chunk_tokens(index, num_tokens))
                if obj is None:
                    self._counters.store_skipped_no_space += len(keys) - index
                    break
                staged.append((key, ChunkTransfer(obj, index * self.config.chunk_size)))
        except BaseException:
            for _, transfer in staged:
                transfer.obj.unref()
            raise
        return staged

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> metrics.EngineStats:
        """Every component's typed statistics now, as one snapshot; `EngineStats.to_prometheus`
        renders it for Prometheus, `EngineStats.as_dict` as plain dicts."""
        storage, arena = self._storage, self._arena
        return metrics.EngineStats(
            engine=dataclasses.replace(self._counters),
            l1=None if storage is None else storage.l1.stats(),
            arena=None if arena is None or arena.closed else arena.stats(),
            storage=None if storage is None else storage.stats(),
            prefetch=None if self._prefetch is None else self._prefetch.stats(),
            lower=() if storage is None else tuple((t.name, t.stats()) for t in storage.lower),
            mover=None if self._mover is None else MoverStats.from_counters(self._mover.stats()),
        )


def _count(token_ids: TokenIds) -> int:
    return len(token_ids)


def _int_argument(name: str, value: Any) -> int:
    """``value`` as an int when it is one (Python or NumPy/torch integer scalar), else a
    `LayoutError` naming the argument: 64.0, "64", True and None are refused, not coerced."""
    if isinstance(value, bool):
        raise LayoutError(f"{name}: expected an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise LayoutError(f"{name}: expected an int, got {value!r}") from None


def _block_id_list(block_ids: Any) -> list[int]:
    """``block_ids`` (a sequence of ints, or a 1-D integer tensor or array) as a list of ints.
    Floats, strings, bools and None are refused, never truncated or parsed."""
    dtype = getattr(block_ids, "dtype", None)
    if dtype is not None and hasattr(block_ids, "tolist"):
        kind = str(dtype)
        if "int" not in kind or "bool" in kind or getattr(block_ids, "ndim", 1) != 1:
            raise LayoutError(
                f"block_ids: expected a 1-D integer tensor or array, got {kind} with shape "
                f"{tuple(getattr(block_ids, 'shape', ()))}"
            )
        values: list[int] = block_ids.tolist()
        return values
    if type(block_ids) is list and set(map(type, block_ids)) <= {int}:
        return list(block_ids)  # the common case, checked without a call per id
    if block_ids is None or isinstance(block_ids, (str, bytes, bytearray, memoryview)):
        raise LayoutError(
            f"block_ids: expected a sequence of ints or a 1-D integer tensor, got {block_ids!r}"
        )
    try:
        items = list(block_ids)
    except TypeError:
        raise LayoutError(
            f"block_ids: expected a sequence of ints, got {type(block_ids).__name__}"
        ) from None
    return [_int_argument(f"block_ids[{i}]", value) for i, value in enumerate(items)]


def _whole_blocks(reg: Registration, token_ids: TokenIds) -> TokenIds:
    """The tokens a registration can cache: all of them, or for caches moved as whole blocks
    (format 'blocks') the whole blocks only; a partial last block is never stored or loaded."""
    multiple = reg.layout.layout_desc.token_multiple
    if multiple == 1:
        return token_ids
    partial = _count(token_ids) % multiple
    return token_ids[:-partial] if partial else token_ids  # no slice (a tensor op) if whole
