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
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.remote_fixtures import free_port, tkv_server  # noqa: F401
from tiered_kv.cli import main
from tiered_kv.codec import GroupSpec, encode_chunk
from tiered_kv.errors import (
    ConfigError,
    ProtocolError,
    RemoteAuthError,
    RemoteError,
    RemoteUnavailable,
)
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


async def test_segments_of_deleted_and_evicted_frames_serve_puts_of_their_size() -> None:
    payloads = {f"k{i}".encode(): os.urandom(1 << 20) for i in range(10)}
    size = len(frame_bytes(b"k0", payloads[b"k0"]))
    options = ServerOptions(port=0, capacity=8 * size)  # pools up to 2 frames
    async with (
        RemoteCacheServer(options) as server,
        RemoteClient("127.0.0.1", server.port) as client,
    ):
        keys = list(payloads)
        for key in keys[:8]:
            await client.put(key, frame(key, payloads[key]))
        assert await client.delete([b"k0"]) == [True]
        assert server.stats()["bytes_pooled"] == size
        await client.put(b"k8", frame(b"k8", payloads[b"k8"]))  # built from k0's segments
        assert server.stats()["bytes_pooled"] == 0
        # Full: the next PUT evicts k1, and k1's segments become the new frame's.
        await client.put(b"k9", frame(b"k9", payloads[b"k9"]))
        stats = server.stats()
        assert (stats["evictions"], stats["bytes_pooled"]) == (1, 0)
        assert stats["bytes_used"] == 8 * size
        for key in keys[2:]:
            assert await client.get(key) == frame_bytes(key, payloads[key])


async def test_segments_a_get_is_still_sending_are_not_reused() -> None:
    # A connection's thread sends views of the stored segments; its reader does not read, so
    # the views stay held while the value is deleted and its size is put again.
    first, second = os.urandom(32 << 20), os.urandom(32 << 20)
    whole = frame_bytes(b"k", first)

    async with (
        RemoteCacheServer(ServerOptions(port=0, capacity=1 << 30)) as server,
        RemoteClient("127.0.0.1", server.port) as client,
    ):
        await client.put(b"k", frame(b"k", first))
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            writer.write(pack_frame_header(Op.GET, 0, 1, 1) + b"k")  # not read yet
            await _until(lambda: server.stats()["gets"] == 1, "the GET")
            assert await client.delete([b"k"]) == [True]
            assert server.stats()["bytes_pooled"] < len(whole)  # the unsent stay out
            await client.put(b"k2", frame(b"k2", second))  # takes what was pooled
            answer = await reader.readexactly(HEADER_LEN + len(whole))
            assert answer[HEADER_LEN:] == whole
        finally:
            writer.close()
        assert await client.get(b"k2") == frame_bytes(b"k2", second)


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


# -- hostile clients ------------------------------------------------------------------------------
async def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _frames(answer: bytes) -> list[tuple[int, int, bytes]]:
    """(op, status, meta) of each frame in ``answer`` (frames without data)."""
    frames = []
    while answer:
        header = decode_frame_header(answer[:HEADER_LEN], ProtocolLimits())
        end = HEADER_LEN + header.meta_len
        frames.append((header.op, header.status, answer[HEADER_LEN:end]))
        answer = answer[end + header.data_len :]
    return frames


def _auth(token: bytes, request_id: int = 1) -> bytes:
    return pack_frame_header(Op.AUTH, 0, request_id, len(token)) + token


async def test_a_header_claiming_a_big_meta_allocates_only_as_the_meta_arrives(
    tkv_server: RemoteCacheServer,  # noqa: F811
) -> None:
    stats = tkv_server.stats
    streams = [await asyncio.open_connection("127.0.0.1", tkv_server.port) for _ in range(20)]
    try:
        for index, (_, writer) in enumerate(streams):
            writer.write(pack_frame_header(Op.EXISTS, 0, index, 4 << 20))  # 4 MiB claimed
        await _until(lambda: stats()["bytes_in"] >= 20 * HEADER_LEN, "20 headers")
        assert stats()["connections"] == 20
        held = stats()["bytes_receive_buffers"]
        assert held <= 20 * (64 << 10), f"20 headers alone hold {held} bytes of buffers"
        # Meta that arrives grows one buffer, by at most twice what came.
        streams[0][1].write(os.urandom(1 << 20))
        await _until(lambda: stats()["bytes_in"] >= 20 * HEADER_LEN + (1 << 20), "1 MiB of meta")
        grown = stats()["bytes_receive_buffers"] - held
        assert 0 < grown <= 2 * (HEADER_LEN + (1 << 20)), grown
    finally:
        for _, writer in streams:
            writer.close()
    await _until(lambda: stats()["connections"] == 0, "connections to close")
    assert stats()["bytes_receive_buffers"] == 0, "closed connections give their buffers back"


