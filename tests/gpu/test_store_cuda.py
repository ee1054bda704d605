"""TierKVStore on a real GPU: with ``store_mode="copied"`` (the default) the compute stream
waits on a store's copy, so blocks rewritten on it right after ``store()`` returns never
reach the chunk, even when the copy runs late. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tierkv.config import CpuTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore
from tierkv.keys import chunk_keys

pytestmark = pytest.mark.cuda

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time on the store's stream: the copy runs late


def test_blocks_rewritten_on_the_compute_stream_after_store_never_reach_the_chunk() -> None:
    kv = [torch.ones((32, 2, 16, 8, 64), dtype=torch.float16, device="cuda") for _ in range(4)]
    config = StoreConfig(blocks_per_chunk=4, device="cuda", cpu=CpuTierConfig(max_bytes=64 << 20))
    with TierKVStore(kv, model_id="cuda-lifetime", tokens_per_block=16, config=config) as store:
        keys = chunk_keys(list(range(4 * 64)), store.tokens_per_chunk)
        sources = list(range(16))
        with torch.cuda.stream(store.executor.transfer._store.stream):  # type: ignore[attr-defined]
            torch.cuda._sleep(SLEEP_CYCLES)
        job = store.store(keys, sources)
        for layer in kv:  # the next step's KV, queued on the compute stream at once
            layer[:16].fill_(2.0)
        store.wait([job])
        handle = store.load(keys, list(range(16, 32)))
        store.wait([handle.job_id])
        assert handle.num_chunks == len(keys)
        torch.cuda.synchronize()
        for layer in kv:
            assert bool((layer[16:32] == 1.0).all())
