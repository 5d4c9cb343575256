"""`MooncakeConnector`: chunk frames in Mooncake Store, moved straight from and into L1.

Owns one Mooncake client (`_Client`: a `mooncake.store.MooncakeDistributedStore`, set up on
first use; its segment of ``segment`` bytes joins the pool that every engine of the fleet
lends to), the registration of the L1 arena and of a small slab of header slots with the
client's transfer engine, a `BlockingPool` that runs the client's calls (they block; none of
them runs on the event loop or its default executor), and the master's `Circuit`.

Values are whole codec frames. A put sends ``[header slot, group buffers...]`` and a get
receives into ``[header slot, the L1 object's group buffers...]``: Python never copies payload
bytes (only the header, a few KiB, goes through its slot). Requests that arrive while a batch
is in flight are gathered into the next batch: one ``batch_put_from_multi_buffers`` for puts,
one get session (``batch_get_session_start``, then ``batch_get_into_multi_buffer_ranges``)
for gets, one ``batch_is_exist`` per lookup.

Outages: a call to a master that is down fails at once while its connection closes, then blocks
about 4.3 s per call (Mooncake's reconnect loop, which no setting shortens), so the master's
reachability is a `Circuit`. A connection-level code (-900, -901), a failed set-up, or a master
round trip still running after ``stall_s`` trips it; from then on every request is refused at
once (a miss that costs microseconds) until a background probe (a TCP connect to the master,
then one ``batch_is_exist``) finds the master answering. Callers waiting on a master round trip
when it trips leave at once; the call finishes on its thread.

Deadlines: a get is split so that only the part that lends no buffer talks to the master: the
session's start is abandoned at the caller's deadline, its thread left to finish. The transfer
into the caller's buffers cannot be stopped (one from a segment whose owner died is retried for
1 + 2 + 4 s): a get cancelled during it takes a reference on the sink's owner (the L1 object)
and returns at once; the transfer's end drops it, so the buffers are never reused while they
may still be written (the object is a miss, never promoted). If a custom tier below L3 were then
read into the same object, a late transfer could still land in it: only dead or stalled
segments leave one running. Puts lend their buffers for the whole call and are waited for.

Closing: Mooncake frees a client's state under any call still running in it (a SIGSEGV), from
``close()``, from its destructor and from its own C ``atexit`` handler. So `_Client` counts the
calls running in it; `aclose` (and the finalizer of a connector dropped unclosed) refuses new
calls, waits for the running ones within ``close_timeout_s`` and only then tears the client
down; a client with a call still running past that is left open (counted in
``clients_left_open``) and never destroyed under it, and the exit barrier
(`tiered_kv.threads.wait_before_exit`) waits for its calls before the process exits.

Return codes (never exceptions) become `FetchStatus` or `RemoteError`s: -704 not found is
MISSING, -200 no space is `RemoteNoSpace` (counted as ``no_space``); a get of fewer bytes than
asked is SIZE_MISMATCH. Names are ``<prefix>:<namespace>:<chunk hex>`` with the namespace
percent-encoded, so tenants never meet.

Threads: loop-only (the `RemoteConnector` contract); Mooncake calls run on the pool's threads;
`_Client` is thread-safe.
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
import sys
import threading
import urllib.parse
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

from tiered_kv.config import MooncakeOptions
from tiered_kv.errors import ConfigError, RemoteDown, RemoteError, RemoteUnavailable
from tiered_kv.keys import ChunkKey
from tiered_kv.threads import BlockingPool, wait_before_exit
from tiered_kv.tiers.remote.circuit import Circuit
from tiered_kv.tiers.remote.connector import BytesLike, FetchStatus, FrameSink, RemoteConnector

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Mooncake's return codes (mooncake-store/include/types.h).
NO_SPACE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
RPC_TIMEOUT = -901
MASTER_UNREACHABLE = (RPC_FAIL, RPC_TIMEOUT)

HEADER_SLOT_BYTES = 16 << 10  # a frame header: key, groups' shapes, padded to 4 KiB (codec)
HEADER_SLOTS = 128  # requests in flight at once (both directions)
MAX_BATCH = 64
POOL_THREADS = 4
# A master round trip (exists, a get session's start, remove) answers in milliseconds; one still
# running after this long trips the circuit (at most half the request deadline).
MASTER_STALL_S = 1.0
PROBE_CONNECT_S = 1.0  # the probe's TCP connect to the master

# What Mooncake lets one call run: a master round trip up to its RPC timeout (coro_rpc's 30 s
# unless MC_RPC_TIMEOUT_MS says otherwise), a transfer from a dead segment its retries after it.
TRANSFER_RETRIES_S = 8.0  # 1 + 2 + 4 s of backoff, and the last try
_USER_RPC_TIMEOUT_MS = os.environ.get("MC_RPC_TIMEOUT_MS")  # a user's own setting wins
_setup_env_lock = threading.Lock()


def rpc_call_bound_s() -> float:
    """The longest a Mooncake call runs with the environment as it is now."""
    try:
        rpc_s = float(os.environ.get("MC_RPC_TIMEOUT_MS", "30000")) / 1e3
    except ValueError:
        rpc_s = 30.0
    return max(rpc_s, 0.0) + TRANSFER_RETRIES_S


# Clients left open by a close that found a call still running past its deadline: held here so
# that nothing destroys them under the call (the exit barrier waits for it).
_left_open: list[_Client] = []


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


def _master_address(master: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) as a host and a port."""
    host, _, port = master.rpartition(":")
    return host.strip("[]"), int(port)


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


