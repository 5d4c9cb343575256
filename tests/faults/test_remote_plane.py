"""L3 (``tkv://``) GETs and PUTs through the I/O worker processes: each worker's own connection
(authenticated when the server has a token), frames bit-exact, a frame of another length a
layout mismatch, a corrupt frame a miss and removed, a server that is down or never answers
only misses within the tier's timeout, and a worker killed mid-GET costing only its chunk."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest_asyncio
import torch

from tests.kvfactory import make_caches
from tests.remote_fixtures import BLOCK, CHUNK, free_port
from tiered_kv.codec import decode_chunk
from tiered_kv.io.plane import WorkerPlane
from tiered_kv.keys import KeyScope, chunk_keys
from tiered_kv.layout import build_layout
from tiered_kv.memory import HostArena, MemoryObj
from tiered_kv.tiers.l3_remote import RemoteTier
from tiered_kv.tiers.remote.client import ClientOptions, RemoteClient, TkvConnector
from tiered_kv.tiers.remote.server import RemoteCacheServer, ServerOptions

TOKEN = b"plane-token"


class Rig:
    """A shared arena, a plane over it and an L3 tier using the plane."""

    def __init__(self, port: int, timeout_s: float) -> None:
        caches = make_caches("mla", torch.bfloat16, num_blocks=8, block_size=BLOCK)
        self.layout = build_layout(caches.entries, chunk_size=CHUNK).layout_desc
        self.arena = HostArena(8 << 20, pin=False, shared=True)
        self.plane = WorkerPlane(self.arena, 1, 1)
        options = ClientOptions(timeout_s=timeout_s, backoff_initial_s=0.02, backoff_max_s=0.1)
        client = RemoteClient("127.0.0.1", port, token=TOKEN, options=options)
        self.tier = RemoteTier(TkvConnector(client), timeout_s=timeout_s)
        scope = KeyScope("t", "m", "", 1, 0, self.layout.layout_id)
        self.keys = chunk_keys(scope, list(range(4 * CHUNK)), CHUNK)

    def obj(self, num_tokens: int = CHUNK, seed: int | None = None) -> MemoryObj:
        obj = self.arena.allocate_obj(self.layout, num_tokens)
        assert obj is not None
        if seed is None:
            obj.raw().fill_(0xAA)
        else:
            gen = torch.Generator().manual_seed(seed)
            obj.raw().copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
        return obj


@pytest_asyncio.fixture
async def server() -> AsyncIterator[RemoteCacheServer]:
    server = RemoteCacheServer(ServerOptions(port=0, capacity=64 << 20, token=TOKEN))
    await server.start()
    try:
        yield server
    finally:
        await server.aclose(grace_s=1.0)


async def _rig(port: int, timeout_s: float = 2.0) -> Rig:
    rig = Rig(port, timeout_s)
    assert rig.tier.use_plane(rig.plane)
    rig.plane.start()
    await rig.tier.open()
    return rig


async def _close(rig: Rig, objs: list[MemoryObj]) -> None:
    for obj in objs:
        obj.unref()
    await rig.tier.aclose()
    await rig.plane.aclose()
    assert rig.arena.close() == 0


async def test_frames_go_through_workers_bit_exact_and_bad_ones_are_misses(
    server: RemoteCacheServer,
) -> None:
    rig = await _rig(server.port)
    src, dst, short = rig.obj(seed=1), rig.obj(), rig.obj(CHUNK // 2)
    try:
        key = rig.keys[0]
        assert await rig.tier.put(key, src)
        assert await rig.tier.get_into(key, dst)
        assert torch.equal(dst.raw(), src.raw())
        stats = rig.plane.stats()
        assert (stats.reads, stats.writes) == (1, 1)  # both went through the workers
        assert rig.tier.connector.stats()["connects"] == 0  # the client never connected
        with server.store.lock:
            frame = bytes(server.store.entries[key.to_bytes()])
        header, groups = decode_chunk(frame)  # the worker sealed a valid frame
        assert header.key_bytes == key.to_bytes()
        assert b"".join(bytes(group) for group in groups) == bytes(src.raw().numpy())
        # Another token count: a frame of another length, not read, a layout mismatch; the
        # next GET on that worker (a new connection) still reads.
        assert not await rig.tier.get_into(key, short)
        assert rig.tier.stats().layout_mismatch == 1
        assert await rig.tier.get_into(key, dst)
        # Missing: a miss.
        assert not await rig.tier.get_into(rig.keys[1], dst)
        # One payload byte flipped on the server: a miss, and the copy is removed.
        with server.store.lock:
            server.store.entries[key.to_bytes()][-1] ^= 0xFF
        dst.raw().fill_(0)
        assert not await rig.tier.get_into(key, dst)
        stats_after = rig.tier.stats()
        assert (stats_after.corrupt, stats_after.corrupt_removed) == (1, 1)
        assert server.store.contains_many([key.to_bytes()]) == [False]
        assert rig.plane.stats().worker_deaths == 0
    finally:
        await _close(rig, [src, dst, short])


async def test_a_server_down_or_silent_costs_misses_within_the_timeout() -> None:
    """Nobody listening: misses at once (the worker backs off); a server that accepts and
    never answers: the GET and the PUT fail by the tier's timeout, the worker lives on."""
    port = free_port()
    rig = await _rig(port, timeout_s=0.3)
    src, dst = rig.obj(seed=2), rig.obj()
    try:
        started = time.monotonic()
        for key in rig.keys[:3]:
            assert not await rig.tier.get_into(key, dst)
        assert not await rig.tier.put(rig.keys[0], src)
        assert time.monotonic() - started < 2.0  # a hang guard
        assert rig.tier.stats().read_failures == 3

        async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while await reader.read(1 << 20):
                pass
            writer.close()

        silent = await asyncio.start_server(swallow, "127.0.0.1", port)
        try:
            await asyncio.sleep(2.1)  # past the worker's longest backoff
            assert not await asyncio.wait_for(rig.tier.get_into(rig.keys[0], dst), 5)
            assert not await asyncio.wait_for(rig.tier.put(rig.keys[1], src), 5)
            assert rig.plane.stats().worker_deaths == 0
        finally:
            silent.close()
            await silent.wait_closed()
    finally:
        await _close(rig, [src, dst])


