"""tests/gpu run only where a GPU exists: without CUDA every test here is skipped, with
the reason printed (``-ra``)."""

from __future__ import annotations

import pytest
import torch

REASON = "CUDA not available: tests/gpu run only where a GPU exists"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if not torch.cuda.is_available():
        pytest.skip(REASON)
