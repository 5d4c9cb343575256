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
