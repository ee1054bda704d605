"""A typo in a connector key fails while vLLM builds its VllmConfig, before the model loads
(it was reported only once the scheduler's connector was built, after about 24 s of model
loading): vLLM asks the connector class ``requires_piecewise_for_cudagraph`` there when
CUDA graphs are on (its default on GPUs), and ``supports_sleep_mode`` with sleep mode on.

These tests run on vLLM's UnspecifiedPlatform (no GPU), which says it has no graph mode, so
VllmConfig would turn CUDA graphs off; only that answer is changed, while the config is
built (as tests/integration/harness/config.py does for the hybrid KV cache manager)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
from vllm.platforms import current_platform

from tests.integration.harness.config import HarnessConfig, build_vllm_config, write_tiny_llama
from tests.integration.test_vllm_connector import tierkv_config
from tierkv.integrations.vllm import TierKVConnector


@pytest.fixture
def cuda_graphs() -> Iterator[None]:
    """VllmConfig built as on a GPU: CUDA graphs on (full and piecewise, vLLM's default)."""
    build = VllmConfig.__init__

    def with_graphs(self: VllmConfig, *args: Any, **kwargs: Any) -> None:
        kwargs["compilation_config"] = CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE")
        build(self, *args, **kwargs)

    with mock.patch.object(VllmConfig, "__init__", with_graphs), \
            mock.patch.object(current_platform, "support_static_graph_mode", lambda: True):
        yield


def build(tmp_path: Path, **extra: Any) -> VllmConfig:
    cfg = HarnessConfig(kv_transfer_config=tierkv_config(**extra))
    return build_vllm_config(cfg, write_tiny_llama(tmp_path / "model", cfg))


def test_a_typo_in_a_key_fails_while_vllm_builds_its_config(tmp_path: Path,
                                                            cuda_graphs: None) -> None:
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['cpu_byts'\] = 1: "
                                         r"unknown key; known keys: \['cpu_bytes'"):
        build(tmp_path, cpu_byts=1)
    config = build(tmp_path)  # the same config without the typo builds
    assert config.compilation_config.cudagraph_mode.has_full_cudagraphs()


def test_every_early_hook_checks_the_settings() -> None:
    bad = tierkv_config(disk_bytes="lots")
    with pytest.raises(ValueError, match="disk_bytes"):
        TierKVConnector.requires_piecewise_for_cudagraph(bad.kv_connector_extra_config)
    with pytest.raises(ValueError, match="disk_bytes"):
        TierKVConnector.supports_sleep_mode(bad)
    with pytest.raises(ValueError, match="disk_bytes"):
        TierKVConnector.get_required_kvcache_layout(SimpleNamespace(kv_transfer_config=bad))
    good: KVTransferConfig = tierkv_config()
    assert TierKVConnector.requires_piecewise_for_cudagraph(good.kv_connector_extra_config) \
        is False
    assert TierKVConnector.supports_sleep_mode(good) is True
