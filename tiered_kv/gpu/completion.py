"""Turning "the GPU reached this event" into an asyncio result: no blocked loop, no spinning core.

Owns `TransferClock` (when a queue of transfers should end, from the fastest rate seen) and
`CompletionWaiter` (one daemon thread per mover that sleeps until just before a submission's
predicted end, then polls its event and runs its callback on its loop with
``call_soon_threadsafe``). Why not blocking-sync events or host functions, and the wake-up
latencies behind the lead times: docs/architecture.md, "Completion".

Rules: the thread never blocks in the driver (it polls ``query``); it calls into a loop only
through ``call_soon_threadsafe``; near a non-awaited call's predicted end it pokes that loop with
a no-op every `PREWAKE_S` (`PREWAKE_LEAD_S` ahead) so the loop is awake for the delivery; a
submission with an early callback (``early``: its submitter watches the event itself from then
on) gets that callback once and no pokes; a withdrawn submission is never delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

POLL_S = 20e-6  # poll interval near the predicted end
POLL_MAX_S = 500e-6  # for calls far behind their prediction (waiting on a busy caller stream)
LATE_FRACTION = 0.25  # ... beyond this share of the predicted duration, plus LATE_GRACE_S
LATE_GRACE_S = 1e-3
EARLY_FRACTION = 0.95  # polling starts at this share of the predicted duration
PREWAKE_LEAD_S = 400e-6  # loop pokes start this long before the predicted end
PREWAKE_S = 100e-6  # ... and repeat this often until the call is seen done (or found late)


class Pollable(Protocol):
    def query(self) -> bool: ...


class TransferClock:
    """Predicts when one queue of transfers (a direction of a device) finishes, at the fastest
    rate seen so far (lowered by ``decay`` per call, so a link that got slower for good is
    relearnt over a few hundred calls). A prediction at the fastest rate errs early, which costs
    a few polls; a slower, average one would err late, which costs latency. Until the first
    observation the rate is ``initial_rate``, above any PCIe link's."""

    def __init__(self, initial_rate: float = 128e9, decay: float = 0.999) -> None:
        if initial_rate <= 0:
            raise ValueError(f"TransferClock: initial rate must be > 0, got {initial_rate}")
        if not 0 < decay <= 1:
            raise ValueError(f"TransferClock: decay must be in (0, 1], got {decay}")
        self.rate = initial_rate
        self.decay = decay
        self.busy_until = 0.0
        self.observed = False

    def schedule(self, nbytes: int, now: float) -> tuple[float, float]:
        """(predicted start, predicted seconds) of ``nbytes`` queued at ``now`` behind the calls
        scheduled before."""
        start = max(now, self.busy_until)
        seconds = nbytes / self.rate
        self.busy_until = start + seconds
        return start, seconds

    def observe(self, nbytes: int, gpu_seconds: float) -> None:
        """A finished call's bytes and GPU time (from timing events that bracket all its work,
        so the rate is never overstated)."""
        if gpu_seconds <= 0 or nbytes <= 0:
            return
        sample = nbytes / gpu_seconds
        self.rate = max(self.rate * self.decay, sample) if self.observed else sample
        self.observed = True


@dataclasses.dataclass(eq=False, slots=True)
class _Pending:
    event: Pollable
    next_poll: float
    next_poke: float
    late_at: float
    interval: float
    loop: asyncio.AbstractEventLoop
    callback: Callable[[float, BaseException | None], None]
    error: BaseException | None = None
    early_at: float = math.inf
    early: Callable[[], None] | None = None

    @property
    def next_due(self) -> float:
        return min(self.next_poll, self.next_poke, self.early_at)