async def test_before_auth_only_a_small_auth_frame_is_read() -> None:
    async with RemoteCacheServer(ServerOptions(port=0, token=b"s3cret")) as server:
        # Answered on the header alone: nothing waits for (or allocates) the claimed meta.
        answer = await _raw_exchange(server.port, pack_frame_header(Op.EXISTS, 0, 5, 4 << 20))
        assert _error_code(answer) == ErrorCode.AUTH_REQUIRED
        answer = await _raw_exchange(server.port, pack_frame_header(Op.AUTH, 0, 6, 1 << 20))
        assert _error_code(answer) == ErrorCode.FRAME_TOO_LARGE
        answer = await _raw_exchange(server.port, pack_frame_header(Op.AUTH, 0, 7, 6, 1 << 20))
        assert _error_code(answer) == ErrorCode.BAD_FRAME  # AUTH carries no data
        await _until(lambda: server.stats()["connections"] == 0, "connections to close")
        assert server.stats()["bytes_receive_buffers"] == 0
        async with RemoteClient("127.0.0.1", server.port, token=b"s3cret") as client:
            await client.put(b"k", frame(b"k", b"v" * 100))
            assert await client.exists([b"k"]) == [True]
        assert server.stats()["protocol_errors"] == 3


def test_server_options_validate_the_connection_bounds() -> None:
    with pytest.raises(ConfigError, match="max_auth_bytes"):
        ServerOptions(token=b"x" * 65, max_auth_bytes=64)
    for name, value in (
        ("max_connections", 0),
        ("header_timeout_s", -1.0),
        ("idle_timeout_s", 0.0),
        ("max_auth_bytes", 0),
        ("read_delay_s", -0.5),
        ("read_delay_s", float("nan")),
    ):
        with pytest.raises(ConfigError, match=name):
            ServerOptions(**{name: value})  # type: ignore[arg-type]


async def test_a_put_reserves_and_evicts_only_as_its_data_arrives() -> None:
    options = ServerOptions(port=0, capacity=64 << 20)
    async with (
        RemoteCacheServer(options) as server,
        RemoteClient("127.0.0.1", server.port) as client,
    ):
        payloads = {f"k{i}".encode(): os.urandom(1 << 20) for i in range(8)}
        for key, payload in payloads.items():
            await client.put(key, frame(key, payload))
        bytes_in = server.stats()["bytes_in"]
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            # Claims 63 of the 64 MiB, sends 100 bytes, stalls.
            writer.write(pack_frame_header(Op.PUT, 0, 1, 4, 63 << 20) + b"huge" + b"x" * 100)
            await _until(
                lambda: server.stats()["bytes_in"] >= bytes_in + HEADER_LEN + 104, "the claim"
            )
            stats = server.stats()
            assert stats["evictions"] == 0
            assert stats["bytes_reserved"] <= 1 << 20, stats["bytes_reserved"]
            assert await client.exists(list(payloads)) == [True] * len(payloads)
            real = os.urandom(8 << 20)
            await client.put(b"real", frame(b"real", real))
            assert await client.get(b"real") == frame_bytes(b"real", real)
        finally:
            writer.close()
        await _until(lambda: server.stats()["connections"] == 1, "the stalled PUT to close")
        assert server.stats()["bytes_reserved"] == 0
        assert server.stats()["evictions"] == 0


async def test_a_put_that_cannot_get_room_midway_is_refused_and_the_stream_goes_on() -> None:
    payload = os.urandom(3 << 20)
    size = len(frame_bytes(b"a", payload))
    async with (
        RemoteCacheServer(ServerOptions(port=0, capacity=size + (1 << 20))) as server,
        RemoteClient("127.0.0.1", server.port) as client,
    ):
        _, writer = await asyncio.open_connection("127.0.0.1", server.port)
        try:
            # A PUT in flight that has really sent 2 MiB holds that room ...
            writer.write(pack_frame_header(Op.PUT, 0, 1, 1, size) + b"b" + b"x" * (2 << 20))
            await _until(lambda: server.stats()["bytes_reserved"] >= 2 << 20, "a reservation")
            # ... so this one runs out of room part way and is refused; the connection goes on.
            with pytest.raises(RemoteError, match="NO_SPACE"):
                await client.put(b"a", frame(b"a", payload))
            assert await client.exists([b"a"]) == [False]
        finally:
            writer.close()
        await _until(lambda: server.stats()["connections"] == 1, "the hostile PUT to close")
        await client.put(b"a", frame(b"a", payload))
        assert await client.get(b"a") == frame_bytes(b"a", payload)
        stats = server.stats()
        assert stats["bytes_reserved"] == 0
        assert stats["put_refused"] == 1


