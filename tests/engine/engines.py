"""The real-engine helpers the tests use (they live in tierkv.integrations.vllm_runner,
which scripts/bench_ttft.py and make demo-vllm use too)."""

from tierkv.integrations.vllm_runner import (CONNECTOR, Engine, Output, assert_distinct, changed,
                                             compare, deviation, difference, kv_transfer_config,
                                             prompt)

__all__ = ["CONNECTOR", "Engine", "Output", "assert_distinct", "changed", "compare", "deviation",
           "difference", "kv_transfer_config", "prompt"]
