"""Remote stores for the L3 tests: `tiered-kv serve` in a subprocess, and Redis (the core
suite's `tests.remote_fixtures.redis_service`: ``TIERED_KV_TEST_REDIS_URL``, exported by
``.ci/run``, names a running server and an unreachable one fails the test; without it a private
``redis-server`` from PATH is started, and where there is none the test skips, or fails under
``CI``).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.remote_fixtures import redis_service
from tiered_kv.benchmarks.common import free_port, stop_process, wait_port

CAPACITY = ("--capacity", "64MiB")


@contextlib.contextmanager
def tkv_server(directory: Path) -> Iterator[str]:
    """`tiered-kv serve` on a free loopback port; yields its ``tkv://`` URL."""
    port = free_port()
    log = directory / "tkv-serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiered_kv.cli", "serve", "--port", str(port), *CAPACITY],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        try:
            wait_port(port, timeout_s=30, proc=proc)
        except Exception as exc:
            raise RuntimeError(f"tiered-kv serve did not start: {log.read_text()}") from exc
        yield f"tkv://127.0.0.1:{port}"
    finally:
        stop_process(proc, timeout_s=30)


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    with redis_service(directory, "the SGLang backend's Redis test") as url:
        yield url


__all__ = ["free_port", "redis_server", "tkv_server"]
