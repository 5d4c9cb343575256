"""tiered_kv: keep an LLM serving engine's KV cache in host memory, on disk and remote."""

from tiered_kv.config import EngineConfig
from tiered_kv.engine import TieredKVEngine
from tiered_kv.errors import (
    CodecError,
    ConfigError,
    EngineStateError,
    KernelCompileError,
    LayoutError,
    TieredKVError,
)
from tiered_kv.keys import KeySalt
from tiered_kv.layerwise_store import LayerwiseStore
from tiered_kv.retrieval import LayerwiseRetrieve, RetrieveResult
from tiered_kv.sync import SyncTieredKVEngine

__all__ = [
    "CodecError",
    "ConfigError",
    "EngineConfig",
    "EngineStateError",
    "KernelCompileError",
    "KeySalt",
    "LayerwiseRetrieve",
    "LayerwiseStore",
    "LayoutError",
    "RetrieveResult",
    "SyncTieredKVEngine",
    "TieredKVEngine",
    "TieredKVError",
]
__version__ = "0.1.0"
