"""`MooncakeConnector`: chunk frames in Mooncake Store, moved straight from and into L1.

Owns one Mooncake client (`mooncake.store.MooncakeDistributedStore`, set up on first use; its
segment of ``segment`` bytes joins the pool that every engine of the fleet lends to), the
registration of the L1 arena and of a small slab of header slots with the client's transfer
engine, and a `BlockingPool` that runs the client's calls (they block; none of them runs on the
event loop or its default executor).

Values are whole codec frames. A put sends ``[header slot, group buffers...]`` and a get
receives into ``[header slot, the L1 object's group buffers...]``: Python never copies payload
bytes (only the header, a few KiB, goes through its slot). Requests that arrive while a batch
is in flight are gathered into the next batch: one ``batch_put_from_multi_buffers`` for puts,
one get session (``batch_get_session_start``, then ``batch_get_into_multi_buffer_ranges``)
for gets, one ``batch_is_exist`` per lookup.

Deadlines: a call blocks about 4.3 s while the master is unreachable, and a transfer from a
segment whose owner died is retried for seconds (1 + 2 + 4 s) while the master still lists it.
A get is split so that only the part that lends no buffer talks to the master: the session's
start (which segments hold the keys) is abandoned at the caller's deadline, its thread left to
finish. The transfer into the caller's buffers cannot be stopped: a get cancelled during it
takes a reference on the sink's owner (the L1 object) and returns at once; the transfer's end
drops it, so the buffers are never reused while they may still be written (the object is a
miss, never promoted). If a custom tier below L3 were then read into the same object, a late
transfer could still land in it: only dead or stalled segments leave one running. Puts lend
their buffers for the whole call and are waited for (within Mooncake's own RPC timeout). While
a master round trip that outlived its deadline is still running, new requests fail at once:
threads never pile up behind a dead master, and every request then costs a miss, not a
timeout.

Return codes (never exceptions) become `FetchStatus` or `RemoteError`s: -704 not found is
MISSING, -200 no space is `RemoteNoSpace` (counted as ``no_space``); a get of fewer bytes than
asked is SIZE_MISMATCH. Names are ``<prefix>:<namespace>:<chunk hex>`` with the namespace
percent-encoded, so tenants never meet.

Threads: loop-only (the `RemoteConnector` contract); Mooncake calls run on the pool's threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import importlib
import ipaddress
import logging
import os
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from tiered_kv.config import MooncakeOptions
from tiered_kv.errors import ConfigError, RemoteError, RemoteUnavailable
from tiered_kv.keys import ChunkKey
from tiered_kv.threads import BlockingPool
from tiered_kv.tiers.remote.connector import BytesLike, FetchStatus, FrameSink, RemoteConnector

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Mooncake's return codes (mooncake-store/include/types.h).
NO_SPACE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900

HEADER_SLOT_BYTES = 16 << 10  # a frame header: key, groups' shapes, padded to 4 KiB (codec)
HEADER_SLOTS = 128  # requests in flight at once (both directions)
MAX_BATCH = 64
SETUP_BACKOFF_S = (1.0, 30.0)  # first and largest wait after a failed set-up


class RemoteNoSpace(RemoteError):
    """The pool refused a put for lack of space (-200): a dropped write."""


def mooncake_key_name(prefix: str, key: ChunkKey) -> str:
    namespace = urllib.parse.quote(key.scope.namespace, safe="")
    return f"{prefix}:{namespace}:{key.hex}"


def _address(buffer: memoryview) -> int:
    """The address of a writable, contiguous buffer (L1 views are both)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def import_store_class() -> Any:
    """`MooncakeDistributedStore`, or a `ConfigError` saying what to install."""
    try:
        module = importlib.import_module("mooncake.store")
    except ImportError as exc:
        hint = (
            "apt-get install libibverbs1 (Mooncake's native parts link it, even for TCP)"
            if "libibverbs" in str(exc)
            else "pip install 'tiered-kv[mooncake]'"
        )
        raise ConfigError(
            f"l3_url: mooncake:// cannot import mooncake.store ({exc}); {hint}"
        ) from exc
    return module.MooncakeDistributedStore


