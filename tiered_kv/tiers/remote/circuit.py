"""`Circuit`: a remote store noticed down once, every request after it refused at once.

Owns the state of one store's reachability (``closed``: requests go through; ``open``: they fail
with `RemoteDown` before any I/O), the background task that probes the store while the circuit
is open, and the counters. A connector trips it on evidence that the store does not answer (a
connection-level error code, a round trip past its stall limit, a failed set-up); the probe
closes it when the store answers again. The log says once when it opens and once when it closes.

Must not: know what a probe does (the connector gives it), retry a refused request, or hold
buffers. Threads: loop-only (the connector's loop); the probe task is the circuit's own and
`aclose` cancels and waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Literal

from tiered_kv.errors import RemoteDown

logger = logging.getLogger(__name__)

CircuitState = Literal["closed", "open"]

PROBE_BACKOFF_S = (0.25, 2.0)  # the first wait between probes and the largest (it doubles)


class Circuit:
    """The reachability of the store named ``name``; ``probe`` (a bound method of the circuit's
    owner, held weakly so that probing never keeps a dropped owner alive) answers whether it is
    back (it may raise, which counts as no; it is bounded by its own deadline)."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], Awaitable[bool]],
        *,
        backoff_s: tuple[float, float] = PROBE_BACKOFF_S,
    ) -> None:
        self.name = name
        self._probe = weakref.WeakMethod(probe)
        self._backoff = backoff_s
        self.state: CircuitState = "closed"
        self.reason = ""
        self._opened_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._closed_for_good = False
        self.counters = dict.fromkeys(
            ("circuit_opens", "circuit_closes", "refused_down", "probes", "down_seconds"), 0.0
        )

    @property
    def is_open(self) -> bool:
        return self.state == "open"

    def check(self) -> None:
        """Raise `RemoteDown` (counted) while the circuit is open; nothing otherwise."""
        if self.state == "open":
            self.counters["refused_down"] += 1
            raise RemoteDown(f"{self.name}: down since {self.reason}; a probe is retrying")

    def trip(self, reason: str) -> None:
        """Open the circuit (once; later trips while open change nothing) and start probing."""
        if self.state == "open" or self._closed_for_good:
            return
        self.state = "open"
        self.reason = reason
        self._opened_at = time.monotonic()
        self.counters["circuit_opens"] += 1
        logger.warning(
            "%s: circuit open (%s); requests are misses until a probe finds it answering",
            self.name,
            reason,
        )
        self._task = asyncio.get_running_loop().create_task(
            self._probe_until_closed(), name=f"{self.name} probe"
        )

    async def _probe_until_closed(self) -> None:
        wait, largest = self._backoff
        while True:
            await asyncio.sleep(wait)
            wait = min(largest, wait * 2)
            probe = self._probe()
            if probe is None:  # the owner is gone
                return
            self.counters["probes"] += 1
            try:
                answered = await probe()
            except Exception:  # a probe that fails is a "not yet"
                logger.debug("%s: probe failed", self.name, exc_info=True)
                answered = False
            del probe
            if answered:
                break
        down = time.monotonic() - self._opened_at
        self.counters["down_seconds"] += down
        self.counters["circuit_closes"] += 1
        self.state = "closed"
        self._task = None
        logger.warning("%s: circuit closed; the store answers again after %.1fs", self.name, down)

    def stats(self) -> dict[str, int | float]:
        down = self.counters["down_seconds"]
        if self.state == "open":
            down += time.monotonic() - self._opened_at
        return {
            "circuit_open": int(self.state == "open"),
            "circuit_opens": int(self.counters["circuit_opens"]),
            "circuit_closes": int(self.counters["circuit_closes"]),
            "refused_down": int(self.counters["refused_down"]),
            "probes": int(self.counters["probes"]),
            "down_seconds": down,
        }

    async def aclose(self) -> None:
        """Stop probing (the state stays as it is); idempotent."""
        self._closed_for_good = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
