"""The L2 fault tests' chunks: a chunk's key and content follow from an index, so a test (or a
process it forked) rebuilds what any writer stored and checks what a tier serves, bit-exact."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path

import torch

from tiered_kv.keys import ChunkKey, KeyScope, chunk_keys
from tiered_kv.layout import GroupLayout, MemoryLayoutDesc
from tiered_kv.memory import HostArena, MemoryObj
from tiered_kv.tiers.l2 import LOCK_NAME, DiskTier

CHUNK = 64
LAYOUT = MemoryLayoutDesc(
    (
        GroupLayout(torch.bfloat16, num_layers=4, kv_count=2, row_elems=128),
        GroupLayout(torch.int8, num_layers=1, kv_count=1, row_elems=132),
    ),
    CHUNK,
)
POISON = 0xA5


@dataclasses.dataclass(frozen=True)
class IndexedChunks:
    """Chunks of `LAYOUT` under ``tenant``; ``num_tokens_of(index)`` sets each one's length."""

    tenant: str
    num_tokens_of: Callable[[int], int]

    @property
    def scope(self) -> KeyScope:
        return KeyScope(self.tenant, "test-model", "v1", 1, 0, LAYOUT.layout_id)

    def key_of(self, index: int) -> ChunkKey:
        # The first token tells chunks apart.
        tokens = [index, *range(self.num_tokens_of(index) - 1)]
        return chunk_keys(self.scope, tokens, CHUNK)[0]

    def chunk_of(self, arena: HostArena, index: int) -> MemoryObj:
        obj = arena.allocate_obj(LAYOUT, self.num_tokens_of(index))
        if obj is None:
            raise RuntimeError("arena full: a chunk was not released")
        data = bytearray(random.Random(index).randbytes(obj.nbytes))
        obj.raw().copy_(torch.frombuffer(data, dtype=torch.uint8))
        return obj

    async def assert_reads_back(
        self, tier: DiskTier, arena: HostArena, key: ChunkKey, index: int
    ) -> None:
        """``tier`` serves ``key`` (chunk ``index``) into poisoned memory, every group bit-exact."""
        want = self.chunk_of(arena, index)
        got = arena.allocate_obj(LAYOUT, self.num_tokens_of(index))
        assert got is not None
        try:
            got.raw().fill_(POISON)
            assert await tier.get_into(key, got), index
            for group in range(len(LAYOUT.groups)):
                assert torch.equal(want.group_bytes(group), got.group_bytes(group)), index
        finally:
            want.unref()
            got.unref()


def temp_files(root: Path) -> list[Path]:
    return [path for path in root.rglob("*.tmp") if path.is_file()]


def chunk_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p.name != LOCK_NAME]