class _Client:
    """One Mooncake client and the calls running in it: every call goes through `call`, which
    counts it, so `shut` never tears the client down under one. Owns the header slab (the
    client has it registered, so it lives as long as the client). Thread-safe."""

    def __init__(
        self,
        store_class: Any,
        options: MooncakeOptions,
        counters: dict[str, int],
        *,
        rpc_timeout_s: float,
        close_timeout_s: float,
    ) -> None:
        self._store_class = store_class
        self.options = options
        self.rpc_timeout_s = rpc_timeout_s
        self.close_timeout_s = close_timeout_s
        self.call_bound_s = rpc_call_bound_s()  # how long a call can run, as set up
        self._counters = counters  # the connector's; these are bumped from pool threads
        self._cond = threading.Condition()
        self._setup_lock = threading.Lock()
        self._store: Any = None
        self._running = 0
        self._refusing = False  # closing, closed or exiting: no new call
        # Regions announced by the tier (base -> bytes) and those registered with the client.
        self._regions: dict[int, int] = {}
        self._registered: set[int] = set()
        self._slab = (ctypes.c_uint8 * (HEADER_SLOT_BYTES * HEADER_SLOTS))()
        self.slab_ptr = ctypes.addressof(self._slab)

    @property
    def running(self) -> int:
        return self._running

    @property
    def ready(self) -> bool:
        """Set up, with every announced region registered (a call would not set anything up)."""
        return self._store is not None and len(self._registered) == len(self._regions)

    @property
    def registered_regions(self) -> int:
        return len(self._registered)

    def announce(self, base_ptr: int, nbytes: int) -> None:
        with self._cond:
            self._regions.setdefault(base_ptr, nbytes)

    def regions(self) -> list[tuple[int, int]]:
        with self._cond:
            return list(self._regions.items())

    def call(self, fn: Callable[[Any], _T]) -> _T:
        """``fn(store)`` on this (pool) thread, the client set up first; counted while it runs.
        `RemoteUnavailable` once the client is closing."""
        with self._cond:
            if self._refusing:
                raise RemoteUnavailable("mooncake: the client is closing")
            self._running += 1
        try:
            return fn(self._ready_store())
        finally:
            self._call_ended()

    def _call_ended(self) -> None:
        with self._cond:
            self._running -= 1
            if not self._running:
                self._cond.notify_all()

    def _ready_store(self) -> Any:
        with self._setup_lock:
            store = self._store
            if store is None:
                store = self._setup()
            with self._cond:
                regions = list(self._regions.items())
            for base, nbytes in regions:
                if base not in self._registered:
                    code = store.register_buffer(base, nbytes)
                    if code != 0:
                        raise RemoteError(f"mooncake register_buffer of L1: code {code}")
                    self._registered.add(base)
            return store

    def _setup(self) -> Any:
        options = self.options
        # Without these Mooncake retries a missing master for 90 s, and its TCP transport
        # advertises the machine's external address even when the pool is on loopback.
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        if options.protocol == "tcp" and _is_ip(options.local_hostname):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", options.local_hostname)
        store = self._store_class()
        with _setup_env_lock:  # the client reads the RPC timeout from the environment in setup
            if _USER_RPC_TIMEOUT_MS is None:
                # A master that accepts connections but does not answer (hung, overloaded)
                # would hold each call for coro_rpc's 30 s; none should outlive its deadline.
                os.environ["MC_RPC_TIMEOUT_MS"] = str(max(1000, round(self.rpc_timeout_s * 1e3)))
            self.call_bound_s = rpc_call_bound_s()
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
            code = store.register_buffer(self.slab_ptr, HEADER_SLOT_BYTES * HEADER_SLOTS)
        if code != 0:
            with contextlib.suppress(Exception):
                store.close()
            self._counters["setup_failures"] += 1
            raise RemoteUnavailable(f"mooncake setup with master {options.master}: code {code}")
        self._counters["setups"] += 1
        self._registered.clear()
        self._store = store
        return store

    def shut(self, timeout_s: float) -> bool:
        """Refuse new calls, wait up to ``timeout_s`` for the running ones, then tear the client
        down (counted as a call while it runs). False when a call was still running: the client
        is left open (counted), never destroyed under it. Blocks; never on a pool thread."""
        with self._cond:
            self._refusing = True
            if not self._cond.wait_for(lambda: self._running == 0, timeout_s):
                if self not in _left_open:
                    _left_open.append(self)
                    self._counters["clients_left_open"] += 1
                    logger.warning(
                        "mooncake: %d calls still running %.1fs into close; the client is left "
                        "open for the process to drop",
                        self._running,
                        timeout_s,
                    )
                return False
            store, self._store = self._store, None
            registered = list(self._registered)
            self._registered.clear()
            self._running += 1  # the teardown: the exit barrier waits for it too
        try:
            if store is not None:
                for base in registered:
                    with contextlib.suppress(Exception):
                        store.unregister_buffer(base)
                with contextlib.suppress(Exception):
                    store.close()
        finally:
            self._call_ended()
        return True

    def wait_at_exit(self) -> None:
        """The exit barrier's wait: refuse new calls, and let the running ones end before
        Mooncake's exit handler tears the client down: within ``close_timeout_s``, or as long
        as Mooncake lets a call run when that is longer (a crash is worse than a late exit)."""
        bound = max(self.close_timeout_s, self.call_bound_s)
        with self._cond:
            self._refusing = True
            if not self._cond.wait_for(lambda: self._running == 0, bound):
                logger.error(
                    "mooncake: %d calls still running at exit after %.1fs; Mooncake's own exit "
                    "cleanup runs under them",
                    self._running,
                    bound,
                )