@dataclasses.dataclass(slots=True, eq=False)
class _Request(Generic[_T]):
    name: str
    pointers: list[int]
    sizes: list[int]
    future: asyncio.Future[_T]
    slot: int
    sink: FrameSink | None = None
    lent: bool = False  # its buffers (and header slot) are in a transfer now
    released: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    on_release: list[Callable[[], None]] = dataclasses.field(default_factory=list)

    def lend(self) -> None:
        self.lent = True

    def release(self) -> None:
        """On the loop, when the transfer has let go of the buffers."""
        self.lent = False
        self.released.set()
        callbacks, self.on_release = self.on_release, []
        for callback in callbacks:
            callback()


class MooncakeConnector(RemoteConnector):
    """Mooncake Store at ``options.master`` (see `MooncakeOptions` and docs/remote.md);
    ``connections``: the gets a load keeps in flight (gathered into batches)."""

    def __init__(
        self,
        options: MooncakeOptions,
        *,
        key_prefix: str = "tkv",
        timeout_s: float = 5.0,
        connections: int = 8,
    ) -> None:
        self.options = options
        self.description = f"mooncake://{options.master} ({options.protocol})"
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self._connections = connections
        self._store_class = import_store_class()
        self._store: Any = None
        self._setup_lock = threading.Lock()
        self._setup_failed_at = 0.0
        self._setup_backoff = 0.0
        # Regions announced by the tier (base -> bytes) and those registered with the engine.
        self._regions: dict[int, int] = {}
        self._registered: set[int] = set()
        self._slab = (ctypes.c_uint8 * (HEADER_SLOT_BYTES * HEADER_SLOTS))()
        self._slab_ptr = ctypes.addressof(self._slab)
        self._free_slots = list(range(HEADER_SLOTS))
        self._slots_free: asyncio.Semaphore | None = None
        self._pool = BlockingPool("tkv-mooncake", 4)
        self._gets: list[_Request[FetchStatus]] = []
        self._puts: list[_Request[None]] = []
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._running: dict[int, float] = {}  # master round trip -> when it was submitted
        self._call_ids = 0
        self._closed = False
        self._counters = dict.fromkeys(
            (
                "get_batches",
                "put_batches",
                "no_space",
                "refused_stalled",
                "setups",
                "setup_failures",
                "abandoned_calls",
                "held_past_deadline",
            ),
            0,
        )

    # -- the seam -------------------------------------------------------------------------------
    @property
    def connections(self) -> int:
        return self._connections

    def name(self, key: ChunkKey) -> str:
        return mooncake_key_name(self.key_prefix, key)

    def use_host_memory(self, base_ptr: int, nbytes: int) -> None:
        # Registered once, on the next call's thread (an arena outlives its connector).
        self._regions.setdefault(base_ptr, nbytes)

    async def open(self) -> None:
        # Set-up talks to the master; it happens on the first request, so a master that is
        # down at start-up costs misses, not a failed engine start.
        self._slots_free = asyncio.Semaphore(HEADER_SLOTS)

    def stats(self) -> dict[str, int | float]:
        pool = self._pool.stats()
        return {
            **self._counters,
            "threads": pool.threads,
            "master_calls_running": len(self._running),
            "registered_regions": len(self._registered),
        }

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        names = [self.name(key) for key in keys]
        codes = await self._abandonable(lambda store: store.batch_is_exist(names))
        if any(code < 0 for code in codes):
            raise RemoteError(f"mooncake batch_is_exist: codes {sorted(set(codes))}")
        return [code == 1 for code in codes]

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        names = [self.name(key) for key in keys]
        codes = await self._abandonable(lambda store: store.batch_remove(names, True))
        return [code == 0 for code in codes]

    async def put(self, key: ChunkKey, frame: Sequence[BytesLike], frame_len: int) -> None:
        self._check_usable()
        header, payload = frame[0], frame[1:]
        if len(header) > HEADER_SLOT_BYTES:
            raise RemoteError(f"mooncake: a {len(header)}-byte header exceeds its slot")
        pointers = [self._payload_address(part) for part in payload]
        slot = await self._take_slot()
        start = slot * HEADER_SLOT_BYTES
        ctypes.memmove(self._slab_ptr + start, bytes(header), len(header))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        request = _Request(
            self.name(key),
            [self._slab_ptr + start, *pointers],
            [len(header), *(len(part) for part in payload)],
            future,
            slot,
        )
        self._puts.append(request)
        self._drain("put")
        await self._await_request(request)

    async def get_into(self, key: ChunkKey, sink: FrameSink) -> FetchStatus:
        self._check_usable()
        if len(sink.header) > HEADER_SLOT_BYTES:
            raise RemoteError(f"mooncake: a {len(sink.header)}-byte header exceeds its slot")
        pointers = [self._payload_address(buffer) for buffer in sink.payload]
        slot = await self._take_slot()
        future: asyncio.Future[FetchStatus] = asyncio.get_running_loop().create_future()
        request = _Request(
            self.name(key),
            [self._slab_ptr + slot * HEADER_SLOT_BYTES, *pointers],
            [len(sink.header), *(len(buffer) for buffer in sink.payload)],
            future,
            slot,
            sink,
        )
        self._gets.append(request)
        self._drain("get")
        return await self._await_request(request)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for queue in (self._gets, self._puts):
            for request in queue:
                if not request.future.done():
                    request.future.set_exception(RemoteUnavailable("mooncake: connector closed"))
            queue.clear()
        drains = list(self._drains.values())
        for task in drains:
            task.cancel()
        for task in drains:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        store, self._store = self._store, None
        if store is not None:
            registered = list(self._registered)
            self._registered.clear()

            def close() -> None:
                for base in registered:
                    store.unregister_buffer(base)
                store.close()

            with contextlib.suppress(Exception):
                await self._pool.run(close)
        await self._pool.aclose()

    # -- requests -------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise RemoteUnavailable("mooncake: connector closed")
        now = time.monotonic()
        if any(now - started > self.timeout_s for started in self._running.values()):
            self._counters["refused_stalled"] += 1
            raise RemoteUnavailable(
                "mooncake: a master round trip is still running past its deadline (master "
                "unreachable?)"
            )
        if self._store is None and now < self._setup_failed_at + self._setup_backoff:
            raise RemoteUnavailable("mooncake: set-up failed recently; retrying after a backoff")

    def _payload_address(self, buffer: BytesLike) -> int:
        if not isinstance(buffer, memoryview) or buffer.readonly:
            raise RemoteError("mooncake: payload buffers must be writable memoryviews (L1)")
        pointer = _address(buffer)
        for base, nbytes in self._regions.items():
            if base <= pointer and pointer + len(buffer) <= base + nbytes:
                return pointer
        raise RemoteError("mooncake: a payload buffer lies outside the announced host memory")

    async def _take_slot(self) -> int:
        slots = self._slots_free
        if slots is None:
            raise RemoteUnavailable("mooncake: connector not open")
        await slots.acquire()
        return self._free_slots.pop()

    def _give_slot(self, slot: int) -> None:
        assert self._slots_free is not None  # a slot was taken
        self._free_slots.append(slot)
        self._slots_free.release()

    async def _await_request(self, request: _Request[_T]) -> _T:
        """The request's result; its header slot goes back once no transfer uses it.

        Cancelled while a transfer uses the caller's buffers: a get whose sink names an owner
        (the L1 object) takes a reference on it, which the transfer's end drops, and returns at
        once (a transfer to a dead segment retries for seconds); otherwise it waits for the
        transfer to let go of the buffers."""
        try:
            return await request.future
        except asyncio.CancelledError:
            owner = None if request.sink is None else request.sink.owner
            if request.lent and owner is not None:
                owner.ref()
                self._counters["held_past_deadline"] += 1
                request.on_release.append(owner.unref)
            while request.lent and owner is None:
                with contextlib.suppress(asyncio.CancelledError):
                    await request.released.wait()
            raise
        finally:
            if request.lent:
                request.on_release.append(functools.partial(self._give_slot, request.slot))
            else:
                self._give_slot(request.slot)

    def _drain(self, kind: str) -> None:
        """Start the batch loop of ``kind`` unless it runs already (it ends when idle)."""
        task = self._drains.get(kind)
        if task is not None and not task.done():
            return
        if kind == "get":
            run = self._run_batches(self._gets, "get_batches", self._get_batch)
        else:
            run = self._run_batches(self._puts, "put_batches", self._put_batch)
        self._drains[kind] = asyncio.get_running_loop().create_task(
            run, name=f"tkv-mooncake-{kind}s"
        )

    @staticmethod
    def _take_batch(queue: list[_Request[_T]]) -> list[_Request[_T]]:
        """Up to `MAX_BATCH` live requests, one per name (a repeat waits for the next batch)."""
        batch: list[_Request[_T]] = []
        names: set[str] = set()
        rest: list[_Request[_T]] = []
        for request in queue:
            if request.future.done():
                continue
            if len(batch) < MAX_BATCH and request.name not in names:
                batch.append(request)
                names.add(request.name)
            else:
                rest.append(request)
        queue[:] = rest
        return batch

    async def _run_batches(
        self,
        queue: list[_Request[_T]],
        counter: str,
        run_batch: Callable[[list[_Request[_T]]], Awaitable[None]],
    ) -> None:
        """Batches of ``queue`` through ``run_batch`` (each counted in ``counter``) until it is
        empty."""
        while queue:
            batch = self._take_batch(queue)
            if not batch:
                continue
            self._counters[counter] += 1
            try:
                await run_batch(batch)
            except BaseException as exc:  # every request of the batch fails alike
                _fail(batch, exc)
                if not isinstance(exc, Exception):
                    raise

    async def _get_batch(self, batch: list[_Request[FetchStatus]]) -> None:
        names = [request.name for request in batch]
        # The master round trip: no buffer is lent, so callers may leave at their deadline.
        codes = await self._abandonable(lambda store: store.batch_get_session_start(names))
        started = [name for name, code in zip(names, codes, strict=True) if code == 0]
        ready: list[_Request[FetchStatus]] = []
        for request, code in zip(batch, codes, strict=True):
            if request.future.done():
                continue
            if code == 0:
                ready.append(request)
            elif code == OBJECT_NOT_FOUND:
                request.future.set_result(FetchStatus.MISSING)
            else:
                request.future.set_exception(RemoteError(f"mooncake get of a chunk: code {code}"))
        for request in ready:
            request.lend()
        try:
            results = await self._lent(lambda store: self._transfer_in(store, ready, started))
        finally:
            for request in ready:
                request.release()
        for request, result in zip(ready, results, strict=True):
            if request.future.done():
                continue
            if isinstance(result, FetchStatus):
                request.future.set_result(result)
            else:
                request.future.set_exception(result)

    @staticmethod
    def _transfer_in(
        store: Any, ready: list[_Request[FetchStatus]], started: list[str]
    ) -> list[FetchStatus | RemoteError]:
        """On a pool thread: the session's transfer into the requests' buffers, then the header
        out of its slot and every payload byte through the request's hasher."""
        try:
            codes: list[int] = []
            if ready:
                offsets = []
                for request in ready:
                    position = 0
                    parts = []
                    for size in request.sizes:
                        parts.append(position)
                        position += size
                    offsets.append(parts)
                codes = store.batch_get_into_multi_buffer_ranges(
                    [request.name for request in ready],
                    [request.pointers for request in ready],
                    [request.sizes for request in ready],
                    offsets,
                )
        finally:
            if started:
                store.batch_get_session_end(started)
        results: list[FetchStatus | RemoteError] = []
        for request, code in zip(ready, codes, strict=True):
            sink = request.sink
            assert sink is not None  # every get carries its sink
            if code == sink.total_len:
                ctypes.memmove(
                    (ctypes.c_char * len(sink.header)).from_buffer(sink.header),
                    request.pointers[0],
                    len(sink.header),
                )
                for buffer in sink.payload:
                    sink.hasher.update(buffer)
                results.append(FetchStatus.HIT)
            elif code == INVALID_PARAMS or 0 <= code < sink.total_len:
                results.append(FetchStatus.SIZE_MISMATCH)  # stored frame shorter than asked
            elif code == OBJECT_NOT_FOUND:
                results.append(FetchStatus.MISSING)
            else:
                results.append(RemoteError(f"mooncake transfer of a chunk: code {code}"))
        return results

    async def _put_batch(self, batch: list[_Request[None]]) -> None:
        names = [request.name for request in batch]
        pointers = [request.pointers for request in batch]
        sizes = [request.sizes for request in batch]
        replicas = self.options.replicas

        def put(store: Any) -> list[int]:
            config = importlib.import_module("mooncake.store").ReplicateConfig()
            config.replica_num = replicas
            codes: list[int] = store.batch_put_from_multi_buffers(names, pointers, sizes, config)
            return codes

        for request in batch:
            request.lend()
        try:
            codes: list[int | Exception]
            try:
                codes = list(await self._lent(put))
            except Exception as exc:
                codes = [exc] * len(batch)
        finally:
            for request in batch:
                request.release()
        for request, code in zip(batch, codes, strict=True):
            if request.future.done():
                continue
            if isinstance(code, Exception):
                request.future.set_exception(code)
            elif code == 0:
                request.future.set_result(None)
            elif code == NO_SPACE:
                self._counters["no_space"] += 1
                request.future.set_exception(RemoteNoSpace("mooncake put: the pool is full"))
            else:
                request.future.set_exception(RemoteError(f"mooncake put: code {code}"))

    # -- calls on the pool ----------------------------------------------------------------------
    async def _abandonable(self, call: Callable[[Any], _T]) -> _T:
        """``call(store)`` on the pool; a caller cancelled meanwhile leaves at once (nothing of
        its is lent), the call finishing on its thread."""
        self._check_usable()
        future = self._pool.submit(self._tracked(call, gate=True))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if not future.done():
                self._counters["abandoned_calls"] += 1
                future.add_done_callback(_retrieve)
            raise

    async def _lent(self, call: Callable[[Any], _T]) -> _T:
        """``call(store)`` on the pool, lending the caller's buffers: waited for when cancelled.
        Not a stall when long (a batch of large transfers is)."""
        return await self._pool.run(self._tracked(call, gate=False))

    def _tracked(self, call: Callable[[Any], _T], *, gate: bool) -> Callable[[], _T]:
        """``call`` with the client ready; with ``gate``, a master round trip that should be
        quick: counted in ``_running`` until it ends, so that one stuck past its deadline
        refuses new requests (`_check_usable`)."""
        self._call_ids += 1
        call_id = self._call_ids
        loop = asyncio.get_running_loop()
        if gate:
            self._running[call_id] = time.monotonic()

        def done() -> None:
            self._running.pop(call_id, None)

        def job() -> _T:
            try:
                return call(self._ready_store())
            finally:
                with contextlib.suppress(RuntimeError):  # a closed loop: nothing to tell
                    loop.call_soon_threadsafe(done)

        return job

    def _ready_store(self) -> Any:
        """On a pool thread: the client, set up and with every announced region registered."""
        with self._setup_lock:
            store = self._store
            if store is None:
                store = self._setup()
            for base, nbytes in list(self._regions.items()):
                if base not in self._registered:
                    code = store.register_buffer(base, nbytes)
                    if code != 0:
                        raise RemoteError(f"mooncake register_buffer of L1: code {code}")
                    self._registered.add(base)
            return store

    def _setup(self) -> Any:
        now = time.monotonic()
        if now < self._setup_failed_at + self._setup_backoff:
            raise RemoteUnavailable("mooncake: set-up failed recently; retrying after a backoff")
        options = self.options
        # Without these Mooncake retries a missing master for 90 s, and its TCP transport
        # advertises the machine's external address even when the pool is on loopback.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        if options.protocol == "tcp" and _is_ip(options.local_hostname):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", options.local_hostname)
        store = self._store_class()
        code = store.setup(
            options.local_hostname,
            options.metadata,
            options.segment_bytes,
            options.local_buffer_bytes,
            options.protocol,
            options.devices,
            options.master,
        )
        if code == 0:
            code = store.register_buffer(self._slab_ptr, HEADER_SLOT_BYTES * HEADER_SLOTS)
        if code != 0:
            with contextlib.suppress(Exception):
                store.close()
            self._counters["setup_failures"] += 1
            self._setup_failed_at = time.monotonic()
            low, high = SETUP_BACKOFF_S
            self._setup_backoff = min(high, max(low, self._setup_backoff * 2))
            raise RemoteUnavailable(f"mooncake setup with master {options.master}: code {code}")
        self._counters["setups"] += 1
        self._setup_backoff = 0.0
        self._registered.clear()
        self._store = store
        return store


def _fail(batch: Sequence[_Request[Any]], exc: BaseException) -> None:
    """Fail the batch's requests still waiting (a cancelled loop: the connector is closing)."""
    error = exc if isinstance(exc, Exception) else RemoteUnavailable("mooncake: connector closed")
    for request in batch:
        if not request.future.done():
            request.future.set_exception(error)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
