"""Test-side KV caches of every supported format, with an independent way to address one token.

`row(entry, kv, block, offset)` returns a *view* of one token's ``[NH, HS]`` (or ``[D]``) row, so
tests can both read and write expected values without going through `tiered_kv.layout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

FORMATS = (
    "vllm_nhd",
    "vllm_hnd_view",
    "vllm_hnd_hint",
    "flashinfer_nhd",
    "flashinfer_hnd",
    "mla",
    "separate",
    "fused",
)
# The KV dtypes the round-trip tests cover, by the short name their test ids use.
DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
}
POISON = 0xA5

Entry = Any  # a tensor, or a (K, V) tuple, or (view, physical) for permuted layouts


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str = "cpu"
) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs included: tests compare bytes)."""
    *lead, last = shape
    raw = torch.randint(0, 256, (*lead, last * dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.to(device).view(dtype)


@dataclasses.dataclass
class KVCaches:
    fmt: str
    kv_count: int
    entries: list[Any]  # what register_kv_caches gets
    physical: list[Any]  # the tensors that own the bytes, addressed by `row`
    hints: dict[str, Any]
    row: Callable[[Any, int, int, int], torch.Tensor]

    def token_row(self, layer: int, kv: int, block: int, offset: int) -> torch.Tensor:
        return self.row(self.physical[layer], kv, block, offset)

    def snapshot(self) -> list[list[torch.Tensor]]:
        return [[t.clone() for t in _tensors(p)] for p in self.physical]

    def bytes_equal(self, other: list[list[torch.Tensor]]) -> bool:
        return all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8))
            for mine, theirs in zip(self.physical, other, strict=True)
            for a, b in zip(_tensors(mine), theirs, strict=True)
        )


def _tensors(physical: Any) -> tuple[torch.Tensor, ...]:
    return physical if isinstance(physical, tuple) else (physical,)


def make_caches(
    fmt: str,
    dtype: torch.dtype,
    *,
    num_layers: int = 2,
    num_blocks: int = 16,
    block_size: int = 16,
    num_heads: int = 2,
    head_size: int = 8,
    mla_width: int = 24,
    seed: int = 0,
    device: str = "cpu",
) -> KVCaches:
    gen = torch.Generator().manual_seed(seed)
    nb, bs, nh, hs = num_blocks, block_size, num_heads, head_size
    entries: list[Any] = []
    physical: list[Any] = []
    for _ in range(num_layers):
        if fmt == "vllm_nhd":
            t = random_tensor((2, nb, bs, nh, hs), dtype, gen, device)
            entries.append(t)
            physical.append(t)
        elif fmt == "vllm_hnd_view":
            p = random_tensor((2, nb, nh, bs, hs), dtype, gen, device)
            entries.append(p.permute(0, 1, 3, 2, 4))
            physical.append(p)
        elif fmt == "vllm_hnd_hint":
            p = random_tensor((2, nb, nh, bs, hs), dtype, gen, device)
            entries.append(p)
            physical.append(p)
        elif fmt == "flashinfer_nhd":
            t = random_tensor((nb, 2, bs, nh, hs), dtype, gen, device)
            entries.append(t)
            physical.append(t)
        elif fmt == "flashinfer_hnd":
            t = random_tensor((nb, 2, nh, bs, hs), dtype, gen, device)
            entries.append(t)
            physical.append(t)
        elif fmt == "mla":
            t = random_tensor((nb, bs, mla_width), dtype, gen, device)
            entries.append(t)
            physical.append(t)
        elif fmt == "separate":
            k = random_tensor((nb, bs, nh, hs), dtype, gen, device)
            v = random_tensor((nb, bs, nh, hs), dtype, gen, device)
            entries.append((k, v))
            physical.append((k, v))
        elif fmt == "fused":
            t = random_tensor((nb, nh, bs, 2 * hs), dtype, gen, device)
            entries.append(t)
            physical.append(t)
        else:
            raise ValueError(fmt)
    return KVCaches(
        fmt, 1 if fmt == "mla" else 2, entries, physical, hints_for(fmt, bs), _ROWS[fmt](hs)
    )


HND_FORMATS = ("vllm_hnd_view", "vllm_hnd_hint", "flashinfer_hnd", "fused")


def hints_for(fmt: str, block_size: int) -> dict[str, Any]:
    """What a caller who knows its engine passes: the block size, and the memory order of
    (position, head) where the format has heads."""
    if fmt == "mla":
        return {"block_size": block_size}
    return {"block_size": block_size, "kv_layout": "HND" if fmt in HND_FORMATS else "NHD"}


def _rows() -> dict[str, Callable[[int], Callable[[Any, int, int, int], torch.Tensor]]]:
    return {
        "vllm_nhd": lambda hs: lambda p, k, b, o: p[k, b, o],
        "vllm_hnd_view": lambda hs: lambda p, k, b, o: p[k, b, :, o],
        "vllm_hnd_hint": lambda hs: lambda p, k, b, o: p[k, b, :, o],
        "flashinfer_nhd": lambda hs: lambda p, k, b, o: p[b, k, o],
        "flashinfer_hnd": lambda hs: lambda p, k, b, o: p[b, k, :, o],
        "mla": lambda hs: lambda p, k, b, o: p[b, o],
        "separate": lambda hs: lambda p, k, b, o: p[k][b, o],
        "fused": lambda hs: lambda p, k, b, o: p[b, :, o, k * hs : (k + 1) * hs],
    }


_ROWS = _rows()


def poison_blocks(caches: KVCaches, blocks: list[int]) -> None:
    """Overwrite every token slot of ``blocks`` in every layer with the poison byte."""
    bs = _block_size(caches)
    for layer in range(len(caches.physical)):
        for k in range(caches.kv_count):
            for b in blocks:
                for o in range(bs):
                    caches.token_row(layer, k, b, o).view(torch.uint8).fill_(POISON)


def _block_size(caches: KVCaches) -> int:
    first = caches.entries[0]
    tensor = first[0] if isinstance(first, tuple) else first
    if caches.fmt in ("vllm_nhd", "vllm_hnd_view"):
        return int(tensor.shape[2])
    if caches.fmt == "vllm_hnd_hint":
        return int(tensor.shape[3])
    if caches.fmt == "flashinfer_nhd":
        return int(tensor.shape[2])
    if caches.fmt == "flashinfer_hnd":
        return int(tensor.shape[3])
    if caches.fmt in ("mla", "separate"):
        return int(tensor.shape[1])
    return int(tensor.shape[2])  # fused [NB, NH, BS, 2*HS]


def expect_copy(
    caches: KVCaches,
    expected: list[list[torch.Tensor]],
    reference: list[list[torch.Tensor]],
    src_blocks: list[int],
    dst_blocks: list[int],
    tokens: range,
    block_size: int,
) -> None:
    """In ``expected``, copy ``tokens``' rows from ``reference`` at src slots to dst slots."""
    for layer in range(len(caches.physical)):
        exp = expected[layer] if len(expected[layer]) > 1 else expected[layer][0]
        ref = reference[layer] if len(reference[layer]) > 1 else reference[layer][0]
        exp = tuple(exp) if isinstance(exp, list) else exp
        ref = tuple(ref) if isinstance(ref, list) else ref
        for k in range(caches.kv_count):
            for t in tokens:
                src = caches.row(ref, k, src_blocks[t // block_size], t % block_size)
                dst = caches.row(exp, k, dst_blocks[t // block_size], t % block_size)
                dst.copy_(src)
