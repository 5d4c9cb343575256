"""`BlockingPool`: a bounded set of threads that a data plane owns, for its blocking I/O.

Owns its worker threads (started lazily up to ``threads``, named after the pool) and a queue of
jobs. A coroutine hands a job over with `run` and awaits its result, which comes back to the
loop with ``call_soon_threadsafe``; `run_all` hands over several parts of one job, which run on
as many threads at once and wake the loop once, when the last ends. Not the loop's default
executor, and not `concurrent.futures`: those refuse new work once the interpreter starts
shutting down, so an engine closed from an ``atexit`` hook (a script that just ends) could not
flush its writes.

Cancellation: a job not yet started is dropped; a running job gets its ``abort`` event set (the
job checks it between steps) and `run` waits for the thread to finish before re-raising, so a
cancelled caller's buffers are never touched after `run` returns.

Threads: `run` and `aclose` on one event loop; `close` from any thread but a worker's.
Must not know what its jobs do (files, sockets) or hold references to their buffers.

Also owns the exit barrier (`wait_before_exit`): native clients whose library tears itself down
from a C ``atexit`` handler (Mooncake's) must not have a call running when the process exits,
or the teardown frees what the call still uses. The barrier's hook is registered when this
module is imported, before `tiered_kv.sync`'s, so it runs after every facade was closed.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from tiered_kv.errors import ConfigError, EngineStateError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MIN_IO_THREADS = 4
MAX_IO_THREADS = 16


def default_io_threads() -> int:
    """Threads for a data plane sized from the machine: one per core, 4 to 16."""
    return max(MIN_IO_THREADS, min(MAX_IO_THREADS, os.cpu_count() or 1))


def write_threads(read_threads: int) -> int:
    """Threads for a tier's writes beside ``read_threads`` for its reads: a quarter, 2 to 4
    (writes wait on fsync; more of them only queue at the disk)."""
    return max(2, min(4, read_threads // 4))


def check_thread_count(name: str, value: object) -> int:
    """``value`` as a thread count (an int >= 1); `ConfigError` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}: expected an int >= 1, got {value!r}")
    return value


class ExitWaiter(Protocol):
    """What the exit barrier waits for: `wait_at_exit` returns once no native call of its is
    running (or its own bound ran out) and refuses new ones from then on."""

    def wait_at_exit(self) -> None: ...


_exit_waiters: weakref.WeakSet[ExitWaiter] = weakref.WeakSet()


def wait_before_exit(waiter: ExitWaiter) -> None:
    """Have the exit barrier wait for ``waiter`` (held weakly: a waiter that is gone has
    nothing running)."""
    _exit_waiters.add(waiter)


@atexit.register
def _exit_barrier() -> None:
    for waiter in list(_exit_waiters):
        try:
            waiter.wait_at_exit()
        except Exception:
            logger.warning("tiered_kv: waiting for native calls at exit failed", exc_info=True)


class Aborted(Exception):
    """Raised inside a job when its caller was cancelled: stop before the next step."""


def check_abort(abort: threading.Event | None) -> None:
    """Raise `Aborted` when ``abort`` is set (a job's check between steps)."""
    if abort is not None and abort.is_set():
        raise Aborted


@dataclasses.dataclass(slots=True, eq=False)
class _Batch:
    """The parts of one `run_all` job: how many have not ended, and the first error."""

    remaining: int
    results: list[Any]
    error: BaseException | None = None


@dataclasses.dataclass(slots=True, eq=False)
class _Job(Generic[_T]):
    fn: Callable[[], _T]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[_T]
    abort: threading.Event
    started: bool = False
    batch: _Batch | None = None  # a part of a `run_all` job, at ``index`` among its parts
    index: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStats:
    """`BlockingPool.stats()`: its threads and its queue now."""

    threads: int  # started so far (at most the pool's size)
    busy: int  # running a job now
    queued: int  # waiting for a thread


