"""Make SGLang's model-config imports work on the CPU build of torch (tests only).

`sglang.srt.mem_cache.memory_pool` imports `sglang.srt.configs`, which imports
`torchvision.transforms` (for two ImageNet constants). The registry's torchvision 0.28.0 is built
against CUDA torch: on the CPU build its C ops (`torchvision._C`) do not load, which torchvision
tolerates (`extension._has_ops()` is False), except that its `_meta_registrations` then registers
fake kernels for `torchvision::nms` and `torchvision::qnms` unguarded, and that fails with
"operator torchvision::nms does not exist". `prepare` defines those two op schemas (as
torchvision's own C library would) before torchvision is imported, so the import goes through
with torchvision's ops still unavailable; nothing SGLang's pools or storage do here calls them.
Nothing else is patched. Serving machines run CUDA torch with its matching torchvision and need
none of this.
"""

from __future__ import annotations

import sys
import warnings

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: object = None


def prepare() -> None:
    """Define the missing schemas once (only on a CPU torch, before torchvision is imported)."""
    global _library
    import torch

    if _library is not None or torch.version.cuda is not None or "torchvision" in sys.modules:
        return
    library = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        library.define(schema)
    _library = library  # the definitions last as long as the Library object


def import_sglang() -> None:
    """Import the SGLang modules the tests use, after `prepare`. Their import-time warnings
    (quantization methods that need CUDA, ...) are SGLang's own and not under test."""
    prepare()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.mem_cache.hicache_storage
        import sglang.srt.mem_cache.memory_pool
        import sglang.srt.mem_cache.pool_host.mha
        import sglang.srt.mem_cache.pool_host.mla
        import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
