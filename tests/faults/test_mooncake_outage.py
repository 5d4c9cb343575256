"""Mooncake L3 through a master outage, against a real ``mooncake_master``
(tests/mooncake_fixtures.py): the outage is noticed once and every request after it is a miss
at once (the circuit), a hung master trips it at the stall limit, a restarted master closes it
without reopening the engine, and closing, exiting or dropping an engine with calls still
running in Mooncake never crashes the process (each in a process of its own,
tests/faults/mooncake_outage_child.py, whose exit status shows a crash)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.kvfactory import expect_copy, make_caches, poison_blocks
from tests.mooncake_fixtures import MooncakeMaster, mooncake_master  # noqa: F401
from tests.remote_fixtures import (
    BLOCK,
    CHUNK,
    engine_config,
    registered_engine,
    store_and_drop_l1,
    tokens_for,
)
from tiered_kv import TieredKVEngine

REPO = Path(__file__).resolve().parents[2]
CIRCUIT_LOG = "tiered_kv.tiers.remote.circuit"


def _circuit_records(caplog: pytest.LogCaptureFixture, words: str) -> int:
    return sum(
        1 for record in caplog.records if record.name == CIRCUIT_LOG and words in record.message
    )


async def _loads_again(engine: TieredKVEngine, caches: object, src: list[int]) -> None:
    """New stores land in L3 and read back bit-exact, on the engine as it is (a restarted master
    knows no keys; Mooncake remounts this engine's segment in the background, so the first
    stores after it may still miss)."""
    deadline = time.monotonic() + 60
    seed = 40
    dst = list(range(12, 16))
    while True:
        fresh = tokens_for(2 * CHUNK, seed=seed)
        await engine.evict_l1()
        assert await engine.store(fresh, src[:4]) == len(fresh)
        assert await engine.flush(timeout=30) == 0
        await engine.evict_l1()
        poison_blocks(caches, dst)  # type: ignore[arg-type]
        before = caches.snapshot()  # type: ignore[attr-defined]
        loaded = (await engine.retrieve(fresh, dst)).valid_tokens
        if loaded == len(fresh):
            break
        assert loaded == 0, loaded  # a prefix of misses, never part of a chunk
        assert time.monotonic() < deadline, engine.stats()["l3"]
        await asyncio.sleep(0.5)
        seed += 1
    expected = [[tensor.clone() for tensor in layer] for layer in before]
    expect_copy(caches, expected, before, src[:4], dst, range(len(fresh)), BLOCK)  # type: ignore[arg-type]
    assert caches.bytes_equal(expected)  # type: ignore[attr-defined]


async def _circuit_closes(engine: TieredKVEngine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.stats().tier("L3").client["circuit_open"]:
        assert time.monotonic() < deadline, engine.stats().tier("L3").client
        await asyncio.sleep(0.1)


@pytest.mark.slow
async def test_an_outage_is_noticed_once_then_every_request_misses_at_once_until_the_master_is_back(
    mooncake_master: MooncakeMaster,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=CIRCUIT_LOG)
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=24, block_size=BLOCK)
    tokens = tokens_for(4 * CHUNK, seed=31)
    config = engine_config(l3_url=mooncake_master.url())  # the default l3_timeout_s
    async with registered_engine(config, caches) as engine:
        src = await store_and_drop_l1(engine, caches, tokens)
        assert await engine.lookup(tokens) == len(tokens)
        mooncake_master.kill()
        dst = list(range(12, 20))
        started = time.monotonic()
        for _ in range(10):
            assert await engine.lookup(tokens) == 0
            assert (await engine.retrieve(tokens, dst)).valid_tokens == 0
        elapsed = time.monotonic() - started
        first_s = engine.stats().tier("L3").read_seconds  # includes the one that noticed it
        # Twenty requests, each of which would have waited ~4.3 s in Mooncake, within one
        # request's deadline in all: the first noticed the outage, the rest were refused.
        assert elapsed < config.l3_timeout_s, elapsed
        stats = engine.stats().tier("L3")
        client = stats.client
        assert (client["circuit_open"], client["circuit_opens"]) == (1, 1)
        assert stats.refused_down >= 18 and client["refused_down"] >= 18
        assert stats.hits == 0 and stats.corrupt == 0
        assert client["threads"] <= 4  # no thread waits on the dead master
        assert _circuit_records(caplog, "circuit open") == 1
        # The master comes back on the same ports (knowing no keys): a probe closes the circuit
        # and loads work again without reopening the engine.
        started = time.monotonic()
        for _ in range(100):
            await engine.lookup(tokens)
        lookup_us = (time.monotonic() - started) / 100 * 1e6
        restarted = time.monotonic()
        mooncake_master.start()
        await _circuit_closes(engine)
        closed_s = time.monotonic() - restarted
        print(
            f"\nmaster SIGKILLed, l3_timeout_s={config.l3_timeout_s}: 10 lookups + 10 retrieves "
            f"in {elapsed * 1e3:.1f} ms (L3 read seconds {first_s * 1e3:.1f} ms); a lookup "
            f"while the circuit is open: {lookup_us:.0f} us; circuit closed {closed_s:.2f} s "
            "after the master's restart"
        )
        # One outage, said once each way.
        client = engine.stats().tier("L3").client
        assert (client["circuit_opens"], client["circuit_closes"]) == (1, 1)
        assert _circuit_records(caplog, "circuit open") == 1
        assert _circuit_records(caplog, "circuit closed") == 1
        await _loads_again(engine, caches, src)
        # (A call on a connection to the old master may still fail once after it: a miss that
        # trips the circuit again until the next probe; it ends closed either way.)
        client = engine.stats().tier("L3").client
        assert client["circuit_open"] == 0
        assert engine.stats().tier("L3").corrupt == 0


@pytest.mark.slow
async def test_a_hung_master_trips_the_circuit_at_the_stall_limit_and_recovers(
    mooncake_master: MooncakeMaster,  # noqa: F811
) -> None:
    """SIGSTOP: the master's port still accepts connections, but nothing answers (a hung or
    partitioned master); a call would wait for Mooncake's RPC timeout."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=24, block_size=BLOCK)
    tokens = tokens_for(4 * CHUNK, seed=32)
    config = engine_config(l3_url=mooncake_master.url())
    assert mooncake_master.process is not None
    pid = mooncake_master.process.pid
    async with registered_engine(config, caches) as engine:
        src = await store_and_drop_l1(engine, caches, tokens)
        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert await engine.lookup(tokens) == 0
            first_s = time.monotonic() - started
            started = time.monotonic()
            for _ in range(5):
                assert (await engine.retrieve(tokens, list(range(12, 20)))).valid_tokens == 0
                assert await engine.lookup(tokens) == 0
            rest_s = time.monotonic() - started
            client = engine.stats().tier("L3").client
            assert client["stalled_calls"] == 1 and client["circuit_open"] == 1
            # The first request left at the stall limit (1 s), well inside its 5 s deadline, and
            # the others did not wait at all; the hung call still runs in Mooncake.
            assert first_s < config.l3_timeout_s / 2, first_s
            assert rest_s < 1.0, rest_s
            assert client["calls_running"] >= 1
            print(
                f"\nmaster SIGSTOPped: the first lookup left after {first_s:.2f} s, then 5 "
                f"retrieves + 5 lookups in {rest_s * 1e3:.1f} ms"
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        await _circuit_closes(engine)
        await _loads_again(engine, caches, src)
        assert engine.stats().tier("L3").client["calls_running"] == 0


def _run_child(mode: str, master: MooncakeMaster) -> tuple[subprocess.CompletedProcess[str], dict]:  # type: ignore[type-arg]
    assert master.process is not None
    pid = master.process.pid
    url = master.url(segment="128MiB")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tests.faults.mooncake_outage_child", mode, url, str(pid)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
            env={**os.environ, "MC_LOG_LEVEL": "WARNING"},
        )
    finally:
        if master.process is not None and master.process.poll() is None:
            os.kill(pid, signal.SIGCONT)  # a hung master, so that the fixture can stop it
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-3000:])
    assert lines, done.stdout
    return done, json.loads(lines[-1])


