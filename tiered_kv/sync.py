"""`SyncTieredKVEngine`: the blocking facade of `TieredKVEngine`, for callers without a loop.

Owns the engine's event loop (uvloop when installed, `new_event_loop`) and the thread that runs
it, and `SyncPrefetchHandle`. Each blocking verb is made from the async engine's method of the
same name (`_blocking`, `_on_loop`), so its signature, types and docstring are written once, on
`TieredKVEngine`; except the verbs that take or give a handle (`prefetch`, `retrieve`,
`retrieve_layerwise`, `store_layerwise`), whose blocking handle changes one parameter's or the
result's type, which a `ParamSpec` cannot express: those are written out, and a test keeps their
parameters those of the async verbs. Must not hold engine state of its own: every call runs on
the engine's loop.

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
        self._loop = new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="tiered-kv-loop", daemon=True
        )
        self._thread.start()
        self._engine = TieredKVEngine(config, mover=mover, lower_tiers=lower_tiers)
        self._closed = False
        try:
            self._call(self._engine.open())
        except BaseException:
            self._stop_loop()
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
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

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
