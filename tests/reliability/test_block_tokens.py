"""tokens_per_block against the tensors: keys cut for blocks of another size would cover the
wrong tokens, so a value no dim of the pages holds is refused before anything opens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierkv.config import CpuTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore, build_namespace
from tierkv.errors import ConfigError
from tierkv.integrations.vllm_worker import check_block_tokens
from tierkv.transfer.layout import KVLayout

CONFIG = StoreConfig(blocks_per_chunk=2, cpu=CpuTierConfig(max_bytes=1 << 20, pin_memory="never"),
                     device="cpu")


def kv(*page: int) -> list[torch.Tensor]:
    return [torch.zeros((8, *page), dtype=torch.float16) for _ in range(2)]


def test_a_tokens_per_block_no_dim_holds_is_refused() -> None:
    """Regression: TierKVStore took any tokens_per_block (the default 16 over blocks of 4
    tokens made every key cover four blocks' tokens)."""
    with pytest.raises(ConfigError, match=r"tokens_per_block=16 is no dim of layer 'layer 0'"
                                          r"'s pages \[2, 4, 8\]"):
        TierKVStore(kv(2, 4, 8), model_id="m", config=CONFIG)
    with pytest.raises(ConfigError, match="tokens_per_block=32"):
        build_namespace(KVLayout.from_tensors(kv(2, 16, 8, 64)), "m", 32, CONFIG)


@pytest.mark.parametrize("page,tokens", [((2, 4, 8), 4), ((4096,), 16), ((1, 1, 4096), 16),
                                         ((2, 16, 1, 64), 16)])
def test_pages_that_hold_the_tokens_or_name_no_token_dim_are_taken(
        page: tuple[int, ...], tokens: int) -> None:
    TierKVStore(kv(*page), model_id="m", tokens_per_block=tokens, config=CONFIG).close()


def test_the_vllm_worker_refuses_views_of_another_block_size() -> None:
    view = torch.zeros((8, 4, 16, 64))  # logical [B, H, N, C]: 16 tokens a block
    check_block_tokens("layers.0", view, 8, 16)
    check_block_tokens("layers.0", torch.zeros((16, 4, 8, 64)), 8, 16)  # 2 kernel blocks of 8
    with pytest.raises(ConfigError, match="'layers.0' holds 16 tokens per block .* block "
                                          "size is 32"):
        check_block_tokens("layers.0", view, 8, 32)
