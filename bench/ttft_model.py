"""The model side of ``bench/ttft.py``: a transformers Llama over a vLLM-shaped paged KV cache.

A `PagedPrefill` (a transformers ``Cache``) lets an unmodified ``LlamaForCausalLM`` prefill a
request whose first ``prefix_tokens`` tokens are already in the paged cache, as a serving engine
does: for each layer ``update`` (1) waits for that layer's load (``load.wait_layer``, layerwise
retrieves), (2) writes the new tokens' K/V into their slots (vLLM's ``reshape_and_cache``),
(3) calls ``on_layer_written(layer)`` (layerwise stores: ``saver.save_layer``), (4) returns the
whole request's K/V, gathered from the paged cache into the contiguous form sdpa needs.

Paged caches are vLLM's NHD layout: per layer ``[2, num_blocks, block_size, kv_heads, head_dim]``.
transformers is a bench-only requirement (not a tiered_kv dependency): this module imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import Cache, CacheLayerMixin


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
    """Random-init bf16 sdpa Llama made directly on ``device`` (no fp32 copy, nothing
    downloaded); transformers' own init (normal, std 0.02) runs there, fast on a GPU."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            shape.config(), dtype=torch.bfloat16, attn_implementation="sdpa"
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
    float32 on the host (the copy waits for the GPU: the first token is known)."""
    num_tokens = token_ids.numel()
    if not 0 <= prefix_tokens < num_tokens:
        raise ValueError(f"prefix_tokens must be in [0, {num_tokens}), got {prefix_tokens}")
    cache = PagedPrefill(paged, slots, prefix_tokens, load=load, on_layer_written=on_layer_written)
    positions = torch.arange(prefix_tokens, num_tokens, device=token_ids.device).unsqueeze(0)
    with torch.inference_mode():
        out = model(
            input_ids=token_ids[prefix_tokens:].unsqueeze(0),
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1].float().cpu()
