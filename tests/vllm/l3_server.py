"""`tiered-kv serve` in a subprocess on a free loopback port, for tests/vllm and bench/vllm_ttft."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def l3_server(
    log_path: Path, capacity: str, *, read_delay_s: float = 0.0
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Yield the server's ``tkv://`` URL and its process (tests kill it); stopped on exit.
    ``read_delay_s``: the server's ``--read-delay`` (a slow store)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    command = [sys.executable, "-m", "tiered_kv.cli", "serve", "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [*command, "--capacity", capacity, "--read-delay", str(read_delay_s)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), 1),
                ):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"tiered-kv serve did not start: {log_path.read_text()}")
                time.sleep(0.1)
            yield f"tkv://127.0.0.1:{port}", proc
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=30)
