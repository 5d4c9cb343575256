"""Model fingerprints: what makes two serving instances' KV interchangeable, as one short tag.

Owns the default ``fingerprint`` of chunk keys for serving-stack integrations: a digest of the
model's config, its weight files' identity (names, sizes and a content digest: the Hugging Face
cache's own sha256 where a file is a cache blob, else a sampled xxh3 of its bytes), the weights'
and the KV cache's dtypes and the parallel layout. Two instances agree on it exactly when they
would compute the same KV for the same tokens, so new weights copied over an old path never meet
the old KV. Computed once at start-up; must not import a serving stack.

The sampled digest reads the first and last MiB of each file and 16 windows of 64 KiB between
them (a file up to 4 MiB whole): a few MiB per file, where a retrained or fine-tuned checkpoint
changes every tensor. A change confined to bytes it does not read goes unseen: give
``fingerprint`` yourself when weights are edited in place that way.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from tiered_kv.errors import ConfigError

FINGERPRINT_VERSION = 1
WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".gguf",
    ".ckpt",
    ".msgpack",
    ".h5",
    ".npz",
    ".npy",
)
_WHOLE_FILE_BYTES = 4 << 20
_EDGE_BYTES = 1 << 20
_WINDOW_BYTES = 64 << 10
_WINDOWS = 16
# A Hugging Face cache blob is named by the sha256 of its content (LFS files) or its git sha1.
_HF_BLOB_NAME = re.compile(r"^(?:[0-9a-f]{64}|[0-9a-f]{40})$")


def file_digest(path: str) -> str:
    """A content digest of one file: ``"sha256:<hex>"`` when it is a Hugging Face cache blob
    (a symlink to ``blobs/<sha256>``, the checkpoint's own hash), else ``"xxh3s:<hex>"`` over its
    size and sampled bytes (the whole file up to 4 MiB)."""
    target = os.path.realpath(path)
    name = os.path.basename(target)
    if os.path.islink(path) and _HF_BLOB_NAME.match(name):
        return f"{'sha256' if len(name) == 64 else 'gitsha1'}:{name}"
    size = os.path.getsize(target)
    digest = xxhash.xxh3_128(struct.pack("<Q", size))
    with open(target, "rb") as f:
        if size <= _WHOLE_FILE_BYTES:
            digest.update(f.read())
        else:
            span = size - 2 * _EDGE_BYTES - _WINDOW_BYTES
            windows = [
                (0, _EDGE_BYTES),
                *(
                    (_EDGE_BYTES + span * (i + 1) // (_WINDOWS + 1), _WINDOW_BYTES)
                    for i in range(_WINDOWS)
                ),
                (size - _EDGE_BYTES, _EDGE_BYTES),
            ]
            for offset, length in windows:
                f.seek(offset)
                digest.update(f.read(length))
    return f"xxh3s:{digest.hexdigest()}"


def weight_files(path: str) -> list[str]:
    """The weight files of a model directory (top level, by suffix, sorted), or ``[path]`` for
    a single-file model. Raises `ConfigError` when there is none: a fingerprint without the
    weights' identity would let new weights meet old KV."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ConfigError(f"fingerprint: {path!r} is neither a model directory nor a file")
    files = sorted(
        entry.path
        for entry in os.scandir(path)
        if entry.name.endswith(WEIGHT_SUFFIXES) and entry.is_file()
    )
    if not files:
        raise ConfigError(
            f"fingerprint: no weight files ({', '.join(WEIGHT_SUFFIXES)}) in {path!r}; set "
            "'fingerprint' to a tag that changes whenever the weights do"
        )
    return files


def model_fingerprint(
    *,
    weights_path: str,
    model_config: Mapping[str, Any],
    dtype: str,
    kv_cache_dtype: str,
    tensor_parallel_size: int,
    pipeline_parallel_size: int = 1,
    extra: Mapping[str, Any] | None = None,
) -> str:
    """The default fingerprint: ``"auto-<32 hex>"`` over the model's config (as a JSON-able
    mapping), its weight files (names relative to ``weights_path``, sizes, `file_digest`), the
    dtypes, the parallel sizes and ``extra`` (anything else that changes KV, e.g. quantization)."""
    files = weight_files(weights_path)
    base = weights_path if os.path.isdir(weights_path) else os.path.dirname(weights_path)
    described: dict[str, Any] = {
        "version": FINGERPRINT_VERSION,
        "config": model_config,
        "weights": [[os.path.relpath(f, base), os.path.getsize(f), file_digest(f)] for f in files],
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "extra": dict(extra or {}),
    }
    text = json.dumps(described, sort_keys=True, separators=(",", ":"), default=str)
    return f"auto-{xxhash.xxh3_128_hexdigest(text.encode())}"


def adapter_digest(path: str, files: Sequence[str] | None = None) -> str:
    """A digest of an adapter directory (e.g. a LoRA): every top-level file's name, size and
    `file_digest`; ``files`` limits it to those names."""
    if not os.path.isdir(path):
        raise ConfigError(f"adapter path {path!r} is not a directory")
    names = sorted(
        entry.name
        for entry in os.scandir(path)
        if entry.is_file() and (files is None or entry.name in files)
    )
    digest = xxhash.xxh3_128()
    for name in names:
        full = os.path.join(path, name)
        digest.update(f"{name}\0{os.path.getsize(full)}\0{file_digest(full)}\0".encode())
    return digest.hexdigest()