class CompletionWaiter:
    """One daemon thread that polls submitted events near their predicted ends and runs each
    one's callback on its loop once the event completes. Submissions of any number of calls
    share the thread; each call is polled on its own schedule."""

    def __init__(self, name: str = "tkv-cuda-wait") -> None:
        self.name = name
        self._cond = threading.Condition()
        self._pending: list[_Pending] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.polls = 0  # event queries made (a measure of the CPU spent waiting)
        self.pokes = 0  # no-op wake-ups sent to loops

    def submit(
        self,
        event: Pollable,
        start: float,
        predicted_s: float,
        loop: asyncio.AbstractEventLoop,
        callback: Callable[[float, BaseException | None], None],
        *,
        early: Callable[[], None] | None = None,
        early_at: float = math.inf,
    ) -> object:
        """Run ``callback(seen, None)`` on ``loop`` once ``event.query()`` is true; ``seen`` is
        the ``time.perf_counter()`` at which the thread saw it. If the query raises (a CUDA
        error), ``callback(seen, error)`` instead. The call is predicted to run from ``start``
        for ``predicted_s`` (see `TransferClock`). ``early``, if given, runs on ``loop`` once,
        at ``early_at`` (perf_counter seconds) unless the event was seen before, and the loop
        gets no pokes (its submitter watches the event from then on). Returns a handle for
        `withdraw`."""
        end = start + predicted_s
        poll_at = start + EARLY_FRACTION * predicted_s
        late_at = poll_at + LATE_FRACTION * predicted_s + LATE_GRACE_S
        pending = _Pending(event, poll_at, end - PREWAKE_LEAD_S, late_at, POLL_S, loop, callback)
        if early is not None:  # the loop wakes for it and watches: no pokes
            pending.early, pending.early_at = early, early_at
            pending.next_poke = math.inf
        with self._cond:
            if self._closed:
                raise RuntimeError("CompletionWaiter is closed")
            self._pending.append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return pending

    def withdraw(self, handle: object) -> bool:
        """Stop watching a submission whose event its submitter saw complete itself. Returns
        False if the thread has already taken it (its callback runs, or has run, regardless)."""
        with self._cond:
            try:
                self._pending.remove(handle)  # type: ignore[arg-type]
            except ValueError:
                return False
            return True

    def close(self) -> None:
        """Stop the thread once nothing is pending (callbacks of pending events still run)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @property
    def pending(self) -> int:
        with self._cond:
            return len(self._pending)

    def _main(self) -> None:
        _precise_timers()
        while True:
            with self._cond:
                while True:
                    if not self._pending:
                        if self._closed:
                            return
                        self._cond.wait()
                        continue
                    now = time.perf_counter()
                    wake = min(p.next_due for p in self._pending)
                    if wake <= now:
                        break
                    self._cond.wait(wake - now)
                due = [p for p in self._pending if p.next_due <= now]
            finished = []
            for p in due:
                if p.early_at <= now:
                    p.early_at = math.inf
                    _post(p.loop, p.early)
                if p.next_poke <= now:
                    self.pokes += 1
                    p.next_poke = now + PREWAKE_S
                    _poke(p.loop)
                if p.next_poll > now:
                    continue
                self.polls += 1
                try:
                    done = p.event.query()
                except Exception as exc:  # a GPU fault: the call will never complete
                    p.error = exc
                    done = True
                if done:
                    finished.append(p)
                elif now < p.late_at:
                    p.next_poll = now + p.interval
                else:  # far behind the prediction: back off (to POLL_MAX_S late), stop poking
                    p.interval = min(POLL_MAX_S, 2 * p.interval)
                    p.next_poll = now + p.interval
                    p.next_poke = math.inf
            if not finished:
                continue
            seen = time.perf_counter()
            with self._cond:
                self._pending = [p for p in self._pending if p not in finished]
            for p in finished:
                _deliver(p, seen)


def _noop() -> None:
    pass


def _poke(loop: asyncio.AbstractEventLoop) -> None:
    _post(loop, _noop)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[[], None] | None) -> None:
    if fn is None:
        return
    with contextlib.suppress(RuntimeError):  # closed: `_deliver` falls back to this thread
        loop.call_soon_threadsafe(fn)


def _deliver(pending: _Pending, seen: float) -> None:
    try:
        pending.loop.call_soon_threadsafe(pending.callback, seen, pending.error)
    except RuntimeError:
        # The loop is closed: nobody awaits the result any more, but the callback still has
        # references to release. Nothing else runs on that loop, so running it here is safe.
        pending.callback(seen, pending.error)


def _precise_timers() -> None:
    """Linux's default 50 µs timer slack would stretch every poll interval; ask for 1 µs
    (this thread only). Elsewhere, or if refused, polls are just coarser."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, nanoseconds
    except (OSError, AttributeError):
        pass
