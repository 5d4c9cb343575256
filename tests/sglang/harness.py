"""SGLang's real KV pools on the CPU, backends built by SGLang's own factory, and the cache
controller's page moves (its `_page_set_zero_copy` / `_generic_page_set` and the two gets),
shared by the tests and by the subprocess of the cross-process test (`python -m`).

The controller's functions are reproduced line for line from
`sglang/srt/managers/cache_controller.py` (0.5.23): building a whole `HiCacheController` needs a
CUDA device and process groups.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import torch

from tests.sglang.cpu_torch import import_sglang

import_sglang()

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

PAGE = 4
DEVICE_TOKENS = 64
OURS = {
    "backend_name": "tiered_kv",
    "module_path": "tiered_kv.integrations.sglang",
    "class_name": "TieredKVHiCacheStorage",
}


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """A device pool and its host pool, as SGLang builds them for one model shard."""

    kind: str  # "mha" or "mla"
    layout: str
    layers: int = 3
    dtype: torch.dtype = torch.bfloat16

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.layout}-{self.layers}l"


def host_pool(spec: PoolSpec) -> Any:
    """SGLang's host pool (unpinned, on the CPU) over a CPU device pool of ``spec``."""
    common = dict(
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE,
        layout=spec.layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=spec.layers,
    )
    if spec.kind == "mha":
        device = MHATokenToKVPool(
            size=DEVICE_TOKENS,
            page_size=PAGE,
            dtype=spec.dtype,
            head_num=2,
            head_dim=8,
            layer_num=spec.layers,
            device="cpu",
            enable_memory_saver=False,
        )
        return MHATokenToKVPoolHost(device._mha_buffer_info(), **common)
    device = MLATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE,
        dtype=spec.dtype,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        layer_num=spec.layers,
        device="cpu",
        enable_memory_saver=False,
    )
    return MLATokenToKVPoolHost(device._mla_buffer_info(), **common, target_layer_num=spec.layers)


def storage_config(
    *,
    extra: dict[str, Any] | None,
    model: str = "tiny-model",
    tp_rank: int = 0,
    tp_size: int = 1,
    mla: bool = False,
    page_first: bool = True,
) -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=page_first,
        model_name=model,
        extra_config=extra,
    )


def create_backend(name: str, config: Any, pool: Any) -> Any:
    """As the controller's `attach_storage_backend`: the factory, then the pool."""
    backend = StorageBackendFactory.create_backend(name, config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def ours(pool: Any, *, interface_v1: bool, **options: Any) -> Any:
    """Our backend through SGLang's dynamic path; ``options`` go to the extra config."""
    extra = {**OURS, "interface_v1": int(interface_v1), "l2_durability": "none"}
    config_args = {k: options.pop(k) for k in ("model", "tp_rank", "tp_size") if k in options}
    extra.update(options)
    config = storage_config(extra=extra, mla=is_mla(pool), **config_args)
    return create_backend("dynamic", config, pool)


def is_mla(pool: Any) -> bool:
    return type(pool).__name__.startswith("MLA")


def fill(pool: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    buffer = pool.kv_buffer
    buffer.copy_(torch.randn(buffer.shape, generator=gen).to(buffer.dtype))


def page_bytes(pool: Any, start: int) -> torch.Tensor:
    """A copy of the page at token ``start``, as raw bytes (bit-exact comparisons)."""
    return pool.get_data_page(start, flat=True).clone().view(torch.uint8)


def indices(starts: Sequence[int]) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + PAGE) for s in starts]) if starts else torch.empty(0)


def store(backend: Any, pool: Any, keys: list[str], starts: Sequence[int], v1: bool) -> bool:
    """The controller's `_page_set_zero_copy` (v1) or `_generic_page_set`."""
    host_indices = indices(starts)
    if v1:
        return all(backend.batch_set_v1(keys, host_indices, None))
    data = [pool.get_data_page(host_indices[i * PAGE]) for i in range(len(keys))]
    return bool(backend.batch_set(keys, data))


def load(backend: Any, pool: Any, keys: list[str], starts: Sequence[int], v1: bool) -> int:
    """The controller's `_page_get_zero_copy` (v1) or `_generic_page_get`: pages loaded, from
    the first."""
    host_indices = indices(starts)
    if v1:
        results = backend.batch_get_v1(keys, host_indices, None)
        count = 0
        for ok in results:
            if not ok:
                break
            count += 1
        return count
    dummy = [pool.get_dummy_flat_data_page() for _ in keys]
    page_data = backend.batch_get(keys, dummy)
    if page_data is None:
        return 0
    count = 0
    for i in range(len(keys)):
        if page_data[i] is None:
            break
        pool.set_from_flat_data_page(host_indices[i * PAGE], page_data[i])
        count += 1
    return count


def _reader_main(argv: list[str]) -> int:
    """Subprocess: open our backend on an L2 directory, load pages, save them for the parent.

    argv: l2_path, kind, layout, keys (comma-separated), output file."""
    l2_path, kind, layout, keys_arg, out = argv
    pool = host_pool(PoolSpec(kind, layout))
    pool.kv_buffer.zero_()
    backend = ours(pool, interface_v1=True, l2_path=l2_path)
    try:
        keys = keys_arg.split(",")
        starts = [PAGE * (1 + i) for i in range(len(keys))]
        hits = backend.batch_exists(keys)
        loaded = load(backend, pool, keys, starts, v1=True)
        torch.save(
            {"hits": hits, "loaded": loaded, "pages": [page_bytes(pool, s) for s in starts]}, out
        )
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    sys.exit(_reader_main(sys.argv[1:]))