class BlockingPool:
    """Runs blocking jobs on at most ``threads`` threads of its own; see the module docstring."""

    def __init__(self, name: str, threads: int) -> None:
        self.name = name
        self.size = check_thread_count(f"{name} threads", threads)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queue: collections.deque[_Job[Any]] = collections.deque()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._busy = 0
        self._closing = False

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(len(self._threads), self._busy, len(self._queue))

    async def run(self, fn: Callable[[], _T], abort: threading.Event | None = None) -> _T:
        """``fn()`` on one of the pool's threads. Cancellation drops a job not yet started, or
        sets ``abort`` and waits for the running job to end; further cancellations during that
        wait are absorbed and one is re-raised."""
        job = self._enqueue(fn, abort)
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            with self._lock:
                if not job.started:
                    self._queue.remove(job)
                    job.started = True  # never runs now
                    raise
            job.abort.set()
            while not job.future.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait((job.future,))
            if not job.future.cancelled():
                job.future.exception()  # mark retrieved: the cancellation is what the caller sees
            raise

    async def run_all(
        self, fns: Sequence[Callable[[], _T]], abort: threading.Event | None = None
    ) -> list[_T]:
        """Each of ``fns`` on the pool's threads, as many at once as threads are free; their
        results in order, back on the loop once, when the last one ends. When a part raises,
        ``abort`` is set (parts check it between steps) and the first error is raised once
        every started part has ended. Cancellation drops the parts not yet started, sets
        ``abort`` and waits for the running ones to end, as `run` does."""
        if not fns:
            return []
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[_T]] = loop.create_future()
        batch = _Batch(len(fns), [None] * len(fns))
        event = abort or threading.Event()
        jobs = [
            _Job(fn, loop, future, event, batch=batch, index=index)  # type: ignore[arg-type]
            for index, fn in enumerate(fns)
        ]
        self._enqueue_jobs(jobs)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            with self._lock:
                for job in jobs:
                    if not job.started:
                        self._queue.remove(job)
                        job.started = True  # never runs now
                        batch.remaining -= 1
                running = batch.remaining
            event.set()
            if running:
                while not future.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait((future,))
                if not future.cancelled():
                    future.exception()  # mark retrieved: the cancellation is what the caller sees
            raise

    def submit(self, fn: Callable[[], _T]) -> asyncio.Future[_T]:
        """``fn()`` on one of the pool's threads; the future (of the running loop) gets its
        result. Cancelling the future does not stop the job: callers that lend buffers to
        ``fn`` release them in the future's done callback (or use `run`)."""
        return self._enqueue(fn, None).future

    def _enqueue(self, fn: Callable[[], _T], abort: threading.Event | None) -> _Job[_T]:
        loop = asyncio.get_running_loop()
        job: _Job[_T] = _Job(fn, loop, loop.create_future(), abort or threading.Event())
        self._enqueue_jobs([job])
        return job

    def _enqueue_jobs(self, jobs: Sequence[_Job[Any]]) -> None:
        with self._lock:
            if self._closing:
                raise EngineStateError(f"{self.name}: the pool is closed")
            for job in jobs:
                self._queue.append(job)
                # A thread counted idle here has not been woken yet: each wake-up takes one
                # off, so a burst of jobs wakes as many threads (or starts new ones), never
                # one twice.
                if self._idle:
                    self._idle -= 1
                    self._work.notify()
                elif len(self._threads) < self.size:
                    self._start_thread()

    def _start_thread(self) -> None:
        thread = threading.Thread(
            target=self._serve, name=f"{self.name}-{len(self._threads)}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closing:
                    self._idle += 1  # the waker takes it off again
                    self._work.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                job.started = True
                self._busy += 1
            result, error = None, None
            try:
                result = job.fn()
            except BaseException as exc:
                error = exc
            if job.batch is None:
                self._settle(job, result, error)
            else:
                self._part_ended(job, job.batch, result, error)
            with self._lock:
                self._busy -= 1

    def _part_ended(
        self, job: _Job[Any], batch: _Batch, result: Any, error: BaseException | None
    ) -> None:
        with self._lock:
            batch.remaining -= 1
            last = not batch.remaining
            if error is not None and batch.error is None:
                batch.error = error
                job.abort.set()  # the other parts stop at their next check
            else:
                batch.results[job.index] = result
        if last:
            self._settle(job, batch.results, batch.error)

    @staticmethod
    def _settle(job: _Job[Any], result: Any, error: BaseException | None) -> None:
        def settle() -> None:
            if job.future.done():  # cancelled by a `submit` caller
                return
            if error is not None:
                job.future.set_exception(error)
            else:
                job.future.set_result(result)

        # A closed loop: its caller is gone, and nothing waits for the result.
        with contextlib.suppress(RuntimeError):
            job.loop.call_soon_threadsafe(settle)

    def close(self, timeout: float | None = None) -> bool:
        """Refuse new jobs, let queued ones run, and join the threads (at most ``timeout``
        seconds in all). True when every thread ended. Idempotent."""
        with self._lock:
            self._closing = True
            self._work.notify_all()
            threads = list(self._threads)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            if thread is threading.current_thread():
                raise EngineStateError(f"{self.name}: close() from one of its own threads")
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        alive = [thread.name for thread in threads if thread.is_alive()]
        if alive:
            logger.warning("%s: threads still running after close: %s", self.name, alive)
        return not alive

    async def aclose(self, timeout: float | None = None) -> bool:
        """`close` without blocking the loop: the joins run on a thread of their own."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def settle(ended: bool) -> None:
            if not done.done():
                done.set_result(ended)

        def join() -> None:
            ended = self.close(timeout)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, ended)

        closer = threading.Thread(target=join, name=f"{self.name}-close", daemon=True)
        closer.start()
        ended = await asyncio.shield(done)
        closer.join()  # it has handed its answer over: only its return is left
        return ended
