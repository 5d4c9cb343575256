"""An engine process for the Mooncake outage tests: it stores a prompt through Mooncake, takes
the master down itself (``killed``: SIGKILL; ``hung``: SIGSTOP, so calls to it hang), asks for
the prompt again, then ends as ``MODE`` says and prints one JSON line of what it saw.

Usage: ``python -m tests.faults.mooncake_outage_child MODE L3_URL MASTER_PID``, MODE one of
``close-killed``, ``close-hung`` (`aclose` with calls to the hung master in flight),
``exit-killed``, ``exit-hung`` (the script ends without closing), ``drop-hung`` (a connector
dropped unclosed with a call in flight, collected while the process runs on).
The parent reads the exit status: a crash in Mooncake's teardown is a signal, never 0.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import sys
import threading
import time
import weakref

import torch

from tests.kvfactory import make_caches
from tests.remote_fixtures import BLOCK, CHUNK, store_and_drop_l1, tokens_for
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.tiers.factory import remote_tier
from tiered_kv.tiers.remote import mooncake_store
from tiered_kv.tiers.remote.mooncake_store import MooncakeConnector

CLOSE_TIMEOUT_S = {"close-hung": 0.5}


def report(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def take_master_down(mode: str, pid: int) -> None:
    os.kill(pid, signal.SIGKILL if mode.endswith("killed") else signal.SIGSTOP)


async def engine_run(mode: str, url: str, master_pid: int) -> None:
    # The set-up: 2 MiB chunks, 48 MiB of L1, a 128 MiB segment.
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=24, block_size=BLOCK)
    tokens = tokens_for(4 * CHUNK, seed=51)
    config = EngineConfig(
        chunk_size=CHUNK,
        l1_size="48MiB",
        l3_url=url,
        l3_timeout_s=1.0 if mode.endswith("killed") else 5.0,
        close_timeout_s=CLOSE_TIMEOUT_S.get(mode, 30.0),
    )
    engine = TieredKVEngine(config)
    await engine.open()
    engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
    await store_and_drop_l1(engine, caches, tokens)
    take_master_down(mode, master_pid)
    started = time.monotonic()
    looked_up = await engine.lookup(tokens)
    loaded = (await engine.retrieve(tokens, list(range(12, 20)))).valid_tokens
    asked_s = time.monotonic() - started
    client = dict(engine.stats().tier("L3").client)
    if mode.startswith("exit"):
        report(looked_up=looked_up, loaded=loaded, asked_s=asked_s, client=client)
        return  # no aclose: the interpreter exits with the engine open
    started = time.monotonic()
    await engine.aclose()
    report(
        looked_up=looked_up,
        loaded=loaded,
        asked_s=asked_s,
        client=client,
        close_s=time.monotonic() - started,
        clients_left_open=len(mooncake_store._left_open),
    )


async def drop_run(url: str, master_pid: int) -> None:
    config = EngineConfig(chunk_size=CHUNK, l3_url=url, l3_timeout_s=5.0, close_timeout_s=30.0)
    tier = remote_tier(config)
    await tier.open()
    keys_of = tokens_for(CHUNK, seed=52)
    from tiered_kv.keys import KeyScope, chunk_keys

    keys = chunk_keys(KeyScope("t", "m", "", 1, 0, "x"), keys_of, CHUNK)
    assert await tier.contains_many(keys) == [False]  # the client is set up
    os.kill(master_pid, signal.SIGSTOP)
    assert await tier.contains_many(keys) == [False]  # left at the stall limit, still running
    connector = tier.connector
    assert isinstance(connector, MooncakeConnector)
    running = connector.stats()["calls_running"]
    dropped = weakref.ref(connector)
    del tier, connector
    gc.collect()
    # A call still runs in the client: what it runs on keeps the connector, so nothing can
    # tear the client down under it.
    alive_while_running = dropped() is not None
    await asyncio.sleep(0.5)
    os.kill(master_pid, signal.SIGCONT)  # the hung call ends; the connector can go
    deadline = time.monotonic() + 60
    while dropped() is not None and time.monotonic() < deadline:
        gc.collect()  # its finalizer shuts the client and the pool on a thread of their own
        await asyncio.sleep(0.1)
    for thread in threading.enumerate():
        if thread.name == "tkv-mooncake-drop":
            thread.join(60)
    left = [t.name for t in threading.enumerate() if t.name.startswith("tkv-mooncake")]
    report(
        calls_running_when_dropped=running,
        alive_while_running=alive_while_running,
        collected=dropped() is None,
        threads_left=left,
    )


def main() -> None:
    mode, url, master_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "drop-hung":
        asyncio.run(drop_run(url, master_pid))
    else:
        asyncio.run(engine_run(mode, url, master_pid))


if __name__ == "__main__":
    main()
