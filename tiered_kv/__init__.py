"""tiered_kv: keep an LLM serving engine's KV cache in host memory, on disk and remote.

`__all__` names every type a user passes in or gets back (tests/test_public_api.py walks the
public surface to keep it so): the engines and their verbs' results, the configuration and its
policies, the statistics snapshot with every section, and the extension points (`KVMover`,
`LowerTier`) with the types their methods take.
"""

from tiered_kv.codec import GroupSpec
from tiered_kv.config import EngineConfig, LoadPolicy, PrefetchPolicy, WritePolicy
from tiered_kv.engine import TieredKVEngine
from tiered_kv.errors import (
    CodecError,
    ConfigError,
    EngineStateError,
    KernelCompileError,
    LayoutError,
    TieredKVError,
)
from tiered_kv.gpu.base import ChunkTransfer, KVMover, LayerLoad, LayerSave, MoverStats
from tiered_kv.io.plane import ChunkBytes, PlaneStats, PlaneWrite, WorkerPlane, WriteDone
from tiered_kv.keys import ChunkKey, KeySalt, KeyScope, TokenIds
from tiered_kv.layerwise_store import LayerwiseStore
from tiered_kv.layout import (
    Format,
    GroupLayout,
    KVCacheLayout,
    KVLayout,
    LayerGroup,
    MemoryLayoutDesc,
    StrideDesc,
)
from tiered_kv.memory import ArenaStats, HostArena, MemoryObj
from tiered_kv.metrics import EngineCounters, EngineStats
from tiered_kv.prefetch import PrefetchCounters, PrefetchHandle, PrefetchStats
from tiered_kv.retrieval import LayerwiseRetrieve, RetrieveResult, StopReason
from tiered_kv.storage import LowerTierTraffic, StorageStats, TierReadStats, WriteQueueStats
from tiered_kv.sync import (
    SyncLayerwiseRetrieve,
    SyncLayerwiseStore,
    SyncPrefetchHandle,
    SyncTieredKVEngine,
)
from tiered_kv.tiers.base import LowerTier, TierEvent, TierEventKind, TierEventLog, TierStats
from tiered_kv.tiers.l1 import L1Stats

__all__ = [
    "ArenaStats",
    "ChunkBytes",
    "ChunkKey",
    "ChunkTransfer",
    "CodecError",
    "ConfigError",
    "EngineConfig",
    "EngineCounters",
    "EngineStateError",
    "EngineStats",
    "Format",
    "GroupLayout",
    "GroupSpec",
    "HostArena",
    "KVCacheLayout",
    "KVLayout",
    "KVMover",
    "KernelCompileError",
    "KeySalt",
    "KeyScope",
    "L1Stats",
    "LayerGroup",
    "LayerLoad",
    "LayerSave",
    "LayerwiseRetrieve",
    "LayerwiseStore",
    "LayoutError",
    "LoadPolicy",
    "LowerTier",
    "LowerTierTraffic",
    "MemoryLayoutDesc",
    "MemoryObj",
    "MoverStats",
    "PlaneStats",
    "PlaneWrite",
    "PrefetchCounters",
    "PrefetchHandle",
    "PrefetchPolicy",
    "PrefetchStats",
    "RetrieveResult",
    "StopReason",
    "StorageStats",
    "StrideDesc",
    "SyncLayerwiseRetrieve",
    "SyncLayerwiseStore",
    "SyncPrefetchHandle",
    "SyncTieredKVEngine",
    "TierEvent",
    "TierEventKind",
    "TierEventLog",
    "TierReadStats",
    "TierStats",
    "TieredKVEngine",
    "TieredKVError",
    "TokenIds",
    "WritePolicy",
    "WorkerPlane",
    "WriteDone",
    "WriteQueueStats",
]
__version__ = "0.1.0"
