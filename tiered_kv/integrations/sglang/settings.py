"""`BackendSettings`: the tiered_kv options of SGLang's ``--hicache-storage-backend-extra-config``.

Owns parsing that dict: our keys become an `EngineConfig` for the lower tiers (L2 at
``l2_path/<shard>``, L3 at ``l3_url``); SGLang's own keys (`SGLANG_KEYS`) are let through
unread; any other key is refused with the allowed set named, so a misspelt option never goes
unnoticed. Must not import SGLang: it is checked and tested without it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tiered_kv.config import EngineConfig
from tiered_kv.errors import ConfigError

# Keys SGLang itself reads from the same dict (its dynamic loader, its controller).
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)

# Our keys: the `EngineConfig` field each one sets (None: the backend's own setting).
OPTION_FIELDS: Mapping[str, str | None] = {
    "l2_path": "l2_path",
    "l2_size": "l2_size",
    "l2_bytes": "l2_size",  # an alias: "how many bytes of disk"
    "l2_durability": "l2_durability",
    "l2_io_threads": "l2_io_threads",
    "l2_eviction": "l2_eviction",
    "l3_url": "l3_url",
    "l3_timeout_s": "l3_timeout_s",
    "l3_token_file": "l3_token_file",
    "l3_key_prefix": "l3_key_prefix",
    "l3_ttl_s": "l3_ttl_s",
    "l3_pool_size": "l3_pool_size",
    "namespace": "namespace",
    "fingerprint": "fingerprint",
    "call_timeout_s": None,
}

DEFAULT_CALL_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True, slots=True)
class BackendSettings:
    """The parsed options. ``engine`` holds the tier options (its ``chunk_size`` is the host
    pool's page size, set at `with_page_size`); ``call_timeout_s`` bounds one SGLang call
    (a batch), after which it answers a miss / a failed store."""

    engine: EngineConfig
    call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.engine.l2_path is None and self.engine.l3_url is None:
            raise ConfigError(
                "tiered_kv SGLang backend: no tier configured; set 'l2_path' (a local "
                "directory) and/or 'l3_url' (tkv://, redis://, valkey://) in "
                "--hicache-storage-backend-extra-config"
            )
        timeout = self.call_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError(f"call_timeout_s: expected a number > 0, got {timeout!r}")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> BackendSettings:
        """Parse SGLang's extra-config dict; `ConfigError` names any bad or unknown key."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(OPTION_FIELDS) - SGLANG_KEYS)
        if unknown:
            raise ConfigError(
                f"tiered_kv SGLang backend: unknown extra-config key(s) {unknown}; ours: "
                f"{sorted(OPTION_FIELDS)}; SGLang's: {sorted(SGLANG_KEYS)}"
            )
        if "l2_size" in extra and "l2_bytes" in extra:
            raise ConfigError("l2_size and l2_bytes: give one of them (they are the same option)")
        url = extra.get("l3_url")
        if isinstance(url, str) and url.partition("://")[0].lower() == "mooncake":
            raise ConfigError(
                f"l3_url: {url!r}: mooncake:// is not supported by the SGLang backend (its "
                "transfers register our own host arena; SGLang's host pool is not one); use "
                "SGLang's own 'mooncake' backend, or tkv:// / redis://"
            )
        fields: dict[str, Any] = {}
        for key, field in OPTION_FIELDS.items():
            if key in extra and field is not None:
                fields[field] = extra[key]
        try:
            engine = EngineConfig(**fields)
        except TypeError as exc:  # a value of the wrong kind that EngineConfig did not name
            raise ConfigError(f"tiered_kv SGLang backend: {exc}") from None
        timeout = extra.get("call_timeout_s", DEFAULT_CALL_TIMEOUT_S)
        return cls(engine, call_timeout_s=timeout)

    def with_page_size(self, page_size: int, l2_path: str | None) -> EngineConfig:
        """The tier config for one host pool: chunks of one page, L2 at ``l2_path``."""
        return dataclasses.replace(self.engine, chunk_size=page_size, l2_path=l2_path)
