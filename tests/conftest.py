"""Shared pytest set-up: tests marked ``gpu`` skip cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not ``item.keywords``: keywords also hold the test's folder names, and
        # every test under tests/gpu/ (NVRTC compiles, planning: CPU tests) would skip.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
