"""The L3 tier over real Redis (and a real three-node Redis Cluster): round trips, tenants,
corrupt values, TTL, failures as misses. Needs redis-server: see tests/remote_fixtures.py."""

from __future__ import annotations

import asyncio
import os
import urllib.parse
from pathlib import Path

import pytest
import redis.asyncio
import torch

from tests.kvfactory import make_caches
from tests.remote_fixtures import (  # noqa: F401
    BLOCK,
    CHUNK,
    engine_config,
    free_port,
    key_prefix,
    redis_cluster_url,
    redis_url,
    registered_engine,
    retrieve_bit_exact,
    store_and_drop_l1,
    tokens_for,
)
from tiered_kv.codec import GroupSpec, PayloadHasher, encode_chunk
from tiered_kv.keys import KeyScope, chunk_keys
from tiered_kv.tiers.l3_remote import RemoteTier
from tiered_kv.tiers.remote.connector import FetchStatus, FrameSink
from tiered_kv.tiers.remote.redis import RedisConnector, redis_key_name


async def _keys(url: str, pattern: str) -> list[bytes]:
    client = redis.asyncio.Redis.from_url(url)
    try:
        return sorted([key async for key in client.scan_iter(match=pattern)])
    finally:
        await client.aclose()


async def test_engine_round_trip_through_redis(
    redis_url: str,  # noqa: F811
    key_prefix: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    caches = make_caches("flashinfer_hnd", torch.bfloat16, num_blocks=24, block_size=BLOCK)
    tokens = tokens_for(3 * CHUNK + 5, seed=11)
    config = engine_config(
        l2_path=str(tmp_path / "l2"), l2_size="12KiB", l3_url=redis_url, l3_key_prefix=key_prefix
    )
    async with registered_engine(config, caches) as engine:
        src = await store_and_drop_l1(engine, caches, tokens)
        await retrieve_bit_exact(engine, caches, tokens, src)
        stats = engine.stats()
        assert stats.tier("L3").puts == 4
        assert stats.storage.tier("L3").reads.hits >= 3
    names = await _keys(redis_url, f"{key_prefix}:*")
    assert len(names) == 4
    assert all(name.startswith(f"{key_prefix}::".encode()) for name in names)  # namespace ""
    # L3 only, a new process: everything from Redis.
    l3_only = engine_config(l3_url=redis_url, l3_key_prefix=key_prefix)
    async with registered_engine(l3_only, caches) as engine:
        await retrieve_bit_exact(engine, caches, tokens, src)
        assert engine.stats().tier("L3").hits == 4


async def test_tenants_are_separate_key_spaces(
    redis_url: str,  # noqa: F811
    key_prefix: str,  # noqa: F811
) -> None:
    caches = make_caches("vllm_nhd", torch.float16, num_blocks=16, block_size=BLOCK)
    tokens = tokens_for(64, seed=12)
    shared = {"l3_url": redis_url, "l3_key_prefix": key_prefix}
    async with registered_engine(engine_config(namespace="alice/{x}", **shared), caches) as engine:
        src = await store_and_drop_l1(engine, caches, tokens)
    async with registered_engine(engine_config(namespace="bob", **shared), caches) as engine:
        assert await engine.lookup(tokens) == 0
    names = await _keys(redis_url, f"{key_prefix}:*")
    quoted = urllib.parse.quote("alice/{x}", safe="")
    assert len(names) == 2
    assert all(name.startswith(f"{key_prefix}:{quoted}:".encode()) for name in names)
    assert all(b"{" not in name for name in names)  # no hash tag sneaks in
    async with registered_engine(engine_config(namespace="alice/{x}", **shared), caches) as engine:
        await retrieve_bit_exact(engine, caches, tokens, src)


async def test_corrupt_value_is_a_miss_and_removed_and_ttl_applies(
    redis_url: str,  # noqa: F811
    key_prefix: str,  # noqa: F811
) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16, block_size=BLOCK)
    tokens = tokens_for(32, seed=13)
    config = engine_config(l3_url=redis_url, l3_key_prefix=key_prefix, l3_ttl_s=60)
    async with registered_engine(config, caches) as engine:
        await store_and_drop_l1(engine, caches, tokens)
        (key,) = engine.chunk_keys(tokens)
        name = redis_key_name(key_prefix, key)
        client = redis.asyncio.Redis.from_url(redis_url)
        try:
            ttl = await client.pttl(name)
            assert 50_000 < ttl <= 60_000
            value = bytearray(await client.get(name))
            value[-1] ^= 0x01
            await client.set(name, bytes(value))
            assert await engine.lookup(tokens) == 32  # EXISTS says yes ...
            assert (
                await engine.retrieve(tokens, [5, 6])
            ).valid_tokens == 0  # ... the checksum says no
            assert not await client.exists(name)
        finally:
            await client.aclose()
        stats = engine.stats().tier("L3")
        assert stats.corrupt == 1
        assert stats.corrupt_removed == 1