@pytest.mark.slow
def test_closing_right_after_the_master_died_never_crashes(
    mooncake_master: MooncakeMaster,  # noqa: F811
) -> None:
    """The reported crash: chunks in L3, the master SIGKILLed, a lookup and a retrieve, then
    close (it was a SIGSEGV 4 times out of 4, and 6-15 s when it lived)."""
    _, seen = _run_child("close-killed", mooncake_master)
    assert (seen["looked_up"], seen["loaded"]) == (0, 0)
    assert seen["client"]["circuit_open"] == 1
    assert seen["clients_left_open"] == 0  # nothing was running: torn down at once
    # Mooncake's own teardown against a dead master (its unmount waits out the reconnect loop)
    # took 7 s here; the bound is close_timeout_s (30 s), with margin.
    assert seen["close_s"] < 20, seen
    print(f"\nclose after the master's SIGKILL: {seen['close_s']:.2f} s")


@pytest.mark.slow
def test_closing_with_calls_to_a_hung_master_in_flight_leaves_the_client_and_never_crashes(
    mooncake_master: MooncakeMaster,  # noqa: F811
) -> None:
    """close_timeout_s=0.5 with a call to the hung master still running: close returns within
    its bound, the client is left open (counted), and the process exits cleanly once the call
    ends (the exit barrier waits for it)."""
    _, seen = _run_child("close-hung", mooncake_master)
    assert seen["client"]["calls_running"] >= 1  # in flight when close began
    assert seen["clients_left_open"] == 1
    assert seen["close_s"] < 0.5 + 2.0, seen
    print(f"\nclose with a call to the hung master in flight: {seen['close_s']:.2f} s")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit-killed", "exit-hung"])
def test_exiting_without_close_during_an_outage_never_crashes(
    mooncake_master: MooncakeMaster,  # noqa: F811
    mode: str,
) -> None:
    _, seen = _run_child(mode, mooncake_master)
    assert (seen["looked_up"], seen["loaded"]) == (0, 0)
    if mode == "exit-hung":
        assert seen["client"]["calls_running"] >= 1  # still running when the script ended


@pytest.mark.slow
def test_a_connector_dropped_unclosed_is_shut_without_crashing(
    mooncake_master: MooncakeMaster,  # noqa: F811
) -> None:
    _, seen = _run_child("drop-hung", mooncake_master)
    assert seen["calls_running_when_dropped"] >= 1
    assert seen["alive_while_running"] and seen["collected"]
    assert seen["threads_left"] == []  # its pool and the shut thread ended
