"""`TieredKVEngine`, the facade serving stacks call, and `SyncTieredKVEngine`, its blocking twin.

Owns: registrations of KV caches (model, world size, worker → layout + key scope), the request
verbs (store / lookup / retrieve), argument validation, and the lifetime of the arena, tiers and
mover. Everything else is delegated: keys to `keys`, formats to `layout`, bytes to the mover,
placement to the `StorageManager`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

from tiered_kv.config import EngineConfig
from tiered_kv.errors import EngineStateError, LayoutError
from tiered_kv.gpu.base import ChunkTransfer, KVMover
from tiered_kv.gpu.reference import TorchMover
from tiered_kv.keys import ChunkKey, KeyScope, TokenIds, chunk_keys
from tiered_kv.layout import KVCacheLayout, MemoryLayoutDesc, build_layout
from tiered_kv.memory import HostArena, MemoryObj
from tiered_kv.storage import StorageManager
from tiered_kv.tiers.base import LowerTier
from tiered_kv.tiers.l1 import L1Tier

logger = logging.getLogger(__name__)

T = TypeVar("T")
RETRIEVE_READ_CONCURRENCY = 8


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Registration:
    model_name: str
    world_size: int
    worker_id: int
    layout: KVCacheLayout
    scope: KeyScope


@dataclasses.dataclass(slots=True)
class _Counters:
    store_calls: int = 0
    stored_chunks: int = 0
    stored_tokens: int = 0
    store_skipped_present: int = 0
    store_skipped_no_space: int = 0
    lookup_calls: int = 0
    lookup_hit_tokens: int = 0
    retrieve_calls: int = 0
    retrieved_tokens: int = 0
    retrieved_chunks: int = 0


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
    ) -> None:
        """``mover`` replaces the default mover; ``lower_tiers`` are extra tiers below L2 (or
        below L1 without one), searched in order: custom backends and fault-injection tests."""
        self.config = config or EngineConfig()
        self._mover_override = mover
        self._extra_tiers = tuple(lower_tiers)
        self._registrations: dict[str, Registration] = {}
        self._counters = _Counters()
        self._arena: HostArena | None = None
        self._storage: StorageManager | None = None
        self._mover: KVMover | None = None
        self._l2: LowerTier | None = None
        self._closed = False
        self.dropped_on_close = 0

    # -- lifetime ---------------------------------------------------------------------------
    async def open(self) -> TieredKVEngine:
        if self._closed:
            raise EngineStateError("TieredKVEngine: cannot reopen a closed engine")
        if self._storage is not None:
            return self
        self._arena = HostArena(self.config.l1_bytes, pin=self.config.pin_memory)
        l1 = L1Tier(self._arena)
        lower: list[LowerTier] = []
        if self.config.l2_path is not None:
            from tiered_kv.tiers.l2_disk import DiskTier

            self._l2 = DiskTier(
                self.config.l2_path, self.config.l2_bytes, fsync=self.config.l2_fsync
            )
            lower.append(self._l2)
        lower.extend(self._extra_tiers)
        storage = StorageManager(l1, lower, write_queue=self.config.l2_write_queue)
        try:
            await storage.open()
        except BaseException:
            await storage.aclose(0)
            self._arena.close()
            self._arena = None
            raise
        self._storage = storage
        self._mover = self._mover_override or TorchMover()
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

    async def flush(self, timeout: float | None = None) -> int:
        """Wait until queued lower-tier writes finish; returns how many were still pending."""
        return await self._require_storage().flush(timeout)

    async def evict_l1(self, max_bytes: int | None = None) -> int:
        """Evict unreferenced L1 chunks, least recently used first; returns bytes freed.

        Chunks still waiting for their lower-tier write are referenced by the write queue and stay.
        """
        return self._require_storage().l1.evict_unreferenced(max_bytes)

    async def aclose(self) -> None:
        """Flush pending writes (bounded by ``close_timeout_s``), then free every host byte."""
        if self._closed:
            return
        self._closed = True
        storage, mover, arena = self._storage, self._mover, self._arena
        self._storage = self._mover = None
        try:
            if storage is not None:
                self.dropped_on_close = await storage.aclose(self.config.close_timeout_s)
                if self.dropped_on_close:
                    logger.warning(
                        "tiered_kv: %d chunk writes to lower tiers were dropped at close",
                        self.dropped_on_close,
                    )
        finally:
            if mover is not None:
                await mover.aclose()
            if arena is not None:
                leaked = arena.close()
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
        self._registrations[model_name] = Registration(
            model_name, world_size, worker_id, layout, scope
        )
        return layout.layout_desc

    def chunk_keys(self, token_ids: TokenIds, *, model_name: str | None = None) -> list[ChunkKey]:
        """The keys this engine uses for ``token_ids`` (one per chunk, a partial last included)."""
        reg = self._registration(model_name)
        return chunk_keys(reg.scope, token_ids, self.config.chunk_size)

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

    # -- request verbs ----------------------------------------------------------------------
    def _chunk_tokens(self, index: int, total: int) -> int:
        return min(self.config.chunk_size, total - index * self.config.chunk_size)

    def _check_blocks(
        self, reg: Registration, block_ids: Sequence[int], num_tokens: int
    ) -> list[int]:
        needed = -(-num_tokens // reg.layout.block_size)
        if len(block_ids) < needed:
            raise LayoutError(
                f"block_ids: {num_tokens} tokens need {needed} blocks of "
                f"{reg.layout.block_size}, got {len(block_ids)}"
            )
        ids = [int(b) for b in block_ids[:needed]]
        if ids and not 0 <= min(ids) <= max(ids) < reg.layout.num_blocks:
            bad = [b for b in ids if not 0 <= b < reg.layout.num_blocks]
            raise LayoutError(f"block_ids: {bad[:8]} out of range [0, {reg.layout.num_blocks})")
        return ids

    async def store(
        self, token_ids: TokenIds, block_ids: Sequence[int], *, model_name: str | None = None
    ) -> int:
        """Copy the request's KV into the cache, chunk by chunk; returns tokens newly stored.

        Chunks some tier already holds are skipped. When L1 has no room even after evicting
        everything unreferenced, the remaining chunks are skipped (counted), not an error.
        """
        storage = self._require_storage()
        mover = self._require_mover()
        reg = self._registration(model_name)
        keys = chunk_keys(reg.scope, token_ids, self.config.chunk_size)
        num_tokens = _count(token_ids)
        ids = self._check_blocks(reg, block_ids, num_tokens)
        self._counters.store_calls += 1
        desc = reg.layout.layout_desc
        staged: list[tuple[ChunkKey, ChunkTransfer]] = []
        try:
            for index, key in enumerate(keys):
                if storage.tier_of(key) is not None:
                    self._counters.store_skipped_present += 1
                    continue
                tokens = self._chunk_tokens(index, num_tokens)
                obj = storage.allocate(desc, tokens)
                if obj is None:
                    self._counters.store_skipped_no_space += len(keys) - index
                    break
                staged.append((key, ChunkTransfer(obj, index * self.config.chunk_size)))
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

    async def lookup(self, token_ids: TokenIds, *, model_name: str | None = None) -> int:
        """Tokens of the longest cached prefix across all tiers (a miss ends the prefix)."""
        storage = self._require_storage()
        reg = self._registration(model_name)
        keys = chunk_keys(reg.scope, token_ids, self.config.chunk_size)
        hits = storage.prefix_hits(keys)
        tokens = min(hits * self.config.chunk_size, _count(token_ids))
        self._counters.lookup_calls += 1
        self._counters.lookup_hit_tokens += tokens
        return tokens

    async def retrieve(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        skip_prefix_tokens: int = 0,
        model_name: str | None = None,
    ) -> int:
        """Load the cached prefix into the request's blocks; returns the tokens now valid.

        The first ``skip_prefix_tokens`` tokens are the engine's own (their slots are never
        written, and chunks wholly inside them are not loaded). The result is the end of the
        valid prefix: ``skip_prefix_tokens`` when nothing more could be loaded.
        """
        storage = self._require_storage()
        mover = self._require_mover()
        reg = self._registration(model_name)
        num_tokens = _count(token_ids)
        if isinstance(skip_prefix_tokens, bool) or not 0 <= skip_prefix_tokens <= num_tokens:
            raise LayoutError(
                f"skip_prefix_tokens must be in [0, {num_tokens}], got {skip_prefix_tokens!r}"
            )
        ids = self._check_blocks(reg, block_ids, num_tokens)
        self._counters.retrieve_calls += 1
        chunk_size = self.config.chunk_size
        keys = chunk_keys(reg.scope, token_ids, chunk_size)
        first = skip_prefix_tokens // chunk_size
        if first >= len(keys):
            return skip_prefix_tokens
        wanted = keys[first:]
        wanted = wanted[: storage.prefix_hits(wanted)]
        desc = reg.layout.layout_desc
        limiter = asyncio.Semaphore(RETRIEVE_READ_CONCURRENCY)

        async def load(index: int, key: ChunkKey) -> MemoryObj | None:
            async with limiter:
                return await storage.get_lower(key, desc, self._chunk_tokens(index, num_tokens))

        loop = asyncio.get_running_loop()
        tasks: list[asyncio.Future[MemoryObj | None]] = []
        for i, key in enumerate(wanted):
            cached = storage.get_l1(key)
            if cached is None:
                tasks.append(asyncio.ensure_future(load(first + i, key)))
            else:  # the common case: no task, no await
                tasks.append(loop.create_future())
                tasks[-1].set_result(cached)
        transfers: list[ChunkTransfer] = []
        try:
            if any(not task.done() for task in tasks):
                await asyncio.wait(tasks)
            for i, task in enumerate(tasks):
                obj = task.result()
                if obj is None:
                    break
                index = first + i
                start = index * chunk_size
                transfers.append(ChunkTransfer(obj, start, max(0, skip_prefix_tokens - start)))
            if transfers:
                await mover.scatter(reg.layout, ids, transfers)
        finally:
            _release_loads(tasks)
        end = max(
            skip_prefix_tokens,
            (transfers[-1].token_start + transfers[-1].obj.num_tokens) if transfers else 0,
        )
        self._counters.retrieved_chunks += len(transfers)
        self._counters.retrieved_tokens += end - skip_prefix_tokens
        return end

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int | float]]:
        """Nested counters: engine, l1, arena, storage, l2 (when present), mover."""
        out: dict[str, dict[str, int | float]] = {
            "engine": dict(dataclasses.asdict(self._counters)),
        }
        if self._storage is not None:
            out["l1"] = dict(self._storage.l1.stats())
            out["storage"] = self._storage.stats()
        if self._arena is not None and not self._arena.closed:
            arena = dataclasses.asdict(self._arena.stats())
            out["arena"] = {k: int(v) for k, v in arena.items()}
        if self._l2 is not None:
            out["l2"] = dict(self._l2.stats())
        if self._mover is not None:
            out["mover"] = dict(self._mover.stats())
        return out


def _count(token_ids: TokenIds) -> int:
    return len(token_ids)


def _release_loads(tasks: Sequence[asyncio.Future[MemoryObj | None]]) -> None:
    """Drop the caller's reference of every loaded object; unfinished loads are cancelled and
    release theirs when they end. Never awaits, so a second cancellation cannot leak."""
    for task in tasks:
        if task.done():
            _drop_result(task)
        else:
            task.cancel()
            task.add_done_callback(_drop_result)


def _drop_result(task: asyncio.Future[MemoryObj | None]) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    obj = task.result()
    if obj is not None:
        obj.unref()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, else the stdlib loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


class SyncTieredKVEngine:
    """Blocking facade: the engine's loop (uvloop when present) runs in its own thread.

    Same verbs as `TieredKVEngine`, for callers without an event loop. Thread-safe: calls from
    several threads are serialized onto the engine's loop.
    """

    def __init__(self, config: EngineConfig | None = None, *, mover: KVMover | None = None) -> None:
        self._loop = new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tiered-kv-loop", daemon=True
        )
        self._thread.start()
        self._engine = TieredKVEngine(config, mover=mover)
        self._closed = False
        try:
            self._call(self._engine.open())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def engine(self) -> TieredKVEngine:
        return self._engine

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise EngineStateError("SyncTieredKVEngine is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def register_kv_caches(
        self,
        kv_caches: Sequence[Any] | Mapping[str, Any],
        *,
        model_name: str,
        world_size: int = 1,
        worker_id: int = 0,
        layout_hints: Mapping[str, Any] | None = None,
    ) -> MemoryLayoutDesc:
        async def register() -> MemoryLayoutDesc:
            return self._engine.register_kv_caches(
                kv_caches,
                model_name=model_name,
                world_size=world_size,
                worker_id=worker_id,
                layout_hints=layout_hints,
            )

        return self._call(register())

    def store(
        self, token_ids: TokenIds, block_ids: Sequence[int], *, model_name: str | None = None
    ) -> int:
        return self._call(self._engine.store(token_ids, block_ids, model_name=model_name))

    def lookup(self, token_ids: TokenIds, *, model_name: str | None = None) -> int:
        return self._call(self._engine.lookup(token_ids, model_name=model_name))

    def retrieve(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        skip_prefix_tokens: int = 0,
        model_name: str | None = None,
    ) -> int:
        return self._call(
            self._engine.retrieve(
                token_ids, block_ids, skip_prefix_tokens=skip_prefix_tokens, model_name=model_name
            )
        )

    def flush(self, timeout: float | None = None) -> int:
        return self._call(self._engine.flush(timeout))

    def evict_l1(self, max_bytes: int | None = None) -> int:
        return self._call(self._engine.evict_l1(max_bytes))

    def stats(self) -> dict[str, dict[str, int | float]]:
        async def stats() -> dict[str, dict[str, int | float]]:
            return self._engine.stats()

        return self._call(stats())

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._call(self._engine.aclose())
        finally:
            self._closed = True
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncTieredKVEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
