"""`GpuPrefillTimer`: how long a serving engine's forward pass ran on the GPU, for the recompute
model (`TieredKVEngine.observe_prefill`), without ever synchronizing the engine's thread.

On CUDA the forward's kernels are still queued when the host reaches its end, so the host's
wall time says nothing. The timer records a timing event on the current stream where the
forward begins (`begin`) and another where the host has enqueued all of it (`end`); their GPU
times are read later (`poll`, at the next step), once the end event has completed. The time
between the events is the forward's time on the GPU, including any wait for the host to launch
it (a launch-bound prefill costs that too).

Measurements wait at most `MAX_PENDING` deep (the oldest is dropped): a GPU that runs that far
behind has nothing to report soon anyway.
"""

from __future__ import annotations

from collections import deque

import torch

MAX_PENDING = 16


class GpuPrefillTimer:
    """Times forward passes of one CUDA device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"GpuPrefillTimer: expected a CUDA device, got {device}")
        self.device = device
        self._started: torch.cuda.Event | None = None
        self._shape: tuple[int, int] | None = None
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event, tuple[int, int]]] = deque()
        self.dropped = 0  # measurements dropped unread (more than MAX_PENDING behind)

    def begin(self, new_tokens: int, prefix_tokens: int) -> None:
        """The forward of a prefill of ``new_tokens`` over ``prefix_tokens`` resident ones is
        about to be enqueued on the current stream."""
        started = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        started.record(torch.cuda.current_stream(self.device))
        self._started, self._shape = started, (new_tokens, prefix_tokens)

    def end(self) -> None:
        """The host has enqueued the forward begun (nothing when none was begun)."""
        started, shape = self._started, self._shape
        self._started = self._shape = None
        if started is None or shape is None:
            return
        ended = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        ended.record(torch.cuda.current_stream(self.device))
        self._pending.append((started, ended, shape))
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1

    def poll(self) -> list[tuple[int, int, float]]:
        """(new tokens, prefix tokens, seconds) of every timed forward the GPU has finished, in
        order; never waits."""
        done = []
        while self._pending and self._pending[0][1].query():  # type: ignore[no-untyped-call]
            started, ended, (new_tokens, prefix_tokens) = self._pending.popleft()
            seconds = started.elapsed_time(ended) / 1e3
            if seconds > 0:
                done.append((new_tokens, prefix_tokens, seconds))
        return done

    @property
    def pending(self) -> int:
        return len(self._pending)
