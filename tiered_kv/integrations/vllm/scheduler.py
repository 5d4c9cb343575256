"""The connector's scheduler half: lookups, claims and each step's plan (`SchedulerHalf`).

Owns, in vLLM's scheduler process (no KV caches there): the state of each request vLLM asks
about, the `LookupClient` over which it asks every worker's engine how much of a prompt is
cached and ready in host memory, the claims (whole blocks beyond vLLM's own prefix-cache hit),
each step's plan of which blocks the workers load and store (`TieredKVMetadata`), the router
events on their way from the workers to vLLM's publisher, and the request's key salt
(`request_salt`). Called on vLLM's scheduler thread only, one hook at a time.

Must not: block on disk, network or the workers (a step's lookups wait for the workers'
replies at most `LOOKUP_WAIT_PER_STEP_S` in all, and answer "ask again" until they have
arrived and their loads are done), claim a partial block, load into blocks vLLM's own prefix
cache owns, or hold worker state (an engine, KV caches): the workers live in other processes
and hear from this half only through the plan and the lookup channel.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from tiered_kv.integrations.fingerprint import adapter_digest
from tiered_kv.integrations.kv_events import TieredKVEvents
from tiered_kv.integrations.lookup_channel import LookupClient, socket_path
from tiered_kv.integrations.vllm.config import ConnectorSettings
from tiered_kv.integrations.vllm.metadata import (
    LoadSpec,
    StoreSpec,
    TieredKVMetadata,
    prefill_of_step,
)
from tiered_kv.integrations.vllm.stats import SCHEDULER_STATS, TieredKVConnectorStats
from tiered_kv.keys import KeySalt

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# How long one scheduler step may wait, over all its lookups, for the workers' replies (their
# round trip, not their loads: a worker answers "ask again" while it loads). Without it a
# request whose KV is in host memory sits out one step for its answer (docs/vllm.md).
LOOKUP_WAIT_PER_STEP_S = 0.002
# Router events the scheduler holds between a step's output and vLLM's next `take_events`
# (called every step, so only a publisher that stopped draining reaches it): the oldest beyond
# are dropped and counted in ``kv_events_dropped``.
PENDING_EVENTS_MAX = 1 << 16


@dataclasses.dataclass(slots=True, eq=False)
class _RequestState:
    """Scheduler-side bookkeeping of one request."""

    request: Request
    cacheable: bool = True  # False: its KV cannot be keyed (see `request_salt`)
    salt: KeySalt | None = None
    local_tokens: int = 0  # vLLM's block-aligned prefix-cache hit at the last lookup
    load_end: int = 0  # end of the tokens to load (0: none)
    ready_end: int = 0  # the workers' answer: the cached prefix's end (may pass load_end)
    load_pending: bool = False
    stored_end: int = 0  # tokens already handed to a StoreSpec or loaded from the cache
    first_lookup: float | None = None  # time.monotonic() of the first unanswered lookup


class SchedulerHalf:
    """`TieredKVConnector`'s scheduler side: the connector forwards vLLM's scheduler hooks
    here (same names and arguments; see the module docstring)."""

    def __init__(self, settings: ConnectorSettings) -> None:
        self.settings = settings
        self._requests: dict[str, _RequestState] = {}
        self._release: list[str] = []  # requests whose lookup prefetches the workers may free
        self._lookup_wait_left = LOOKUP_WAIT_PER_STEP_S  # this step's time for lookup replies
        self._adapter_digests: dict[tuple[str, str], str | None] = {}  # LoRA (name, path)
        self._pending_events: deque[KVCacheEvent] = deque()
        self._stats: dict[str, float] = dict.fromkeys(SCHEDULER_STATS, 0)
        paths = [
            socket_path(settings.socket_dir, settings.instance_id, rank)
            for rank in range(settings.world_size)
        ]
        self._client: LookupClient | None = LookupClient(paths)
        if settings.is_consumer and settings.load_failure_policy != "recompute":
            logger.warning(
                "TieredKVConnector: kv_load_failure_policy=%r fails a request whose cached "
                "KV could not be loaded; 'recompute' recomputes it instead",
                settings.load_failure_policy,
            )

    @property
    def lookup_wait_left(self) -> float:
        """Seconds this step's lookups may still wait for the workers' replies."""
        return self._lookup_wait_left

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.settings.is_consumer or self._client is None:
            return 0, False
        block = self.settings.block_size
        # Whole blocks only, and at least one token left for vLLM to compute.
        limit = (request.num_tokens - 1) // block * block
        if limit <= num_computed_tokens:
            return 0, False
        state = self._state(request)
        if not state.cacheable:
            return 0, False
        now = time.monotonic()
        if state.first_lookup is None:
            state.first_lookup = now
        # Ask about every whole block of the request, not only up to the limit: a block-aligned
        # prompt's last chunk was stored whole, and a key over fewer tokens would not match it.
        looked_up = request.num_tokens // block * block
        started = time.monotonic()
        ready = self._client.lookup(
            request.request_id,
            request.all_token_ids[:looked_up],
            state.salt,
            limit,
            wait_s=self._lookup_wait_left,
        )
        self._lookup_wait_left = max(0.0, self._lookup_wait_left - (time.monotonic() - started))
        stats = self._stats
        if ready is None:
            stats["scheduler_lookups_pending"] += 1
            return None, False  # the answer or the loads are on the way: vLLM asks again
        stats["scheduler_lookups_answered"] += 1
        # Measured to now: an answer can arrive within the very call that asked.
        stats["scheduler_lookup_latency_seconds"] += time.monotonic() - state.first_lookup
        state.first_lookup = None
        hit = min(ready, limit) // block * block
        state.local_tokens = num_computed_tokens
        state.ready_end = ready
        if hit <= num_computed_tokens:
            return 0, False
        stats["claimed_tokens"] += hit - num_computed_tokens
        # Hybrid models load asynchronously: vLLM recomputes a failed load only then.
        return hit - num_computed_tokens, self.settings.hybrid

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._state(request)
        if num_external_tokens > 0:
            state.load_end = state.local_tokens + num_external_tokens
            state.load_pending = True
        elif self.settings.is_consumer:
            self._release.append(request.request_id)  # its lookup's prefetch is not needed

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, kv_cache_manager: KVCacheManager | None
    ) -> TieredKVMetadata:
        """This step's plan. Block ids come from the output's block state when vLLM gives
        one, else from ``kv_cache_manager`` (the one vLLM bound to the connector)."""
        self._lookup_wait_left = LOOKUP_WAIT_PER_STEP_S  # for the next step's lookups
        meta = TieredKVMetadata(release=self._release)
        self._release = []
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)

        def resolve(request_id: str) -> Any:
            if block_state is not None:
                return block_state.resolve_block_ids(request_id)
            if kv_cache_manager is not None:
                return kv_cache_manager.get_block_ids(request_id)
            raise RuntimeError("TieredKVConnector: no way to resolve block ids")

        if self.settings.hybrid:  # loads are asynchronous: their requests are not scheduled yet
            for request_id, state in list(self._requests.items()):
                if state.load_pending:
                    self._plan_load(meta, request_id, state, resolve)
        scheduled = scheduler_output.num_scheduled_tokens
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
            self._plan(meta, new.req_id, new.num_computed_tokens, scheduled[new.req_id], resolve)
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[index]
            self._plan(meta, req_id, cached.num_computed_tokens[index], scheduled[req_id], resolve)
        if self.settings.engine_config.load_policy == "cost":
            meta.prefill = prefill_of_step(scheduled, computed)
        return meta

    def _plan(
        self,
        meta: TieredKVMetadata,
        request_id: str,
        num_computed: int,
        num_scheduled: int,
        resolve: Callable[[str], Any],
    ) -> None:
        state = self._requests.get(request_id)
        if state is None:
            return
        if state.load_pending:  # synchronous: loaded in the step that computes the rest
            self._plan_load(meta, request_id, state, resolve)
        block = self.settings.block_size
        if not self.settings.is_producer or not state.cacheable:
            return
        prompt_len = state.request.num_prompt_tokens
        computed_after = min(num_computed + num_scheduled, prompt_len)
        if computed_after >= prompt_len:
            target = prompt_len // block * block  # the whole prompt, whole blocks
        else:  # chunked prefill: whole chunks only, so no partial chunk is stored twice
            chunk = self.settings.engine_config.chunk_size
            target = computed_after // chunk * chunk // block * block
        if target <= state.stored_end:
            return
        groups = [list(ids) for ids in resolve(request_id)]
        count = -(-target // block)
        meta.stores.append(
            StoreSpec(
                request_id,
                list(state.request.all_token_ids[:target]),
                groups[0][:count],
                salt=_wire(state.salt),
                group_block_ids=[ids[:count] for ids in groups] if self.settings.hybrid else None,
            )
        )
        state.stored_end = target

    def _plan_load(
        self,
        meta: TieredKVMetadata,
        request_id: str,
        state: _RequestState,
        resolve: Callable[[str], Any],
    ) -> None:
        state.load_pending = False
        block = self.settings.block_size
        groups = [list(ids) for ids in resolve(request_id)]
        end = state.load_end
        # Load through the end of the chunk holding the claim's last token (its stored key
        # covers the whole chunk), as far as whole blocks vLLM already allocated reach.
        chunk = self.settings.engine_config.chunk_size
        through = -(-end // chunk) * chunk
        if not self.settings.hybrid and end <= state.ready_end < through:
            through = state.ready_end  # that chunk was stored partial: its key ends there
        through = min(
            through,
            state.request.num_tokens // block * block,
            min(len(ids) for ids in groups) * block,
        )
        through = max(through, end)
        count = -(-through // block)
        meta.loads.append(
            LoadSpec(
                request_id,
                list(state.request.all_token_ids[:through]),
                groups[0][:count],
                state.local_tokens,
                claimed_end=end,
                salt=_wire(state.salt),
                group_block_ids=[ids[:count] for ids in groups] if self.settings.hybrid else None,
            )
        )
        state.stored_end = max(state.stored_end, through)  # already in the cache

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        if self._client is not None:
            self._client.forget(request.request_id)
        if self.settings.is_consumer:
            self._release.append(request.request_id)
        return False, None  # stores are copied out before wait_for_save returns

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        events = connector_output.kv_cache_events
        if not self.settings.publish_events or not isinstance(events, TieredKVEvents):
            return
        pending = self._pending_events
        pending.extend(events.get_all_events())
        overflow = len(pending) - PENDING_EVENTS_MAX
        if overflow > 0:
            for _ in range(overflow):
                pending.popleft()
            self._stats["kv_events_dropped"] += overflow

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The workers' tier events since the last call, for vLLM's publisher."""
        pending, self._pending_events = self._pending_events, deque()
        return pending

    def get_kv_connector_stats(self) -> TieredKVConnectorStats | None:
        """This interval's `SCHEDULER_STATS` (None when all are zero)."""
        data, self._stats = self._stats, dict.fromkeys(SCHEDULER_STATS, 0)
        stats = TieredKVConnectorStats(data=data)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            cacheable, salt = request_salt(request, self._adapter_digests)
            state = self._requests[request.request_id] = _RequestState(request, cacheable, salt)
        return state


