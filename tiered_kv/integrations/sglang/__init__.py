"""tiered_kv as SGLang's HiCache storage backend (docs/sglang.md).

SGLang loads `TieredKVHiCacheStorage` through its ``dynamic`` backend path::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "tiered_kv", "module_path": "tiered_kv.integrations.sglang",
      "class_name": "TieredKVHiCacheStorage", "interface_v1": 1, "l2_path": "/var/cache/tkv"}'

Importing this package imports SGLang; importing tiered_kv never does.
"""

from tiered_kv.integrations.sglang.backend import SGLangStorageStats, TieredKVHiCacheStorage

__all__ = ["SGLangStorageStats", "TieredKVHiCacheStorage"]
