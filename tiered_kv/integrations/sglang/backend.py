"""`TieredKVHiCacheStorage`: SGLang's HiCache storage backend over our lower tiers (L2, L3).

SGLang's host pool plays our L1: pages move between it and the tiers with no second host copy
(`tiered_kv.integrations.sglang.pages`). Loaded by SGLang's ``dynamic`` backend path, built as
``cls(storage_config, kwargs)``; `register_mem_pool_host` then reads the pool's page geometry and
opens the tiers (L2 in ``l2_path/<shard>``, L3 at ``l3_url``) on a private event loop.

Contract with SGLang's cache controller:
- Every verb is synchronous and may be called from any of the controller's threads at once; the
  tiers run on the backend's own loop (`LoopThread`), each call bounded by ``call_timeout_s``.
- Misses, corrupt chunks (checksums, verified by the tiers), a remote that is down and timeouts
  answer False / 0 / None; nothing raises into the controller. Each kind of failure is logged
  once with its traceback and counted (`get_stats`). Bad configuration raises at construction
  (`ConfigError`), an unreadable host pool at `register_mem_pool_host` (`LayoutError`).
- Buffers: a call's pages are the pool's (or the caller's flat tensors); the tiers touch them
  only while the call runs, and a timed-out call has finished cancelling before it returns.
- MLA: one copy for all TP ranks (the keys carry no TP rank). Only the storage writer
  (SGLang's ``is_storage_writer``: rank 0) writes L3; every rank reads it. L2 is per process.
- A set succeeds when at least one tier stored the page; a get reads L2 first, then L3.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from tiered_kv.errors import ConfigError, LayoutError, TieredKVError
from tiered_kv.integrations.sglang.page_keys import PageKeys, StorageShard
from tiered_kv.integrations.sglang.pages import (
    HostPool,
    PageGeometry,
    PageObj,
    PoolRegion,
    pool_region,
)
from tiered_kv.integrations.sglang.settings import BackendSettings
from tiered_kv.keys import ChunkKey
from tiered_kv.sync import LoopThread
from tiered_kv.tiers.base import LowerTier, TierStats
from tiered_kv.tiers.factory import lower_tiers

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True, slots=True)
class SGLangStorageStats:
    """`TieredKVHiCacheStorage.get_stats()`: the backend's counters and each tier's stats."""

    counters: dict[str, int]
    tiers: dict[str, TierStats]


@dataclasses.dataclass(slots=True)
class _Opened:
    """What `register_mem_pool_host` sets up: the pool, its geometry, keys and tiers."""

    pool: HostPool
    region: PoolRegion
    geometry: PageGeometry
    keys: PageKeys
    tiers: list[LowerTier]


class TieredKVHiCacheStorage(HiCacheStorage):
    """A HiCache storage backend over tiered_kv's L2 (local disk) and L3 (remote) tiers."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(
            getattr(storage_config, "extra_config", None)
        )
        self.shard = StorageShard.of(storage_config)
        engine = self.settings.engine
        if self.shard.is_mla and self.shard.tp_size > 1 and engine.l3_url is None:
            raise ConfigError(
                "tiered_kv SGLang backend: an MLA model with tp_size > 1 needs 'l3_url': SGLang "
                "writes MLA pages from one rank only, and an L2 directory belongs to one "
                "process, so the other ranks can find them only in a shared remote store"
            )
        self._opened: _Opened | None = None
        self._lock = threading.Lock()
        self._counters: collections.Counter[str] = collections.Counter()
        self._logged: set[str] = set()
        self._loop = LoopThread(f"tkv-sglang-tp{self.shard.tp_rank}")

    # -- set-up ---------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Read ``mem_pool_host``'s page geometry and open the tiers for it (once)."""
        if self._opened is not None:
            if mem_pool_host is self._opened.pool:
                return
            raise TieredKVError(
                "tiered_kv SGLang backend: register_mem_pool_host called with a second pool"
            )
        super().register_mem_pool_host(mem_pool_host)
        pool: HostPool = mem_pool_host
        geometry = PageGeometry.read(pool)
        region = pool_region(pool)
        engine = self.settings.engine
        keys = PageKeys(self.shard, engine.namespace, engine.fingerprint, geometry.layout_id)
        l2_path = (
            None if engine.l2_path is None else str(Path(engine.l2_path) / self.shard.directory)
        )
        tiers = lower_tiers(self.settings.with_page_size(geometry.page_size, l2_path))
        opened: list[LowerTier] = []

        async def open_all() -> None:
            for tier in tiers:
                await tier.open()
                opened.append(tier)

        try:
            self._loop.run(open_all(), self.settings.call_timeout_s)
        except BaseException:
            self._loop.run(_close_tiers(opened), self.settings.engine.close_timeout_s)
            raise
        self._opened = _Opened(pool, region, geometry, keys, tiers)
        logger.info(
            "tiered_kv SGLang backend: %s pages of %d bytes (%d groups, %s), tiers %s",
            geometry.layout,
            geometry.nbytes,
            len(geometry.specs),
            "zero-copy" if geometry.zero_copy else "staged",
            [tier.name for tier in tiers],
        )

    def close(self) -> None:
        """Close the tiers and stop the loop; safe to call twice (SGLang's detach calls it)."""
        opened, self._opened = self._opened, None
        final = None if opened is None else _close_tiers(opened.tiers)
        self._loop.close(final, self.settings.engine.close_timeout_s)

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.closed:
            # At interpreter shutdown there is nothing left to report a failure to.
            with contextlib.suppress(Exception):
                self.close()

    # -- zero-copy page verbs (``"interface_v1": 1``) -------------------------------------
    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        pages = self._pool_pages("batch_get_v1", keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        return self._get_pages("batch_get_v1", pages)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        pages = self._pool_pages("batch_set_v1", keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        return self._set_pages("batch_set_v1", pages)

    # -- generic verbs (flat page tensors) ----------------------------------------------
    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        opened = self._ready("batch_get")
        if opened is None:
            return [None] * len(keys)
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        if len(targets) != len(keys):
            self._fail("batch_get", f"{len(targets)} targets for {len(keys)} keys")
            return [None] * len(keys)
        flats: list[torch.Tensor] = []
        pages: list[tuple[ChunkKey, PageObj]] = []
        try:
            for key, target in zip(keys, targets, strict=True):
                flat = target if target is not None else opened.pool.get_dummy_flat_data_page()
                flats.append(flat)
                groups = opened.geometry.groups_of_flat(flat)
                pages.append(
                    (opened.keys.key(key), PageObj(opened.geometry, groups, opened.region))
                )
        except (TieredKVError, TypeError, ValueError) as exc:
            self._fail("batch_get", exc)
            return [None] * len(keys)
        found = self._get_pages("batch_get", pages)
        return [flat if hit else None for flat, hit in zip(flats, found, strict=True)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        opened = self._ready("batch_set")
        if opened is None:
            return False
        if values is None or len(values) != len(keys):
            self._fail("batch_set", "expected one flat page tensor per key")
            return False
        pages: list[tuple[ChunkKey, PageObj]] = []
        try:
            for key, value in zip(keys, values, strict=True):
                flat = value.contiguous()  # a copy only when SGLang handed a strided view
                groups = opened.geometry.groups_of_flat(flat)
                pages.append(
                    (opened.keys.key(key), PageObj(opened.geometry, groups, opened.region))
                )
        except (TieredKVError, TypeError, ValueError, AttributeError) as exc:
            self._fail("batch_set", exc)
            return False
        return all(self._set_pages("batch_set", pages))

    # -- lookups --------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many of ``keys``, from the first, are stored (in L2 or L3)."""
        opened = self._ready("batch_exists")
        if opened is None or not keys:
            return 0
        try:
            chunk_keys = [opened.keys.key(key) for key in keys]
        except TieredKVError as exc:
            self._fail("batch_exists", exc)
            return 0
        flags = self._call("batch_exists", lambda: _exists_many(opened.tiers, chunk_keys), None)
        if flags is None:
            return 0
        count = 0
        for flag in flags:
            if not flag:
                break
            count += 1
        self._count(exists_calls=1, exists_keys=len(keys), exists_hits=count)
        return count

    def clear(self) -> None:
        """Empty this rank's L2 directory. The remote store is shared and is left alone."""
        opened = self._ready("clear")
        if opened is None:
            return
        self._call("clear", lambda: _clear_local(opened.tiers), None)

    def get_stats(self) -> SGLangStorageStats:
        with self._lock:
            counters = dict(self._counters)
        opened = self._opened
        tiers = {} if opened is None else {tier.name: tier.stats() for tier in opened.tiers}
        return SGLangStorageStats(counters, tiers)

    # -- internals ------------------------------------------------------------------------
    def _ready(self, verb: str) -> _Opened | None:
        opened = self._opened
        if opened is None:
            self._fail(verb, "no host pool registered (register_mem_pool_host) or closed")
        return opened

    def _pool_pages(
        self, verb: str, keys: Sequence[str], host_indices: torch.Tensor
    ) -> list[tuple[ChunkKey, PageObj]] | None:
        opened = self._ready(verb)
        if opened is None:
            return None
        page_size = opened.geometry.page_size
        try:
            if host_indices.numel() != len(keys) * page_size:
                raise LayoutError(
                    f"{host_indices.numel()} host indices for {len(keys)} pages of {page_size}"
                )
            starts = host_indices[::page_size].tolist() if keys else []
            pages = []
            for key, start in zip(keys, starts, strict=True):
                view = opened.geometry.page_view(opened.pool, opened.region, int(start))
                groups = opened.geometry.groups_of_view(view)
                pages.append(
                    (opened.keys.key(key), PageObj(opened.geometry, groups, opened.region))
                )
        except (TieredKVError, TypeError, ValueError, IndexError, RuntimeError) as exc:
            self._fail(verb, exc)
            return None
        return pages

    def _get_pages(self, verb: str, pages: list[tuple[ChunkKey, PageObj]]) -> list[bool]:
        opened = self._opened
        if opened is None or not pages:
            return [False] * len(pages)
        tiers = opened.tiers
        found = self._call(verb, lambda: _gather(_get_one(tiers, k, p) for k, p in pages), None)
        if found is None:
            return [False] * len(pages)
        hits: list[bool] = []
        for (_, page), tier_index in zip(pages, found, strict=True):
            if tier_index is not None:
                page.finish_read()
                self._count(**{f"hits_{tiers[tier_index].name}": 1})
            hits.append(tier_index is not None)
        self._count(pages_read=len(pages), page_hits=sum(hits))
        return hits

    def _set_pages(self, verb: str, pages: list[tuple[ChunkKey, PageObj]]) -> list[bool]:
        opened = self._opened
        if opened is None or not pages:
            return [False] * len(pages)
        tiers = [
            tier
            for tier in opened.tiers
            # MLA: one copy in the shared store, from the writer rank.
            if self.shard.is_writer or tier.name != "L3"
        ]
        for _, page in pages:
            page.stage_for_write()
        stored = self._call(verb, lambda: _gather(_put_one(tiers, k, p) for k, p in pages), None)
        if stored is None:
            return [False] * len(pages)
        self._count(pages_written=sum(stored), page_write_failures=len(stored) - sum(stored))
        return stored

    def _call(self, verb: str, make: Callable[[], Awaitable[_T]], default: _T) -> _T:
        """Run ``make()`` on the loop within the call timeout; any failure answers ``default``."""

        async def run() -> _T:
            return await make()

        try:
            return self._loop.run(run(), self.settings.call_timeout_s)
        except TimeoutError:
            self._fail(verb, f"timed out after {self.settings.call_timeout_s} s", kind="timeouts")
            return default
        except Exception as exc:  # the SGLang boundary: a miss, never an exception
            self._fail(verb, exc)
            return default

    def _fail(self, verb: str, what: object, *, kind: str = "errors") -> None:
        self._count(**{kind: 1, f"{kind}_{verb}": 1})
        tag = f"{verb}:{kind}:{type(what).__name__}"
        with self._lock:
            first = tag not in self._logged
            self._logged.add(tag)
        if first:
            logger.warning(
                "tiered_kv SGLang backend: %s failed: %s (logged once; counted in get_stats)",
                verb,
                what,
                exc_info=what if isinstance(what, BaseException) else None,
            )

    def _count(self, **increments: int) -> None:
        with self._lock:
            self._counters.update(increments)


async def _gather(calls: Any) -> list[Any]:
    return list(await asyncio.gather(*calls))


async def _get_one(tiers: Sequence[LowerTier], key: ChunkKey, page: PageObj) -> int | None:
    """The index of the first tier that filled ``page`` with ``key``'s bytes, or None."""
    for index, tier in enumerate(tiers):
        if await tier.get_into(key, page):
            return index
    return None


async def _put_one(tiers: Sequence[LowerTier], key: ChunkKey, page: PageObj) -> bool:
    results = await asyncio.gather(*(tier.put(key, page) for tier in tiers))
    return any(results)


async def _exists_many(tiers: Sequence[LowerTier], keys: list[ChunkKey]) -> list[bool]:
    flags = [False] * len(keys)
    for tier in tiers:
        missing = [i for i, flag in enumerate(flags) if not flag]
        if not missing:
            break
        answers = await tier.contains_many([keys[i] for i in missing])
        for i, answer in zip(missing, answers, strict=True):
            flags[i] = answer
    return flags


async def _clear_local(tiers: Sequence[LowerTier]) -> None:
    from tiered_kv.tiers.l2 import DiskTier

    for tier in tiers:
        if isinstance(tier, DiskTier):
            for key, *_ in tier.entries():
                await tier.remove(key)


async def _close_tiers(tiers: Sequence[LowerTier]) -> None:
    for tier in tiers:
        try:
            await tier.aclose()
        except Exception:
            logger.warning("tiered_kv SGLang backend: closing %s failed", tier.name, exc_info=True)
