# vLLM's base classes are Any where vLLM is not installed (the light .venv that lints).
"""The scheduler's plan for one step, as vLLM carries it to every worker: `TieredKVMetadata`.

Owns the plan's types (`LoadSpec`, `StoreSpec`, `TieredKVMetadata`) and the rule that marks a
step as one request's prefill (`prefill_of_step`), which the workers time for the recompute
model. The scheduler half builds a plan per step; vLLM pickles it to the workers' processes,
where the worker half carries it out. Plain data: must not hold a request, a tensor or any
state of either half, so that it crosses processes as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclasses.dataclass(slots=True)
class LoadSpec:
    """Load ``token_ids``'s cached prefix into ``block_ids``, never writing the first
    ``skip_prefix_tokens`` (vLLM's own prefix-cache hit). The scheduler claimed the tokens up to
    ``claimed_end`` (0: up to the end of ``token_ids``); ``token_ids`` may go on to the end of
    the chunk holding the claim's last token, so that the chunk's key matches the one stored:
    those extra tokens land in the request's own next blocks, which vLLM computes anyway."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    skip_prefix_tokens: int
    claimed_end: int = 0
    salt: list[list[int | str]] | None = None  # `KeySalt.to_wire` of the request's salt
    group_block_ids: list[list[int]] | None = None  # hybrid models: every group's blocks

    @property
    def end(self) -> int:
        return self.claimed_end or len(self.token_ids)


@dataclasses.dataclass(slots=True)
class StoreSpec:
    """Store the KV of ``token_ids`` (whole blocks) from ``block_ids`` after this step."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    salt: list[list[int | str]] | None = None  # `KeySalt.to_wire` of the request's salt
    group_block_ids: list[list[int]] | None = None  # hybrid models: every group's blocks


@dataclasses.dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """One step's plan: loads (before the forward pass), stores (after it), and requests whose
    lookup prefetches the workers may free."""

    loads: list[LoadSpec] = dataclasses.field(default_factory=list)
    stores: list[StoreSpec] = dataclasses.field(default_factory=list)
    release: list[str] = dataclasses.field(default_factory=list)
    # (new tokens, prefix tokens) when the step is one request's prefill (`prefill_of_step`):
    # the workers time its forward pass for the recompute model of load_policy "cost".
    prefill: tuple[int, int] | None = None


PREFILL_SHARE = 16  # a step is timed as a prefill when other requests' tokens are <= 1/16


def prefill_of_step(
    scheduled: Mapping[str, int], computed: Mapping[str, int]
) -> tuple[int, int] | None:
    """(new tokens, prefix tokens) when one request's prefill is nearly all of a step's work,
    else None: the request with the most scheduled tokens (more than one), over ``computed``
    tokens already resident, while the others (decodes) add at most 1/16 of its tokens. Those
    are counted as new tokens too, so the estimate errs towards recomputing being slower."""
    if not scheduled:
        return None
    request_id = max(scheduled, key=scheduled.__getitem__)
    new_tokens = scheduled[request_id]
    others = sum(scheduled.values()) - new_tokens
    if new_tokens < 2 or others * PREFILL_SHARE > new_tokens:
        return None
    return new_tokens + others, computed.get(request_id, 0)
