"""tests/vllm runs only where vLLM imports (the `.venv-vllm` of `make test-vllm`).

The core suite (`.venv`, no vLLM) does not collect this directory at all. Where vLLM is meant to
be present, `make test-vllm` runs these tests explicitly and a missing vLLM is an error there
(`test_vllm_is_importable`), never a skip.
"""

from __future__ import annotations

import importlib.util

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*.py"]


if not collect_ignore_glob:
    import pathlib

    import pytest

    @pytest.fixture(scope="session")
    def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
        """The tiny random Llama, built once per session (see `tiny_llama`)."""
        from tests.vllm.tiny_llama import build_tiny_llama

        return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