async def test_redis_down_is_only_misses() -> None:
    port = free_port()  # nothing listens there
    connector = RedisConnector(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16, block_size=BLOCK)
    tokens = tokens_for(64, seed=14)
    tier = RemoteTier(connector, timeout_s=0.5)
    async with registered_engine(engine_config(), caches, lower_tiers=[tier]) as engine:
        await store_and_drop_l1(engine, caches, tokens)
        assert await engine.lookup(tokens) == 0
    stats = tier.stats()
    assert stats.put_failures == 2
    assert stats.exists_failures == 1


async def test_cluster_routes_keys_across_slots(
    redis_cluster_url: str,  # noqa: F811
    key_prefix: str,  # noqa: F811
) -> None:
    caches = make_caches("separate", torch.bfloat16, num_blocks=50, block_size=BLOCK)
    tokens = tokens_for(12 * CHUNK, seed=15)
    config = engine_config(l3_url=redis_cluster_url, l3_key_prefix=key_prefix)
    async with registered_engine(config, caches) as engine:
        src = await store_and_drop_l1(engine, caches, tokens)
        await retrieve_bit_exact(engine, caches, tokens, src)
        assert engine.stats().tier("L3").hits == 12
        keys = engine.chunk_keys(tokens)
    # The chunks really are spread over the cluster's nodes (a batch EXISTS spans slots).
    cluster = redis.asyncio.RedisCluster.from_url(redis_cluster_url.replace("+cluster", ""))
    try:
        await cluster.initialize()
        nodes = {cluster.get_node_from_key(redis_key_name(key_prefix, key)).name for key in keys}
        assert len(nodes) >= 2
    finally:
        await cluster.aclose()
    async with registered_engine(config, caches) as engine:
        assert await engine.lookup(tokens) == 12 * CHUNK
        assert engine.stats().tier("L3").exists_calls == 1


async def test_connector_batches_in_one_pipeline(
    redis_url: str,  # noqa: F811
    key_prefix: str,  # noqa: F811
) -> None:
    connector = RedisConnector(redis_url, key_prefix=key_prefix)
    await connector.open()
    try:
        from tiered_kv.keys import KeyScope, chunk_keys

        keys = chunk_keys(KeyScope("", "m", "", 1, 0, "x"), list(range(512 * 4)), 4)
        assert await connector.exists(keys) == [False] * 512
        stats = await connector.remote_stats()
        assert "used_memory" in stats
        assert await connector.delete(keys[:2]) == [False, False]
    finally:
        await connector.aclose()
        await connector.aclose()
    await asyncio.sleep(0)


def test_unknown_scheme_is_refused() -> None:
    from tiered_kv.errors import ConfigError

    with pytest.raises(ConfigError, match="scheme"):
        RedisConnector("memcached://h:1")


