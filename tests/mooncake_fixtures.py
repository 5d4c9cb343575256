"""A real ``mooncake_master`` for the Mooncake tests: started on free loopback ports, stopped by
its pid (SIGKILL for fault tests, then restarted on the same ports).

The master comes with the ``mooncake`` extra (``mooncake-transfer-engine-non-cuda``, whose
native parts need the Debian package ``libibverbs1``; ``.ci/run`` installs both). Under CI
(``CI`` set) a missing package or binary fails the tests; elsewhere they skip. A master that is
installed but does not start always fails.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiered_kv.benchmarks.common import free_port, stop_process


def master_binary() -> str:
    """The ``mooncake_master`` beside this interpreter (the venv's), or on PATH; fails under CI
    and skips elsewhere when the package or its native library is missing."""
    problem = None
    try:
        import mooncake.store  # noqa: F401 - its native part needs libibverbs1
    except ImportError as exc:
        problem = f"mooncake.store does not import ({exc})"
    candidate = Path(sys.executable).with_name("mooncake_master")
    binary = str(candidate) if candidate.exists() else shutil.which("mooncake_master")
    if binary is None and problem is None:
        problem = "mooncake_master is not installed"
    if problem is not None:
        message = (
            f"Mooncake tests: {problem}; pip install 'tiered-kv[mooncake]' and "
            "apt-get install libibverbs1"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    assert binary is not None
    return binary


@dataclasses.dataclass
class MooncakeMaster:
    """One ``mooncake_master`` process on loopback; `url` is the ``l3_url`` that reaches it."""

    binary: str
    log: Path
    rpc_port: int = dataclasses.field(default_factory=free_port)
    http_port: int = dataclasses.field(default_factory=free_port)
    metrics_port: int = dataclasses.field(default_factory=free_port)
    flags: tuple[str, ...] = ()  # more mooncake_master flags, e.g. "--client_ttl=2"
    process: subprocess.Popen[bytes] | None = None

    def url(self, segment: str = "64MiB", **query: str) -> str:
        extra = "".join(f"&{name}={value}" for name, value in query.items())
        return (
            f"mooncake://127.0.0.1:{self.rpc_port}?metadata=http://127.0.0.1:{self.http_port}"
            f"/metadata&segment={segment}{extra}"
        )

    def start(self, timeout_s: float = 20.0) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    f"--rpc_port={self.rpc_port}",
                    "--rpc_address=127.0.0.1",
                    "--enable_http_metadata_server=true",
                    "--http_metadata_server_host=127.0.0.1",
                    f"--http_metadata_server_port={self.http_port}",
                    f"--metrics_port={self.metrics_port}",
                    *self.flags,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while not (_listening(self.rpc_port) and _listening(self.http_port)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"mooncake_master did not start on port {self.rpc_port}: "
                    f"{self.log.read_text(errors='replace')[-2000:]}"
                )
            time.sleep(0.05)

    def start_pool_node(self, segment: str = "256MB") -> subprocess.Popen[bytes]:
        """A ``mooncake_client`` lending ``segment`` to the pool (a storage node of the fleet:
        what it holds outlives any engine); the caller stops it by pid."""
        binary = str(Path(self.binary).with_name("mooncake_client"))
        with self.log.open("ab") as log:
            node = subprocess.Popen(
                [
                    binary,
                    "--host=127.0.0.1",
                    f"--global_segment_size={segment}",
                    f"--master_server_address=127.0.0.1:{self.rpc_port}",
                    f"--metadata_server=http://127.0.0.1:{self.http_port}/metadata",
                    f"--port={free_port()}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"},
            )
        # Mounted once the master counts its segment: poll the master's metrics.
        deadline = time.monotonic() + 20
        while not self._segments_mounted():
            if node.poll() is not None or time.monotonic() > deadline:
                stop_process(node)
                raise RuntimeError(f"mooncake_client did not mount a segment (rc={node.poll()})")
            time.sleep(0.1)
        return node

    def _segments_mounted(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1
            ) as answer:
                text = answer.read().decode()
        except OSError:
            return False
        for line in text.splitlines():
            if line.startswith("master_total_capacity_bytes "):
                return float(line.split()[-1]) > 0
        return False

    def kill(self) -> None:
        """SIGKILL by pid (a crash: every key is gone, its metadata was in memory)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            stop_process(process, timeout_s=10)


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@pytest.fixture
def mooncake_master(tmp_path: Path) -> Iterator[MooncakeMaster]:
    """A master of this test's own (a test may kill and restart it)."""
    master = MooncakeMaster(master_binary(), tmp_path / "mooncake_master.log")
    master.start()
    try:
        yield master
    finally:
        master.stop()