def _drop_client(client: _Client, pool: BlockingPool) -> None:
    """The finalizer of a connector dropped without `aclose`: shut its client and pool on a
    thread of their own (the collector may run on the loop). At interpreter shutdown only refuse
    new calls: the exit barrier has waited for the running ones."""
    if sys.is_finalizing():
        client.wait_at_exit()
        return

    def shut() -> None:
        client.shut(client.close_timeout_s)
        pool.close(client.close_timeout_s)

    threading.Thread(target=shut, name="tkv-mooncake-drop", daemon=True).start()


def _run_in_thread(fn: Callable[[], _T], name: str) -> asyncio.Future[_T]:
    """``fn()`` on a new daemon thread; its result on the running loop's future."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # a closed loop: nothing waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


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
    ``connections``: the gets a load keeps in flight (gathered into batches);
    ``close_timeout_s``: how long `aclose` waits for calls still running; ``stall_s``: a master
    round trip running longer trips the circuit (capped at half of ``timeout_s``)."""

    def __init__(
        self,
        options: MooncakeOptions,
        *,
        key_prefix: str = "tkv",
        timeout_s: float = 5.0,
        connections: int = 8,
        close_timeout_s: float = 30.0,
        stall_s: float = MASTER_STALL_S,
    ) -> None:
        self.options = options
        self.description = f"mooncake://{options.master} ({options.protocol})"
        self.key_prefix = key_prefix
        self.timeout_s = timeout_s
        self.close_timeout_s = close_timeout_s
        self._stall_s = min(stall_s, timeout_s / 2)
        self._connections = connections
        self._counters = dict.fromkeys(
            (
                "get_batches",
                "put_batches",
                "no_space",
                "setups",
                "setup_failures",
                "abandoned_calls",
                "stalled_calls",
                "held_past_deadline",
                "clients_left_open",
            ),
            0,
        )
        self._client = _Client(
            import_store_class(),
            options,
            self._counters,
            rpc_timeout_s=timeout_s,
            close_timeout_s=close_timeout_s,
        )
        wait_before_exit(self._client)
        self._pool = BlockingPool("tkv-mooncake", POOL_THREADS)
        # A connector dropped unclosed still never tears its client down under a call.
        self._finalizer = weakref.finalize(self, _drop_client, self._client, self._pool)
        self._finalizer.atexit = False  # the exit barrier covers exit
        self._circuit = Circuit(f"L3 {self.description}", self._probe)
        self._free_slots = list(range(HEADER_SLOTS))
        self._slots_free: asyncio.Semaphore | None = None
        self._ready_lock: asyncio.Lock | None = None
        self._gets: list[_Request[FetchStatus]] = []
        self._puts: list[_Request[None]] = []
        self._drains: dict[str, asyncio.Task[None]] = {}
        self._gated: set[asyncio.Future[Any]] = set()  # callers of master round trips running
        self._master_calls = 0
        self._closed = False

    # -- the seam -------------------------------------------------------------------------------
    @property
    def connections(self) -> int:
        return self._connections

    def name(self, key: ChunkKey) -> str:
        return mooncake_key_name(self.key_prefix, key)

    def use_host_memory(self, base_ptr: int, nbytes: int) -> None:
        # Registered once, on the next call's thread (an arena outlives its connector).
        self._client.announce(base_ptr, nbytes)

    async def open(self) -> None:
        # Set-up talks to the master; it happens on the first request, so a master that is
        # down at start-up costs misses, not a failed engine start.
        self._slots_free = asyncio.Semaphore(HEADER_SLOTS)
        self._ready_lock = asyncio.Lock()

    def stats(self) -> dict[str, int | float]:
        pool = self._pool.stats()
        return {
            **self._counters,
            **self._circuit.stats(),
            "threads": pool.threads,
            "master_calls_running": self._master_calls,
            "calls_running": self._client.running,
            "registered_regions": self._client.registered_regions,
        }

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        names = [self.name(key) for key in keys]
        codes = await self._abandonable(lambda store: store.batch_is_exist(names))
        self._check_master_codes(codes, "batch_is_exist")
        if any(code < 0 for code in codes):
            raise RemoteError(f"mooncake batch_is_exist: codes {sorted(set(codes))}")
        return [code == 1 for code in codes]

    async def delete(self, keys: Sequence[ChunkKey]) -> list[bool]:
        if not keys:
            return []
        names = [self.name(key) for key in keys]
        codes = await self._abandonable(lambda store: store.batch_remove(names, True))
        self._check_master_codes(codes, "batch_remove")
        return [code == 0 for code in codes]

    async def put(self, key: ChunkKey, frame: Sequence[BytesLike], frame_len: int) -> None:
        self._check_usable()
        header, payload = frame[0], frame[1:]
        if len(header) > HEADER_SLOT_BYTES:
            raise RemoteError(f"mooncake: a {len(header)}-byte header exceeds its slot")
        pointers = [self._payload_address(part) for part in payload]
        slot = await self._take_slot()
        start = slot * HEADER_SLOT_BYTES
        slab = self._client.slab_ptr
        ctypes.memmove(slab + start, bytes(header), len(header))
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        request = _Request(
            self.name(key),
            [slab + start, *pointers],
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
            [self._client.slab_ptr + slot * HEADER_SLOT_BYTES, *pointers],
            [len(sink.header), *(len(buffer) for buffer in sink.payload)],
            future,
            slot,
            sink,
        )
        self._gets.append(request)
        self._drain("get")
        return await self._await_request(request)

    async def aclose(self) -> None:
        """Refuse new requests, then, within ``close_timeout_s`` in all: let the batches in
        flight end, wait for every Mooncake call still running and tear the client down; a
        client with a call running past that is left open (``clients_left_open``)."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.close_timeout_s
        for queue in (self._gets, self._puts):
            for request in queue:
                if not request.future.done():
                    request.future.set_exception(RemoteUnavailable("mooncake: connector closed"))
            queue.clear()
        drains = [task for task in self._drains.values() if not task.done()]
        for task in drains:
            task.cancel()
        if drains:
            # A cancelled batch still waits for the transfer that lends its buffers.
            await asyncio.wait(drains, timeout=self.close_timeout_s)
        await self._circuit.aclose()
        remaining = max(0.0, deadline - loop.time())
        shut = _run_in_thread(functools.partial(self._client.shut, remaining), "tkv-mooncake-shut")
        done, _ = await asyncio.wait([shut], timeout=max(0.0, deadline - loop.time()) + 1.0)
        if not done:  # the teardown itself is slow (an unreachable master): it goes on alone
            logger.warning("mooncake: the client's teardown outlasted close_timeout_s")
        await self._pool.aclose(max(0.0, deadline - loop.time()))

    # -- requests -------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise RemoteUnavailable("mooncake: connector closed")
        self._circuit.check()

    def _payload_address(self, buffer: BytesLike) -> int:
        if not isinstance(buffer, memoryview) or buffer.readonly:
            raise RemoteError("mooncake: payload buffers must be writable memoryviews (L1)")
        pointer = _address(buffer)
        for base, nbytes in self._client.regions():
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
        if 0 not in codes:  # no session to end
            self._check_master_codes(codes, "batch_get_session_start")
        started = [name for name, code in zip(names, codes, strict=True) if code == 0]
        ready: list[_Request[FetchStatus]] = []
        for request, code in zip(batch, codes, strict=True):
            if request.future.done():
                continue
            if code == 0:
                ready.append(request)
            elif code == OBJECT_NOT_FOUND:
                request.future.set_result(FetchStatus.MISSING)
            elif code in MASTER_UNREACHABLE:
                self._trip(f"batch_get_session_start: code {code}")
                request.future.set_exception(RemoteDown(f"mooncake get: master down ({code})"))
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
            if isinstance(code, int) and code in MASTER_UNREACHABLE:
                self._trip(f"put: code {code}")
                request.future.set_exception(RemoteDown(f"mooncake put: master down ({code})"))
            elif isinstance(code, Exception):
                request.future.set_exception(code)
            elif code == 0:
                request.future.set_result(None)
            elif code == NO_SPACE:
                self._counters["no_space"] += 1
                request.future.set_exception(RemoteNoSpace("mooncake put: the pool is full"))
            else:
                request.future.set_exception(RemoteError(f"mooncake put: code {code}"))

    # -- calls on the pool ----------------------------------------------------------------------
    async def _ensure_ready(self) -> None:
        """Set the client up (and register announced regions) unless that is done; one set-up
        at a time. A failed set-up trips the circuit."""
        if self._client.ready:
            return
        lock = self._ready_lock
        if lock is None:
            raise RemoteUnavailable("mooncake: connector not open")
        async with lock:
            if self._client.ready:
                return
            future = self._pool.submit(functools.partial(self._client.call, _nothing))
            try:
                await asyncio.shield(future)
            except asyncio.CancelledError:
                future.add_done_callback(_retrieve)
                raise
            except RemoteUnavailable as exc:
                self._trip(str(exc))
                raise

    async def _abandonable(self, call: Callable[[Any], _T], *, probe: bool = False) -> _T:
        """``call(store)``, a master round trip, on the pool. A caller cancelled meanwhile leaves
        at once (nothing of its is lent), the call finishing on its thread; the call trips the
        circuit if still running after ``stall_s``, which releases its callers. ``probe``: the
        circuit's own probe, let through while the circuit is open."""
        if not probe:
            self._check_usable()
        await self._ensure_ready()
        if not probe:
            self._check_usable()
        loop = asyncio.get_running_loop()
        job = self._pool.submit(functools.partial(self._client.call, call))
        self._master_calls += 1
        waiter: asyncio.Future[_T] = loop.create_future()
        self._gated.add(waiter)

        def settle(job: asyncio.Future[_T]) -> None:
            self._master_calls -= 1
            error = None if job.cancelled() else job.exception()
            if waiter.done():
                return
            if job.cancelled():
                waiter.cancel()
            elif error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(job.result())

        job.add_done_callback(settle)
        stall = loop.call_later(self._stall_s, self._stalled, job)
        try:
            return await waiter
        except asyncio.CancelledError:
            if not job.done():
                self._counters["abandoned_calls"] += 1
            raise
        finally:
            stall.cancel()
            self._gated.discard(waiter)

    def _stalled(self, job: asyncio.Future[Any]) -> None:
        if not job.done():
            self._counters["stalled_calls"] += 1
            self._trip(f"a master round trip still running after {self._stall_s:.2f}s")

    async def _lent(self, call: Callable[[Any], _T]) -> _T:
        """``call(store)`` on the pool, lending the caller's buffers: waited for when cancelled.
        Never a stall when long (a batch of large transfers is)."""
        await self._ensure_ready()
        return await self._pool.run(functools.partial(self._client.call, call))

    def _check_master_codes(self, codes: Sequence[int], what: str) -> None:
        """When ``codes`` say the master did not answer: trip the circuit and raise
        `RemoteDown` (the request is a miss like those refused after it)."""
        for code in codes:
            if code in MASTER_UNREACHABLE:
                reason = f"{what}: code {code}"
                self._trip(reason)
                raise RemoteDown(f"mooncake: master down ({reason})")

    def _trip(self, reason: str) -> None:
        """Open the circuit and release every caller waiting on a master round trip."""
        if self._closed:
            return
        self._circuit.trip(reason)
        for waiter in list(self._gated):
            if not waiter.done():
                waiter.set_exception(RemoteDown(f"mooncake: master down ({reason})"))

    async def _probe(self) -> bool:
        """Whether the master answers: its port accepts a connection (no Mooncake call waits on
        a master that is down), then it answers one ``batch_is_exist``; never while an earlier
        master round trip still runs (threads never pile up behind a hung master)."""
        if self._master_calls:
            return False
        host, port = _master_address(self.options.master)
        try:
            async with asyncio.timeout(min(PROBE_CONNECT_S, self.timeout_s)):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        name = f"{self.key_prefix}:probe"
        async with asyncio.timeout(self.timeout_s):
            codes = await self._abandonable(lambda store: store.batch_is_exist([name]), probe=True)
        return all(code >= 0 for code in codes)


def _nothing(store: Any) -> None:
    """A call that only sets the client up."""


def _fail(batch: Sequence[_Request[Any]], exc: BaseException) -> None:
    """Fail the batch's requests still waiting (a cancelled loop: the connector is closing)."""
    error = exc if isinstance(exc, Exception) else RemoteUnavailable("mooncake: connector closed")
    for request in batch:
        if not request.future.done():
            request.future.set_exception(error)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