async def test_a_read_worker_killed_mid_get_costs_its_chunk_and_is_replaced(
    server: RemoteCacheServer,
) -> None:
    rig = await _rig(server.port, timeout_s=5.0)
    src, dst = rig.obj(seed=3), rig.obj()
    try:
        assert await rig.tier.put(rig.keys[0], src)
        (reader,) = rig.plane.worker_pids("read")
        os.kill(reader, signal.SIGSTOP)  # it cannot take the job
        get = asyncio.create_task(rig.tier.get_into(rig.keys[0], dst))
        await asyncio.sleep(0.2)
        os.kill(reader, signal.SIGKILL)
        assert not await get  # a miss, never a partial chunk
        assert rig.tier.stats().read_failures == 1
        assert rig.plane.stats().worker_deaths == 1
        assert rig.plane.worker_pids("read") != [reader]
        assert await rig.tier.get_into(rig.keys[0], dst)  # the new worker connects and reads
        assert torch.equal(dst.raw(), src.raw())
    finally:
        await _close(rig, [src, dst])


def test_the_worker_speaks_the_protocol_modules_frames() -> None:
    """The worker cannot import tiered_kv: its copy of the frame constants must agree."""
    import importlib.util

    from tiered_kv.io import plane
    from tiered_kv.tiers.remote import protocol

    spec = importlib.util.spec_from_file_location("tkv_worker", plane.WORKER_PATH)
    assert spec is not None and spec.loader is not None
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    assert worker.TKV_MAGIC == protocol.MAGIC
    assert worker.TKV_VERSION == protocol.PROTOCOL_VERSION
    assert worker.TKV_HEADER.format == protocol.FRAME_HEADER.format
    ops = (worker.TKV_AUTH, worker.TKV_PUT, worker.TKV_GET)
    assert ops == (protocol.Op.AUTH, protocol.Op.PUT, protocol.Op.GET)
    statuses = (worker.TKV_REQUEST, worker.TKV_OK, worker.TKV_NOT_FOUND, worker.TKV_ERROR)
    assert statuses == tuple(protocol.Status)
