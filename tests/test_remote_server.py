"""The tkv server and client: operations, pipelining, limits, auth, bad clients, shutdown, CLI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.remote_fixtures import free_port, tkv_server  # noqa: F401
from tiered_kv.codec import GroupSpec, encode_chunk
from tiered_kv.errors import ProtocolError, RemoteAuthError, RemoteError, RemoteUnavailable
from tiered_kv.tiers.remote.client import ClientOptions, RemoteClient
from tiered_kv.tiers.remote.connector import FetchStatus
from tiered_kv.tiers.remote.protocol import (
    HEADER_LEN,
    ErrorCode,
    Op,
    ProtocolLimits,
    Status,
    decode_frame_header,
    pack_frame_header,
)
from tiered_kv.tiers.remote.server import RemoteCacheServer, ServerOptions


def frame(key: bytes, payload: bytes, tokens: int = 3) -> list[bytes | memoryview]:
    return encode_chunk(key, tokens, [GroupSpec("uint8", (len(payload),))], [payload])


def frame_bytes(key: bytes, payload: bytes) -> bytes:
    return b"".join(bytes(part) for part in frame(key, payload))


async def test_put_get_exists_delete_stats_ping(tkv_server: RemoteCacheServer) -> None:  # noqa: F811
    async with RemoteClient("127.0.0.1", tkv_server.port) as client:
        assert await client.ping(b"abc") >= 0
        payload = os.urandom(100_000)
        await client.put(b"k1", frame(b"k1", payload))
        assert await client.exists([b"k1", b"k2", b"k1"]) == [True, False, True]
        assert await client.get(b"k1") == frame_bytes(b"k1", payload)
        assert await client.get(b"k2") is None
        stats = await client.stats()
        assert stats["entries"] == 1
        assert stats["hits"] == 1
        assert stats["misses"] == 1
        assert await client.delete([b"k1", b"k2"]) == [True, False]
        assert await client.exists([b"k1"]) == [False]


async def test_get_into_receives_into_the_callers_buffers(
    tkv_server: RemoteCacheServer,  # noqa: F811
) -> None:
    async with RemoteClient("127.0.0.1", tkv_server.port) as client:
        payload = os.urandom(3 * 4096 + 17)
        whole = frame_bytes(b"key", payload)
        await client.put(b"key", frame(b"key", payload))
        header = bytearray(len(whole) - len(payload))
        first, second = bytearray(5000), bytearray(len(payload) - 5000)
        buffers = [memoryview(header), memoryview(first), memoryview(second)]
        assert await client.get_into(b"key", buffers) == FetchStatus.HIT
        assert bytes(header) + first + second == whole
        small = [memoryview(bytearray(100))]
        assert await client.get_into(b"key", small) == FetchStatus.SIZE_MISMATCH
        assert await client.get_into(b"nope", buffers) == FetchStatus.MISSING
        # The connection is still in step after a discarded answer.
        assert await client.exists([b"key"]) == [True]


async def test_many_pipelined_requests_on_few_connections(
    tkv_server: RemoteCacheServer,  # noqa: F811
) -> None:
    options = ClientOptions(pool_size=2)
    async with RemoteClient("127.0.0.1", tkv_server.port, options=options) as client:
        payloads = {f"k{i}".encode(): os.urandom(1000 + i) for i in range(200)}
        await asyncio.gather(*(client.put(k, frame(k, v)) for k, v in payloads.items()))
        got = await asyncio.gather(*(client.get(k) for k in payloads))
        assert got == [frame_bytes(k, v) for k, v in payloads.items()]
        assert client.client_stats()["connections"] <= 2
    assert tkv_server.stats()["puts"] == 200


async def test_capacity_bound_evicts_least_recently_used() -> None:
    payload = os.urandom(60_000)
    size = len(frame_bytes(b"a", payload))
    options = ServerOptions(port=0, capacity=3 * size + 10)
    async with (
        RemoteCacheServer(options) as server,
        RemoteClient("127.0.0.1", server.port) as client,
    ):
        for key in (b"a", b"b", b"c"):
            await client.put(key, frame(key, payload))
        assert await client.get(b"a") is not None  # a is now the most recent
        await client.put(b"d", frame(b"d", payload))
        assert await client.exists([b"a", b"b", b"c", b"d"]) == [True, False, True, True]
        stats = server.stats()
        assert stats["bytes_used"] <= server.options.capacity
        assert stats["evictions"] == 1
        with pytest.raises(RemoteError, match="NO_SPACE"):
            await client.put(b"big", frame(b"big", os.urandom(4 * size)))
        assert await client.exists([b"d"]) == [True]  # the connection still works


async def test_put_of_something_else_than_a_chunk_frame_is_refused(
    tkv_server: RemoteCacheServer,  # noqa: F811
) -> None:
    async with RemoteClient("127.0.0.1", tkv_server.port) as client:
        with pytest.raises(RemoteError, match="BAD_REQUEST"):
            await client.put(b"k", [os.urandom(9000)])
        with pytest.raises(RemoteError, match="differs"):
            await client.put(b"k", frame(b"other", b"x" * 10))
        assert await client.exists([b"k", b"other"]) == [False, False]


async def test_wrong_or_missing_token_is_rejected() -> None:
    options = ServerOptions(port=0, token=b"s3cret")
    async with RemoteCacheServer(options) as server:
        fast = ClientOptions(timeout_s=2.0, backoff_initial_s=0.01)
        async with RemoteClient("127.0.0.1", server.port, token=b"wrong", options=fast) as bad:
            with pytest.raises(RemoteAuthError, match="AUTH_FAILED"):
                await bad.exists([b"k"])
        async with RemoteClient("127.0.0.1", server.port, options=fast) as anonymous:
            with pytest.raises((RemoteAuthError, RemoteUnavailable)):
                await anonymous.exists([b"k"])
        async with RemoteClient("127.0.0.1", server.port, token=b"s3cret") as good:
            await good.put(b"k", frame(b"k", b"v" * 100))
            assert await good.exists([b"k"]) == [True]
        assert server.stats()["auth_failures"] == 1


async def _raw_exchange(port: int, data: bytes, idle_s: float = 2.0) -> bytes:
    """Send ``data`` on a fresh socket; what the server sends until it closes or is idle."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        chunks = []
        while True:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), idle_s)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def _error_code(answer: bytes) -> int:
    header = decode_frame_header(answer[:HEADER_LEN], ProtocolLimits())
    assert header.status == Status.ERROR
    (code,) = struct.unpack_from("<H", answer, HEADER_LEN)
    return int(code)


