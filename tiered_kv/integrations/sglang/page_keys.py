"""`PageKeys`: SGLang's page keys as our `ChunkKey`s, scoped to one model shard's page format.

SGLang names a page by a string (its prefix-chained page hash). Our key adds what that string
does not carry: the namespace, the model, the fingerprint, the shard (TP rank and size; the
pipeline, context-parallel and decode-context-parallel ranks when they split the KV) and the
page format (`PageGeometry.layout_id`: layout, dtype, page shape). ``chunk_hash`` is
``xxh3_128(scope bytes || page key)``, so tiers that index by ``chunk_hash`` alone still never
mix two scopes. MLA models keep one copy for all TP ranks: their scope has no TP rank.

Must not import SGLang: the storage config is read through `StorageShard`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import xxhash

from tiered_kv.errors import ConfigError
from tiered_kv.keys import ChunkKey, KeyScope

_UNNAMED_MODEL = "(unnamed)"


@dataclasses.dataclass(frozen=True, slots=True)
class StorageShard:
    """What of SGLang's ``HiCacheStorageConfig`` decides which pages are interchangeable."""

    model_name: str
    tp_rank: int
    tp_size: int
    is_mla: bool
    is_writer: bool
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1

    def __post_init__(self) -> None:
        for rank, size in (
            ("tp_rank", "tp_size"),
            ("pp_rank", "pp_size"),
            ("cp_rank", "cp_size"),
            ("dcp_rank", "dcp_size"),
        ):
            r, n = getattr(self, rank), getattr(self, size)
            if not (isinstance(n, int) and isinstance(r, int) and n >= 1 and 0 <= r < n):
                raise ConfigError(f"SGLang storage config: {rank}={r!r} / {size}={n!r} invalid")

    @classmethod
    def of(cls, config: Any) -> StorageShard:
        """From SGLang's ``HiCacheStorageConfig`` (its attributes, read by name)."""
        try:
            tp_rank, tp_size = int(config.tp_rank), int(config.tp_size)
            is_mla = bool(config.is_mla_model)
        except AttributeError as exc:
            raise ConfigError(f"SGLang storage config: missing field ({exc})") from None
        writer = getattr(config, "is_storage_writer", None)
        return cls(
            model_name=str(getattr(config, "model_name", None) or _UNNAMED_MODEL),
            tp_rank=tp_rank,
            tp_size=tp_size,
            is_mla=is_mla,
            is_writer=bool(writer) if writer is not None else (not is_mla or tp_rank == 0),
            pp_rank=int(getattr(config, "pp_rank", 0)),
            pp_size=int(getattr(config, "pp_size", 1)),
            cp_rank=int(getattr(config, "attn_cp_rank", 0)),
            cp_size=int(getattr(config, "attn_cp_size", 1)),
            dcp_rank=int(getattr(config, "dcp_rank", 0)),
            dcp_size=int(getattr(config, "dcp_size", 1)),
        )

    @property
    def splits(self) -> str:
        """The shard's parts beyond TP that split the KV (empty when there are none)."""
        parts = [
            f"{name}{rank}of{size}"
            for name, rank, size in (
                ("pp", self.pp_rank, self.pp_size),
                ("cp", self.cp_rank, self.cp_size),
                ("dcp", self.dcp_rank, self.dcp_size),
            )
            if size > 1
        ]
        return "-".join(parts)

    @property
    def directory(self) -> str:
        """This process's own L2 subdirectory: an L2 directory belongs to one process (its
        lock), so every rank has one, MLA ranks included."""
        name = f"tp{self.tp_rank}of{self.tp_size}"
        return f"{name}-{self.splits}" if self.splits else name


class PageKeys:
    """Chunk keys of one backend's pages."""

    def __init__(
        self, shard: StorageShard, namespace: str, fingerprint: str, layout_id: str
    ) -> None:
        layout = f"{layout_id}:{shard.splits}" if shard.splits else layout_id
        world, worker = (1, 0) if shard.is_mla else (shard.tp_size, shard.tp_rank)
        self.scope = KeyScope(namespace, shard.model_name, fingerprint, world, worker, layout)
        self._seed = self.scope.to_bytes()

    def key(self, page_key: str) -> ChunkKey:
        if not isinstance(page_key, str) or not page_key:
            raise ConfigError(f"SGLang page key: expected a non-empty str, got {page_key!r}")
        state = xxhash.xxh3_128(self._seed)
        state.update(page_key.encode())
        return ChunkKey(self.scope, state.digest())
