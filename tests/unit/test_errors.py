"""The error tree: every class is raised somewhere, misuse is not configuration."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from tierkv import errors
from tierkv.core.jobs import JobId, SpillSpec
from tierkv.errors import ConfigError, TierKVError, UsageError

PACKAGE = Path(__file__).resolve().parents[2] / "tierkv"


def test_every_error_class_is_raised_somewhere() -> None:
    """A class nobody raises promises callers a distinction that does not exist
    (NotFoundError and CorruptChunkError were never raised)."""
    classes = {name for name, value in vars(errors).items()
               if inspect.isclass(value) and issubclass(value, TierKVError)}
    raised: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                raised.add(node.func.id)
    assert classes - raised - {"TierKVError"} == set()  # the root is caught, not raised


def test_misuse_is_a_usage_error_not_a_configuration_error() -> None:
    from tierkv.tiers.cpu import CpuSlab
    from tierkv.transfer.cpu import CpuTransferEngine
    from tierkv.transfer.executor import JobExecutor
    from tierkv.transfer.layout import KVLayout

    layout = KVLayout.from_tensors([torch.zeros((4, 8), dtype=torch.uint8)])
    slab = CpuSlab(2, layout.chunk_bytes(1), "never")
    executor = JobExecutor(CpuTransferEngine(layout, slab, 1))
    try:
        with pytest.raises(UsageError, match="without a disk tier") as info:
            executor.submit(SpillSpec(JobId(1), ((bytes(32), 0),)))  # type: ignore[arg-type]
        assert not isinstance(info.value, ConfigError)
    finally:
        executor.shutdown()
