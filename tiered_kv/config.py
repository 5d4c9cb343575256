"""`EngineConfig`: every knob of the engine, validated once, with `TIERED_KV_*` env overrides.

Owns parsing of human sizes ("8GiB") and the checks that give clear messages. Imports stdlib only.
"""

from __future__ import annotations

import dataclasses
import decimal
import os
import re
from collections.abc import Mapping
from typing import Any

from tiered_kv.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, name: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "512 MiB", "1.5GB"."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{name}: cannot parse size {value!r}; use an int or a number with one of "
                "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
            )
        # Decimal, not float: "4.1MB" is exactly 4_100_000 bytes.
        return int(decimal.Decimal(match.group(1)) * _SIZE_UNITS[unit])
    raise ConfigError(f"{name}: expected int or str, got {type(value).__name__}")


def format_size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings. Sizes accept ints (bytes) or strings like "8GiB"; they are stored as ints.

    chunk_size: tokens per chunk, the unit of storage.
    l1_size: bytes of the host arena (pinned when CUDA is available, see ``pin_memory``).
    l2_path: directory of the disk tier; None disables it.
    l2_size: capacity of the disk tier in bytes (LRU beyond it).
    l3_url: remote tier URL; None disables it (remote tiers arrive with a later release).
    namespace: tenant / cache salt; two namespaces never share a chunk.
    fingerprint: model weights / version tag; part of every key.
    l2_write_queue: chunks that may wait for their background L2 write; beyond it a store
        skips the L2 copy and counts it (the serving path never blocks on disk).
    close_timeout_s: how long ``aclose()`` waits for pending L2 writes before dropping them.
    pin_memory: pin the arena; None means "when CUDA is available".
    l2_fsync: fsync each L2 file and its directory before it becomes visible (crash safety).
    """

    chunk_size: int = 256
    l1_size: int | str = "1GiB"
    l2_path: str | None = None
    l2_size: int | str = "16GiB"
    l3_url: str | None = None
    namespace: str = ""
    fingerprint: str = ""
    l2_write_queue: int = 256
    close_timeout_s: float = 30.0
    pin_memory: bool | None = None
    l2_fsync: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int):
            raise ConfigError(f"chunk_size: expected int, got {self.chunk_size!r}")
        if not 1 <= self.chunk_size <= 1 << 20:
            raise ConfigError(f"chunk_size: must be in [1, 1048576], got {self.chunk_size}")
        object.__setattr__(self, "l1_size", parse_size(self.l1_size, name="l1_size"))
        object.__setattr__(self, "l2_size", parse_size(self.l2_size, name="l2_size"))
        if self.l1_size == 0:
            raise ConfigError("l1_size: must be > 0 (the host tier stages every transfer)")
        if self.l2_path is not None:
            object.__setattr__(self, "l2_path", os.fspath(self.l2_path))
        if self.l3_url is not None:
            raise ConfigError(
                f"l3_url: remote tiers are not available in this release (got {self.l3_url!r}); "
                "leave it None"
            )
        for name in ("namespace", "fingerprint"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name}: expected str, got {getattr(self, name)!r}")
        if isinstance(self.l2_write_queue, bool) or not isinstance(self.l2_write_queue, int):
            raise ConfigError(f"l2_write_queue: expected int, got {self.l2_write_queue!r}")
        if self.l2_write_queue < 1:
            raise ConfigError(f"l2_write_queue: must be >= 1, got {self.l2_write_queue}")
        if not self.close_timeout_s >= 0:
            raise ConfigError(f"close_timeout_s: must be >= 0, got {self.close_timeout_s}")

    @property
    def l1_bytes(self) -> int:
        assert isinstance(self.l1_size, int)  # normalized in __post_init__
        return self.l1_size

    @property
    def l2_bytes(self) -> int:
        assert isinstance(self.l2_size, int)
        return self.l2_size

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> EngineConfig:
        """Defaults, then ``TIERED_KV_<FIELD>`` variables, then explicit ``overrides``."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = environ.get(f"TIERED_KV_{field.name.upper()}")
            if raw is not None:
                values[field.name] = _from_env_string(field.name, raw)
        values.update(overrides)
        return cls(**values)


def _from_env_string(name: str, raw: str) -> Any:
    if name in ("chunk_size", "l2_write_queue"):
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"TIERED_KV_{name.upper()}: expected an int, got {raw!r}") from None
    if name == "close_timeout_s":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"TIERED_KV_{name.upper()}: expected a number, got {raw!r}") from None
    if name in ("pin_memory", "l2_fsync"):
        lowered = raw.strip().lower()
        if lowered in ("", "auto") and name == "pin_memory":
            return None
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"TIERED_KV_{name.upper()}: expected true/false, got {raw!r}")
    if name in ("l2_path", "l3_url"):
        return raw or None
    return raw
