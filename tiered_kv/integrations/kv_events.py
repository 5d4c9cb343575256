"""KV events for routers: the worker's tier activity as vLLM's `BlockStored` / `BlockRemoved`.

Owns the translation of the worker engine's `ResolvedTierEvent`s into vLLM's KV cache events
(which medium, locality and owner each tier is, which hash stands for a chunk) and the container
that carries them from the workers to the scheduler (`TieredKVEvents`), whose connector half
hands them to vLLM's publisher (`take_events`). One event per chunk; its hash is our chunk hash,
so a chunk is announced under one hash in every tier and on every instance that shares it
(docs/vllm.md, "KV events"). Must not touch the engine (the host drains it) or keep state beyond
the events of one step. vLLM is imported here only, as in `integrations.vllm`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from tiered_kv.integrations.tier_watch import ResolvedTierEvent


@dataclasses.dataclass(frozen=True, slots=True)
class TierMedium:
    """How a tier is announced: vLLM's ``medium`` ("CPU", "STORAGE"), ``locality`` ("LOCAL",
    "REMOTE": relative to the publishing instance) and ``ownership`` (the secondary tier that
    made the event; None for L1, the primary offload tier)."""

    medium: str
    locality: str | None
    ownership: str | None


# L1 is host memory; L2 a local disk; L3 and custom lower tiers a store other instances share.
TIER_MEDIA: dict[str, TierMedium] = {
    "L1": TierMedium(MEDIUM_CPU, "LOCAL", None),
    "L2": TierMedium(MEDIUM_STORAGE, "LOCAL", "L2"),
    "L3": TierMedium(MEDIUM_STORAGE, "REMOTE", "L3"),
}


def tier_medium(tier: str) -> TierMedium:
    """The announcement of tier ``tier`` (a custom lower tier: remote storage under its name)."""
    return TIER_MEDIA.get(tier) or TierMedium(MEDIUM_STORAGE, "REMOTE", tier)


@dataclasses.dataclass(frozen=True, slots=True)
class EventGroup:
    """What the events say about one registration's chunks: vLLM's KV cache group index (None
    for a model with one group) and its kind ("full_attention", "sliding_window")."""

    group_idx: int | None = None
    spec_kind: str | None = None
    sliding_window: int | None = None


def chunk_event_hash(chunk_hash: bytes) -> int | bytes:
    """A chunk hash as vLLM publishes block hashes (its ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``:
    by default the low 64 bits as an int, else the bytes)."""
    converted: int | bytes = maybe_convert_block_hash(BlockHash(chunk_hash))
    return converted


def to_vllm_events(
    resolved: list[ResolvedTierEvent], groups: Mapping[str, EventGroup]
) -> list[KVCacheEvent]:
    """vLLM events for the tier events of the registrations in ``groups`` (model name in chunk
    keys -> its group); events of other models' chunks are left out."""
    out: list[KVCacheEvent] = []
    for item in resolved:
        event = item.event
        group = groups.get(event.key.scope.model)
        if group is None:
            continue
        media = tier_medium(event.tier)
        block_hash = chunk_event_hash(event.key.chunk_hash)
        if event.kind == "removed":
            out.append(
                BlockRemoved(
                    block_hashes=[block_hash],
                    medium=media.medium,
                    group_idx=group.group_idx,
                    locality=media.locality,
                    ownership=media.ownership,
                )
            )
            continue
        tokens = list(item.token_ids) if item.token_ids is not None else []
        parent = item.parent_hash
        out.append(
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=None if parent is None else chunk_event_hash(parent),
                token_ids=tokens,
                block_size=len(tokens) or event.num_tokens,
                lora_id=None,
                medium=media.medium,
                lora_name=None,
                group_idx=group.group_idx,
                kv_cache_spec_kind=group.spec_kind,
                kv_cache_spec_sliding_window=group.sliding_window,
                locality=media.locality,
                ownership=media.ownership,
            )
        )
    return out


class TieredKVEvents(KVConnectorKVEvents):
    """The events of one step, from the workers to the scheduler (in
    ``KVConnectorOutput.kv_cache_events``). Only tensor-parallel rank 0 reports (its tiers speak
    for the instance), so merging workers' containers concatenates."""

    def __init__(self, events: list[KVCacheEvent] | None = None, num_workers: int = 1) -> None:
        self._events = list(events or [])
        self._num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> TieredKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._events.clear()
