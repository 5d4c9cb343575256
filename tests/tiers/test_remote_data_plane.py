"""The threaded data plane of the tkv client and server: striping over connections, pipelining,
a connection dying mid-stripe, cancellation, stuck servers, threads and fds owned and released.

Real sockets throughout: the in-process `RemoteCacheServer`, or a small fault-injecting server
below (`_FaultyServer`) that answers GETs from stored frames and can cut or stall one answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Callable

import pytest
import xxhash

from tests.remote_fixtures import tkv_server  # noqa: F401
from tiered_kv.codec import GroupSpec, encode_chunk
from tiered_kv.errors import RemoteError, RemoteTimeout, RemoteUnavailable
from tiered_kv.tiers.l3_remote import RemoteTier
from tiered_kv.tiers.remote.client import ClientOptions, RemoteClient, TkvConnector
from tiered_kv.tiers.remote.connector import FetchStatus, default_pool_size
from tiered_kv.tiers.remote.protocol import (
    DEFAULT_LIMITS,
    HEADER_LEN,
    Op,
    Status,
    decode_frame_header,
    pack_frame_header,
)
from tiered_kv.tiers.remote.server import RemoteCacheServer, ServerOptions


def frame_bytes(key: bytes, payload: bytes) -> bytes:
    parts = encode_chunk(key, 1, [GroupSpec("uint8", (len(payload),))], [payload])
    return b"".join(bytes(part) for part in parts)


def header_len(key: bytes) -> int:
    return len(frame_bytes(key, b"x")) - 1


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def client_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tkv-client ")]


async def settled(count: Callable[[], int], at_most: int) -> int:
    """``count()`` once it is at most ``at_most``, or after 5 s (a closed peer's socket may
    take a loop turn or two to go)."""
    for _ in range(500):
        if count() <= at_most:
            break
        await asyncio.sleep(0.01)
    return count()


async def get_checked(client: RemoteClient, key: bytes, expected: bytes) -> bool:
    """GET ``key`` into fresh buffers (a header buffer, then the payload, as the tier does);
    True when the bytes and the hash fed on the way are exactly ``expected``'s."""
    head = bytearray(header_len(key))
    payload = bytearray(len(expected) - len(head))
    hasher = xxhash.xxh3_64()
    status = await client.get_into(
        key, [memoryview(head), memoryview(payload)], hash_from=len(head), hasher=hasher
    )
    assert status is FetchStatus.HIT
    assert bytes(head) + bytes(payload) == expected
    assert hasher.intdigest() == xxhash.xxh3_64(expected[len(head) :]).intdigest()
    return True


class _FaultyServer:
    """Speaks enough tkv for PING and GET, answering from ``frames``. An answer for a key in
    ``cut`` stops half way and the connection is aborted; one for a key in ``stall`` stops
    half way until ``resume`` is set, then goes on."""

    def __init__(self, frames: dict[bytes, bytes]) -> None:
        self.frames = frames
        self.cut: set[bytes] = set()
        self.stall: set[bytes] = set()
        self.stalled = asyncio.Event()
        self.resume = asyncio.Event()
        self.connections = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> _FaultyServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.resume.set()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                header = decode_frame_header(await reader.readexactly(HEADER_LEN), DEFAULT_LIMITS)
                meta = await reader.readexactly(header.meta_len)
                if header.op == Op.PING:
                    writer.write(
                        pack_frame_header(Op.PING, Status.OK, header.request_id, len(meta)) + meta
                    )
                    continue
                stored = self.frames.get(meta)
                if stored is None:
                    writer.write(pack_frame_header(Op.GET, Status.NOT_FOUND, header.request_id, 0))
                    continue
                half = len(stored) // 2
                writer.write(
                    pack_frame_header(Op.GET, Status.OK, header.request_id, 0, len(stored))
                )
                if meta in self.cut:
                    writer.write(stored[:half])
                    await writer.drain()
                    writer.transport.abort()
                    return
                if meta in self.stall:
                    writer.write(stored[:half])
                    await writer.drain()
                    self.stalled.set()
                    await self.resume.wait()
                    writer.write(stored[half:])
                else:
                    writer.write(stored)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def faulty_server(frames: dict[bytes, bytes]) -> AsyncIterator[_FaultyServer]:
    async with _FaultyServer(frames) as server:
        yield server


