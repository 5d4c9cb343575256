"""`TieredKVHiCacheStorage` loaded by SGLang's own `StorageBackendFactory` (the ``dynamic``
path) over SGLang's real device and host KV pools on the CPU, moved as the cache controller
moves pages; SGLang's built-in ``file`` backend passes the same harness checks."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.sglang import harness
from tests.sglang.harness import PAGE, PoolSpec, host_pool, load, ours, page_bytes, store
from tests.sglang.servers import redis_server, tkv_server
from tiered_kv.errors import ConfigError, LayoutError

ROOT = Path(__file__).resolve().parents[2]

POOLS = [
    PoolSpec("mha", "page_first"),
    PoolSpec("mha", "layer_first"),
    PoolSpec("mha", "page_first_direct"),
    PoolSpec("mha", "page_head"),
    PoolSpec("mla", "page_first"),
    PoolSpec("mla", "layer_first"),
    # 40 layers: 80 K/V runs per page, more than a frame's groups: staged through bounces.
    PoolSpec("mha", "layer_first", layers=40),
]
SRC = [8, 12, 16]  # token index of each page written
DST = [32, 36, 40]  # where it is loaded back


def test_sglang_is_importable() -> None:
    import sglang

    assert sglang.__version__ == "0.5.23"


def _round_trip(backend: Any, pool: Any, v1: bool, keys: list[str]) -> None:
    """Store pages SRC, poison the pool, load them into DST: bit-exact, and nothing else in
    the pool changed."""
    harness.fill(pool, seed=1)
    written = [page_bytes(pool, s) for s in SRC]
    assert store(backend, pool, keys, SRC, v1)
    harness.fill(pool, seed=99)
    poison = pool.kv_buffer.clone()
    poison_pages = [pool.get_data_page(s, flat=True).clone() for s in DST]
    assert backend.batch_exists(keys) == len(keys)
    assert load(backend, pool, keys, DST, v1) == len(keys)
    for start, expected in zip(DST, written, strict=True):
        assert torch.equal(page_bytes(pool, start), expected)
    # Only the loaded pages changed: put the poison back there and compare the whole pool.
    for start, page in zip(DST, poison_pages, strict=True):
        pool.set_from_flat_data_page(start, page)
    assert torch.equal(pool.kv_buffer.view(torch.uint8), poison.view(torch.uint8))


@pytest.mark.parametrize("spec", POOLS, ids=lambda s: s.id)
@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "generic"])
def test_l2_round_trip(tmp_path: Path, spec: PoolSpec, v1: bool) -> None:
    pool = host_pool(spec)
    backend = ours(pool, interface_v1=v1, l2_path=str(tmp_path))
    try:
        assert type(backend).__name__ == "TieredKVHiCacheStorage"
        _round_trip(backend, pool, v1, ["p0", "p1", "p2"])
        stats = backend.get_stats()
        assert stats.counters.get("hits_L2") == 3
        assert stats.counters.get("errors", 0) == 0
        assert stats.tiers["L2"].entries == 3
        geometry = backend._opened.geometry
        assert geometry.zero_copy == (spec.layers <= 32)
    finally:
        backend.close()
    # The files are in this rank's own directory.
    assert (tmp_path / "tp0of1").is_dir()


@pytest.mark.parametrize("spec", POOLS[:2], ids=lambda s: s.id)
def test_file_backend_passes_the_same_checks(tmp_path: Path, spec: PoolSpec) -> None:
    pool = host_pool(spec)
    config = harness.storage_config(
        extra={"file_storage_path": str(tmp_path)}, page_first=spec.layout != "layer_first"
    )
    backend = harness.create_backend("file", config, pool)
    assert type(backend).__name__ == "HiCacheFile"
    _round_trip(backend, pool, False, ["f0", "f1", "f2"])
    _leading_hits(backend, pool, v1=False)


def _leading_hits(backend: Any, pool: Any, v1: bool) -> None:
    harness.fill(pool, seed=2)
    assert store(backend, pool, ["a", "b"], [8, 12], v1)
    assert store(backend, pool, ["d"], [20], v1)
    assert backend.batch_exists(["a", "b", "c", "d"]) == 2  # the hole at c stops the count
    assert backend.batch_exists(["c", "a", "b"]) == 0
    assert backend.batch_exists(["a", "b", "d"]) == 3
    assert backend.exists("d") and not backend.exists("c")
    assert load(backend, pool, ["a", "c", "d"], [32, 36, 40], v1) == 1


@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "generic"])
def test_batch_exists_counts_leading_hits(tmp_path: Path, v1: bool) -> None:
    pool = host_pool(POOLS[0])
    backend = ours(pool, interface_v1=v1, l2_path=str(tmp_path))
    try:
        _leading_hits(backend, pool, v1)
    finally:
        backend.close()


def test_generic_and_zero_copy_verbs_store_the_same_frames(tmp_path: Path) -> None:
    pool = host_pool(PoolSpec("mha", "layer_first"))
    harness.fill(pool, seed=3)
    written = [page_bytes(pool, s) for s in SRC]
    keys = ["g0", "g1", "g2"]
    backend = ours(pool, interface_v1=False, l2_path=str(tmp_path))
    try:
        assert store(backend, pool, keys, SRC, v1=False)
    finally:
        backend.close()
    pool.kv_buffer.fill_(0)
    backend = ours(pool, interface_v1=True, l2_path=str(tmp_path))
    try:
        assert load(backend, pool, keys, DST, v1=True) == 3
    finally:
        backend.close()
    for start, expected in zip(DST, written, strict=True):
        assert torch.equal(page_bytes(pool, start), expected)


def test_a_second_process_reads_what_the_first_wrote(tmp_path: Path) -> None:
    pool = host_pool(PoolSpec("mha", "page_first"))
    harness.fill(pool, seed=4)
    keys = ["x0", "x1", "x2"]
    starts = [PAGE * (1 + i) for i in range(len(keys))]  # where the reader loads them
    written = [page_bytes(pool, s) for s in SRC]
    backend = ours(pool, interface_v1=True, l2_path=str(tmp_path / "l2"))
    try:
        assert store(backend, pool, keys, SRC, v1=True)
    finally:
        backend.close()  # the L2 directory belongs to one process at a time
    out = tmp_path / "read.pt"
    reader_args = [str(tmp_path / "l2"), "mha", "page_first", ",".join(keys), str(out)]
    subprocess.run(
        [sys.executable, "-m", "tests.sglang.harness", *reader_args],
        cwd=ROOT,
        check=True,
        timeout=300,
    )
    result = torch.load(out)
    assert result["hits"] == 3 and result["loaded"] == 3
    assert len(starts) == len(result["pages"])
    for got, expected in zip(result["pages"], written, strict=True):
        assert torch.equal(got, expected)


def test_a_corrupt_file_is_a_miss(tmp_path: Path) -> None:
    pool = host_pool(PoolSpec("mha", "page_first"))
    harness.fill(pool, seed=5)
    written = [page_bytes(pool, s) for s in SRC]
    backend = ours(pool, interface_v1=True, l2_path=str(tmp_path))
    keys = ["c0", "c1", "c2"]
    try:
        assert store(backend, pool, keys, SRC, v1=True)
        victim = backend._opened.keys.key("c1").hex
    finally:
        backend.close()
    (path,) = (p for p in (tmp_path / "tp0of1").rglob("*") if p.name == victim)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40  # one bit of the payload's last stripe
    path.write_bytes(bytes(data))
    pool.kv_buffer.fill_(0)
    backend = ours(pool, interface_v1=True, l2_path=str(tmp_path))
    try:
        assert backend.batch_get_v1(keys, harness.indices(DST)) == [True, False, True]
        assert torch.equal(page_bytes(pool, DST[0]), written[0])
        assert torch.equal(page_bytes(pool, DST[2]), written[2])
        assert backend.get_stats().tiers["L2"].corrupt_removed == 1
        assert backend.batch_exists(keys) == 1  # the corrupt copy is gone
        # The generic verb: a miss is None.
        assert backend.get("c1", pool.get_dummy_flat_data_page()) is None
    finally:
        backend.close()


def test_other_models_and_tp_ranks_do_not_see_each_others_pages(tmp_path: Path) -> None:
    with tkv_server(tmp_path) as url:
        pool = host_pool(PoolSpec("mha", "page_first"))
        harness.fill(pool, seed=6)
        namespace = uuid.uuid4().hex
        writer = ours(pool, interface_v1=True, l3_url=url, namespace=namespace, model="m1")
        try:
            assert store(writer, pool, ["k0", "k1"], SRC[:2], v1=True)
        finally:
            writer.close()
        other = host_pool(PoolSpec("mha", "page_first"))
        for options in (
            {"model": "m2"},
            {"model": "m1", "tp_rank": 1, "tp_size": 2},
            {"model": "m1", "namespace": "someone-else"},
            {"model": "m1", "fingerprint": "weights-v2"},
        ):
            options = {"namespace": namespace, **options}
            reader = ours(other, interface_v1=True, l3_url=url, **options)
            try:
                assert reader.batch_exists(["k0", "k1"]) == 0, options
                assert reader.batch_get_v1(["k0"], harness.indices(DST[:1])) == [False]
            finally:
                reader.close()
        same = ours(other, interface_v1=True, l3_url=url, namespace=namespace, model="m1")
        try:
            assert same.batch_exists(["k0", "k1"]) == 2
        finally:
            same.close()
        # Another page format (layout) of the same model: its own keys too.
        layer_first = host_pool(PoolSpec("mha", "layer_first"))
        reader = ours(layer_first, interface_v1=True, l3_url=url, namespace=namespace, model="m1")
        try:
            assert reader.batch_exists(["k0"]) == 0
        finally:
            reader.close()


@pytest.mark.parametrize("store_kind", ["tkv", "redis"])
@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "generic"])
def test_l3_round_trip(tmp_path: Path, store_kind: str, v1: bool) -> None:
    server = tkv_server if store_kind == "tkv" else redis_server
    with server(tmp_path) as url:
        namespace = uuid.uuid4().hex
        pool = host_pool(PoolSpec("mha", "page_first"))
        backend = ours(pool, interface_v1=v1, l3_url=url, namespace=namespace)
        try:
            _round_trip(backend, pool, v1, ["r0", "r1", "r2"])
            assert backend.get_stats().counters.get("hits_L3") == 3
        finally:
            backend.close()
        # A fresh backend (another host's, as far as L3 knows) finds them too.
        other = host_pool(PoolSpec("mha", "page_first"))
        reader = ours(other, interface_v1=v1, l3_url=url, namespace=namespace)
        try:
            assert reader.batch_exists(["r0", "r1", "r2", "r3"]) == 3
        finally:
            reader.close()


def test_mla_ranks_share_one_copy_written_by_rank_0(tmp_path: Path) -> None:
    with tkv_server(tmp_path) as url:
        namespace = uuid.uuid4().hex
        spec = PoolSpec("mla", "page_first")
        pools = [host_pool(spec), host_pool(spec)]
        harness.fill(pools[0], seed=7)
        harness.fill(pools[1], seed=8)
        written = [page_bytes(pools[0], s) for s in SRC[:2]]
        backends = [
            ours(
                pools[rank],
                interface_v1=True,
                l3_url=url,
                namespace=namespace,
                tp_rank=rank,
                tp_size=2,
                l2_path=str(tmp_path / "l2"),
            )
            for rank in (0, 1)
        ]
        try:
            # Rank 1 is no writer: its pages reach its own L2, never the shared store.
            assert store(backends[1], pools[1], ["w0", "w1"], SRC[:2], v1=True)
            assert store(backends[0], pools[0], ["m0", "m1"], SRC[:2], v1=True)
            pools[1].kv_buffer.fill_(0)
            assert backends[1].batch_exists(["m0", "m1"]) == 2
            assert load(backends[1], pools[1], ["m0", "m1"], DST[:2], v1=True) == 2
            for start, expected in zip(DST, written, strict=False):
                assert torch.equal(page_bytes(pools[1], start), expected)
            assert backends[1].get_stats().counters.get("hits_L3") == 2
            assert backends[0].batch_exists(["w0"]) == 0
        finally:
            for backend in backends:
                backend.close()


def test_a_remote_that_is_down_is_a_miss(tmp_path: Path) -> None:
    from tests.sglang.servers import free_port

    pool = host_pool(PoolSpec("mha", "page_first"))
    harness.fill(pool, seed=9)
    url = f"tkv://127.0.0.1:{free_port()}"  # nothing listens there
    backend = ours(pool, interface_v1=True, l3_url=url, l3_timeout_s=2.0)
    try:
        assert backend.batch_set_v1(["d0"], harness.indices(SRC[:1])) == [False]
        assert backend.batch_exists(["d0"]) == 0
        assert backend.batch_get_v1(["d0"], harness.indices(DST[:1])) == [False]
        assert backend.get("d0", pool.get_dummy_flat_data_page()) is None
        assert backend.set("d0", pool.get_data_page(SRC[0])) is False
    finally:
        backend.close()


def test_verbs_before_registration_or_after_close_are_misses(tmp_path: Path) -> None:
    pool = host_pool(PoolSpec("mha", "page_first"))
    backend = ours(pool, interface_v1=True, l2_path=str(tmp_path))
    backend.close()
    backend.close()  # twice is fine
    assert backend.batch_exists(["a"]) == 0
    assert backend.batch_get_v1(["a"], harness.indices(DST[:1])) == [False]
    assert backend.batch_set_v1(["a"], harness.indices(SRC[:1])) == [False]
    assert backend.get_stats().counters["errors"] == 3
    # Wrong index counts are a miss, not an exception.
    backend = ours(pool, interface_v1=True, l2_path=str(tmp_path))
    try:
        assert backend.batch_set_v1(["a", "b"], harness.indices(SRC[:1])) == [False, False]
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"l2_pth": "/tmp/x"}, "unknown extra-config key"),
        ({}, "no tier configured"),
        ({"l3_url": "mooncake://m:50051"}, "mooncake:// is not supported"),
        ({"l2_path": "/tmp/x", "l2_durability": "sometimes"}, "l2_durability"),
        ({"l2_path": "/tmp/x", "call_timeout_s": 0}, "call_timeout_s"),
    ],
)
def test_bad_configuration_is_refused_at_construction(
    options: dict[str, Any], message: str
) -> None:
    pool = host_pool(PoolSpec("mha", "page_first"))
    config = harness.storage_config(extra={**harness.OURS, **options})
    with pytest.raises(ConfigError, match=message):
        harness.create_backend("dynamic", config, pool)


def test_mla_with_tp_needs_a_shared_store(tmp_path: Path) -> None:
    pool = host_pool(PoolSpec("mla", "page_first"))
    config = harness.storage_config(
        extra={**harness.OURS, "l2_path": str(tmp_path)}, mla=True, tp_size=2
    )
    with pytest.raises(ConfigError, match="needs 'l3_url'"):
        harness.create_backend("dynamic", config, pool)


def test_a_pool_whose_pages_are_not_views_is_refused(tmp_path: Path) -> None:
    pool = host_pool(PoolSpec("mha", "page_first"))

    class CopyingPool:
        """A pool whose pages are copies: moving them without a second copy is impossible."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.layout, self.page_size, self.dtype = inner.layout, inner.page_size, inner.dtype
            self.size, self.kv_buffer = inner.size, inner.kv_buffer

        def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
            return self.inner.get_data_page(index, flat).clone()

    config = harness.storage_config(extra={**harness.OURS, "l2_path": str(tmp_path)})
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    try:
        with pytest.raises(LayoutError, match="outside its kv_buffer"):
            backend.register_mem_pool_host(CopyingPool(pool))
    finally:
        backend.close()
