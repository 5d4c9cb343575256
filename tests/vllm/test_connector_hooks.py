"""TieredKVConnector's hooks driven directly, without a model: the scheduler half asks real
`EngineHost`s over real Unix sockets (two of them stand for two tensor-parallel ranks), the
worker half moves KV between CPU caches in vLLM's CPU layout and tiered_kv. vLLM's own config
and request classes are used; what a scheduler step would decide is written out by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tiered_kv import EngineConfig
from tiered_kv.integrations.engine_host import EngineHost
from tiered_kv.integrations.lookup_channel import socket_path
from tiered_kv.keys import ChunkKey
from tiered_kv.memory import MemoryObj
from tiered_kv.tiers.testing import FaultyTier, MemoryTier

# Importing vLLM in the test process (its config and request classes) trips torch's own
# deprecation warnings; the runs in subprocesses never see them.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

BLOCK = 32
CHUNK = 64
MODEL = "tiny-llama"
NUM_BLOCKS = 16


def _tokens(seed: int, length: int) -> list[int]:
    return [(seed * 97 + i * 13) % 500 + 4 for i in range(length)]


def _caches(seed: int) -> dict[str, torch.Tensor]:
    """Two layers of random KV in vLLM's CPU layout [NB, NH, BS, 2 * HS]."""
    generator = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, 2, BLOCK, 64)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=generator)
        for i in range(2)
    }


@pytest.fixture
def socket_dir() -> Iterator[str]:
    directory = tempfile.mkdtemp(prefix="tkv-", dir="/tmp")  # sun_path is short
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def make_config(model_dir: pathlib.Path, socket_dir: str) -> Callable[..., Any]:
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig

    model_config = ModelConfig(model=str(model_dir), dtype="float32", max_model_len=512)

    def make(tensor_parallel_size: int = 1, role: str = "kv_both") -> VllmConfig:
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=BLOCK),
            parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
            kv_transfer_config=KVTransferConfig(
                kv_connector="TieredKVConnector",
                kv_connector_module_path="tiered_kv.integrations.vllm",
                kv_role=role,
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={
                    "chunk_size": CHUNK,
                    "l1_size": "16MiB",
                    "model_name": MODEL,
                    "lookup_socket_dir": socket_dir,
                },
            ),
        )

    return make


def _connector(config: Any, role: str) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tiered_kv.integrations.vllm import TieredKVConnector

    kind = KVConnectorRole.SCHEDULER if role == "scheduler" else KVConnectorRole.WORKER
    return TieredKVConnector(config, kind, None)


def _request(request_id: str, tokens: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id, tokens, SamplingParams(max_tokens=4), None)


@contextlib.contextmanager
def _rank_host(
    config: Any, rank: int, *, lower_tiers: tuple[Any, ...] = (), **engine: Any
) -> Iterator[tuple[EngineHost, dict[str, torch.Tensor]]]:
    """An engine host for ``rank`` of the instance ``config`` names, answering its scheduler."""
    transfer = config.kv_transfer_config
    settings = {"chunk_size": CHUNK, "l1_size": "16MiB", **engine}
    host = EngineHost(EngineConfig(**settings), lower_tiers=lower_tiers)
    try:
        caches = _caches(seed=rank)
        host.register_kv_caches(
            caches,
            model_name=MODEL,
            world_size=config.parallel_config.tensor_parallel_size,
            worker_id=rank,
            layout_hints={"format": "blocks", "block_size": BLOCK},
        )
        directory = transfer.kv_connector_extra_config["lookup_socket_dir"]
        host.serve_lookups(socket_path(directory, transfer.engine_id, rank))
        yield host, caches
    finally:
        host.close()


def _answer(scheduler: Any, request: Any, num_computed_tokens: int = 0) -> int:
    """Ask until the scheduler half has an answer (it never waits for one itself)."""
    for _ in range(2000):
        matched, load_async = scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        assert load_async is False
        if matched is not None:
            return int(matched)
        time.sleep(0.005)
    raise AssertionError("no answer from the workers")


