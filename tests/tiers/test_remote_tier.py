"""The L3 tier over the built-in server: engine round trips, failures as misses, tenants."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import torch

from tests.kvfactory import make_caches
from tests.remote_fixtures import (  # noqa: F401
    BLOCK,
    CHUNK,
    ROUND_TRIP_CASES,
    engine_config,
    free_port,
    registered_engine,
    retrieve_bit_exact,
    round_trip,
    store_and_drop_l1,
    tkv_server,
    tokens_for,
)
from tiered_kv import TieredKVEngine
from tiered_kv.codec import GroupSpec, decode_chunk, encode_chunk
from tiered_kv.errors import ConfigError
from tiered_kv.keys import chunk_keys
from tiered_kv.layout import build_layout
from tiered_kv.memory import HostArena
from tiered_kv.tiers.factory import lower_tiers, remote_tier
from tiered_kv.tiers.l3_remote import RemoteTier
from tiered_kv.tiers.remote.client import ClientOptions, RemoteClient, TkvConnector
from tiered_kv.tiers.remote.server import RemoteCacheServer, ServerOptions


def _tier(port: int, *, timeout_s: float = 2.0, token: bytes | None = None) -> RemoteTier:
    options = ClientOptions(timeout_s=timeout_s, backoff_initial_s=0.02, backoff_max_s=0.1)
    client = RemoteClient("127.0.0.1", port, token=token, options=options)
    return RemoteTier(TkvConnector(client), timeout_s=timeout_s)


@pytest.mark.parametrize(("fmt", "dtype"), ROUND_TRIP_CASES)
async def test_engine_with_l3_only_round_trips_bit_exact(
    tkv_server: RemoteCacheServer,  # noqa: F811
    fmt: str,
    dtype: torch.dtype,
) -> None:
    caches = make_caches(fmt, dtype, num_blocks=16, block_size=BLOCK)
    tokens = tokens_for(80, seed=1)  # two full chunks and a partial one of 16 tokens
    stats = await round_trip(engine_config(l3_url=tkv_server.url), caches, tokens)
    assert stats.tier("L3").puts == 3
    assert stats.tier("L3").hits == 3
    assert stats.storage.tier("L3").reads.hits == 3
    assert tkv_server.stats()["entries"] == 3


async def test_engine_l1_l2_l3_reads_what_l1_and_l2_lost_from_remote(
    tkv_server: RemoteCacheServer,  # noqa: F811
    tmp_path: Path,
) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=24, block_size=BLOCK)
    tokens = tokens_for(4 * CHUNK + 8, seed=2)
    # One chunk's L2 file is 8 KiB (4 KiB header page + 4 KiB of KV): L2 keeps only the last.
    config = engine_config(l2_path=str(tmp_path / "l2"), l2_size="12KiB", l3_url=tkv_server.url)
    async with registered_engine(config, caches) as engine:
        src = await store_and_drop_l1(engine, caches, tokens)
        assert engine.stats().tier("L2").entries <= 1
        await retrieve_bit_exact(engine, caches, tokens, src)
        stats = engine.stats()
        assert stats.storage.tier("L3").reads.hits >= 4
        assert stats.tier("L3").puts == 5
    # A fresh process with an empty L2: everything comes from the remote tier.
    config = engine_config(l2_path=str(tmp_path / "l2-new"), l3_url=tkv_server.url)
    async with registered_engine(config, caches) as engine:
        await retrieve_bit_exact(engine, caches, tokens, src)
        assert engine.stats().storage.tier("L3").reads.hits == 5


async def test_server_restart_mid_run_means_misses_then_recovery() -> None:
    port = free_port()
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=24, block_size=BLOCK)
    first, second = tokens_for(64, seed=3), tokens_for(64, seed=4)
    server = RemoteCacheServer(ServerOptions(port=port))
    await server.start()
    tier = _tier(port)
    try:
        async with registered_engine(engine_config(), caches, lower_tiers=[tier]) as engine:
            src = await store_and_drop_l1(engine, caches, first)
            assert await engine.lookup(first) == 64
            await server.aclose()
            # Down: lookups are misses, stores skip the remote copy; nothing raises.
            assert await engine.lookup(first) == 0
            assert await engine.store(second, src) == 64
            assert await engine.flush(timeout=10) == 0
            down = tier.stats()
            assert down.exists_failures >= 1
            assert down.put_failures >= 1
            # Back (empty, as a restarted cache is): misses, then new stores land again.
            server = RemoteCacheServer(ServerOptions(port=port))
            await server.start()
            await asyncio.sleep(0.15)  # past the client's backoff
            assert await engine.lookup(first) == 0
            await engine.evict_l1()
            assert await engine.store(first, src) == 64
            assert await engine.flush(timeout=10) == 0
            assert await engine.evict_l1() > 0
            await retrieve_bit_exact(engine, caches, first, src)
            assert tier.stats().client["connects"] >= 2
    finally:
        await server.aclose()


async def _black_hole() -> tuple[asyncio.Server, int]:
    """A server that reads everything and never answers: a hung cache."""

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(1 << 20):
                pass
        finally:
            writer.close()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


@pytest.mark.parametrize("plane", ["threads", "processes"])
async def test_slow_server_times_out_without_stalling_the_engine(plane: str) -> None:
    """A server that never answers: stores return with the remote writes still pending (they
    run in the background), L1 hits need no round trip, a lookup past L1 is a miss once the
    timeout fires, and every abandoned PUT is counted, whether the PUTs go out on the
    client's threads or through the I/O worker processes. No wall-clock assertion: the checks
    are on what had happened when each call returned."""
    server, port = await _black_hole()
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=24, block_size=BLOCK)
    tokens = tokens_for(96, seed=5)
    tier = _tier(port, timeout_s=0.2)
    config = engine_config(io_plane=plane)
    try:
        async with registered_engine(config, caches, lower_tiers=[tier]) as engine:
            assert await engine.store(tokens, [1, 2, 3, 4, 5, 6]) == 96
            pending = tier.stats()
            assert pending.puts == 0 and pending.put_failures == 0  # still in the background
            assert await engine.lookup(tokens) == 96  # L1 hits need no remote round trip
            assert tier.stats().exists_calls == 0
            await engine.flush(timeout=5)
            await engine.evict_l1()
            # A deadlock guard, not a speed check: 25x the tier's timeout.
            assert await asyncio.wait_for(engine.lookup(tokens), 5) == 0
            plane_stats = engine.io_plane.stats() if engine.io_plane is not None else None
        stats = tier.stats()
        assert stats.put_failures == 3
        assert stats.exists_failures == 1
        if plane == "threads":
            assert stats.timeouts >= 2
            assert stats.client["aborted_connections"] >= 1  # abandoned PUTs dropped their socket
        else:  # the PUTs went through the write workers, each bounded by its socket's timeout
            assert plane_stats is not None and plane_stats.writes == 3
            assert stats.timeouts >= 1  # the lookup's EXISTS, on the client
    finally:
        server.close()
        await server.wait_closed()


async def test_cancelled_get_never_writes_into_the_buffer_afterwards() -> None:
    """The answer arrives in two halves; the reader is cancelled in between."""
    halves_sent = asyncio.Event()
    release = asyncio.Event()
    payload = bytes(range(256)) * 64
    whole = b"".join(
        bytes(p) for p in encode_chunk(b"k", 1, [GroupSpec("uint8", (16384,))], [payload])
    )

    async def half_then_rest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from tiered_kv.tiers.remote.protocol import HEADER_LEN, Op, Status, pack_frame_header

        head = await reader.readexactly(HEADER_LEN)
        meta_len = int.from_bytes(head[12:16], "little")
        await reader.readexactly(meta_len)
        writer.write(
            pack_frame_header(
                Op.GET, Status.OK, int.from_bytes(head[8:12], "little"), 0, len(whole)
            )
        )
        writer.write(whole[: len(whole) // 2])
        await writer.drain()
        halves_sent.set()
        await release.wait()
        writer.write(whole[len(whole) // 2 :])
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(half_then_rest, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = RemoteClient("127.0.0.1", port)
    buffer = bytearray(len(whole))
    try:
        task = asyncio.create_task(client.get_into(b"k", [memoryview(buffer)]))
        await halves_sent.wait()
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        snapshot = bytes(buffer)
        assert snapshot[: len(whole) // 2] == whole[: len(whole) // 2]
        release.set()
        await asyncio.sleep(0.1)
        assert bytes(buffer) == snapshot
        assert client.aborted_connections == 1
    finally:
        release.set()
        await client.aclose()
        server.close()
        await server.wait_closed()


async def test_two_tenants_never_see_each_others_chunks(
    tkv_server: RemoteCacheServer,  # noqa: F811
) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16, block_size=BLOCK)
    tokens = tokens_for(64, seed=6)
    tenant_a, tenant_b = (engine_config(l3_url=tkv_server.url, namespace=n) for n in "ab")
    async with registered_engine(tenant_a, caches) as engine:
        src = await store_and_drop_l1(engine, caches, tokens)
    async with registered_engine(tenant_b, caches) as engine:
        assert await engine.lookup(tokens) == 0
        assert engine.stats().tier("L3").hits == 0
    async with registered_engine(tenant_a, caches) as engine:
        await retrieve_bit_exact(engine, caches, tokens, src)


def _arena_obj(fmt: str, num_tokens: int) -> tuple[HostArena, object, object]:
    caches = make_caches(fmt, torch.float16, num_blocks=8, block_size=BLOCK)
    layout = build_layout(caches.entries, chunk_size=CHUNK, layout_hints=caches.hints)
    arena = HostArena(4 << 20, pin=False)
    return arena, layout, caches


async def test_layerwise_keys_partial_chunks_and_corrupt_frames(
    tkv_server: RemoteCacheServer,  # noqa: F811
) -> None:
    caches = make_caches("mla", torch.bfloat16, num_blocks=8, block_size=BLOCK)
    layout = build_layout(caches.entries, chunk_size=CHUNK).layout_desc
    arena = HostArena(4 << 20, pin=False)
    from tiered_kv.keys import KeyScope

    scope = KeyScope("t", "m", "", 1, 0, layout.layout_id)
    key = chunk_keys(scope, list(range(40)), CHUNK)[-1]  # the partial chunk: 8 tokens
    layer_key = key.with_layer(3)
    tier = _tier(tkv_server.port)
    await tier.open()
    try:
        src = arena.allocate_obj(layout, 8)
        dst = arena.allocate_obj(layout, 8)
        wrong = arena.allocate_obj(layout, 9)
        assert src is not None and dst is not None and wrong is not None
        src.raw().copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
        assert await tier.put(layer_key, src)
        assert tier.contains(layer_key) and not tier.contains(key)
        assert await tier.contains_many([key, layer_key]) == [False, True]
        assert await tier.get_into(layer_key, dst)
        assert torch.equal(dst.raw(), src.raw())
        assert not await tier.get_into(layer_key, wrong)  # other token count: a miss
        assert tier.stats().layout_mismatch == 1
        store = tkv_server.store
        with store.lock:
            frame = bytes(store.entries[layer_key.to_bytes()])
        header, _ = decode_chunk(frame)
        assert header.num_tokens == 8
        assert header.key_bytes == layer_key.to_bytes()
        # Flip one payload byte on the server: a miss, and the copy is removed.
        with store.lock:
            store.entries[layer_key.to_bytes()][-1] ^= 0xFF
        assert not await tier.get_into(layer_key, dst)
        stats = tier.stats()
        assert stats.corrupt == 1
        assert stats.corrupt_removed == 1
        assert store.contains_many([layer_key.to_bytes()]) == [False]
        assert not tier.contains(layer_key)
        for obj in (src, dst, wrong):
            obj.unref()
    finally:
        await tier.aclose()
        assert arena.close() == 0


async def test_any_rank_frames_pass_through_unchanged(
    tkv_server: RemoteCacheServer,  # noqa: F811
) -> None:
    specs = [GroupSpec("bfloat16", (3,)), GroupSpec("int8", (2, 1, 3, 1, 2, 5))]
    buffers = [bytes(range(6)), bytes(range(60))]
    async with RemoteClient("127.0.0.1", tkv_server.port) as client:
        await client.put(b"rank", encode_chunk(b"rank", 7, specs, buffers))
        frame = await client.get(b"rank")
    assert frame is not None
    header, payload = decode_chunk(frame)
    assert header.groups == tuple(specs)
    assert [bytes(p) for p in payload] == buffers


def test_tier_factory_by_scheme(tmp_path: Path) -> None:
    from tiered_kv.tiers.remote.redis import redis_py_url  # redis is optional

    tier = remote_tier(engine_config(l3_url="tkv://127.0.0.1:7474", l3_timeout_s=0.5))
    assert isinstance(tier, RemoteTier)
    assert tier.connector.description == "tkv://127.0.0.1:7474"
    options = tier.connector.client.options  # type: ignore[attr-defined]
    assert options.pool_size == engine_config().l3_pool_size  # None: sized from the machine
    for url in ("redis://h:1/0", "valkey://h:1", "rediss://:pw@h:1", "redis+cluster://h:1"):
        tier = remote_tier(engine_config(l3_url=url))
        assert "pw" not in tier.connector.description
        assert type(tier.connector).__name__ == "RedisConnector"
    cluster = remote_tier(engine_config(l3_url="valkeys+cluster://h:1")).connector
    assert cluster.cluster is True and cluster.description == "valkeys+cluster://h:1"
    assert redis_py_url("valkeys+cluster://h:1") == "rediss://h:1"
    assert redis_py_url("valkey://:pw@h:1/2") == "redis://:pw@h:1/2"
    assert isinstance(remote_tier(engine_config(l3_url="tkv://h:1")), RemoteTier)
    token = tmp_path / "token"
    token.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        remote_tier(engine_config(l3_url="tkv://h:1", l3_token_file=str(token)))
    with pytest.raises(ConfigError, match="unknown scheme"):
        engine_config(l3_url="memcached://h:1")
    with pytest.raises(ConfigError, match="needs a port"):
        engine_config(l3_url="tkv://h")


def test_lower_tiers_come_from_the_config_top_first(tmp_path: Path) -> None:
    from tiered_kv.tiers.l2 import DiskTier

    assert lower_tiers(engine_config()) == []
    tiers = lower_tiers(engine_config(l2_path=str(tmp_path), l2_size="1MiB", l3_url="tkv://h:1"))
    assert [type(tier) for tier in tiers] == [DiskTier, RemoteTier]
    assert [tier.name for tier in tiers] == ["L2", "L3"]
    assert isinstance(tiers[0], DiskTier) and tiers[0].capacity == 1 << 20


def test_redis_url_without_the_redis_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """redis is an optional extra: a redis:// URL without it is refused when configured, with
    the pip line to fix it; tkv:// needs nothing extra."""
    import sys

    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis now fails
    for url in ("redis://h:1/0", "valkeys+cluster://h:1"):
        with pytest.raises(ConfigError, match=r"pip install 'tiered-kv\[redis\]'"):
            engine_config(l3_url=url)
    assert isinstance(remote_tier(engine_config(l3_url="tkv://h:1")), RemoteTier)


async def test_wrong_token_through_the_engine_is_only_misses(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("right\n")
    async with RemoteCacheServer(ServerOptions(port=0, token=b"right")) as server:
        caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16, block_size=BLOCK)
        tokens = tokens_for(64, seed=8)
        wrong = tmp_path / "wrong"
        wrong.write_text("wrong")
        async with TieredKVEngine(
            engine_config(l3_url=server.url, l3_token_file=str(wrong))
        ) as engine:
            engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
            assert await engine.store(tokens, [1, 2, 3, 4]) == 64
            await engine.flush(timeout=10)
            assert engine.stats().tier("L3").put_failures == 2
        assert server.stats()["auth_failures"] >= 1
        assert server.stats()["entries"] == 0
        config = engine_config(l3_url=server.url, l3_token_file=str(token_file))
        async with registered_engine(config, caches) as engine:
            src = await store_and_drop_l1(engine, caches, tokens)
            await retrieve_bit_exact(engine, caches, tokens, src)
