"""`EngineHost`: a worker's engine answering lookups over the real Unix-socket channel; the
prefetch a lookup starts is the one the request's load uses and ends."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from tests.kvfactory import expect_copy, make_caches, poison_blocks
from tiered_kv import EngineConfig
from tiered_kv.integrations.engine_host import EngineHost
from tiered_kv.integrations.lookup_channel import LookupClient, socket_path
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

CHUNK = 32
TOKENS = list(range(3000, 3096))  # three chunks
SRC, DST = [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]


def _answer(client: LookupClient, request_id: str) -> int:
    """Ask as the scheduler does until the worker has an answer (loads finished)."""
    for _ in range(2000):
        answer = client.lookup(request_id, TOKENS, wait_s=0.01)
        if answer is not None:
            return answer
        time.sleep(0.005)
    raise AssertionError("the worker never answered")


def test_a_load_uses_the_prefetch_its_lookup_started_and_ends_it(tmp_path: Path) -> None:
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=16)
    tier = FaultyTier(MemoryTier(), get_delay_s=0.01)
    host = EngineHost(EngineConfig(chunk_size=CHUNK, l1_size="8MiB"), lower_tiers=[tier])
    path = socket_path(str(tmp_path), "instance", 0)
    client: LookupClient | None = None
    try:
        host.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert host.store(TOKENS, SRC) == 96
        host.flush()
        host.evict_l1()
        host.serve_lookups(path)
        client = LookupClient([path])
        assert _answer(client, "r1") == 96
        prefetch = host.stats().prefetch
        assert (prefetch.counters.loads_started, prefetch.live_handles) == (3, 1)
        reference = caches.snapshot()
        poison_blocks(caches, DST)
        expected = caches.snapshot()
        result = host.load(TOKENS, DST, skip_prefix_tokens=0, request_id="r1")
        assert result.valid_tokens == 96
        expect_copy(caches, expected, reference, SRC, DST, range(96), 16)
        assert caches.bytes_equal(expected)
        prefetch = host.stats().prefetch
        # No second prefetch joined the lookup's loads: the load took them over and ended it.
        assert prefetch.counters.loads_started == 3 and prefetch.counters.loads_deduplicated == 0
        assert prefetch.live_handles == 0 and prefetch.counters.handles == 1
        assert tier.calls["get"] == 3
        host.release(["r1"])  # the request ends: nothing left to free
        assert host.stats().prefetch.counters.cancelled == 0
    finally:
        if client is not None:
            client.close()
        host.close()