def test_tensor_parallel_hit_is_the_minimum_over_ranks(make_config: Callable[..., Any]) -> None:
    """Rank 0 holds 192 tokens of the prompt, rank 1 only 128: the scheduler claims 128 (whole
    blocks, past vLLM's own hit), and nothing when one rank holds nothing."""
    config = make_config(tensor_parallel_size=2)
    scheduler = _connector(config, "scheduler")
    tokens = _tokens(1, 200)
    try:
        with _rank_host(config, 0) as (rank0, _), _rank_host(config, 1) as (rank1, _):
            assert rank0.store(tokens[:192], list(range(6))) == 192
            assert rank1.store(tokens[:128], list(range(4))) == 128
            assert _answer(scheduler, _request("a", tokens)) == 128
            assert _answer(scheduler, _request("b", tokens), num_computed_tokens=32) == 96
            other = _tokens(2, 200)
            assert rank0.store(other[:192], list(range(6))) == 192
            assert _answer(scheduler, _request("c", other)) == 0
            assert rank0.counters.lookups >= 3 and rank1.counters.lookups >= 3
    finally:
        scheduler.shutdown()


def test_each_role_holds_only_its_half(make_config: Callable[..., Any]) -> None:
    """A scheduler-role connector has no engine and a worker-role one no lookup client: a hook
    of the other role answers "nothing" when it is a query and raises when it would act."""
    from vllm.v1.core.sched.output import SchedulerOutput

    config = make_config()
    scheduler = _connector(config, "scheduler")
    worker = _connector(config, "worker")
    try:
        request = _request("r", _tokens(13, 100))
        assert scheduler.get_finished({"r"}) == (None, None)
        assert scheduler.get_block_ids_with_load_errors() == set()
        assert scheduler.get_kv_connector_kv_cache_events() is None
        scheduler.wait_for_layer_load("model.layers.0.self_attn.attn")
        assert worker.get_num_new_matched_tokens(request, 0) == (0, False)
        assert list(worker.take_events()) == []
        for act in (
            lambda: scheduler.register_kv_caches(_caches(seed=13)),
            lambda: scheduler.engine_stats(),
            lambda: worker.build_connector_meta(SchedulerOutput.make_empty()),
            lambda: worker.request_finished(request, []),
        ):
            with pytest.raises(RuntimeError, match="-role connector has no"):
                act()
        assert scheduler.failures == 0 and worker.failures == 0
    finally:
        worker.shutdown()
        scheduler.shutdown()


class _ThreadGatedTier(FaultyTier):
    """Reads wait until the test opens ``opened`` (a threading.Event: the test is on another
    thread than the engine's loop)."""

    def __init__(self, inner: MemoryTier) -> None:
        super().__init__(inner)
        self.opened = threading.Event()

    async def get_into(self, key: ChunkKey, obj: MemoryObj) -> bool:
        await asyncio.get_running_loop().run_in_executor(None, self.opened.wait)
        return await super().get_into(key, obj)


def test_lookup_answers_ask_again_while_loads_are_in_flight(
    make_config: Callable[..., Any],
) -> None:
    """The prompt's chunks are only in a lower tier whose reads are held: the scheduler gets
    "ask again" (None) on every call, without waiting, until the reads are let go; then the
    whole blocks that are ready (prefetch policy wait_complete)."""
    config = make_config()
    scheduler = _connector(config, "scheduler")
    tier = _ThreadGatedTier(MemoryTier("L2"))
    tokens = _tokens(3, 160)
    try:
        with _rank_host(config, 0, lower_tiers=(tier,), prefetch_policy="wait_complete") as (
            host,
            _,
        ):
            assert host.store(tokens[:128], list(range(4))) == 128
            host.flush()
            host.evict_l1()
            request = _request("slow", tokens)
            answers = [scheduler.get_num_new_matched_tokens(request, 0)]
            for _ in range(2000):
                if host.stats().host.lookups_pending >= 1:
                    break
                time.sleep(0.005)
                answers.append(scheduler.get_num_new_matched_tokens(request, 0))
            answers += [scheduler.get_num_new_matched_tokens(request, 0) for _ in range(20)]
            assert host.stats().host.lookups_pending >= 1  # the worker said "in flight"
            assert set(answers) == {(None, False)}
            tier.opened.set()
            assert _answer(scheduler, request) == 128
            assert host.stats().storage.tier("L2").reads.hits >= 2
    finally:
        tier.opened.set()
        scheduler.shutdown()


def _meta(**fields: Any) -> Any:
    from tiered_kv.integrations.vllm.metadata import TieredKVMetadata

    return TieredKVMetadata(**fields)


