"""Remote-tier (L3) benchmark on loopback, with the socket ceilings measured in the same run.

Measures, in one run:
1. The raw ceilings: 1..8 loopback TCP streams at once (``--quick``: 1, 2, 4, 8 and our
   connection count), a process per end (`ceilings.loopback_tcp_gbps`: 32 MiB messages, a
   1-byte ack per message, so it is paced like a request / response; median of three passes).
2. Our server (``tiered-kv serve`` in its own process) through `RemoteTier`: PUT (checksum,
   frame, send) and GET (receive straight into the L1 buffer, verify) of 32 MiB chunks: one
   connection with one request at a time (``x1``, against the 1-stream ceiling), and the
   prefetch's shape, a 16-chunk load with K `get_into` in flight (the tier's
   ``read_parallelism``) over the client's default pool of K connections (``xK``, K =
   `default_pool_size`, against the K-stream ceiling); GB/s, p50 / p99.
3. The same through redis-server (own process) and `RedisConnector` (pool of 1, then K).
4. The same through Mooncake Store: ``mooncake_master`` and a pool node (``mooncake_client``
   lending the segment that holds the chunks) in their own processes, and `MooncakeConnector`
   (lending no segment itself, so every byte crosses a socket as with the others), its gets
   batched; needs the ``mooncake`` extra. Its rows are held against the raw socket with as
   many streams as its transfer engine opened to the pool node for them (counted in /proc).

Every PUT is of a new key (Mooncake answers a put of a key it holds without moving a byte) and
every GET reads what its round put, into zeroed buffers; rounds remove their keys, untimed.
5. ``contains_many`` of 512 keys (one round trip) against each.

Usage: ``tiered-kv bench remote [--quick] [--out DIR] [--no-plot]`` (or ``python
bench/remote.py`` in a clone). Details go to stderr; the table of ratios is printed last on
stdout; ``DIR/remote.png`` (needs the ``bench`` extra: matplotlib) plots PUT and GET GB/s beside
the raw socket by streams.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import importlib.util
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tiered_kv.benchmarks import ceilings
from tiered_kv.benchmarks.common import (
    DEFAULT_OUT,
    bar_chart,
    free_port,
    load_pyplot,
    percentile,
    process,
    run_on_engine_loop,
)
from tiered_kv.benchmarks.progress import Progress, print_line
from tiered_kv.keys import ChunkKey, KeyScope, chunk_keys
from tiered_kv.layout import MemoryLayoutDesc, build_layout
from tiered_kv.memory import HostArena, MemoryObj
from tiered_kv.tiers.l3_remote import RemoteTier
from tiered_kv.tiers.remote.client import ClientOptions, RemoteClient, TkvConnector
from tiered_kv.tiers.remote.connector import default_pool_size

MiB = 1 << 20
CHUNK_TOKENS = 256
LAYERS = 32  # 32 layers x 256 tokens x 8 heads x 128 x bf16 x K/V = 32 MiB per chunk
STRIPED_CHUNKS = 16  # chunks of one striped load (a 4k-token prompt)


def log(message: str) -> None:
    print_line(message, sys.stderr)


# -- chunk objects ------------------------------------------------------------------------------
def chunk_layout() -> MemoryLayoutDesc:
    caches = [torch.empty(2, 16, 16, 8, 128, dtype=torch.bfloat16) for _ in range(LAYERS)]
    return build_layout(
        caches, chunk_size=CHUNK_TOKENS, layout_hints={"block_size": 16, "kv_layout": "NHD"}
    ).layout_desc


def filled_obj(arena: HostArena, layout: MemoryLayoutDesc, seed: int) -> MemoryObj:
    obj = empty_obj(arena, layout)
    gen = torch.Generator().manual_seed(seed)
    obj.raw().copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
    return obj


def empty_obj(arena: HostArena, layout: MemoryLayoutDesc) -> MemoryObj:
    """A chunk's L1 object, its pages touched: a pinned L1 arena has every page resident, and
    a first-touch fault inside ``recv_into`` would be charged to the transfer."""
    obj = arena.allocate_obj(layout, CHUNK_TOKENS)
    if obj is None:
        raise RuntimeError("arena too small")
    obj.raw().zero_()
    return obj


# -- 2/3. a tier under load ---------------------------------------------------------------------
async def put_get(
    tier: RemoteTier,
    layout: MemoryLayoutDesc,
    arena: HostArena,
    chunks: int,
    in_flight: int,
    rounds: int,
    label: str,
    before_close: Callable[[], None] | None = None,
) -> dict[str, float]:
    """PUT then GET ``chunks`` chunks through ``tier``, at most ``in_flight`` at once (the
    prefetch controller's way: one `get_into` per chunk), ``rounds`` times; GB/s and latency.

    Every PUT is of a key the store does not hold (a store may answer a repeated key without
    moving a byte: Mooncake does), and every GET reads, into zeroed buffers, what the round's
    PUTs wrote; the round's keys are then removed, untimed, so the store never fills up.
    ``before_close`` runs while the tier is still open (a connection count, say)."""
    scope = KeyScope("bench", "m", "", 1, 0, layout.layout_id)
    await tier.open()
    sources = [filled_obj(arena, layout, seed) for seed in range(chunks)]
    sinks = [empty_obj(arena, layout) for _ in range(chunks)]
    put_times: list[float] = []
    get_times: list[float] = []
    frame_bytes = 0
    limit = asyncio.Semaphore(in_flight)

    def round_keys(round_index: int) -> list[ChunkKey]:
        first = (round_index + 1) * chunks  # round -1 is the warm-up
        return [
            chunk_keys(scope, [first + i] * CHUNK_TOKENS, CHUNK_TOKENS)[0] for i in range(chunks)
        ]

    async def timed(op: Callable[[], Awaitable[bool]], into: list[float] | None) -> None:
        async with limit:
            started = time.perf_counter()
            if not await op():
                raise RuntimeError(f"{label}: an operation failed")
            if into is not None:
                into.append(time.perf_counter() - started)

    async def wall(ops: list[Callable[[], Awaitable[bool]]], into: list[float] | None) -> float:
        started = time.perf_counter()
        await asyncio.gather(*(timed(op, into) for op in ops))
        return time.perf_counter() - started

    put_wall = get_wall = 0.0
    try:
        for round_index in range(-1, rounds):  # -1: the warm-up (connect, allocate), untimed
            keys = round_keys(round_index)
            warm = round_index < 0
            for sink in sinks:
                sink.raw().zero_()
            seconds = await wall(
                [functools.partial(tier.put, k, o) for k, o in zip(keys, sources, strict=True)],
                None if warm else put_times,
            )
            put_wall += 0.0 if warm else seconds
            seconds = await wall(
                [functools.partial(tier.get_into, k, o) for k, o in zip(keys, sinks, strict=True)],
                None if warm else get_times,
            )
            get_wall += 0.0 if warm else seconds
            for source, sink in zip(sources, sinks, strict=True):
                if not torch.equal(source.raw(), sink.raw()):
                    raise RuntimeError(f"{label}: a GET returned other bytes than were PUT")
            if warm:
                frame_bytes = tier.stats().bytes_written // chunks
            for key in keys:
                await tier.remove(key)
        if before_close is not None:
            before_close()
    finally:
        await tier.aclose()
        for obj in (*sources, *sinks):
            obj.unref()
    moved = frame_bytes * chunks * rounds
    result = {
        "put_gbps": moved / put_wall / 1e9,
        "get_gbps": moved / get_wall / 1e9,
        "put_p50_ms": percentile(put_times, 0.5) * 1e3,
        "put_p99_ms": percentile(put_times, 0.99) * 1e3,
        "get_p50_ms": percentile(get_times, 0.5) * 1e3,
        "get_p99_ms": percentile(get_times, 0.99) * 1e3,
    }
    log(
        f"{label}: PUT {result['put_gbps']:.2f} GB/s "
        f"(p50 {result['put_p50_ms']:.1f} ms, p99 {result['put_p99_ms']:.1f} ms), "
        f"GET {result['get_gbps']:.2f} GB/s "
        f"(p50 {result['get_p50_ms']:.1f} ms, p99 {result['get_p99_ms']:.1f} ms)"
    )
    return result


def _socket_inodes(pid: int | str) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _tcp_sockets() -> Iterator[tuple[str, int, int]]:
    """(inode, state, remote port) of every TCP socket of this network namespace (/proc)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                state = int(fields[3], 16)
                yield fields[9], state, remote_port if state == _ESTABLISHED else local_port


_ESTABLISHED, _LISTEN = 0x01, 0x0A


def connections_to(peer_pid: int) -> int:
    """TCP connections this process holds to any port process ``peer_pid`` listens on (Linux,
    /proc): how many connections a Mooncake client opened to a pool node, say."""
    theirs = _socket_inodes(peer_pid)
    listening = {
        port for inode, state, port in _tcp_sockets() if state == _LISTEN and inode in theirs
    }
    ours = _socket_inodes("self")
    return sum(
        1
        for inode, state, port in _tcp_sockets()
        if state == _ESTABLISHED and inode in ours and port in listening
    )


async def exists_latency(make_tier: Callable[[], RemoteTier], rounds: int, label: str) -> float:
    tier = make_tier()
    await tier.open()
    try:
        keys: list[ChunkKey] = chunk_keys(
            KeyScope("bench", "m", "", 1, 0, "x"), list(range(512 * 16)), 16
        )
        await tier.contains_many(keys)
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            flags = await tier.contains_many(keys)
            times.append(time.perf_counter() - started)
            if len(flags) != 512 or tier.stats().exists_failures:
                raise RuntimeError(f"{label}: EXISTS failed")
    finally:
        await tier.aclose()
    p50, p99 = percentile(times, 0.5) * 1e3, percentile(times, 0.99) * 1e3
    log(f"{label}: EXISTS of 512 keys p50 {p50:.3f} ms, p99 {p99:.3f} ms")
    return p50


def mooncake_binaries() -> tuple[str, str] | None:
    """``mooncake_master`` and ``mooncake_client`` of the ``mooncake`` extra (beside this
    interpreter, or on PATH), or None when the extra or its native library is missing."""
    if importlib.util.find_spec("mooncake") is None:
        return None
    try:
        importlib.import_module("mooncake.store")
    except ImportError as exc:  # libibverbs1 missing
        log(f"mooncake.store does not import: {exc}")
        return None
    found = []
    for name in ("mooncake_master", "mooncake_client"):
        beside = Path(sys.executable).with_name(name)
        path = str(beside) if beside.exists() else shutil.which(name)
        if path is None:
            return None
        found.append(path)
    return found[0], found[1]


@contextlib.contextmanager
def mooncake_pool(binaries: tuple[str, str], segment: str) -> Iterator[tuple[str, int]]:
    """A master and a pool node lending ``segment``, each in its own process, on loopback;
    yields the ``l3_url`` of a client that lends nothing, and the node's pid."""
    master, node = binaries
    rpc, http, metrics, node_port = (free_port() for _ in range(4))
    master_args = [
        master,
        f"--rpc_port={rpc}",
        "--rpc_address=127.0.0.1",
        "--enable_http_metadata_server=true",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={http}",
        f"--metrics_port={metrics}",
    ]
    node_args = [
        node,
        "--host=127.0.0.1",
        f"--global_segment_size={segment}",
        f"--master_server_address=127.0.0.1:{rpc}",
        f"--metadata_server=http://127.0.0.1:{http}/metadata",
        f"--port={node_port}",
    ]
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    with process(master_args, rpc, env=env), process(node_args, node_port, env=env) as node_proc:
        deadline = time.monotonic() + 30
        while not _pool_capacity(metrics):  # the node's segment is mounted
            if time.monotonic() > deadline:
                raise RuntimeError("mooncake: the pool node's segment was never mounted")
            time.sleep(0.1)
        url = f"mooncake://127.0.0.1:{rpc}?metadata=http://127.0.0.1:{http}/metadata&segment=0"
        yield url, node_proc.pid


def _pool_capacity(metrics_port: int) -> float:
    try:
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=1) as answer:
            text = answer.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("master_total_capacity_bytes "):
            return float(line.split()[-1])
    return 0.0