async def test_garbage_and_oversized_frames_close_only_that_connection(
    tkv_server: RemoteCacheServer,  # noqa: F811
) -> None:
    async with RemoteClient("127.0.0.1", tkv_server.port) as client:
        await client.put(b"k", frame(b"k", b"v" * 1000))
        answer = await _raw_exchange(tkv_server.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _error_code(answer) == ErrorCode.BAD_FRAME
        huge = pack_frame_header(Op.PUT, 0, 7, 1, 1 << 50) + b"k"
        answer = await _raw_exchange(tkv_server.port, huge)
        assert _error_code(answer) == ErrorCode.FRAME_TOO_LARGE
        big_meta = pack_frame_header(Op.EXISTS, 0, 8, 0xFFFFFFFF)
        answer = await _raw_exchange(tkv_server.port, big_meta)
        assert _error_code(answer) == ErrorCode.FRAME_TOO_LARGE
        bad_list = pack_frame_header(Op.EXISTS, 0, 9, 4) + b"\xff\xff\x00\x00"
        ping = pack_frame_header(Op.PING, 0, 10, 2) + b"ok"
        answer = await _raw_exchange(tkv_server.port, bad_list + ping, idle_s=0.3)
        assert _error_code(answer) == ErrorCode.BAD_REQUEST  # per request: the stream goes on
        assert answer.endswith(b"ok")
        # A client that dies half way through a PUT's data releases its reservation.
        torn = pack_frame_header(Op.PUT, 0, 11, 1, 1 << 20) + b"k" + b"x" * 1000
        await _raw_exchange(tkv_server.port, torn, idle_s=0.1)
        assert await client.get(b"k") is not None
        assert await client.exists([b"k"]) == [True]
    await asyncio.sleep(0.05)
    stats = tkv_server.stats()
    assert stats["protocol_errors"] == 3
    assert stats["bytes_reserved"] == 0


async def test_many_concurrent_clients(tkv_server: RemoteCacheServer) -> None:  # noqa: F811
    async def one(index: int) -> bool:
        key = f"c{index}".encode()
        async with RemoteClient("127.0.0.1", tkv_server.port) as client:
            await client.put(key, frame(key, os.urandom(5000)))
            return (await client.exists([key])) == [True]

    assert all(await asyncio.gather(*(one(i) for i in range(40))))
    assert tkv_server.stats()["connections_total"] >= 40


async def test_server_down_fails_fast_with_backoff_then_recovers() -> None:
    port = free_port()
    options = ClientOptions(timeout_s=1.0, backoff_initial_s=0.05, backoff_max_s=0.2)
    async with RemoteClient("127.0.0.1", port, options=options) as client:
        with pytest.raises(RemoteUnavailable, match="cannot connect"):
            await client.ping()
        with pytest.raises(RemoteUnavailable, match="retrying"):
            await client.ping()  # inside the backoff window: no connect attempt
        assert client.connect_failures == 1
        async with RemoteCacheServer(ServerOptions(port=port)):
            for _ in range(50):
                try:
                    await client.ping()
                    break
                except RemoteUnavailable:
                    await asyncio.sleep(0.05)
            assert await client.exists([b"x"]) == [False]
        with pytest.raises(RemoteError):
            await client.ping()  # the server closed our connection on shutdown


async def test_graceful_shutdown_finishes_answers_then_closes() -> None:
    server = RemoteCacheServer(ServerOptions(port=0))
    await server.start()
    client = RemoteClient("127.0.0.1", server.port)
    try:
        await client.put(b"k", frame(b"k", os.urandom(2 << 20)))
        assert server.stats()["connections"] == 1
        await server.aclose(grace_s=2.0)
        assert server.stats()["connections"] == 0
        with pytest.raises(RemoteError):
            await client.exists([b"k"])
        await server.aclose()  # twice is fine
    finally:
        await client.aclose()


async def test_server_protocol_error_from_a_server_that_is_not_ours() -> None:
    async def fake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(10)
        writer.write(b"+OK not a tkv server\r\n" * 4)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(fake, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with RemoteClient("127.0.0.1", port) as client:
            with pytest.raises((ProtocolError, RemoteUnavailable)):
                await client.ping()
    finally:
        server.close()
        await server.wait_closed()


def test_cli_serve_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tiered_kv.cli",
            "serve",
            "--port",
            str(port),
            "--capacity",
            "64MiB",
            "--token-file",
            str(token_file),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert f"listening on tkv://127.0.0.1:{port}" in line, line
        assert "token auth" in line

        async def check() -> None:
            async with RemoteClient("127.0.0.1", port, token=b"t0ken") as client:
                await client.put(b"k", frame(b"k", b"v" * 10))
                assert await client.exists([b"k"]) == [True]

        asyncio.run(check())
        with socket.create_connection(("127.0.0.1", port)):
            pass
        process.send_signal(signal.SIGTERM)
        rest = process.communicate(timeout=20)[1]
        assert process.returncode == 0
        assert "stopped after" in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
