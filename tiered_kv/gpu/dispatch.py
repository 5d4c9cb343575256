"""`DeviceMover`: the engine's default mover: `CudaMover` for CUDA caches, `TorchMover` otherwise.

Owns nothing but the choice: each registered layout goes to the mover of its device type. The
CUDA mover (and with it cuda-python and NVRTC) is created on the first CUDA layout only, so CPU
users never load CUDA libraries.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tiered_kv.gpu.base import ChunkTransfer, KVMover, LayerLoad, LayerSave
from tiered_kv.gpu.reference import TorchMover
from tiered_kv.layout import KVCacheLayout

COMMON_STATS = ("bytes_gathered", "bytes_scattered", "gather_seconds", "scatter_seconds")


class DeviceMover(KVMover):
    """``cuda_path`` forces a CUDA path (``auto``, ``staging``, ``mapped``, ``dma``); the default
    comes from ``TIERED_KV_GPU_PATH`` or is ``auto``."""

    name = "device"

    def __init__(self, *, cuda_path: str | None = None) -> None:
        from tiered_kv.gpu.mover import MoverOptions
        from tiered_kv.gpu.plan import path_choice

        self._cuda_options = MoverOptions(
            path=path_choice(cuda_path or os.environ.get("TIERED_KV_GPU_PATH", "auto"))
        )
        self.torch = TorchMover()
        self.cuda: KVMover | None = None

    def mover_for(self, layout: KVCacheLayout) -> KVMover:
        if layout.device.type != "cuda":
            return self.torch
        if self.cuda is None:
            from tiered_kv.gpu.mover import CudaMover

            self.cuda = CudaMover(self._cuda_options)
        return self.cuda

    def prepare(self, layout: KVCacheLayout) -> None:
        self.mover_for(layout).prepare(layout)

    def forget(self, layout: KVCacheLayout) -> None:
        for mover in (self.torch, self.cuda):
            if mover is not None:
                mover.forget(layout)

    async def gather(
        self,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        transfers: Sequence[ChunkTransfer],
        *,
        layers: Sequence[int] | None = None,
        after: Any = None,
    ) -> None:
        await self.mover_for(layout).gather(
            layout, block_ids, transfers, layers=layers, after=after
        )

    async def scatter(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> None:
        await self.mover_for(layout).scatter(layout, block_ids, transfers)

    async def scatter_layerwise(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> LayerLoad:
        return await self.mover_for(layout).scatter_layerwise(layout, block_ids, transfers)

    def begin_gather(
        self, layout: KVCacheLayout, block_ids: Sequence[int], transfers: Sequence[ChunkTransfer]
    ) -> LayerSave:
        return self.mover_for(layout).begin_gather(layout, block_ids, transfers)

    def stats(self) -> dict[str, int | float]:
        """Totals under the common names (``bytes_gathered``, ``gather_seconds``, ...) plus
        each mover's own counters prefixed with its name."""
        out: dict[str, int | float] = dict.fromkeys(COMMON_STATS, 0)
        for mover in (self.torch, self.cuda):
            if mover is None:
                continue
            for name, value in mover.stats().items():
                if name in COMMON_STATS:
                    out[name] += value
                else:
                    out[f"{mover.name}_{name}"] = value
        return out

    async def aclose(self) -> None:
        try:
            await self.torch.aclose()
        finally:
            if self.cuda is not None:
                await self.cuda.aclose()
