"""Random sequences of engine calls, evictions, flushes and restarts (hypothesis stateful): every
row a retrieve hands back is the one its prefix implies, and closing leaks nothing."""

from __future__ import annotations

import random
import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.faults.model import BLOCK_SIZE, HINTS, PagedModel
from tiered_kv import EngineConfig, SyncTieredKVEngine

CHUNK = 32
ROW_BYTES = 2 * 2 * 2 * 16 * 4  # per token: layers x K/V x heads x head_size x float32
SYSTEMS = [[7] * 40, list(range(100, 164)), list(range(900, 910))]


class EngineCalls(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="tkv-stateful-")
        self.model = PagedModel(num_blocks=64)
        self.rng = random.Random(0)
        self.engine: SyncTieredKVEngine | None = None
        self.served = 0

    def _open(self, l1_chunks: int) -> None:
        config = EngineConfig(
            chunk_size=CHUNK,
            l1_size=l1_chunks * CHUNK * ROW_BYTES,
            l2_path=self.directory,
            l2_size=12 * (CHUNK * ROW_BYTES + 4096),
            l2_durability="none",
            pin_memory=False,
        )
        self.engine = SyncTieredKVEngine(config)
        self.engine.register_kv_caches(self.model.caches, model_name="m", layout_hints=HINTS)

    @initialize(l1_chunks=st.integers(2, 16))
    def start(self, l1_chunks: int) -> None:
        self.l1_chunks = l1_chunks
        self._open(l1_chunks)

    def _prompt(self, system: int, suffix: list[int]) -> list[int]:
        return SYSTEMS[system] + suffix

    @rule(
        system=st.integers(0, len(SYSTEMS) - 1),
        suffix=st.lists(st.integers(1, 5), max_size=90),
        skip_blocks=st.integers(0, 3),
        policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
    )
    def serve(self, system: int, suffix: list[int], skip_blocks: int, policy: str) -> None:
        assert self.engine is not None
        prompt = self._prompt(system, suffix)
        blocks = self.model.allocate(len(prompt), self.rng)
        assert blocks is not None
        try:
            skip = min(skip_blocks * BLOCK_SIZE, len(prompt))
            self.model.prefill(prompt[:skip], blocks, 0)
            valid = self.engine.retrieve(
                prompt, blocks, skip_prefix_tokens=skip, policy=policy
            ).valid_tokens
            assert skip <= valid <= len(prompt)
            assert self.model.wrong_rows(prompt, blocks, valid) == 0
            self.model.prefill(prompt, blocks, valid)
            self.engine.store(prompt, blocks)
            self.served += 1
        finally:
            self.model.release(blocks)

    @rule(system=st.integers(0, len(SYSTEMS) - 1), suffix=st.lists(st.integers(1, 5), max_size=90))
    def lookup(self, system: int, suffix: list[int]) -> None:
        assert self.engine is not None
        prompt = self._prompt(system, suffix)
        assert 0 <= self.engine.lookup(prompt) <= len(prompt)

    @rule(system=st.integers(0, len(SYSTEMS) - 1), cancel=st.booleans())
    def prefetch(self, system: int, cancel: bool) -> None:
        assert self.engine is not None
        handle = self.engine.prefetch(SYSTEMS[system])
        if cancel:
            handle.close()

    @rule(chunks=st.integers(0, 8))
    def evict(self, chunks: int) -> None:
        assert self.engine is not None
        self.engine.evict_l1(chunks * CHUNK * ROW_BYTES if chunks else None)

    @rule()
    def flush(self) -> None:
        assert self.engine is not None
        assert self.engine.flush(timeout=30) == 0

    @rule()
    def restart(self) -> None:
        assert self.engine is not None
        self.engine.close()
        assert self.engine.engine.leaked_on_close == 0
        self._open(self.l1_chunks)

    @invariant()
    def nothing_leaked_so_far(self) -> None:
        if self.engine is not None:
            stats = self.engine.stats()
            assert stats.arena.used <= stats.arena.capacity

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.close()
            assert self.engine.engine.leaked_on_close == 0
        shutil.rmtree(self.directory, ignore_errors=True)


EngineCalls.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
test_engine_call_sequences = EngineCalls.TestCase
