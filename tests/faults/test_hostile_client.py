"""Hostile clients against ``tiered-kv serve`` in its own process (issue 11, defect 2).

One server (a token, 256 MiB of capacity, 4 s header and 5 s idle timeouts, 128 connections)
meets, one test each: headers claiming the largest meta on 100 connections, the same before
AUTH, a PUT claiming nearly all the capacity that then stalls, garbage bytes, truncated frames,
slow senders, idle connections, and more connections than the limit. After each, a real client
puts and gets a real chunk frame bit-exact, the server's RSS stayed under baseline + 64 MiB
while the hostile clients were there and is back near its baseline once they are gone. Each test
prints what it did (``pytest -s``); its assertion messages carry the same summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tiered_kv.codec import GroupSpec, encode_chunk
from tiered_kv.errors import RemoteError
from tiered_kv.tiers.remote.client import ClientOptions, RemoteClient
from tiered_kv.tiers.remote.protocol import (
    HEADER_LEN,
    ErrorCode,
    Op,
    ProtocolLimits,
    Status,
    decode_frame_header,
    pack_frame_header,
)

TOKEN = b"hostile-test-token"
CAPACITY_MIB = 256
HEADER_TIMEOUT_S = 4.0
IDLE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 128
RSS_BOUND_MIB = 64  # over baseline, while hostile clients are connected
SETTLED_MIB = 24  # over baseline, once they are gone
MIB = 1 << 20


@dataclasses.dataclass
class Served:
    process: subprocess.Popen[bytes]
    port: int
    baseline_mib: float = 0.0

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        match = re.search(r"VmRSS:\s+(\d+) kB", status)
        assert match is not None, status
        return int(match.group(1)) / 1024

    def client(self) -> RemoteClient:
        return RemoteClient(
            "127.0.0.1", self.port, token=TOKEN, options=ClientOptions(timeout_s=10.0)
        )

    async def stats(self) -> dict[str, int | float]:
        async with self.client() as client:
            return await client.stats()

    async def wait_stats(
        self, done: Callable[[dict[str, int | float]], bool], what: str, timeout_s: float = 15.0
    ) -> dict[str, int | float]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                stats = await self.stats()
            except RemoteError as exc:  # refused while closed connections still count
                if "BUSY" not in str(exc) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
                continue
            if done(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; server stats: {stats}")
            await asyncio.sleep(0.05)

    async def settled(self) -> dict[str, int | float]:
        """Stats once only the asking connection is left and no PUT holds room."""
        return await self.wait_stats(
            lambda s: s["connections"] == 1 and s["bytes_reserved"] == 0, "hostile clients to go"
        )

    async def serves_a_real_client(self) -> None:
        """PUT then GET of a real chunk frame (bf16 K/V of 64 tokens), bit-exact."""
        key = b"real-client-chunk"
        shape = (2, 64, 8, 128)
        payload = os.urandom(2 * 64 * 8 * 128 * 2)
        frame = encode_chunk(key, 64, [GroupSpec("bfloat16", shape)], [payload])
        async with self.client() as client:
            await client.put(key, frame)
            assert await client.get(key) == b"".join(bytes(part) for part in frame)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("hostile")
    (root / "token").write_bytes(TOKEN + b"\n")
    log = root / "serve.log"
    command = [
        sys.executable,
        *("-m", "tiered_kv.cli", "serve", "--port", "0"),
        *("--capacity", f"{CAPACITY_MIB}MiB", "--token-file", str(root / "token")),
        *("--header-timeout", str(HEADER_TIMEOUT_S), "--idle-timeout", str(IDLE_TIMEOUT_S)),
        *("--max-connections", str(MAX_CONNECTIONS)),
    ]
    # stderr to a file: a pipe nobody reads could fill up and stall the server.
    with log.open("wb") as stderr:
        process = subprocess.Popen(command, stderr=stderr)
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"listening on tkv://127\.0\.0\.1:(\d+)", log.read_text())):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "tiered-kv serve did not start"
            time.sleep(0.05)
        served = Served(process, int(match.group(1)))

        async def warm_up() -> None:
            await served.serves_a_real_client()
            await served.settled()

        asyncio.run(warm_up())
        served.baseline_mib = served.rss_mib()
        print(f"\n[hostile] server pid {process.pid}, baseline RSS {served.baseline_mib:.0f} MiB")
        yield served
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, log.read_text()
        assert "stopped after" in log.read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


# -- raw connections ----------------------------------------------------------------------------
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _auth() -> bytes:
    return pack_frame_header(Op.AUTH, 0, 1, len(TOKEN)) + TOKEN


async def _open(served: Served, first: bytes = b"", *, authenticated: bool = True) -> Stream:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    if authenticated:
        writer.write(_auth())
        answer = await asyncio.wait_for(reader.readexactly(HEADER_LEN), 10)
        assert decode_frame_header(answer, ProtocolLimits()).status == Status.OK
    writer.write(first)
    return reader, writer


async def _ending(stream: Stream, timeout_s: float = 15.0) -> int | None:
    """Read until the server closes; the error code of its last frame (None: none came)."""
    reader, _ = stream
    received = b""
    with contextlib.suppress(ConnectionError):  # a reset: keep what came before it
        while chunk := await asyncio.wait_for(reader.read(65536), timeout_s):
            received += chunk
    code = None
    while len(received) >= HEADER_LEN:
        header = decode_frame_header(received[:HEADER_LEN], ProtocolLimits())
        meta = received[HEADER_LEN : HEADER_LEN + header.meta_len]
        if header.status == Status.ERROR and len(meta) >= 2:
            code = int.from_bytes(meta[:2], "little")
        received = received[HEADER_LEN + header.meta_len + header.data_len :]
    return code


def _close(streams: list[Stream]) -> None:
    for _, writer in streams:
        writer.close()


async def _recover(served: Served, streams: list[Stream]) -> tuple[dict[str, int | float], float]:
    """Close the hostile ``streams``; once the server settled it serves a real client. The
    settled stats and the RSS then."""
    _close(streams)
    settled = await served.settled()
    await served.serves_a_real_client()
    return settled, served.rss_mib()


def _report(
    served: Served, name: str, during_mib: float, after_mib: float, **counts: object
) -> str:
    extra = ", ".join(f"{key} {value}" for key, value in counts.items())
    summary = (
        f"{name}: RSS baseline {served.baseline_mib:.0f} MiB, with the clients "
        f"{during_mib:.0f} MiB, after {after_mib:.0f} MiB; {extra}"
    )
    print(f"[hostile] {summary}")
    return summary


def _check_rss(served: Served, during_mib: float, after_mib: float, summary: str) -> None:
    assert during_mib < served.baseline_mib + RSS_BOUND_MIB, summary
    assert after_mib < served.baseline_mib + SETTLED_MIB, summary


# -- the hostile clients ------------------------------------------------------------------------
async def test_headers_claiming_the_largest_meta(server: Served) -> None:
    started = time.monotonic()
    before = await server.stats()
    claim = pack_frame_header(Op.EXISTS, 0, 2, ProtocolLimits().max_meta_bytes)
    streams = [await _open(server, claim) for _ in range(100)]
    stats = await server.wait_stats(
        lambda s: s["bytes_in"] >= before["bytes_in"] + 100 * (len(_auth()) + HEADER_LEN),
        "100 headers",
    )
    during = server.rss_mib()
    await server.serves_a_real_client()
    _close(streams)
    settled = await server.settled()
    after = server.rss_mib()
    summary = _report(
        server,
        "100 connections claiming 4 MiB metas",
        during,
        after,
        open=stats["connections"] - 1,
        receive_buffers_mib=round(stats["bytes_receive_buffers"] / MIB, 1),
        buffers_after_mib=round(settled["bytes_receive_buffers"] / MIB, 2),
        seconds=round(time.monotonic() - started, 1),
    )
    assert stats["bytes_receive_buffers"] <= 101 * (64 << 10), summary
    _check_rss(server, during, after, summary)


async def test_big_claims_before_auth(server: Served) -> None:
    started = time.monotonic()
    max_meta = ProtocolLimits().max_meta_bytes
    streams = [
        await _open(server, pack_frame_header(Op.EXISTS, 0, 2, max_meta), authenticated=False)
        for _ in range(50)
    ]
    streams += [
        await _open(server, pack_frame_header(Op.AUTH, 0, 2, max_meta), authenticated=False)
        for _ in range(50)
    ]
    during = server.rss_mib()
    codes = await asyncio.gather(*(_ending(stream) for stream in streams))
    _, after = await _recover(server, streams)
    summary = _report(
        server,
        "100 unauthenticated connections claiming 4 MiB metas",
        during,
        after,
        auth_required=codes.count(ErrorCode.AUTH_REQUIRED),
        frame_too_large=codes.count(ErrorCode.FRAME_TOO_LARGE),
        seconds=round(time.monotonic() - started, 1),
    )
    assert codes == [ErrorCode.AUTH_REQUIRED] * 50 + [ErrorCode.FRAME_TOO_LARGE] * 50, summary
    _check_rss(server, during, after, summary)


async def test_a_huge_put_that_stalls(server: Served) -> None:
    started = time.monotonic()
    keys = [f"stored-{i}".encode() for i in range(8)]
    async with server.client() as client:
        for key in keys:
            frame = encode_chunk(
                key, 16, [GroupSpec("uint8", (256 << 10,))], [os.urandom(256 << 10)]
            )
            await client.put(key, frame)
    before = await server.stats()
    claim = pack_frame_header(Op.PUT, 0, 2, 4, (CAPACITY_MIB - 1) * MIB) + b"huge" + b"x" * 100
    stream = await _open(server, claim)
    stats = await server.wait_stats(
        lambda s: s["bytes_in"] >= before["bytes_in"] + len(_auth()) + len(claim), "the claim"
    )
    during = server.rss_mib()
    await server.serves_a_real_client()
    async with server.client() as client:
        still_stored = sum(await client.exists(keys))
    _close([stream])
    settled = await server.settled()
    async with server.client() as client:
        await client.delete(keys)
    after = server.rss_mib()
    summary = _report(
        server,
        f"a PUT claiming {CAPACITY_MIB - 1} MiB, 100 bytes sent",
        during,
        after,
        reserved_kib=stats["bytes_reserved"] // 1024,
        evicted=settled["evictions"] - before["evictions"],
        still_stored=f"{still_stored}/{len(keys)}",
        seconds=round(time.monotonic() - started, 1),
    )
    assert stats["bytes_reserved"] <= MIB, summary
    assert still_stored == len(keys), summary
    assert settled["evictions"] == before["evictions"], summary
    _check_rss(server, during, after, summary)


async def test_garbage_bytes(server: Served) -> None:
    started = time.monotonic()
    streams = [await _open(server, os.urandom(64 << 10), authenticated=False) for _ in range(20)]
    streams += [await _open(server, os.urandom(64 << 10)) for _ in range(20)]
    during = server.rss_mib()
    # The server answers BAD_FRAME and closes; with our unread garbage left on its side the
    # close may be a reset that drops the answer, so only count that each one was closed.
    endings = await asyncio.gather(*(_ending(stream) for stream in streams))
    _, after = await _recover(server, streams)
    summary = _report(
        server,
        "40 connections sending 64 KiB of random bytes",
        during,
        after,
        closed=len(endings),
        bad_frame_answers=endings.count(ErrorCode.BAD_FRAME),
        seconds=round(time.monotonic() - started, 1),
    )
    assert all(code in (None, ErrorCode.BAD_FRAME) for code in endings), summary
    _check_rss(server, during, after, summary)


async def test_truncated_frames(server: Served) -> None:
    started = time.monotonic()
    cut_meta = pack_frame_header(Op.EXISTS, 0, 2, 1000) + b"m" * 500
    cut_data = pack_frame_header(Op.PUT, 0, 3, 1, 8 * MIB) + b"k" + os.urandom(MIB)
    cut_header = pack_frame_header(Op.PING, 0, 4, 0)[:10]
    streams = []
    for first in (cut_meta, cut_data, cut_header):
        streams += [await _open(server, first) for _ in range(10)]
    for _, writer in streams:
        await writer.drain()
    during = server.rss_mib()
    # The frames stay cut: the connections end half way through them.
    settled, after = await _recover(server, streams)
    summary = _report(
        server,
        "30 connections closed half way through a header, a meta or a PUT's data",
        during,
        after,
        reserved_after=settled["bytes_reserved"],
        receive_buffers_after_kib=settled["bytes_receive_buffers"] // 1024,
        seconds=round(time.monotonic() - started, 1),
    )
    assert settled["bytes_receive_buffers"] <= 64 << 10, summary  # the asking connection's
    _check_rss(server, during, after, summary)


async def _trickle(stream: Stream, data: bytes, gap_s: float) -> None:
    with contextlib.suppress(ConnectionError):
        for byte in data:
            if stream[0].at_eof():  # the server closed: more bytes would only draw a reset
                return
            stream[1].write(bytes([byte]))
            await stream[1].drain()
            await asyncio.sleep(gap_s)


async def test_slow_senders(server: Served) -> None:
    started = time.monotonic()
    ping = pack_frame_header(Op.PING, 0, 2, 16) + b"slow but honest!"
    honest = [await _open(server) for _ in range(5)]
    slowloris = [await _open(server) for _ in range(5)]
    slow_auth = [await _open(server, authenticated=False) for _ in range(5)]
    # Honest: the whole request within the header timeout, a byte at a time.
    honest_gap = HEADER_TIMEOUT_S / len(ping) / 4
    sends = [_trickle(stream, ping, honest_gap) for stream in honest]
    # Hostile: far slower than the header timeout allows, for a request or for AUTH.
    sends += [_trickle(stream, ping, 0.5) for stream in slowloris]
    sends += [_trickle(stream, _auth(), 0.5) for stream in slow_auth]
    senders = [asyncio.create_task(send) for send in sends]
    answers = [
        await asyncio.wait_for(reader.readexactly(HEADER_LEN + 16), 10) for reader, _ in honest
    ]
    during = server.rss_mib()
    endings = await asyncio.gather(*(_ending(stream) for stream in slowloris + slow_auth))
    timed_out_s = time.monotonic() - started
    for sender in senders:
        sender.cancel()
    await asyncio.gather(*senders, return_exceptions=True)
    _, after = await _recover(server, honest + slowloris + slow_auth)
    summary = _report(
        server,
        "15 slow senders (a byte at a time)",
        during,
        after,
        honest_answered=sum(answer.endswith(b"slow but honest!") for answer in answers),
        timed_out=endings.count(ErrorCode.TIMEOUT),
        closed_after_s=round(timed_out_s, 1),
    )
    assert all(answer.endswith(b"slow but honest!") for answer in answers), summary
    assert endings == [ErrorCode.TIMEOUT] * 10, summary
    _check_rss(server, during, after, summary)


@pytest.mark.slow
async def test_idle_connections(server: Served) -> None:
    started = time.monotonic()
    idle = [await _open(server) for _ in range(20)]
    unauthenticated = [await _open(server, authenticated=False) for _ in range(10)]
    during = server.rss_mib()
    endings = await asyncio.gather(*(_ending(stream) for stream in idle + unauthenticated))
    closed_after_s = time.monotonic() - started
    _, after = await _recover(server, idle + unauthenticated)
    summary = _report(
        server,
        "30 idle connections (10 never authenticated)",
        during,
        after,
        timed_out=endings.count(ErrorCode.TIMEOUT),
        closed_after_s=round(closed_after_s, 1),
    )
    assert endings == [ErrorCode.TIMEOUT] * 30, summary
    assert closed_after_s >= IDLE_TIMEOUT_S * 0.9, summary
    _check_rss(server, during, after, summary)


async def test_more_connections_than_the_limit(server: Served) -> None:
    started = time.monotonic()
    await server.settled()
    held = [await _open(server) for _ in range(MAX_CONNECTIONS)]  # each answered: all counted
    surplus = [await _open(server, authenticated=False) for _ in range(20)]
    endings = await asyncio.gather(*(_ending(stream, 5.0) for stream in surplus))
    during = server.rss_mib()
    stats, after = await _recover(server, held + surplus)
    summary = _report(
        server,
        f"{MAX_CONNECTIONS} connections held, 20 more",
        during,
        after,
        busy=endings.count(ErrorCode.BUSY),
        refused_total=stats["connections_refused"],
        seconds=round(time.monotonic() - started, 1),
    )
    assert endings == [ErrorCode.BUSY] * 20, summary
    _check_rss(server, during, after, summary)
