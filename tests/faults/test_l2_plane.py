"""L2's threaded data plane under faults, through the engine on CPU caches.

- Cancelling a prefetch while its chunks are being read by several threads leaks no thread, no
  file descriptor and no host byte, and leaves nothing half-read visible: every chunk reads back
  bit for bit afterwards.
- A reader stuck on the disk is bounded by the load's deadline (prefetch policy ``timeout``): the
  retrieve delivers the chunks before it and reports the rest late, without waiting for it.
"""

from __future__ import annotations

import asyncio
import io
import os
import threading
from pathlib import Path

import torch

from tests.kvfactory import expect_copy, make_caches, poison_blocks
from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.tiers.l2 import DiskTier, FileOps

CHUNK = 32
BLOCK = 16
CHUNKS = 12
TOKENS = list(range(7000, 7000 + CHUNK * CHUNKS))
SRC = list(range(CHUNKS * CHUNK // BLOCK))
DST = list(range(len(SRC), 2 * len(SRC)))
THREADS = 4


def _config(**kw: object) -> EngineConfig:
    base: dict[str, object] = {"chunk_size": CHUNK, "l1_size": "16MiB"}
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _read_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tkv-l2-read")]


class SlowReads(FileOps):
    """Each read slice waits ``delay_s``; reads of files in ``stuck`` wait for ``release``."""

    read_slice_bytes = 4096

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.stuck: set[str] = set()
        self.release = threading.Event()
        self.entered = threading.Event()

    def readinto(self, file: io.FileIO, buffer: memoryview) -> int:
        if os.path.basename(str(file.name)) in self.stuck:
            self.entered.set()
            assert self.release.wait(30), "the test never released the stuck read"
        elif self.delay_s:
            self.release.wait(self.delay_s)
        return super().readinto(file, buffer)


async def _filled_tier(tmp_path: Path, ops: SlowReads) -> tuple[DiskTier, object]:
    """An L2 directory holding the prompt's chunks (written by a first engine), and the caches."""
    caches = make_caches("vllm_nhd", torch.bfloat16, num_blocks=2 * len(SRC) + 1, seed=11)
    writer = DiskTier(tmp_path / "l2", 1 << 30)
    async with TieredKVEngine(_config(), lower_tiers=[writer]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        assert await engine.store(TOKENS, SRC) == len(TOKENS)
        await engine.flush(timeout=30)
    return DiskTier(tmp_path / "l2", 1 << 30, file_ops=ops, io_threads=THREADS), caches


async def test_a_prefetch_cancelled_mid_stripe_leaks_nothing(tmp_path: Path) -> None:
    ops = SlowReads(delay_s=0.002)
    tier, caches = await _filled_tier(tmp_path, ops)
    fds_before = _open_fds()
    async with TieredKVEngine(_config(), lower_tiers=[tier]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        for round_ in range(3):
            handle = await engine.prefetch(TOKENS)
            assert handle.hit_tokens == len(TOKENS)
            await asyncio.sleep(0.02 * (round_ + 1))  # some chunks read, some reading
            assert 0 < len(_read_threads()) <= THREADS
            handle.close()
            for _ in range(500):  # cancelled loads wait for their threads to let go
                if engine.stats().prefetch.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.stats().prefetch.in_flight == 0
            await engine.evict_l1()
            assert engine.stats().arena.used == 0
        # Nothing half-read stayed: the whole prefix reads back bit for bit.
        ops.delay_s = 0.0
        reference = caches.snapshot()
        poison_blocks(caches, DST)
        expected = caches.snapshot()
        assert (await engine.retrieve(TOKENS, DST)).valid_tokens == len(TOKENS)
        expect_copy(caches, expected, reference, SRC, DST, range(len(TOKENS)), BLOCK)
        assert caches.bytes_equal(expected)
    assert engine.leaked_on_close == 0
    assert _read_threads() == []
    assert _open_fds() <= fds_before


async def test_a_stuck_reader_is_bounded_by_the_load_s_deadline(tmp_path: Path) -> None:
    ops = SlowReads()
    tier, caches = await _filled_tier(tmp_path, ops)
    config = _config(
        prefetch_policy="timeout", prefetch_timeout_base_s=0.2, prefetch_timeout_per_1k_tokens_s=0
    )
    async with TieredKVEngine(config, lower_tiers=[tier]) as engine:
        engine.register_kv_caches(caches.entries, model_name="m", layout_hints=caches.hints)
        stuck_chunk = 5
        ops.stuck.add(engine.chunk_keys(TOKENS)[stuck_chunk].hex)
        poison_blocks(caches, DST)
        result = await asyncio.wait_for(engine.retrieve(TOKENS, DST), 10)
        assert ops.entered.is_set()
        assert result.stop_reason == "late"
        assert result.valid_tokens == stuck_chunk * CHUNK
        assert stuck_chunk in result.late_chunks
        ops.release.set()
    assert engine.leaked_on_close == 0
    assert _read_threads() == []
