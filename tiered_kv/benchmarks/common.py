"""What the benchmarks share: the error for "cannot run here", percentiles, the engine's loop,
the optional plotting library, a bar chart, and a helper process on a free loopback port (and
how to stop one). No
benchmark logic here."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import Coroutine, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from tiered_kv.errors import TieredKVError
from tiered_kv.sync import new_event_loop

T = TypeVar("T")

DEFAULT_OUT = Path("tiered-kv-bench")


class BenchmarkUnavailable(TieredKVError):
    """A benchmark cannot run as asked on this machine (no CUDA device, no matplotlib)."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0.0 for no values."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_on_engine_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the loop the engine uses (uvloop when installed)."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)


def load_pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or BenchmarkUnavailable naming the extra. Called
    before a run starts, so a missing library costs no benchmark time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise BenchmarkUnavailable(
            f"the plots need matplotlib, which does not import ({exc}); install the 'bench' "
            "extra (pip install 'tiered-kv[bench]', or '.[bench]' in a clone), or pass "
            "--no-plot for the table alone"
        ) from exc
    return plt


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise BenchmarkUnavailable(
            f"needs a CUDA device, and torch {torch.__version__} sees none "
            "(torch.cuda.is_available() is False); it has no CPU part. The CPU benchmarks are "
            "`tiered-kv bench workload` and `tiered-kv bench remote`."
        )


def bar_chart(
    plt: Any,
    path: Path,
    title: str,
    labels: Sequence[str],
    series: dict[str, Sequence[float | None]],
    ylabel: str,
    reference: tuple[float, str] | None = None,
) -> None:
    """Grouped bars: one group per label, one bar per series (None: no bar); an optional
    horizontal reference line (a ceiling) with its legend label."""
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.5))
    width = 0.8 / max(len(series), 1)
    for index, (name, values) in enumerate(series.items()):
        xs = [i + (index - (len(series) - 1) / 2) * width for i in range(len(labels))]
        present = [(x, v) for x, v in zip(xs, values, strict=True) if v is not None]
        if present:
            ax.bar([x for x, _ in present], [v for _, v in present], width, label=name)
    if reference is not None:
        ax.axhline(reference[0], color="grey", linestyle=":", label=reference[1])
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)


def save_figure(plt: Any, fig: Any, path: Path) -> None:
    """Lay ``fig`` out, write it to ``path`` (its directory made) and close it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_port(
    port: int, timeout_s: float = 15.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Until something listens on ``port``; raises when ``proc`` (the server) exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server for port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s:g} s")


@contextlib.contextmanager
def process(
    args: list[str],
    port: int,
    *,
    env: dict[str, str] | None = None,
    log_path: Path | None = None,
    timeout_s: float = 15.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """``args`` in its own process until something listens on ``port``; stopped on exit. Its
    output goes to ``log_path`` (whose tail an early exit reports), else nowhere."""
    if log_path is None:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    else:
        with open(log_path, "wb") as log_file:
            proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        try:
            wait_port(port, timeout_s, proc)
        except RuntimeError as exc:
            if log_path is None or proc.poll() is None:
                raise
            raise RuntimeError(f"{exc}: {log_path.read_text(errors='replace')[-2000:]}") from None
        yield proc
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM, and SIGKILL if ``proc`` has not exited ``timeout_s`` later; returns once it has."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
