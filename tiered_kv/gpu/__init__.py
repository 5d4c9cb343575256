"""Byte movers between the engine's paged KV caches and host `MemoryObj`s.

Importing this package never imports CUDA bindings; the NVRTC path lives in its own modules.
"""

from tiered_kv.gpu.base import ChunkTransfer, KVMover
from tiered_kv.gpu.dispatch import DeviceMover
from tiered_kv.gpu.reference import TorchMover

__all__ = ["ChunkTransfer", "DeviceMover", "KVMover", "TorchMover"]
