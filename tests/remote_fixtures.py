"""Fixtures of the remote-tier tests: in-process tkv servers and real redis-server processes.

Redis: ``TIERED_KV_TEST_REDIS_URL`` (exported by ``.ci/run``) names a running server, and a test
that needs Redis then fails, not skips, if it is unreachable. Without it, a private
``redis-server`` from PATH is started for the session; under CI (``CI`` set) a missing
redis-server fails too, elsewhere the Redis tests skip. The Cluster fixture always starts its
own three-node cluster (``redis-server`` + ``redis-cli --cluster create``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch

from tests.kvfactory import KVCaches
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.benchmarks.common import free_port, stop_process
from tiered_kv.metrics import EngineStats
from tiered_kv.tiers.remote.server import RemoteCacheServer, ServerOptions

REDIS_URL_ENV = "TIERED_KV_TEST_REDIS_URL"


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    import random

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 45000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _redis_missing(what: str) -> None:
    message = f"{what}: redis-server is not installed (apt-get install -y redis-server)"
    if os.environ.get(REDIS_URL_ENV) or os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def _wait_ping(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
                sock.sendall(b"PING\r\n")
                if sock.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server on port {port} did not answer PING")
        time.sleep(0.05)


def _start_redis(directory: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    directory.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_ping(port)
    except BaseException:
        stop_process(process, timeout_s=10)
        raise
    return process


@contextlib.contextmanager
def redis_service(directory: Path, what: str = "Redis tests") -> Iterator[str]:
    """The Redis that ``TIERED_KV_TEST_REDIS_URL`` names (unreachable: a failure), else a
    private ``redis-server`` on a free loopback port (none installed: a skip, a failure under
    ``CI``); yields its URL."""
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
        _redis_missing(what)
    port = free_port()
    process = _start_redis(directory, port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop_process(process, timeout_s=10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_service(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        _redis_missing("Redis Cluster tests")
    root = tmp_path_factory.mktemp("redis-cluster")
    ports: list[int] = []
    while len(ports) < 3:
        port = free_cluster_port()
        if port not in ports:
            ports.append(port)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for port in ports:
            processes.append(
                _start_redis(
                    root / str(port),
                    port,
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                )
            )
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in ports),
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=60,
        )
        _wait_cluster_ok(ports)
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for process in processes:
            stop_process(process, timeout_s=10)


def _wait_cluster_ok(ports: list[int], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for port in ports:
            output = subprocess.run(
                ["redis-cli", "-p", str(port), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            states.append("cluster_state:ok" in output)
        if all(states):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("redis cluster did not reach cluster_state:ok")
        time.sleep(0.1)


@pytest.fixture
def key_prefix() -> str:
    """A prefix of its own per test, so tests sharing one Redis never see each other's keys."""
    return f"tkvtest-{uuid.uuid4().hex[:12]}"


@pytest_asyncio.fixture
async def tkv_server() -> AsyncIterator[RemoteCacheServer]:
    server = RemoteCacheServer(ServerOptions(port=0, capacity=256 << 20))
    await server.start()
    try:
        yield server
    finally:
        await server.aclose(grace_s=1.0)


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


CHUNK = 32
BLOCK = 16
# The formats and dtypes an L3 round trip is checked in: K/V pairs, MLA, separate K and V tensors.
ROUND_TRIP_CASES = [("vllm_nhd", torch.bfloat16), ("mla", torch.int8), ("separate", torch.float16)]


def engine_config(**overrides: object) -> EngineConfig:
    """An engine of `CHUNK`-token chunks and 8 MiB of L1 whose L2, if any, skips fsync."""
    fields: dict[str, object] = {"chunk_size": CHUNK, "l1_size": "8MiB", "l2_durability": "none"}
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def tokens_for(n: int, seed: int) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, 50_000, (n,), generator=gen)]


async def store_and_drop_l1(engine: object, caches: object, tokens: list[int]) -> list[int]:
    """Store ``tokens`` from blocks 1.., wait for lower-tier writes, evict L1; the src blocks."""
    from tiered_kv import TieredKVEngine

    assert isinstance(engine, TieredKVEngine)
    blocks = list(range(1, 1 + -(-len(tokens) // BLOCK)))
    assert await engine.store(tokens, blocks) == len(tokens)
    assert await engine.flush(timeout=30) == 0
    assert await engine.evict_l1() > 0
    return blocks


async def retrieve_bit_exact(
    engine: object, caches: object, tokens: list[int], src_blocks: list[int]
) -> None:
    """lookup finds every token; retrieve into other blocks writes exactly the stored bytes."""
    from tests.kvfactory import KVCaches, expect_copy, poison_blocks
    from tiered_kv import TieredKVEngine

    assert isinstance(engine, TieredKVEngine)
    assert isinstance(caches, KVCaches)
    n = len(tokens)
    dst_blocks = [src_blocks[-1] + 1 + i for i in range(len(src_blocks))][::-1]
    assert await engine.lookup(tokens) == n
    reference = caches.snapshot()
    poison_blocks(caches, dst_blocks)
    expected = caches.snapshot()
    assert (await engine.retrieve(tokens, dst_blocks)).valid_tokens == n
    expect_copy(caches, expected, reference, src_blocks, dst_blocks, range(n), BLOCK)
    assert caches.bytes_equal(expected)


@contextlib.asynccontextmanager
async def registered_engine(
    config: EngineConfig, caches: KVCaches, **engine_args: Any
) -> AsyncIterator[TieredKVEngine]:
    """An open engine on ``config`` with ``caches`` registered (model "m"); closed on exit."""
    async with TieredKVEngine(config, **engine_args) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        yield engine


async def round_trip(config: EngineConfig, caches: KVCaches, tokens: list[int]) -> EngineStats:
    """An engine on ``config`` stores ``tokens`` from blocks 1.., drops L1 (`store_and_drop_l1`)
    and reads them back bit-exact (`retrieve_bit_exact`); its stats before it closed."""
    async with registered_engine(config, caches) as engine:
        src = await store_and_drop_l1(engine, caches, tokens)
        await retrieve_bit_exact(engine, caches, tokens, src)
        return engine.stats()
