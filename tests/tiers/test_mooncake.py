"""The L3 tier over a real Mooncake Store (``mooncake_master`` started by the test, see
tests/mooncake_fixtures.py): bit-exact round trips, engines in two processes sharing chunks,
a writer SIGKILLed (with a pool node, with a second replica), the pool full, missing / corrupt /
short values, URL errors. Master outages: tests/faults/test_mooncake_outage.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.kvfactory import make_caches, poison_blocks
from tests.mooncake_fixtures import (  # noqa: F401
    MooncakeMaster,
    master_binary,
    mooncake_master,
    stop_process,
)
from tests.remote_fixtures import (
    BLOCK,
    CHUNK,
    ROUND_TRIP_CASES,
    engine_config,
    registered_engine,
    retrieve_bit_exact,
    round_trip,
    tokens_for,
)
from tests.tiers.mooncake_writer import FORMAT
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.codec import encode_header, payload_checksums
from tiered_kv.config import parse_l3_url
from tiered_kv.errors import ConfigError
from tiered_kv.keys import KeyScope, chunk_keys
from tiered_kv.layout import build_layout
from tiered_kv.memory import HostArena
from tiered_kv.tiers.factory import remote_tier
from tiered_kv.tiers.l3_remote import RemoteTier
from tiered_kv.tiers.remote.mooncake_store import MooncakeConnector

REPO = Path(__file__).resolve().parents[2]


def _mooncake_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tkv-mooncake")]


@pytest.mark.parametrize(("fmt", "dtype"), ROUND_TRIP_CASES)
async def test_engine_round_trips_bit_exact_through_mooncake(
    mooncake_master: MooncakeMaster,  # noqa: F811
    fmt: str,
    dtype: torch.dtype,
) -> None:
    caches = make_caches(fmt, dtype, num_blocks=24, block_size=BLOCK)
    tokens = tokens_for(3 * CHUNK + 5, seed=11)  # three full chunks and a partial one
    config = engine_config(l3_url=mooncake_master.url())
    stats = (await round_trip(config, caches, tokens)).tier("L3")
    assert stats.puts == 4 and stats.put_failures == 0
    assert stats.hits == 4 and stats.corrupt == 0
    assert stats.client["setups"] == 1
    # The L1 arena was registered once, beside the header slab.
    assert stats.client["registered_regions"] == 1
    assert _mooncake_threads() == []  # aclose joined the connector's threads


def _tier_and_objs(
    master: MooncakeMaster,
    *,
    chunk_size: int = CHUNK,
    heads: int = 2,
    head_size: int = 8,
    segment: str = "64MiB",
) -> tuple[RemoteTier, HostArena, object, KeyScope]:
    caches = make_caches(
        "vllm_nhd",
        torch.float16,
        num_blocks=1,
        block_size=BLOCK,
        num_heads=heads,
        head_size=head_size,
    )
    layout = build_layout(caches.entries, chunk_size=chunk_size, layout_hints=caches.hints)
    tier = remote_tier(engine_config(l3_url=master.url(segment=segment), l3_timeout_s=5.0))
    arena = HostArena(48 << 20, pin=False)
    scope = KeyScope("t", "m", "", 1, 0, layout.layout_desc.layout_id)
    return tier, arena, layout.layout_desc, scope


async def test_missing_corrupt_and_short_values_are_misses(
    mooncake_master: MooncakeMaster,  # noqa: F811
) -> None:
    tier, arena, layout, scope = _tier_and_objs(mooncake_master)
    key, other = chunk_keys(scope, list(range(2 * CHUNK)), CHUNK)
    await tier.open()
    try:
        src = arena.allocate_obj(layout, CHUNK)
        dst = arena.allocate_obj(layout, CHUNK)
        assert src is not None and dst is not None
        src.raw().copy_(torch.randint(0, 256, (src.nbytes,), dtype=torch.uint8))
        dst.raw().fill_(0x5A)
        # A key nobody stored: a miss, not a failure, and the buffer is untouched.
        assert await tier.contains_many([key]) == [False]
        assert not await tier.get_into(key, dst)
        stats = tier.stats()
        assert (stats.misses, stats.read_failures, stats.corrupt) == (1, 0, 0)
        assert bool((dst.raw() == 0x5A).all())
        # A stored frame whose payload was changed after its checksum: a miss, and removed.
        connector = tier.connector
        assert isinstance(connector, MooncakeConnector)
        buffers = src.group_buffers()
        header = encode_header(
            key.to_bytes(), CHUNK, src.group_specs(), [c ^ 1 for c in payload_checksums(buffers)]
        )
        frame_len = len(header) + sum(len(b) for b in buffers)
        await connector.put(key, [header, *buffers], frame_len)
        assert await tier.contains_many([key]) == [True]
        assert not await tier.get_into(key, dst)
        stats = tier.stats()
        assert (stats.corrupt, stats.corrupt_removed) == (1, 1)
        assert await tier.contains_many([key]) == [False]
        # A shorter frame under the key (an empty value, or fewer groups' bytes): a miss.
        await connector.put(other, [header, buffers[0][:100]], len(header) + 100)
        assert not await tier.get_into(other, dst)
        assert tier.stats().layout_mismatch == 1
        # And the real thing reads back bit-exact.
        assert await tier.put(key, src)
        assert await tier.get_into(key, dst)
        assert torch.equal(dst.raw(), src.raw())
        for obj in (src, dst):
            obj.unref()
    finally:
        await tier.aclose()
        assert arena.close() == 0


async def test_a_put_refused_for_space_is_a_counted_dropped_write(
    mooncake_master: MooncakeMaster,  # noqa: F811
) -> None:
    # A 256-token chunk of 2 layers of 64 heads of 128 is 16 MiB of KV, and with its header
    # more than this engine's 16 MiB segment, the whole pool (16 MiB is Mooncake's minimum).
    tier, arena, layout, scope = _tier_and_objs(
        mooncake_master, chunk_size=256, heads=64, head_size=128, segment="16MiB"
    )
    big_key, small_key = chunk_keys(scope, list(range(256 + 1)), 256)
    await tier.open()
    try:
        big = arena.allocate_obj(layout, 256)
        small = arena.allocate_obj(layout, 1)
        dst = arena.allocate_obj(layout, 1)
        assert big is not None and small is not None and dst is not None
        small.raw().copy_(torch.randint(0, 256, (small.nbytes,), dtype=torch.uint8))
        assert not await tier.put(big_key, big)
        stats = tier.stats()
        assert stats.put_failures == 1 and stats.puts == 0
        assert stats.client["no_space"] == 1
        assert not tier.contains(big_key)
        assert await tier.contains_many([big_key]) == [False]
        # What fits is still stored and read back.
        assert await tier.put(small_key, small)
        assert await tier.get_into(small_key, dst)
        assert torch.equal(dst.raw(), small.raw())
        for obj in (big, small, dst):
            obj.unref()
    finally:
        await tier.aclose()
        assert arena.close() == 0


class _Writer:
    """`tests.tiers.mooncake_writer` in its own process, storing ``seed``'s tokens (three full
    chunks and a partial one) from blocks 1..; ``caches`` are a reader's copy of its caches."""

    def __init__(self, url: str, seed: int) -> None:
        self.tokens = tokens_for(3 * CHUNK + 5, seed=seed)
        self.caches = make_caches(*FORMAT, num_blocks=24, block_size=BLOCK, seed=seed)
        self.src_blocks = list(range(1, 1 + -(-len(self.tokens) // BLOCK)))
        num_tokens = str(len(self.tokens))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.tiers.mooncake_writer", url, str(seed), num_tokens],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def wait_stored(self) -> tuple[int, int]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        assert line.startswith("stored"), f"writer ended: {line!r}, rc={self.process.poll()}"
        puts, failures = line.split()[1:]
        return int(puts), int(failures)

    def close(self) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


@pytest.fixture
def writer_of() -> Iterator[type[_Writer]]:
    writers: list[_Writer] = []

    class Tracked(_Writer):
        def __init__(self, url: str, seed: int) -> None:
            super().__init__(url, seed)
            writers.append(self)

    yield Tracked
    for writer in writers:
        writer.close()


async def test_two_engines_in_two_processes_share_chunks(
    mooncake_master: MooncakeMaster,  # noqa: F811
    writer_of: type[_Writer],
) -> None:
    writer = writer_of(mooncake_master.url(), 21)
    assert writer.wait_stored() == (4, 0)
    tokens, caches, src = writer.tokens, writer.caches, writer.src_blocks
    # This engine lends no segment: every chunk it reads lies in the writer's.
    config = engine_config(l3_url=mooncake_master.url(segment="0"))
    async with registered_engine(config, caches) as engine:
        await retrieve_bit_exact(engine, caches, tokens, src)
        assert engine.stats().tier("L3").hits == 4


@pytest.mark.slow
async def test_a_killed_writer_costs_misses_never_wrong_data(
    mooncake_master: MooncakeMaster,  # noqa: F811
    writer_of: type[_Writer],
) -> None:
    writer = writer_of(mooncake_master.url(), 22)
    assert writer.wait_stored() == (4, 0)
    tokens, caches = writer.tokens, writer.caches
    timeout_s = 1.0
    config = engine_config(l3_url=mooncake_master.url(segment="0"), l3_timeout_s=timeout_s)
    engine = TieredKVEngine(config)
    async with engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.lookup(tokens) == len(tokens)
        writer.kill()  # SIGKILL: its segment, holding every chunk, is gone
        dst = list(range(12, 12 + -(-len(tokens) // BLOCK)))
        poison_blocks(caches, dst)
        before = caches.snapshot()
        # The master still lists the dead segment; the transfer from it retries for seconds
        # (Mooncake backs off 1, 2, 4 s), but the load ends at its deadline.
        started = time.monotonic()
        assert (await engine.retrieve(tokens, dst)).valid_tokens == 0
        elapsed = time.monotonic() - started
        assert elapsed < 2 * timeout_s + 1.0, elapsed
        assert caches.bytes_equal(before)  # nothing was written into the blocks
        stats = engine.stats().tier("L3")
        assert stats.hits == 0 and stats.misses >= 1 and stats.corrupt == 0
        # The L1 objects of the transfers still running stay allocated until they end.
        assert stats.client["held_past_deadline"] >= 1
    assert engine.leaked_on_close == 0  # every held object was given back by close


async def test_chunks_on_a_pool_node_outlive_the_engine_that_wrote_them(
    mooncake_master: MooncakeMaster,  # noqa: F811
    writer_of: type[_Writer],
) -> None:
    """Engines that lend no segment (``segment=0``) put into a pool node's (``mooncake_client``):
    a writer killed then costs the others nothing (docs/remote.md, "Mooncake Store")."""
    node = mooncake_master.start_pool_node("64MB")
    try:
        writer = writer_of(mooncake_master.url(segment="0"), 23)
        assert writer.wait_stored() == (4, 0)
        writer.kill()
        tokens, caches, src = writer.tokens, writer.caches, writer.src_blocks
        config = engine_config(l3_url=mooncake_master.url(segment="0"), l3_timeout_s=5.0)
        async with registered_engine(config, caches) as engine:
            await retrieve_bit_exact(engine, caches, tokens, src)
            assert engine.stats().tier("L3").hits == 4
    finally:
        stop_process(node)


@pytest.mark.slow
async def test_a_second_replica_serves_once_the_master_drops_a_killed_writer(
    tmp_path: Path, writer_of: type[_Writer]
) -> None:
    """``replicas=2`` puts each chunk on the writer's segment and a pool node's. Mooncake reads
    one copy and does not fall back to the other, so after the writer is killed its copies are
    misses until the master drops its segment (``--client_ttl``, 2 s here); then every chunk
    loads from the surviving copy."""
    master = MooncakeMaster(master_binary(), tmp_path / "master2.log", flags=("--client_ttl=2",))
    master.start()
    node = master.start_pool_node("64MB")
    try:
        writer = writer_of(master.url(replicas="2"), 24)
        assert writer.wait_stored() == (4, 0)
        writer.kill()
        tokens, caches, src = writer.tokens, writer.caches, writer.src_blocks
        config = engine_config(l3_url=master.url(segment="0"), l3_timeout_s=1.0)
        async with registered_engine(config, caches) as engine:
            deadline = time.monotonic() + 30
            while (await engine.retrieve(tokens, list(range(12, 19)))).valid_tokens < len(tokens):
                assert time.monotonic() < deadline, engine.stats()["l3"]
                await engine.evict_l1()
                await asyncio.sleep(0.5)
            await engine.evict_l1()
            await retrieve_bit_exact(engine, caches, tokens, src)
            assert engine.stats().tier("L3").corrupt == 0
    finally:
        stop_process(node)
        master.stop()


def test_mooncake_urls_are_checked_with_clear_errors() -> None:
    parsed = parse_l3_url(
        "mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&segment=4GiB"
        "&protocol=rdma&devices=mlx5_0,mlx5_1&replicas=2&local_hostname=10.0.0.7"
    )
    options = parsed.mooncake
    assert options is not None
    assert options.master == "10.0.0.5:50051"
    assert options.segment_bytes == 4 << 30 and options.replicas == 2
    assert (options.protocol, options.devices) == ("rdma", "mlx5_0,mlx5_1")
    assert options.local_hostname == "10.0.0.7"
    defaults = parse_l3_url("mooncake://127.0.0.1:50051").mooncake
    assert defaults is not None
    assert defaults.metadata == "http://127.0.0.1:8080/metadata"
    assert defaults.local_hostname == "127.0.0.1" and defaults.replicas == 1
    for url, message in [
        ("mooncake://h", "needs the master's RPC port"),
        ("mooncake://h:1?segmnet=1GiB", "unknown mooncake:// option 'segmnet'"),
        ("mooncake://h:1?protocol=udp", "protocol must be one of tcp, rdma"),
        ("mooncake://h:1?replicas=0", "replicas must be an int >= 1"),
        ("mooncake://h:1?segment=lots", "cannot parse size 'lots'"),
        ("mooncake://h:1?segment=8MiB", "segment must be 0 .* or at least 16MiB"),
        ("mooncake://h:1?replicas=1&replicas=2", "given 2 times"),
    ]:
        with pytest.raises(ConfigError, match=message):
            EngineConfig(l3_url=url)


def test_mooncake_url_without_the_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "mooncake" or m.startswith("mooncake.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mooncake", None)  # import mooncake now fails
    with pytest.raises(ConfigError, match=r"pip install 'tiered-kv\[mooncake\]'"):
        EngineConfig(l3_url="mooncake://h:1")
