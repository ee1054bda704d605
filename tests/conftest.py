"""Tests marked ``cuda`` (every test under tests/gpu is) run only where a GPU exists:
without CUDA they are skipped, with the reason printed (``-ra``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REASON = "CUDA not available: tests marked cuda run only where a GPU exists"
GPU_TESTS = Path(__file__).parent / "gpu"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if GPU_TESTS in item.path.parents:
            item.add_marker(pytest.mark.cuda)
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=REASON))