def _run_step(worker: Any, meta: Any) -> None:
    """What vLLM's model runner does with one step's metadata (no forward pass here)."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def test_finished_or_aborted_request_releases_its_prefetch(
    make_config: Callable[..., Any],
) -> None:
    """A request whose lookup started a prefetch and that ends before it is scheduled (an
    abort): the scheduler forgets it and the next step's metadata makes the worker free the
    prefetch; the worker holds nothing afterwards."""
    from vllm.v1.core.sched.output import SchedulerOutput

    from tiered_kv.integrations.vllm.metadata import StoreSpec

    config = make_config()
    scheduler = _connector(config, "scheduler")
    worker = _connector(config, "worker")
    try:
        worker.register_kv_caches(_caches(seed=5))
        tokens = _tokens(4, 160)
        _run_step(worker, _meta(stores=[StoreSpec("writer", tokens[:128], [0, 1, 2, 3])]))
        assert worker.engine_stats().host.stored_tokens == 128
        request = _request("aborted", tokens)
        assert _answer(scheduler, request) == 128
        assert worker.engine_stats().prefetches_held == 1
        assert scheduler.request_finished(request, []) == (False, None)
        meta = scheduler.build_connector_meta(SchedulerOutput.make_empty())
        assert (meta.release, meta.loads, meta.stores) == (["aborted"], [], [])
        _run_step(worker, meta)
        stats = worker.engine_stats()
        assert stats.prefetches_held == 0
        assert (stats.prefetch.live_handles, stats.prefetch.reserved_bytes) == (0, 0)
        # The next step releases nothing again: the scheduler forgot the request.
        assert scheduler.build_connector_meta(SchedulerOutput.make_empty()).release == []
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_short_load_reports_failed_blocks_and_stats(make_config: Callable[..., Any]) -> None:
    """A load that delivers less than the scheduler claimed (one chunk of two is there):
    the loaded blocks equal the stored ones bit for bit, the rest are reported once through
    get_block_ids_with_load_errors (vLLM recomputes them) and counted in the connector stats,
    and blocks outside the load stay untouched."""
    from tiered_kv.integrations.vllm.metadata import LoadSpec, StoreSpec

    config = make_config()
    worker = _connector(config, "worker")
    try:
        caches = _caches(seed=7)
        worker.register_kv_caches(caches)
        tokens = _tokens(5, 160)
        _run_step(worker, _meta(stores=[StoreSpec("writer", tokens[:64], [0, 1])]))
        before = {name: cache.clone() for name, cache in caches.items()}
        for cache in caches.values():
            cache[8:].fill_(-1.0)
        poisoned = {name: cache.clone() for name, cache in caches.items()}
        _run_step(worker, _meta(loads=[LoadSpec("reader", tokens[:128], [8, 9, 10, 11], 0)]))
        assert worker.get_block_ids_with_load_errors() == {10, 11}
        assert worker.get_block_ids_with_load_errors() == set()
        for name, cache in caches.items():
            assert torch.equal(cache[8:10], before[name][0:2])  # loaded
            assert torch.equal(cache[10:], poisoned[name][10:])  # not loaded, untouched
            assert torch.equal(cache[:8], before[name][:8])
        stats = worker.get_kv_connector_stats().data
        assert stats["load_error_blocks"] == 2
        assert (stats["loaded_tokens"], stats["load_shortfall_tokens"]) == (64, 64)
        assert stats["stored_tokens"] == 64 and stats["storage_hits_l1"] >= 1
        assert worker.get_kv_connector_stats() is None  # deltas: nothing new since
    finally:
        worker.shutdown()


def test_scheduler_stats_count_lookups_latency_and_claims(
    make_config: Callable[..., Any],
) -> None:
    """The scheduler half's own stats (aggregated by vLLM with the workers'): lookups answered
    and pending, the time from a request's first lookup to its answer, and tokens claimed."""
    config = make_config()
    scheduler = _connector(config, "scheduler")
    tokens = _tokens(6, 100)
    try:
        with _rank_host(config, 0) as (host, _):
            assert host.store(tokens[:96], [0, 1, 2]) == 96
            assert _answer(scheduler, _request("s", tokens)) == 96
        stats = scheduler.get_kv_connector_stats().data
        assert stats["scheduler_lookups_answered"] == 1
        assert stats["claimed_tokens"] == 96
        assert stats["scheduler_lookup_latency_seconds"] > 0
        assert scheduler.get_kv_connector_stats() is None
    finally:
        scheduler.shutdown()


