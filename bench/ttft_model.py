"""The model side of ``bench/ttft.py``: a transformers Llama over a vLLM-shaped paged KV cache.

A `PagedPrefill` (a transformers ``Cache``) lets an unmodified ``LlamaForCausalLM`` prefill a
request whose first ``prefix_tokens`` tokens are already in the paged cache, as a serving engine
does: for each layer ``update`` (1) waits for that layer's load (``load.wait_layer``, layerwise
retrieves), (2) writes the new tokens' K/V into their slots (vLLM's ``reshape_and_cache``),
(3) calls ``on_layer_written(layer)`` (layerwise stores: ``saver.save_layer``), (4) returns the
whole request's K/V, gathered from the paged cache into the contiguous form sdpa needs.

Attention over a cached prefix runs as serving engines run it (`prefix_sdpa_attention`, the
model's attention implementation): causal with the mask aligned to the end (the new tokens are
the last ``q_len`` of ``kv_len`` positions), no mask tensor built, so torch's SDPA picks its
FlashAttention or memory-efficient kernel (``causal_lower_right``). transformers' own ``sdpa``
builds a ``q_len x kv_len`` mask for a prefix and falls back to a masked kernel, slower than
recomputing the whole prompt (a 16k prefill over 16k cached tokens took longer than 32k from
scratch on an H200): no serving engine behaves like that.

`PrefillGraphs` runs the same prefill from CUDA graphs (one per decoder layer, plus the embedding
and the head), as serving engines do: vLLM replays its model's pieces between attention ops from
CUDA graphs, or runs compiled code. transformers' eager forward spends about 1.5 ms of Python per
layer launching its kernels, longer than a layer's GPU work for short prompts and for the one
token computed after a fully cached prefix: the TTFT would measure that Python, not the KV.

Paged caches are vLLM's NHD layout: per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``.
transformers is a bench-only requirement (not a tiered_kv dependency): this module imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

ATTENTION = "tkv_prefix_sdpa"


def prefix_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention of ``query`` (``[1, heads, q_len, d]``, the last ``q_len`` positions)
    over ``key`` / ``value`` (``[1, kv_heads, kv_len, d]``, every position): query ``i`` sees
    keys ``0 .. kv_len - q_len + i``. A prefill from scratch (``q_len == kv_len``) is SDPA's
    plain causal case; one token sees every key; a prefix prefill passes torch's
    ``causal_lower_right`` bias, which runs FlashAttention (or the memory-efficient kernel)
    with the mask aligned to the end and never materializes it. Returns ``[1, q_len, heads,
    d]`` as transformers' attention functions do."""
    if attention_mask is not None:
        raise ValueError(f"{ATTENTION}: builds its own causal mask; got one from transformers")
    q_len, kv_len = query.shape[2], key.shape[2]
    mask: Any = None
    if 1 < q_len < kv_len:
        mask = causal_lower_right(q_len, kv_len)
    elif q_len > kv_len:
        raise ValueError(f"{ATTENTION}: {q_len} queries over {kv_len} keys")
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        is_causal=q_len == kv_len and q_len > 1,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """`prefix_sdpa_attention` needs no mask tensor: transformers builds none."""
    return None


AttentionInterface.register(ATTENTION, prefix_sdpa_attention)
AttentionMaskInterface.register(ATTENTION, _no_mask)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelShape:
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, bf16."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * 2

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab,
            max_position_embeddings=131072,
            tie_word_embeddings=False,
        )


# Llama-3-8B's shapes (about 8.0e9 parameters, 16 GB in bf16; 128 KiB of KV per token).
LLAMA3_8B = ModelShape(
    num_layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=14336,
    vocab=128256,
)
# For CPU runs and the test: the same architecture, small enough to run in seconds.
TINY = ModelShape(
    num_layers=2, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=1024
)


