"""Progress of a long run (the demo, the benchmarks): a live tqdm bar on a terminal, a few plain
lines otherwise (CI logs), and detail lines printed above the bar. Never part of a timed region."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

_DEFAULT_SIZE = os.terminal_size((80, 24))


def _reports_no_size(stream: TextIO) -> bool:
    """A terminal whose size was never set (a bare pty: `script`, `docker exec -t`) reports
    0 x 0, and tqdm then draws nothing at all."""
    try:
        size = os.get_terminal_size(stream.fileno())
        return size.columns == 0 or size.lines == 0
    except (AttributeError, OSError, ValueError):
        return False


def print_line(line: str, file: TextIO | None = None) -> None:
    """Print ``line`` to ``file`` (default stdout), above any live bar (which is redrawn)."""
    from tqdm import tqdm

    target = sys.stdout if file is None else file
    tqdm.write(line, file=target)
    target.flush()


class Progress:
    """A live progress bar (tqdm) on a terminal; at most ``plain_lines`` plain lines otherwise.

    ``advance(note)`` marks one step done. ``write(line)`` prints a line of detail: above the
    bar on a terminal (the bar is redrawn under it), as is otherwise. Call from one thread."""

    def __init__(
        self, total: int, label: str, stream: TextIO = sys.stderr, plain_lines: int = 4
    ) -> None:
        if plain_lines < 1:
            raise ValueError(f"plain_lines must be at least 1, got {plain_lines}")
        self.total = max(total, 1)
        self.label = label
        self.stream = stream
        self.plain_lines = plain_lines
        self.done = 0
        self._last_line = -1
        self._bar: Any = None
        if stream.isatty():
            from tqdm import tqdm

            unsized = _reports_no_size(stream)
            self._bar = tqdm(
                total=self.total,
                desc=label,
                file=stream,
                leave=True,
                unit="step",
                ncols=_DEFAULT_SIZE.columns if unsized else None,
                nrows=_DEFAULT_SIZE.lines if unsized else None,
            )

    def advance(self, note: str = "") -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(1)
            if self.done >= self.total:
                self.close()
            return
        line = int(self.plain_lines * self.done / self.total)
        if line > self._last_line:
            self._last_line = line
            tail = f" {note}" if note else ""
            self.stream.write(f"{self.label}: {self.done}/{self.total}{tail}\n")
            self.stream.flush()

    def write(self, line: str, file: TextIO | None = None) -> None:
        """One line of detail to ``file`` (default: the progress stream)."""
        print_line(line, self.stream if file is None else file)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