def test_pool_size_defaults_to_the_machine_and_is_validated() -> None:
    assert ClientOptions().connections == default_pool_size()
    assert 4 <= default_pool_size() <= 8
    assert ClientOptions(pool_size=2).connections == 2
    # The tier keeps two loads in flight per connection (prefetch's per-tier limit): the
    # server answers the second right after the first, with no round trip between chunks.
    client = RemoteClient("127.0.0.1", 1, options=ClientOptions(pool_size=3))
    assert RemoteTier(TkvConnector(client)).read_parallelism == 6
    for bad in (0, -1, 2.0, True):
        with pytest.raises(RemoteError, match="pool_size"):
            ClientOptions(pool_size=bad)  # type: ignore[arg-type]


async def test_round_trips_are_bit_exact_over_all_connections(
    tkv_server: RemoteCacheServer,  # noqa: F811
) -> None:
    frames = {f"k{i}".encode(): os.urandom(1000 + 7919 * i) for i in range(48)}
    wholes = {key: frame_bytes(key, payload) for key, payload in frames.items()}
    options = ClientOptions(pool_size=4)
    async with RemoteClient("127.0.0.1", tkv_server.port, options=options) as client:
        parts = {
            key: encode_chunk(key, 1, [GroupSpec("uint8", (len(p),))], [p])
            for key, p in frames.items()
        }
        await asyncio.gather(*(client.put(key, parts[key]) for key in frames))
        assert all(await asyncio.gather(*(get_checked(client, key, wholes[key]) for key in frames)))
        assert client.client_stats()["connections"] == 4  # concurrent requests spread out
        assert client.client_stats()["in_flight"] == 0
    assert tkv_server.stats()["connections_total"] == 4


async def test_a_connection_dying_mid_stripe_costs_exactly_its_chunks() -> None:
    keys = [f"chunk{i}".encode() for i in range(8)]
    wholes = {key: frame_bytes(key, os.urandom(3 << 20)) for key in keys}
    async with faulty_server(wholes) as server:
        options = ClientOptions(pool_size=4, timeout_s=10)
        async with RemoteClient("127.0.0.1", server.port, options=options) as client:
            # One ping per connection opens all four, so the stripe below is deterministic:
            # chunk i goes to connection i % 4 (all equally loaded, picked in order).
            await asyncio.gather(*(client.ping() for _ in range(4)))
            assert client.client_stats()["connections"] == 4
            server.cut.add(keys[1])  # connection 1 dies half way through chunk1's answer
            results = await asyncio.gather(
                *(get_checked(client, key, wholes[key]) for key in keys), return_exceptions=True
            )
            failed = [key for key, result in zip(keys, results, strict=True) if result is not True]
            assert failed == [keys[1], keys[5]]  # connection 1's chunks, nothing else
            for key in failed:
                result = results[keys.index(key)]
                assert isinstance(result, RemoteUnavailable), result
            # The connection reopens on its next request.
            server.cut.clear()
            assert all(
                await asyncio.gather(*(get_checked(client, key, wholes[key]) for key in keys))
            )
            assert client.client_stats()["connects"] == 5


async def test_cancelling_a_get_mid_transfer_leaks_nothing_and_never_writes_afterwards() -> None:
    key = b"big"
    whole = frame_bytes(key, os.urandom(8 << 20))
    threads_before, fds_before = set(threading.enumerate()), open_fds()
    stored = {key: whole, b"small": frame_bytes(b"small", b"s" * 100)}
    async with faulty_server(stored) as server:
        server.stall.add(key)
        client = RemoteClient("127.0.0.1", server.port, options=ClientOptions(pool_size=2))
        buffer = bytearray(len(whole))
        try:
            task = asyncio.create_task(client.get_into(key, [memoryview(buffer)]))
            await server.stalled.wait()
            await asyncio.sleep(0.05)  # the first half is (being) received
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client.aborted_connections == 1
            buffer[:] = b"\xaa" * len(buffer)  # poison: the caller owns it again
            server.resume.set()  # the rest of the answer is sent now
            await asyncio.sleep(0.2)
            assert buffer == b"\xaa" * len(buffer)
            # The client goes on, over a fresh connection.
            assert await client.ping(b"still here") > 0
            assert await client.get(b"small") == frame_bytes(b"small", b"s" * 100)
        finally:
            await client.aclose()
    assert client_threads() == []
    assert set(threading.enumerate()) - threads_before == set()  # none started stays
    assert await settled(open_fds, fds_before) <= fds_before