def build_model(shape: ModelShape, device: torch.device, seed: int = 0) -> LlamaForCausalLM:
    """Random-init bf16 Llama with `prefix_sdpa_attention`, made directly on ``device`` (no
    fp32 copy, nothing downloaded); transformers' own init (normal, std 0.02) runs there, fast
    on a GPU."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            shape.config(), dtype=torch.bfloat16, attn_implementation=ATTENTION
        )
    if not isinstance(model, LlamaForCausalLM):
        raise TypeError(f"expected a LlamaForCausalLM, got {type(model).__name__}")
    model.eval()
    model.requires_grad_(False)
    return model


class PagedKV:
    """Per-layer paged caches ``[2, num_blocks, block_size, kv_heads, head_dim]`` (bf16)."""

    def __init__(
        self, shape: ModelShape, num_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.shape = shape
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.layers = [
            torch.zeros(
                (2, num_blocks, block_size, shape.kv_heads, shape.head_dim),
                dtype=torch.bfloat16,
                device=device,
            )
            for _ in range(shape.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    def slots(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        """Slot of each token (block * block_size + offset), as vLLM's slot_mapping."""
        device = self.layers[0].device
        blocks = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
        positions = torch.arange(num_tokens, device=device)
        return blocks[positions // self.block_size] * self.block_size + positions % self.block_size

    def poison(self, block_ids: Sequence[int]) -> None:
        """NaN in every slot of ``block_ids``: logits computed on a slot that no load (or
        prefill) wrote come out NaN."""
        device = self.layers[0].device
        blocks = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
        for kv in self.layers:
            kv.index_fill_(1, blocks, float("nan"))


class _PagedLayer(CacheLayerMixin):
    """One layer's view of the request in the paged cache."""

    is_sliding = False

    def __init__(self, kv: torch.Tensor, slots: torch.Tensor, prefix_tokens: int) -> None:
        super().__init__()
        self.kv = kv
        self.slots = slots  # every token of the request
        self.prefix_tokens = prefix_tokens
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # key_states: [1, kv_heads, new_tokens, head_dim]
        _, kv_heads, new_tokens, head_dim = key_states.shape
        if self.prefix_tokens + new_tokens != self.slots.numel():
            raise ValueError(
                f"paged prefill: {self.prefix_tokens} cached + {new_tokens} new tokens, but the "
                f"request has {self.slots.numel()} slots"
            )
        flat = self.kv.view(2, -1, kv_heads, head_dim)
        new_slots = self.slots[self.prefix_tokens :]
        flat[0].index_copy_(0, new_slots, key_states[0].transpose(0, 1))
        flat[1].index_copy_(0, new_slots, value_states[0].transpose(0, 1))
        if self.prefix_tokens == 0:
            return key_states, value_states
        # One gather of whole rows per K and V (each token's kv_heads x head_dim, contiguous),
        # seen as [1, kv_heads, tokens, head_dim]: sdpa reads the strided view as it is.
        keys = flat[0].index_select(0, self.slots).transpose(0, 1)
        values = flat[1].index_select(0, self.slots).transpose(0, 1)
        return keys.unsqueeze(0), values.unsqueeze(0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.prefix_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.prefix_tokens

    def get_max_length(self) -> int:
        return int(self.slots.numel())


class PagedPrefill(Cache):
    """A transformers ``Cache`` for one prefill over a paged cache (see the module docstring).

    ``load``: a layerwise load (``wait_layer(i)`` before layer i reads its K/V), or None when
    the prefix is already in place. ``on_layer_written``: called with the layer index once that
    layer's new K/V writes are queued (a layerwise store's ``save_layer``).
    """

    def __init__(
        self,
        paged: PagedKV,
        slots: torch.Tensor,
        prefix_tokens: int,
        *,
        load: Any = None,
        on_layer_written: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(layers=[_PagedLayer(kv, slots, prefix_tokens) for kv in paged.layers])
        self.load = load
        self.on_layer_written = on_layer_written

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.load is not None:
            self.load.wait_layer(layer_idx)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if self.on_layer_written is not None:
            self.on_layer_written(layer_idx)
        return keys, values


def prefill(
    model: LlamaForCausalLM,
    paged: PagedKV,
    token_ids: torch.Tensor,
    slots: torch.Tensor,
    prefix_tokens: int,
    *,
    load: Any = None,
    on_layer_written: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Compute tokens ``prefix_tokens:`` of ``token_ids`` (on the model's device) over the
    prefix already in (or loading into) the paged cache; returns the last token's logits as
    float32 on the host (`logits_to_host` waits for the GPU: the first token is known)."""
    num_tokens = token_ids.numel()
    if not 0 <= prefix_tokens < num_tokens:
        raise ValueError(f"prefix_tokens must be in [0, {num_tokens}), got {prefix_tokens}")
    cache = PagedPrefill(paged, slots, prefix_tokens, load=load, on_layer_written=on_layer_written)
    positions = torch.arange(prefix_tokens, num_tokens, device=token_ids.device).unsqueeze(0)
    with torch.inference_mode():
        out = model(
            input_ids=token_ids[prefix_tokens:].unsqueeze(0),
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{cache_argument(model): cache},
        )
        return logits_to_host(out.logits[0, -1].float())


def cache_argument(model: LlamaForCausalLM) -> str:
    """The name transformers' forward takes the KV cache under: ``cache`` from 5.24 on
    (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def logits_to_host(logits: torch.Tensor) -> torch.Tensor:
    """The logits in pinned host memory, waited for with an event, as serving engines copy
    their outputs. A plain ``.cpu()`` copies to pageable memory: that synchronous copy blocks
    every other thread's CUDA calls until the GPU reaches it (measured on an H100, torch 2.11:
    a thread's event record stalled 648 ms behind another thread's ``.cpu()`` of a 16-float
    tensor queued after 640 ms of GEMMs), which would stall the engine's copies beside it."""
    if logits.device.type != "cuda":
        return logits.cpu()
    host = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
    host.copy_(logits, non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    done.synchronize()
    return host


class PrefillGraphs:
    """One prefill shape (``num_tokens`` over a prefix of ``prefix_tokens`` in ``slots``) as
    CUDA graphs: the embedding, each decoder layer, the final norm and the head. `run` replays
    them with the same hooks as the eager `PagedPrefill`: ``load.wait_layer(i)`` before layer
    i's graph, ``on_layer_written(i)`` after it (both on the caller's current stream).

    Built from one eager prefill of the shape (it writes the new tokens' K/V into their slots,
    as any prefill does): a pre-hook on the first decoder layer keeps the arguments transformers
    made for it (attention mask, rotary embeddings, positions, the cache), and each layer is
    captured with them. The graphs share one memory pool and replay in capture order, so each
    layer's intermediates reuse the previous layers' memory. Capture only with the default
    kernels (torch's deterministic algorithms off): a graph replays the kernels it captured.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        paged: PagedKV,
        slots: torch.Tensor,
        num_tokens: int,
        prefix_tokens: int,
    ) -> None:
        if not 0 <= prefix_tokens < num_tokens:
            raise ValueError(f"prefix_tokens must be in [0, {num_tokens}), got {prefix_tokens}")
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError("PrefillGraphs: capture with the default kernels, not deterministic")
        device = paged.layers[0].device
        self.num_tokens = num_tokens
        self.prefix_tokens = prefix_tokens
        self.num_layers = len(paged.layers)
        self.ids = torch.zeros((1, num_tokens - prefix_tokens), dtype=torch.long, device=device)
        positions = torch.arange(prefix_tokens, num_tokens, device=device).unsqueeze(0)
        cache = PagedPrefill(paged, slots, prefix_tokens)
        layers = list(model.model.layers)
        seen: dict[str, Any] = {}

        def keep(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen.setdefault("kwargs", dict(kwargs))

        hook = layers[0].register_forward_pre_hook(keep, with_kwargs=True)
        try:
            with torch.inference_mode():
                model(
                    input_ids=self.ids,
                    position_ids=positions,
                    use_cache=True,
                    logits_to_keep=1,
                    **{cache_argument(model): cache},
                )
        finally:
            hook.remove()
        kwargs = seen["kwargs"]
        if kwargs.get(cache_argument(model)) is not cache:
            raise RuntimeError("PrefillGraphs: the decoder layers did not get the paged cache")
        torch.cuda.synchronize(device)
        pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

        def capture(step: Callable[[], torch.Tensor]) -> torch.Tensor:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = step()
            self.graphs.append(graph)
            return out

        with torch.inference_mode():
            hidden = capture(lambda: model.model.embed_tokens(self.ids))
            for layer in layers:
                hidden = capture(functools.partial(_layer_output, layer, hidden, kwargs))
            # As LlamaForCausalLM: the norm over every token, the head over the last one.
            self.logits = capture(
                lambda: model.lm_head(model.model.norm(hidden)[:, -1:, :]).float()
            )
        self._kwargs = kwargs  # the mask and rotary embeddings the layer graphs read

    def run(
        self,
        token_ids: torch.Tensor,
        *,
        load: Any = None,
        on_layer_written: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The prefill of ``token_ids`` (the whole request, on the model's device); returns
        the last token's logits as float32 on the host, as `prefill`."""
        if token_ids.numel() != self.num_tokens:
            raise ValueError(
                f"PrefillGraphs: captured for {self.num_tokens} tokens, got {token_ids.numel()}"
            )
        with torch.inference_mode():
            self.ids.copy_(token_ids[self.prefix_tokens :].unsqueeze(0))
            self.graphs[0].replay()
            for layer in range(self.num_layers):
                if load is not None:
                    load.wait_layer(layer)
                self.graphs[1 + layer].replay()
                if on_layer_written is not None:
                    on_layer_written(layer)
            self.graphs[-1].replay()
            return logits_to_host(self.logits[0, -1])


def _layer_output(layer: Any, hidden: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out
