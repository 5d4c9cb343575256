"""`SyncTieredKVEngine`: the blocking facade of `TieredKVEngine`, for callers without a loop.

Owns `LoopThread` (an event loop, uvloop when installed, on a thread of its own: the engine's
here, the tiers' in the SGLang backend) and `SyncPrefetchHandle`. Each blocking verb is made
from the async engine's method of the same name (`_blocking`, `_on_loop`), so its signature,
types and docstring are written once, on `TieredKVEngine`; except the verbs that take or give a
handle (`prefetch`, `retrieve`, `retrieve_layerwise`, `store_layerwise`), whose blocking handle
changes one parameter's or the result's type, which a `ParamSpec` cannot express: those are
written out, and a test keeps their parameters those of the async verbs. Must not hold engine
state of its own: every call runs on the engine's loop.

A facade still open when the interpreter exits (a script that just ends, as vLLM's scripts do)
is closed by an ``atexit`` hook: pending lower-tier writes are flushed within
``close_timeout_s`` or counted as dropped, and nothing raises from the hook.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, Concatenate, ParamSpec, TypeVar

from tiered_kv.config import EngineConfig, PrefetchPolicy
from tiered_kv.engine import TieredKVEngine
from tiered_kv.errors import EngineStateError
from tiered_kv.gpu.base import KVMover
from tiered_kv.keys import KeySalt, TokenIds
from tiered_kv.layerwise_store import LayerwiseStore
from tiered_kv.prefetch import PrefetchHandle
from tiered_kv.retrieval import LayerwiseRetrieve, RetrieveResult
from tiered_kv.tiers.base import LowerTier

_P = ParamSpec("_P")
_T = TypeVar("_T")

logger = logging.getLogger(__name__)
# Strong references: a facade its owner dropped without closing still has a running loop and
# writes to flush, so the exit hook must still find it. `close` takes it out.
_open_facades: set[SyncTieredKVEngine] = set()


@atexit.register
def _close_at_exit() -> None:
    """Close every facade its owner left open; a failure is logged, never raised."""
    for facade in list(_open_facades):
        try:
            facade.close()
        except Exception:
            logger.warning("tiered_kv: closing an engine at exit failed", exc_info=True)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed, else the stdlib loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


# Beyond a call's own timeout, how long `LoopThread.run` waits for the loop to finish cancelling.
_CANCEL_GRACE_S = 30.0


class LoopThread:
    """An event loop (`new_event_loop`) running on a daemon thread named ``name``, for callers
    that have no loop. Started by the constructor, stopped by `close` (idempotent). `run`
    submits a coroutine from any other thread and waits for it; its timeout is enforced on the
    loop (the coroutine is cancelled there and has finished before `run` returns), so a
    caller's buffers are never touched after `run` returns. Refuses calls from the loop's own
    thread (they would deadlock)."""

    def __init__(self, name: str) -> None:
        self._loop = new_event_loop()
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None = None) -> _T:
        """Run ``coro`` on the loop and return its result; `TimeoutError` after ``timeout_s``
        (the coroutine is cancelled and finished by then); its own exceptions propagate."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise EngineStateError("LoopThread.run: called from the loop's own thread")
        with self._lock:
            if self._closed:
                coro.close()
                raise EngineStateError("LoopThread.run: the loop is closed")
            bounded = coro if timeout_s is None else _bounded(coro, timeout_s)
            future = asyncio.run_coroutine_threadsafe(bounded, self._loop)
        return future.result(None if timeout_s is None else timeout_s + _CANCEL_GRACE_S)

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Queue ``fn(*args)`` onto the loop; returns at once."""
        self._loop.call_soon_threadsafe(fn, *args)

    def close(
        self, final: Coroutine[Any, Any, object] | None = None, timeout_s: float | None = None
    ) -> None:
        """Run ``final`` (e.g. closing what runs on the loop; its exception propagates), then
        stop the loop and join its thread. Later calls do nothing (``final`` is closed
        unawaited)."""
        with self._lock:
            if self._closed:
                if final is not None:
                    final.close()
                return
            self._closed = True
        try:
            if final is not None:
                bounded = final if timeout_s is None else _bounded(final, timeout_s)
                wait = None if timeout_s is None else timeout_s + _CANCEL_GRACE_S
                asyncio.run_coroutine_threadsafe(bounded, self._loop).result(wait)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_CANCEL_GRACE_S)


async def _bounded(coro: Coroutine[Any, Any, _T], timeout_s: float) -> _T:
    async with asyncio.timeout(timeout_s):
        return await coro


def _blocking(
    method: Callable[Concatenate[TieredKVEngine, _P], Coroutine[Any, Any, _T]],
) -> Callable[Concatenate[SyncTieredKVEngine, _P], _T]:
    """The blocking twin of an async engine verb: same parameters, same docstring."""

    @functools.wraps(method)
    def verb(facade: SyncTieredKVEngine, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return facade._call(method(facade._engine, *args, **kwargs))

    return verb


def _on_loop(
    method: Callable[Concatenate[TieredKVEngine, _P], _T],
) -> Callable[Concatenate[SyncTieredKVEngine, _P], _T]:
    """A plain engine method run on the engine's loop (it reads or changes loop-owned state)."""

    @functools.wraps(method)
    def verb(facade: SyncTieredKVEngine, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return facade._run_on_loop(functools.partial(method, facade._engine, *args, **kwargs))

    return verb


class SyncTieredKVEngine:
    """Blocking facade: the engine's loop (uvloop when present) runs in its own thread.

    Same verbs as `TieredKVEngine`, for callers without an event loop. Thread-safe: calls from
    several threads are serialized onto the engine's loop.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        mover: KVMover | None = None,
        lower_tiers: Sequence[LowerTier] = (),
    ) -> None:
        self._loop = LoopThread("tiered-kv-loop")
        self._engine = TieredKVEngine(config, mover=mover, lower_tiers=lower_tiers)
        self._closed = False
        try:
            self._call(self._engine.open())
        except BaseException:
            self._loop.close()
            raise
        _open_facades.add(self)

    @property
    def engine(self) -> TieredKVEngine:
        return self._engine

    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self._closed:
            coro.close()
            raise EngineStateError("SyncTieredKVEngine is closed")
        return self._loop.run(coro)

    def _run_on_loop(self, fn: Callable[[], _T]) -> _T:
        async def run() -> _T:
            return fn()

        return self._call(run())

    register_kv_caches = _on_loop(TieredKVEngine.register_kv_caches)
    store = _blocking(TieredKVEngine.store)
    lookup = _blocking(TieredKVEngine.lookup)
    flush = _blocking(TieredKVEngine.flush)
    evict_l1 = _blocking(TieredKVEngine.evict_l1)
    stats = _on_loop(TieredKVEngine.stats)

    def prefetch(
        self,
        token_ids: TokenIds,
        *,
        model_name: str | None = None,
        salt: KeySalt | None = None,
        from_token: int = 0,
        worth_loading: bool = False,
    ) -> SyncPrefetchHandle:
        """`TieredKVEngine.prefetch` behind a blocking handle."""
        handle = self._engine.prefetch(
            token_ids,
            model_name=model_name,
            salt=salt,
            from_token=from_token,
            worth_loading=worth_loading,
        )
        return SyncPrefetchHandle(self, self._call(handle))

    def retrieve(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        skip_prefix_tokens: int = 0,
        model_name: str | None = None,
        policy: PrefetchPolicy | None = None,
        salt: KeySalt | None = None,
        prefetch: SyncPrefetchHandle | None = None,
    ) -> RetrieveResult:
        """`TieredKVEngine.retrieve`; ``prefetch`` (closed by it) as there."""
        return self._call(
            self._engine.retrieve(
                token_ids,
                block_ids,
                skip_prefix_tokens=skip_prefix_tokens,
                model_name=model_name,
                policy=policy,
                salt=salt,
                prefetch=None if prefetch is None else prefetch._hand_over(),
            )
        )

    def retrieve_layerwise(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        skip_prefix_tokens: int = 0,
        model_name: str | None = None,
        policy: PrefetchPolicy | None = None,
        salt: KeySalt | None = None,
        prefetch: SyncPrefetchHandle | None = None,
    ) -> SyncLayerwiseRetrieve:
        """`TieredKVEngine.retrieve_layerwise` behind a blocking handle (``wait_layer`` from
        any thread, as on the async one)."""
        load = self._call(
            self._engine.retrieve_layerwise(
                token_ids,
                block_ids,
                skip_prefix_tokens=skip_prefix_tokens,
                model_name=model_name,
                policy=policy,
                salt=salt,
                prefetch=None if prefetch is None else prefetch._hand_over(),
            )
        )
        return SyncLayerwiseRetrieve(self, load)

    def store_layerwise(
        self,
        token_ids: TokenIds,
        block_ids: Sequence[int],
        *,
        model_name: str | None = None,
        salt: KeySalt | None = None,
    ) -> SyncLayerwiseStore:
        """`TieredKVEngine.store_layerwise` behind a blocking handle (``save_layer`` from the
        model's thread; ``commit`` / ``abort`` block)."""
        saver = self._call(
            self._engine.store_layerwise(token_ids, block_ids, model_name=model_name, salt=salt)
        )
        return SyncLayerwiseStore(self, saver)

    def close(self) -> None:
        if self._closed:
            return
        _open_facades.discard(self)
        self._closed = True
        self._loop.close(self._engine.aclose())

    def __enter__(self) -> SyncTieredKVEngine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SyncPrefetchHandle:
    """Blocking twin of `PrefetchHandle`; every call hops to the engine's loop. Its owner ends
    it with `close` (or ``with handle:``), or hands it to a retrieve, which closes it."""

    def __init__(self, owner: SyncTieredKVEngine, handle: PrefetchHandle) -> None:
        self._owner = owner
        self._handle: PrefetchHandle | None = handle
        self.hit_tokens = handle.hit_tokens

    def _require(self) -> PrefetchHandle:
        if self._handle is None:
            raise EngineStateError("SyncPrefetchHandle: already closed")
        return self._handle

    def _hand_over(self) -> PrefetchHandle:
        """The async handle, for the retrieve that will close it; this one is closed now."""
        handle = self._require()
        self._handle = None
        return handle

    def done(self) -> bool:
        return self._owner._run_on_loop(self._require().done)

    def ready_tokens(self) -> int:
        return self._owner._run_on_loop(self._require().ready_tokens)

    def wait(self, timeout: float | None = None) -> int:
        """Block until the loads finish (at most ``timeout`` seconds); returns ready tokens."""
        return self._owner._call(self._require().wait(timeout))

    def close(self) -> None:
        """Free the reservations. Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None and not self._owner._closed:
            self._owner._run_on_loop(handle.close)

    def __enter__(self) -> SyncPrefetchHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SyncLayerwiseRetrieve:
    """Blocking twin of `LayerwiseRetrieve`: ``wait_layer`` as there, ``wait`` blocks."""

    def __init__(self, owner: SyncTieredKVEngine, load: LayerwiseRetrieve) -> None:
        self._owner = owner
        self._load = load
        self.result = load.result
        self.num_layers = load.num_layers

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        self._load.wait_layer(layer, stream)

    def wait_all(self, stream: Any = None) -> None:
        self._load.wait_all(stream)

    def done(self) -> bool:
        return self._load.done()

    def enqueued(self) -> None:
        self._owner._call(self._load.enqueued())

    def wait(self) -> None:
        self._owner._call(self._load.wait())


class SyncLayerwiseStore:
    """Blocking twin of `LayerwiseStore`: ``save_layer`` as there (from any thread),
    ``commit`` and ``abort`` block."""

    def __init__(self, owner: SyncTieredKVEngine, saver: LayerwiseStore) -> None:
        self._owner = owner
        self._saver = saver
        self.new_tokens = saver.new_tokens
        self.num_layers = saver.num_layers

    def save_layer(self, layer: int, stream: Any = None) -> None:
        self._saver.save_layer(layer, stream)

    def commit(self) -> int:
        return self._owner._call(self._saver.commit())

    def abort(self) -> None:
        self._owner._call(self._saver.abort())
