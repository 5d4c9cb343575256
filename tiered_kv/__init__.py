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
from tiered_kv.layout import MemoryLayoutDesc
from tiered_kv.metrics import EngineStats
from tiered_kv.prefetch import PrefetchHandle
from tiered_kv.retrieval import LayerwiseRetrieve, RetrieveResult
from tiered_kv.sync import (
    SyncLayerwiseRetrieve,
    SyncLayerwiseStore,
    SyncPrefetchHandle,
    SyncTieredKVEngine,
)
from tiered_kv.tiers.base import TierEventLog

__all__ = [
    "CodecError",
    "ConfigError",
    "EngineConfig",
    "EngineStateError",
    "EngineStats",
    "KernelCompileError",
    "KeySalt",
    "LayerwiseRetrieve",
    "LayerwiseStore",
    "LayoutError",
    "MemoryLayoutDesc",
    "PrefetchHandle",
    "RetrieveResult",
    "SyncLayerwiseRetrieve",
    "SyncLayerwiseStore",
    "SyncPrefetchHandle",
    "SyncTieredKVEngine",
    "TierEventLog",
    "TieredKVEngine",
    "TieredKVError",
]
__version__ = "0.1.0"
