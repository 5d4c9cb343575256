"""`LoopThread`: a private asyncio loop on a thread of its own, for callers that have no loop.

SGLang calls its storage backend synchronously from several cache-controller threads; the tiers
run on one event loop. Owns that loop and its thread: started by the constructor, stopped by
`close` (idempotent). `run` submits a coroutine from any other thread and waits for it; its
timeout is enforced on the loop (the coroutine is cancelled there and has finished, its tier
calls included, before `run` returns), so a caller's buffers are never touched after `run`
returns. Must not be called from the loop's own thread (that would deadlock: refused).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tiered_kv.errors import EngineStateError

_T = TypeVar("_T")

# Beyond a call's own timeout, how long `run` waits for the loop to finish cancelling it.
_CANCEL_GRACE_S = 30.0


class LoopThread:
    """An event loop running on a daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
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

    def run(self, coro: Coroutine[Any, Any, _T], timeout_s: float | None) -> _T:
        """Run ``coro`` on the loop and return its result; `TimeoutError` after ``timeout_s``
        (the coroutine is cancelled and finished by then); its own exceptions propagate."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise EngineStateError("LoopThread.run: called from the loop's own thread")
        with self._lock:
            if self._closed:
                coro.close()
                raise EngineStateError("LoopThread.run: the loop is closed")
            future = asyncio.run_coroutine_threadsafe(_bounded(coro, timeout_s), self._loop)
        wait = None if timeout_s is None else timeout_s + _CANCEL_GRACE_S
        return future.result(wait)

    def close(self, final: Coroutine[Any, Any, object] | None, timeout_s: float) -> None:
        """Run ``final`` (e.g. closing the tiers), then stop the loop and join its thread.
        Safe to call twice; later calls do nothing (``final`` is closed unawaited)."""
        with self._lock:
            if self._closed:
                if final is not None:
                    final.close()
                return
            self._closed = True
        try:
            if final is not None:
                asyncio.run_coroutine_threadsafe(_bounded(final, timeout_s), self._loop).result(
                    timeout_s + _CANCEL_GRACE_S
                )
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_CANCEL_GRACE_S)


async def _bounded(coro: Coroutine[Any, Any, _T], timeout_s: float | None) -> _T:
    async with asyncio.timeout(timeout_s):
        return await coro