async def run(args: argparse.Namespace, plt: Any) -> int:
    rounds = 4 if args.quick else 12
    size = 32 * MiB
    layout = chunk_layout()
    connections = default_pool_size()
    has_redis = (
        shutil.which("redis-server") is not None and importlib.util.find_spec("redis") is not None
    )
    mooncake = mooncake_binaries()
    stream_counts = sorted({1, 2, 4, 8, connections} if args.quick else set(range(1, 9)))
    steps = len(stream_counts) + 4 + (3 if has_redis else 0) + (3 if mooncake else 0)
    progress = Progress(steps, "remote", plain_lines=7)
    log(f"chunk: {layout.nbytes(CHUNK_TOKENS)} bytes of KV; {os.cpu_count()} CPUs")
    raw: dict[int, float] = {}
    for streams in stream_counts:
        raw[streams] = ceilings.loopback_tcp_gbps(
            streams, message_bytes=size, total_bytes=(1 if args.quick else 4) << 30
        )
        progress.advance(f"raw socket x{streams}")
        log(f"raw socket, {streams} streams: {raw[streams]:.2f} GB/s")
    arena = HostArena((2 * STRIPED_CHUNKS + 2) * 32 * MiB, pin=False)
    results: dict[str, dict[str, float]] = {}
    exists: dict[str, float] = {}
    striped = f"x{connections}"

    # The sockets each row's load used, where the store opens its own (Mooncake's transfer
    # engine): the ceiling of that row is the raw socket with as many streams.
    sockets: dict[str, int] = {}

    async def store_rows(
        name: str,
        make_tier: Callable[[int | None], RemoteTier],
        one: str,
        many: str,
        count_sockets: Callable[[], int] | None = None,
    ) -> None:
        """A store's three rows: PUT/GET one chunk at a time, ``connections`` at once, EXISTS."""

        def counter(row: str) -> Callable[[], None] | None:
            if count_sockets is None:
                return None
            return lambda: sockets.__setitem__(row, count_sockets())

        row = f"{name} x1"
        results[row] = await put_get(
            make_tier(1), layout, arena, 1, 1, 4 * rounds, one, counter(row)
        )
        progress.advance(row)
        row = f"{name} {striped}"
        results[row] = await put_get(
            make_tier(None),
            layout,
            arena,
            STRIPED_CHUNKS,
            connections,
            max(1, rounds // 2),
            many,
            counter(row),
        )
        progress.advance(f"{name} {striped}")
        exists[name] = await exists_latency(
            lambda: make_tier(None), 50 if args.quick else 200, name
        )
        progress.advance(f"{name} EXISTS")

    try:
        tkv_port = free_port()
        serve = [sys.executable, "-m", "tiered_kv.cli", "serve", "--port", str(tkv_port)]
        with process([*serve, "--capacity", "2GiB"], tkv_port):

            def tkv_tier(pool_size: int | None) -> RemoteTier:
                options = ClientOptions(pool_size=pool_size, timeout_s=60)
                client = RemoteClient("127.0.0.1", tkv_port, options=options)
                return RemoteTier(TkvConnector(client), timeout_s=60)

            await store_rows(
                "tkv",
                tkv_tier,
                "tkv, 1 connection, 1 in flight",
                f"tkv, {connections} connections, as many in flight",
            )
        if not has_redis:
            log("redis-server or the redis extra (redis-py) not found: skipping the Redis rows")
        else:
            redis_port = free_port()
            with tempfile.TemporaryDirectory() as directory:
                redis_args = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1"]
                redis_args += ["--save", "", "--appendonly", "no", "--dir", directory]
                redis_args += ["--proto-max-bulk-len", "1gb"]
                with process(redis_args, redis_port):
                    url = f"redis://127.0.0.1:{redis_port}/0"

                    from tiered_kv.tiers.remote.redis import RedisConnector  # the redis extra

                    def redis_tier(pool_size: int | None) -> RemoteTier:
                        connector = RedisConnector(
                            url, timeout_s=60, max_connections=pool_size or connections
                        )
                        return RemoteTier(connector, timeout_s=60)

                    await store_rows(
                        "redis",
                        redis_tier,
                        "redis, 1 in flight",
                        f"redis, {connections} connections, as many in flight",
                    )
        if mooncake is None:
            log("the mooncake extra (or libibverbs1) not found: skipping the Mooncake rows")
        else:
            from tiered_kv.config import parse_l3_url
            from tiered_kv.tiers.remote.mooncake_store import MooncakeConnector

            with mooncake_pool(mooncake, "1GB") as (url, node_pid):
                options = parse_l3_url(url).mooncake
                assert options is not None

                def mooncake_tier(in_flight: int | None) -> RemoteTier:
                    connector = MooncakeConnector(
                        options, timeout_s=60, connections=in_flight or connections
                    )
                    return RemoteTier(connector, timeout_s=60)

                await store_rows(
                    "mooncake",
                    mooncake_tier,
                    "mooncake, 1 in flight",
                    f"mooncake, {connections} in flight (batched)",
                    functools.partial(connections_to, node_pid),
                )
            for row_name, count in sockets.items():
                log(f"{row_name}: {count} TCP connections to the pool node")
                if count and count not in raw:  # its ceiling, measured in this run too
                    raw[count] = ceilings.loopback_tcp_gbps(
                        count, message_bytes=size, total_bytes=(1 if args.quick else 4) << 30
                    )
                    log(f"raw socket, {count} streams: {raw[count]:.2f} GB/s")
    finally:
        progress.close()
        leaked = arena.close()
        if leaked:
            log(f"warning: {leaked} arena bytes still referenced")

    ceiling = {"x1": raw[1], striped: raw[connections]}
    if plt is not None:
        png = args.out / "remote.png"
        bar_chart(
            plt,
            png,
            f"loopback, 32 MiB chunks, {os.cpu_count()} CPUs; raw socket measured in the same run",
            [*results, *(f"raw x{n}" for n in raw)],
            {
                "PUT": [row["put_gbps"] for row in results.values()] + [None] * len(raw),
                "GET": [row["get_gbps"] for row in results.values()] + [None] * len(raw),
                "raw socket": [None] * len(results) + list(raw.values()),
            },
            "GB/s",
        )
        print(f"plot: {png}")
    print(f"\nloopback, 32 MiB chunks, {os.cpu_count()} CPUs; tkv connections: {connections}")
    print("raw loopback TCP, GB/s by streams (a process per end):")
    print("  " + "  ".join(f"x{n} {gbps:.2f}" for n, gbps in raw.items()))
    print(f"{'path':<12}{'PUT GB/s':>10}{'p50/p99 ms':>16}{'GET GB/s':>10}{'p50/p99 ms':>16}")
    for name, row in results.items():
        print(
            f"{name:<12}{row['put_gbps']:>10.2f}"
            f"{row['put_p50_ms']:>8.1f}/{row['put_p99_ms']:<7.1f}"
            f"{row['get_gbps']:>10.2f}"
            f"{row['get_p50_ms']:>8.1f}/{row['get_p99_ms']:<7.1f}"
        )
    for name, p50 in exists.items():
        print(f"EXISTS x512 {name}: p50 {p50:.3f} ms")
    print("\nratios (target)")
    for shape, streams in (("x1", 1), (striped, connections)):
        ours = results[f"tkv {shape}"]
        bound = ceiling[shape]
        print(f"  tkv {shape} PUT / raw x{streams}  {ours['put_gbps'] / bound:6.2f}  (>= 0.70)")
        print(f"  tkv {shape} GET / raw x{streams}  {ours['get_gbps'] / bound:6.2f}  (>= 0.70)")
        theirs = results.get(f"redis {shape}")
        if theirs is not None:
            put_ratio = ours["put_gbps"] / theirs["put_gbps"]
            get_ratio = ours["get_gbps"] / theirs["get_gbps"]
            print(f"  tkv {shape} PUT / redis     {put_ratio:6.2f}  (>= 2)")
            print(f"  tkv {shape} GET / redis     {get_ratio:6.2f}  (>= 2)")
        moon = results.get(f"mooncake {shape}")
        if moon is not None:
            # Against the raw socket with as many streams as Mooncake opened for the row.
            opened = sockets.get(f"mooncake {shape}") or streams
            moon_bound = raw[opened]
            put_ratio, get_ratio = moon["put_gbps"] / moon_bound, moon["get_gbps"] / moon_bound
            print(f"  mooncake {shape} PUT / raw x{opened}  {put_ratio:6.2f}  ({opened} sockets)")
            print(f"  mooncake {shape} GET / raw x{opened}  {get_ratio:6.2f}")
    print(f"  tkv EXISTS x512 p50 ms     {exists['tkv']:6.3f}  (< 2)")
    return 0


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where the plot goes (%(default)s)"
    )
    parser.add_argument("--no-plot", action="store_true", help="the table alone (no matplotlib)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    plt = None if args.no_plot else load_pyplot()
    return run_on_engine_loop(run(args, plt))