def test_claimed_chunks_stay_in_l1_until_loaded(make_config: Callable[..., Any]) -> None:
    """Between the scheduler's claim and the worker's load, L1 is emptied of everything
    unreferenced (the pressure other requests' stores would bring): the claimed chunks were
    pinned by the answer, so the load delivers every claimed block bit for bit and reports
    none as failed; the pins go with the load."""
    from tiered_kv.integrations.vllm.metadata import LoadSpec, StoreSpec

    config = make_config()
    scheduler = _connector(config, "scheduler")
    worker = _connector(config, "worker")
    try:
        caches = _caches(seed=9)
        worker.register_kv_caches(caches)
        tokens = _tokens(8, 160)
        _run_step(worker, _meta(stores=[StoreSpec("writer", tokens[:128], [0, 1, 2, 3])]))
        stored = {name: cache[0:4].clone() for name, cache in caches.items()}
        assert _answer(scheduler, _request("claimed", tokens)) == 128
        assert worker.engine_stats().pinned_bytes > 0
        host = worker.worker_half.host
        assert host.evict_l1() == 0  # nothing unreferenced: both chunks are pinned
        _run_step(worker, _meta(loads=[LoadSpec("claimed", tokens[:128], [8, 9, 10, 11], 0)]))
        assert worker.get_block_ids_with_load_errors() == set()
        for name, cache in caches.items():
            assert torch.equal(cache[8:12], stored[name])
        stats = worker.engine_stats()
        assert (stats.host.loaded_tokens, stats.host.load_shortfall_tokens) == (128, 0)
        assert stats.pinned_bytes == 0 and stats.prefetches_held == 0
        assert host.evict_l1() > 0  # unpinned now: evictable again
    finally:
        worker.shutdown()
        scheduler.shutdown()


def test_pins_are_bounded_in_bytes_and_time(make_config: Callable[..., Any]) -> None:
    """A budget of one chunk pins one of the two claimed chunks (counted as over budget); a
    request that is never loaded loses its pins after ``pin_timeout_s`` (counted), and then
    an eviction takes the chunks: a later load falls short and is reported, not wrong."""
    config = make_config()
    transfer = config.kv_transfer_config
    directory = transfer.kv_connector_extra_config["lookup_socket_dir"]
    host = EngineHost(
        EngineConfig(chunk_size=CHUNK, l1_size="16MiB"),
        pin_budget_bytes=64 * 1024,  # one chunk: 2 blocks x 2 layers x 16 KiB
        pin_timeout_s=0.2,
    )
    try:
        caches = _caches(seed=10)
        host.register_kv_caches(
            caches, model_name=MODEL, layout_hints={"format": "blocks", "block_size": BLOCK}
        )
        host.serve_lookups(socket_path(directory, transfer.engine_id, 0))
        tokens = _tokens(9, 160)
        assert host.store(tokens[:128], [0, 1, 2, 3]) == 128
        scheduler = _connector(config, "scheduler")
        try:
            assert _answer(scheduler, _request("slow", tokens)) == 128
            stats = host.stats()
            assert (stats.pinned_bytes, stats.host.pins_over_budget) == (64 * 1024, 1)
            assert host.evict_l1() == 64 * 1024  # the unpinned chunk goes
            time.sleep(0.3)
            _answer(scheduler, _request("other", _tokens(10, 96)))  # a lookup sweeps pins
            stats = host.stats()
            assert (stats.pinned_bytes, stats.host.pins_expired) == (0, 1)
            assert host.evict_l1() == 64 * 1024
        finally:
            scheduler.shutdown()
        result = host.load(tokens[:128], [8, 9, 10, 11], skip_prefix_tokens=0)
        assert result.valid_tokens == 0
    finally:
        host.close()


def _hybrid_config(make_config: Callable[..., Any]) -> tuple[Any, Any]:
    """The instance config and a vLLM `KVCacheConfig` of two groups: layer 0 with a 64-token
    sliding window, layer 1 with full attention (the caches of `_caches`)."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    shape = {"num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    groups = [
        KVCacheGroupSpec(
            ["model.layers.0.self_attn.attn"],
            SlidingWindowSpec(block_size=BLOCK, sliding_window=64, **shape),
        ),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(BLOCK, **shape)),
    ]
    return make_config(), KVCacheConfig(NUM_BLOCKS, [], groups)


def test_hybrid_load_that_falls_short_is_a_failed_receive(
    make_config: Callable[..., Any],
) -> None:
    """A hybrid model's load (two groups) whose chunks are gone: vLLM cannot take failed
    blocks from such models, so the request is reported finished and failed (vLLM recomputes
    it), never as loaded; a complete one is reported finished only, the sliding-window group
    written only over its window."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tiered_kv.integrations.vllm import TieredKVConnector
    from tiered_kv.integrations.vllm.metadata import LoadSpec, StoreSpec

    config, kv_cache_config = _hybrid_config(make_config)
    worker = TieredKVConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        caches = _caches(seed=11)
        worker.register_kv_caches(caches)
        tokens = _tokens(11, 160)
        groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
        _run_step(
            worker,
            _meta(stores=[StoreSpec("w", tokens[:128], groups[0], group_block_ids=groups)]),
        )
        window, full = (
            caches["model.layers.0.self_attn.attn"],
            caches["model.layers.1.self_attn.attn"],
        )
        stored = (window[0:4].clone(), full[4:8].clone())
        for cache in caches.values():
            cache[8:].fill_(-1.0)
        # 128 tokens claimed: the window group reads [96 - 32 ... ): window_start(128) = 64.
        targets = [[0, 0, 8, 9], [10, 11, 12, 13]]  # 0: vLLM's null block for the dropped ones
        load = LoadSpec("ok", tokens[:128], targets[0], 0, group_block_ids=targets)
        _run_step(worker, _meta(loads=[load]))
        results = worker.get_transfer_results(set())
        assert (results.finished_recving, results.failed_recving) == ({"ok"}, set())
        assert torch.equal(window[8:10], stored[0][2:4])  # the window's chunk only
        assert torch.equal(full[10:14], stored[1])
        missing = _tokens(12, 160)[:128]
        lost = LoadSpec("lost", missing, targets[0], 0, group_block_ids=targets)
        _run_step(worker, _meta(loads=[lost]))
        results = worker.get_transfer_results(set())
        assert (results.finished_recving, results.failed_recving) == ({"lost"}, {"lost"})
        assert worker.get_block_ids_with_load_errors() == set()  # never per block
    finally:
        worker.shutdown()


