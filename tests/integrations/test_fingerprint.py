"""The default model fingerprint (`tiered_kv.integrations.fingerprint`): what changes it, what
does not, and what it refuses."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.integrations.fingerprint import (
    adapter_digest,
    file_digest,
    model_fingerprint,
    weight_files,
)


def _model(directory: pathlib.Path, weights: bytes, name: str = "model.safetensors") -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(weights)
    (directory / "config.json").write_text("{}")
    return str(directory)


def _fingerprint(path: str, **changes: Any) -> str:
    args: dict[str, Any] = {
        "weights_path": path,
        "model_config": {"hidden_size": 128, "num_hidden_layers": 2},
        "dtype": "torch.float32",
        "kv_cache_dtype": "auto",
        "tensor_parallel_size": 1,
        **changes,
    }
    return model_fingerprint(**args)


def test_same_weights_same_fingerprint_anywhere(tmp_path: pathlib.Path) -> None:
    """Two copies of one model (different paths, other non-weight files) agree: instances on
    other hosts share the cache."""
    first = _model(tmp_path / "a", b"w" * 1000)
    second = _model(tmp_path / "elsewhere" / "b", b"w" * 1000)
    (tmp_path / "elsewhere" / "b" / "README.md").write_text("notes")
    assert _fingerprint(first) == _fingerprint(second)
    assert _fingerprint(first).startswith("auto-")


def test_everything_that_changes_kv_changes_it(tmp_path: pathlib.Path) -> None:
    path = _model(tmp_path / "a", b"w" * 1000)
    base = _fingerprint(path)
    changed = {
        "config": _fingerprint(path, model_config={"hidden_size": 256, "num_hidden_layers": 2}),
        "dtype": _fingerprint(path, dtype="torch.bfloat16"),
        "kv dtype": _fingerprint(path, kv_cache_dtype="fp8"),
        "tp": _fingerprint(path, tensor_parallel_size=2),
        "pp": _fingerprint(path, pipeline_parallel_size=2),
        "extra": _fingerprint(path, extra={"quantization": "awq"}),
    }
    assert base not in changed.values()
    assert len(set(changed.values())) == len(changed)
    _model(tmp_path / "a", b"v" + b"w" * 999)  # new weights, same name and size
    new_weights = _fingerprint(path)
    assert new_weights != base
    os.rename(tmp_path / "a" / "model.safetensors", tmp_path / "a" / "other.safetensors")
    assert _fingerprint(path) not in (base, new_weights)


def test_large_file_digest_samples_head_middle_and_tail(tmp_path: pathlib.Path) -> None:
    """Files above 4 MiB are sampled: a change in the first or last MiB or in a sampled window
    in between changes the digest; so does the size."""
    size = 12 << 20
    path = tmp_path / "big.safetensors"
    data = bytearray(os.urandom(size))
    path.write_bytes(data)
    base = file_digest(str(path))
    assert base.startswith("xxh3s:")
    span = size - 2 * (1 << 20) - (64 << 10)
    for offset in (10, size - 10, (1 << 20) + span * 8 // 17 + 5):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(changed)
        assert file_digest(str(path)) != base, offset
    path.write_bytes(data + b"x")
    assert file_digest(str(path)) != base


def test_hugging_face_cache_blob_gives_its_own_sha256(tmp_path: pathlib.Path) -> None:
    """A snapshot file that links to ``blobs/<sha256>`` is identified by that hash (no read)."""
    sha = "ab" * 32
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / sha).write_bytes(b"weights")
    snapshot = tmp_path / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(blobs / sha)
    assert file_digest(str(snapshot / "model.safetensors")) == f"sha256:{sha}"
    assert weight_files(str(snapshot)) == [str(snapshot / "model.safetensors")]


def test_no_weights_is_refused_with_what_to_do(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"no weight files .* set 'fingerprint'"):
        _fingerprint(str(tmp_path))
    with pytest.raises(ConfigError, match="neither a model directory nor a file"):
        _fingerprint(str(tmp_path / "missing"))
    single = tmp_path / "model.gguf"
    single.write_bytes(b"gguf")
    assert weight_files(str(single)) == [str(single)]


def test_adapter_digest_follows_the_adapter_files(tmp_path: pathlib.Path) -> None:
    adapter = tmp_path / "lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"a" * 100)
    base = adapter_digest(str(adapter))
    (adapter / "adapter_model.safetensors").write_bytes(b"b" * 100)
    assert adapter_digest(str(adapter)) != base
    with pytest.raises(ConfigError, match="not a directory"):
        adapter_digest(str(tmp_path / "nope"))