async def test_more_concurrent_requests_than_connections_wait_for_one(
    redis_url: str,  # noqa: F811
    key_prefix: str,  # noqa: F811
) -> None:
    """A load's chunks spread over the pool; those beyond it wait for a connection (a blocking
    pool) instead of failing with "Too many connections"."""
    keys = chunk_keys(KeyScope("t", "m", "", 1, 0, "x"), list(range(12 * 16)), 16)
    payloads = [os.urandom(50_000 + index) for index in range(12)]
    frames = [
        encode_chunk(key.to_bytes(), 16, [GroupSpec("uint8", (len(p),))], [p])
        for key, p in zip(keys, payloads, strict=True)
    ]
    connector = RedisConnector(redis_url, key_prefix=key_prefix, max_connections=2)
    await connector.open()
    try:
        await asyncio.gather(
            *(
                connector.put(key, frame, sum(len(part) for part in frame))
                for key, frame in zip(keys, frames, strict=True)
            )
        )
        sinks = [
            FrameSink(bytearray(len(frame[0])), [memoryview(bytearray(len(p)))])
            for frame, p in zip(frames, payloads, strict=True)
        ]
        statuses = await asyncio.gather(
            *(connector.get_into(key, sink) for key, sink in zip(keys, sinks, strict=True))
        )
        assert statuses == [FetchStatus.HIT] * len(keys)
        assert [bytes(sink.payload[0]) for sink in sinks] == payloads
    finally:
        await connector.aclose()


class _ThreadRecordingHasher:
    """A FrameSink hasher that notes which threads hashed (that is, received) the payload."""

    def __init__(self) -> None:
        self._hasher = PayloadHasher()
        self.threads: set[str] = set()

    def update(self, data: object) -> None:
        import threading

        self.threads.add(threading.current_thread().name)
        self._hasher.update(data)  # type: ignore[arg-type]

    def digests(self) -> tuple[int, ...]:
        return self._hasher.digests()


def _one_frame(seed: int, size: int) -> tuple[object, list[memoryview], bytes]:
    key = chunk_keys(KeyScope("t", "m", "", 1, 0, "x"), list(range(seed, seed + 16)), 16)[0]
    payload = os.urandom(size)
    frame = encode_chunk(key.to_bytes(), 16, [GroupSpec("uint8", (len(payload),))], [payload])
    return key, frame, payload


async def test_values_are_received_and_hashed_on_the_connectors_threads_not_the_loop(
    redis_url: str,  # noqa: F811
    key_prefix: str,  # noqa: F811
) -> None:
    import threading

    key, frame, payload = _one_frame(0, 1 << 20)
    connector = RedisConnector(redis_url, key_prefix=key_prefix, max_connections=2)
    await connector.open()
    try:
        await connector.put(key, frame, sum(len(part) for part in frame))  # type: ignore[arg-type]
        hasher = _ThreadRecordingHasher()
        sink = FrameSink(bytearray(len(frame[0])), [memoryview(bytearray(len(payload)))])
        sink.hasher = hasher  # type: ignore[assignment]
        assert await connector.get_into(key, sink) is FetchStatus.HIT  # type: ignore[arg-type]
        assert bytes(sink.payload[0]) == payload
        assert hasher.threads and threading.current_thread().name not in hasher.threads
        assert all(name.startswith("tkv-redis") for name in hasher.threads)
    finally:
        await connector.aclose()


async def test_a_cancelled_get_returns_only_after_its_thread_let_go_of_the_sink(
    redis_url: str,  # noqa: F811
    key_prefix: str,  # noqa: F811
) -> None:
    """The server pauses its clients; a get cancelled meanwhile waits for its command to end, so
    the L1 buffer a cancelled load hands back is never written after the cancel returned."""
    key, frame, payload = _one_frame(100, 4 << 20)
    connector = RedisConnector(redis_url, key_prefix=key_prefix, max_connections=2)
    admin = redis.asyncio.Redis.from_url(redis_url)
    await connector.open()
    try:
        await connector.put(key, frame, sum(len(part) for part in frame))  # type: ignore[arg-type]
        sink = FrameSink(bytearray(len(frame[0])), [memoryview(bytearray(len(payload)))])
        await admin.execute_command("CLIENT", "PAUSE", 600, "ALL")
        task = asyncio.create_task(connector.get_into(key, sink))  # type: ignore[arg-type]
        await asyncio.sleep(0.15)
        assert connector.stats()["threads_busy"] == 1  # the GET waits on the paused server now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        written = bytes(sink.payload[0])  # were the cancel not to wait, the GET lands later
        await asyncio.sleep(0.8)  # past the pause: nothing writes the sink any more
        assert bytes(sink.payload[0]) == written
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
        await connector.aclose()
