"""Remote stores for the L3 tests: `tiered-kv serve` in a subprocess, and Redis.

Redis: ``TIERED_KV_TEST_REDIS_URL`` (exported by ``.ci/run``) names a running server, and the
Redis test then fails, not skips, if it is unreachable; without it a private ``redis-server``
from PATH is started, and where there is none the test skips (fails under ``CI``), as in
tests/remote_fixtures.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_URL_ENV = "TIERED_KV_TEST_REDIS_URL"
CAPACITY = ("--capacity", "64MiB")


def _redis_args(directory: Path, log: Path) -> list[str]:
    return ["--save", "", "--appendonly", "no", "--dir", str(directory), "--logfile", str(log)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server on port {port} did not start: {log.read_text()}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


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
        _wait_port(port, proc, log)
        yield f"tkv://127.0.0.1:{port}"
    finally:
        _stop(proc)


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[str]:
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        import redis

        client = redis.Redis.from_url(url, socket_connect_timeout=5)
        try:
            client.ping()
        except redis.RedisError as exc:
            pytest.fail(f"{REDIS_URL_ENV}={url} is not reachable: {exc}")
        finally:
            client.close()
        yield url
        return
    if shutil.which("redis-server") is None:
        message = "redis-server is not installed (apt-get install -y redis-server)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    log = directory / "redis.log"
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", *_redis_args(directory, log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        log.touch()
        _wait_port(port, proc, log)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        _stop(proc)