def test_a_step_is_timed_as_a_prefill_only_when_one_prefill_dominates_it() -> None:
    from tiered_kv.integrations.vllm.metadata import prefill_of_step

    assert prefill_of_step({"a": 512}, {"a": 256}) == (512, 256)
    assert prefill_of_step({"a": 512, "b": 1, "c": 1}, {"a": 0, "b": 90}) == (514, 0)
    assert prefill_of_step({"a": 512, "b": 64}, {"a": 0, "b": 0}) is None  # two prefills
    assert prefill_of_step({"a": 1, "b": 1}, {"a": 10, "b": 20}) is None  # decodes only
    assert prefill_of_step({}, {}) is None


def test_observe_prefill_refuses_nonsense() -> None:
    host = EngineHost(EngineConfig(chunk_size=CHUNK, l1_size="1MiB"))
    try:
        for args in ((0, 0, 0.1), (10, -1, 0.1), (10, 0, 0.0), (10, 0, float("inf"))):
            with pytest.raises(ValueError, match="observe_prefill"):
                host.observe_prefill(*args)
        host.observe_prefill(100, 0, 0.01)
        assert host.stats().host.prefills_observed == 1
    finally:
        host.close()


def test_a_lookup_waits_for_its_reply_within_the_steps_budget(
    make_config: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler lends each step a few milliseconds for the workers' replies: an answer
    from host memory comes back in the call that asked (no step is lost to "ask again"); a
    worker that does not reply costs the step its budget once, and the step's other lookups
    do not wait at all."""
    import socket

    import tiered_kv.integrations.vllm.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "LOOKUP_WAIT_PER_STEP_S", 30.0)  # as long as it takes
    config = make_config()
    scheduler = _connector(config, "scheduler")
    tokens = _tokens(12, 100)
    try:
        with _rank_host(config, 0) as (host, _):
            assert host.store(tokens[:96], [0, 1, 2]) == 96
            matched, _ = scheduler.get_num_new_matched_tokens(_request("w", tokens), 0)
            assert matched == 96  # the first call: answered within its wait
        assert scheduler.get_kv_connector_stats().data["scheduler_lookups_pending"] == 0
    finally:
        scheduler.shutdown()

    monkeypatch.setattr(scheduler_module, "LOOKUP_WAIT_PER_STEP_S", 0.05)
    config = make_config()
    scheduler = _connector(config, "scheduler")
    transfer = config.kv_transfer_config
    path = socket_path(transfer.kv_connector_extra_config["lookup_socket_dir"],
                       transfer.engine_id, 0)  # fmt: skip
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # accepts, never replies
    silent.bind(path)
    silent.listen()
    try:
        first = scheduler.get_num_new_matched_tokens(_request("a", tokens), 0)
        assert first == (None, False) and scheduler.scheduler_half.lookup_wait_left == 0
        assert scheduler.get_num_new_matched_tokens(_request("b", tokens), 0) == (None, False)
        from vllm.v1.core.sched.output import SchedulerOutput

        scheduler.build_connector_meta(SchedulerOutput.make_empty())  # next step: new budget
        assert scheduler.scheduler_half.lookup_wait_left == 0.05
    finally:
        scheduler.shutdown()
        silent.close()