def request_salt(
    request: Request, adapter_digests: dict[tuple[str, str], str | None]
) -> tuple[bool, KeySalt | None]:
    """Whether the request's KV can be keyed, and its `KeySalt`: what changes its KV beyond the
    token ids, as vLLM's own block hashes take it (v1/core/kv_cache_utils.py):

    - ``cache_salt``: a mark at token 0 (every chunk);
    - a LoRA adapter: a mark at token 0 with its name, path and a digest of its files
      (`adapter_digest`, remembered per name and path in ``adapter_digests``), so new adapter
      weights at an old path are other keys. An adapter not on local disk yet (a hub id vLLM
      has not downloaded) cannot be identified: the request is neither loaded nor stored;
    - each multimodal item: a mark at its placeholder's first token with its modality,
      vLLM's ``identifier`` (the content hash, or the prompt's ``multi_modal_uuids``) and its
      length, so the text before the first item shares chunks with text-only requests.

    Prompt embeddings are not keyed: such requests are neither loaded nor stored."""
    if getattr(request, "prompt_embeds", None) is not None:
        return False, None
    marks: list[tuple[int, bytes]] = []
    cache_salt = getattr(request, "cache_salt", None)
    if cache_salt:
        marks.append((0, b"cache_salt\0" + str(cache_salt).encode()))
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name, path = str(lora.lora_name), str(getattr(lora, "lora_path", "") or "")
        if (name, path) not in adapter_digests:
            adapter_digests[name, path] = _adapter_digest(path)
        digest = adapter_digests[name, path]
        if digest is None:
            return False, None
        marks.append((0, b"lora\0" + f"{name}\0{path}\0{digest}".encode()))
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        text = f"{feature.modality}\0{feature.identifier}\0{int(position.length)}"
        marks.append((int(position.offset), b"mm\0" + text.encode()))
    return True, KeySalt.of(*marks)


def _adapter_digest(path: str) -> str | None:
    """`adapter_digest` of a LoRA adapter on local disk (a directory, or a Hugging Face cache
    snapshot already downloaded); None when it cannot be found (logged)."""
    local = os.path.expanduser(path)
    if not os.path.isdir(local):
        try:
            from huggingface_hub import snapshot_download

            local = str(snapshot_download(path, local_files_only=True))
        except Exception as exc:
            logger.warning(
                "TieredKVConnector: LoRA adapter %r is not on local disk (%s): its requests "
                "are neither loaded nor stored",
                path,
                exc,
            )
            return None
    return adapter_digest(local)


def _wire(salt: KeySalt | None) -> list[list[int | str]] | None:
    return None if salt is None else salt.to_wire()
