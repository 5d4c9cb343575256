"""tests/sglang runs only where SGLang imports (the `.venv-sglang` of `make test-sglang`).

The core suite (`.venv`, no SGLang) does not collect this directory at all. Where SGLang is meant
to be present, `make test-sglang` runs these tests explicitly and a missing SGLang is an error
there (`test_sglang_is_importable`), never a skip.
"""

from __future__ import annotations

import importlib.util

collect_ignore_glob: list[str] = []
if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["*.py"]

if not collect_ignore_glob:
    from tests.sglang.cpu_torch import import_sglang

    import_sglang()