async def test_a_stuck_server_is_bounded_by_the_timeout() -> None:
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(1 << 20):
                pass
        writer.close()

    threads_before, fds_before = set(threading.enumerate()), open_fds()
    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    options = ClientOptions(pool_size=2, timeout_s=0.3)
    buffers = [bytearray(1 << 20) for _ in range(4)]
    try:
        async with RemoteClient("127.0.0.1", port, options=options) as client:
            results = await asyncio.gather(
                *(client.get_into(b"k", [memoryview(b)]) for b in buffers),
                client.put(b"k", [os.urandom(1 << 20)]),
                client.exists([b"k"]),
                return_exceptions=True,
            )
            # Timed out, or failed with a connection that a timed-out request shut down.
            assert all(isinstance(r, RemoteTimeout | RemoteUnavailable) for r in results), results
            assert any(isinstance(r, RemoteTimeout) for r in results), results
            for buffer in buffers:
                buffer[:] = b"\x55" * len(buffer)
            await asyncio.sleep(0.1)
            assert all(buffer == b"\x55" * len(buffer) for buffer in buffers)
    finally:
        server.close()
        await server.wait_closed()
    assert client_threads() == []
    assert set(threading.enumerate()) - threads_before == set()  # none started stays
    assert await settled(open_fds, fds_before) <= fds_before


async def test_aclose_fails_requests_in_flight_and_joins_every_thread() -> None:
    key = b"big"
    async with faulty_server({key: frame_bytes(key, os.urandom(1 << 20))}) as server:
        server.stall.add(key)
        client = RemoteClient("127.0.0.1", server.port, options=ClientOptions(pool_size=3))
        await asyncio.gather(*(client.ping() for _ in range(3)))
        assert len(client_threads()) == 3
        task = asyncio.create_task(client.get_into(key, [memoryview(bytearray(1 << 20 | 64))]))
        await server.stalled.wait()
        await client.aclose()
        assert client_threads() == []
        with pytest.raises(RemoteUnavailable):
            await task
        with pytest.raises(RemoteUnavailable, match="closed"):
            await client.ping()
        await client.aclose()  # twice is fine


async def test_many_clients_at_once_keep_the_server_accounting_consistent() -> None:
    """Threads of the server put, get, evict and delete at once; its books still balance."""
    capacity = 24 << 20
    async with RemoteCacheServer(ServerOptions(port=0, capacity=capacity)) as server:
        payloads = {f"k{i}".encode(): os.urandom((1 << 20) + 4096 * i) for i in range(40)}

        async def worker(index: int) -> None:
            async with RemoteClient(
                "127.0.0.1", server.port, options=ClientOptions(pool_size=2)
            ) as client:
                for round_ in range(3):
                    mine = list(payloads)[index::4]
                    await asyncio.gather(
                        *(
                            client.put(k, encode_chunk(k, 1, [GroupSpec("uint8", (len(v),))], [v]))
                            for k, v in payloads.items()
                            if k in mine
                        )
                    )
                    for key in mine:
                        got = await client.get(key)
                        assert got is None or got == frame_bytes(key, payloads[key])
                    if round_ == 1:
                        await client.delete(mine[:2])

        await asyncio.gather(*(worker(index) for index in range(4)))
        stats = server.stats()
        assert stats["bytes_reserved"] == 0
        assert stats["bytes_used"] + stats["bytes_pooled"] <= capacity
        with server.store.lock:
            stored = list(server.store.entries)
        assert stats["bytes_used"] == sum(len(frame_bytes(key, payloads[key])) for key in stored)
        assert stats["evictions"] > 0