async def test_header_and_idle_timeouts_close_stalled_connections() -> None:
    options = ServerOptions(port=0, token=b"t", header_timeout_s=0.5, idle_timeout_s=1.0)
    async with RemoteCacheServer(options) as server:
        port = server.port
        ping = pack_frame_header(Op.PING, 0, 2, 10) + b"0123456789"
        # Half a header, then nothing: closed after the header timeout.
        answer = await _raw_exchange(port, _auth(b"t") + ping[:10], idle_s=5)
        assert [status for _, status, _ in _frames(answer)] == [Status.OK, Status.ERROR]
        assert _error_code(answer[HEADER_LEN:]) == ErrorCode.TIMEOUT
        # Connected, never authenticated: closed after the header timeout too.
        assert _error_code(await _raw_exchange(port, b"", idle_s=5)) == ErrorCode.TIMEOUT
        # A slow sender within the header timeout is served.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_auth(b"t"))
        for byte in ping:
            writer.write(bytes([byte]))
            await asyncio.sleep(0.002)
        answer = await reader.readexactly(2 * HEADER_LEN + 10)
        assert answer.endswith(b"0123456789")
        # Then idle: closed after the idle timeout.
        loop = asyncio.get_running_loop()
        started = loop.time()
        rest = await asyncio.wait_for(reader.read(), 5)
        assert _error_code(rest) == ErrorCode.TIMEOUT
        assert loop.time() - started >= 0.9
        writer.close()
        stats = server.stats()
        assert (stats["header_timeouts"], stats["idle_timeouts"]) == (2, 1)
        # A pooled client whose idle connection the server closed just opens another.
        async with RemoteClient("127.0.0.1", port, token=b"t") as client:
            await client.put(b"k", frame(b"k", b"v" * 100))
            await asyncio.sleep(1.4)
            assert await client.exists([b"k"]) == [True]
            assert client.client_stats()["connects"] == 2


async def test_connections_beyond_the_limit_are_refused() -> None:
    async with RemoteCacheServer(ServerOptions(port=0, max_connections=3)) as server:
        streams = [await asyncio.open_connection("127.0.0.1", server.port) for _ in range(3)]
        await _until(lambda: server.stats()["connections"] == 3, "3 connections")
        answer = await _raw_exchange(server.port, b"")
        assert _error_code(answer) == ErrorCode.BUSY
        assert server.stats()["connections_refused"] == 1
        streams.pop()[1].close()
        await _until(lambda: server.stats()["connections"] == 2, "one to close")
        async with RemoteClient("127.0.0.1", server.port) as client:
            assert await client.exists([b"k"]) == [False]
        for _, writer in streams:
            writer.close()


def test_cli_serve_takes_the_connection_bounds(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    port = free_port()
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "tiered_kv.cli", "serve", "--port", str(port)),
            *("--token-file", str(token_file), "--max-connections", "1"),
            *("--header-timeout", "0.5", "--idle-timeout", "0", "--max-auth-bytes", "8"),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert "at most 1 connections" in line, line

        async def check() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(_auth(b"t0ken"))
            assert _frames(await reader.readexactly(HEADER_LEN))[0][1] == Status.OK
            assert _error_code(await _raw_exchange(port, b"")) == ErrorCode.BUSY
            writer.close()
            for _ in range(100):  # until the server has seen that close ...
                code = _error_code(await _raw_exchange(port, b"", idle_s=5))
                if code != ErrorCode.BUSY:
                    break
            assert code == ErrorCode.TIMEOUT  # ... then no AUTH within --header-timeout
            # Only the header: bytes the server never reads could turn its close into a reset.
            too_long = pack_frame_header(Op.AUTH, 0, 2, 9)
            assert _error_code(await _raw_exchange(port, too_long)) == ErrorCode.FRAME_TOO_LARGE

        asyncio.run(check())
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=20)
        assert process.returncode == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_cli_serve_refuses_a_token_over_max_auth_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    assert main(["serve", "--token-file", str(token_file), "--max-auth-bytes", "4"]) == 2
    assert "max_auth_bytes=4" in capsys.readouterr().err
