"""A stand-in for the serving engine's model in the fault suite: paged KV caches whose content is
a function of the token prefix, so any row the cache serves can be checked on its own.

Token i of a prompt gets K/V rows derived from a hash of the prompt's first i+1 tokens (the same
prefix chaining as chunk keys): a chunk served for the wrong prefix, the wrong position, or half
written, does not match.
"""

from __future__ import annotations

import random

import torch
import xxhash

NUM_LAYERS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE = 2, 16, 2, 16
HINTS = {"block_size": BLOCK_SIZE, "kv_layout": "NHD"}
POISON = -1.0


def prefix_codes(tokens: list[int]) -> torch.Tensor:
    """Per position, a code of the prefix up to it: exact in float32 (< 2**20)."""
    state = xxhash.xxh3_64()
    codes = []
    for token in tokens:
        state.update(token.to_bytes(4, "little"))
        codes.append(state.intdigest() % (1 << 20))
    return torch.tensor(codes, dtype=torch.float32)


class PagedModel:
    """vLLM NHD caches ``[2, NB, BS, NH, HS]`` float32 per layer, a block allocator, and the
    expected rows of any prompt."""

    def __init__(self, num_blocks: int) -> None:
        shape = (2, num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
        self.caches = [torch.full(shape, POISON) for _ in range(NUM_LAYERS)]
        self.free = list(range(num_blocks))

    def allocate(self, num_tokens: int, rng: random.Random) -> list[int] | None:
        needed = -(-num_tokens // BLOCK_SIZE)
        if needed > len(self.free):
            return None
        rng.shuffle(self.free)
        blocks, self.free = self.free[:needed], self.free[needed:]
        for cache in self.caches:
            cache[:, blocks] = POISON
        return blocks

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def _rows(self, codes: torch.Tensor, layer: int) -> torch.Tensor:
        """``[2, n, NH, HS]`` expected K/V rows for positions with these prefix codes."""
        offsets = torch.arange(NUM_HEADS * HEAD_SIZE, dtype=torch.float32).view(NUM_HEADS, -1)
        base = codes.view(-1, 1, 1) + offsets + layer * 4096.0
        return torch.stack((base, base + 2048.0))

    def _slots(self, blocks: list[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, end)
        ids = torch.tensor(blocks, dtype=torch.long)[positions // BLOCK_SIZE]
        return ids, positions % BLOCK_SIZE

    def prefill(self, tokens: list[int], blocks: list[int], start: int) -> None:
        """Compute (write) the KV of tokens [start, len) into their blocks."""
        if start >= len(tokens):
            return
        codes = prefix_codes(tokens)[start:]
        ids, offsets = self._slots(blocks, start, len(tokens))
        for layer, cache in enumerate(self.caches):
            cache[:, ids, offsets] = self._rows(codes, layer)

    def wrong_rows(self, tokens: list[int], blocks: list[int], end: int) -> int:
        """How many of tokens [0, end)'s rows differ from what their prefix implies."""
        if end == 0:
            return 0
        codes = prefix_codes(tokens[:end])
        ids, offsets = self._slots(blocks, 0, end)
        wrong = torch.zeros(end, dtype=torch.bool)
        for layer, cache in enumerate(self.caches):
            got = cache[:, ids, offsets]
            wrong |= (got != self._rows(codes, layer)).flatten(2).any(-1).any(0)
        return int(wrong.sum())
