"""Tokens served (vLLM's own prefix cache plus tierkv) on a multi-turn chat, with same-step
loads on (``sync_load_bytes`` 64 MiB, the default) and off (0), under vLLM's real Scheduler
(tests/integration/vllm_harness.py: a simulated forward pass, exact KV checks).

Issue 44 asked where same-step loads lose tokens. They lose partial-chunk tails: tierkv
serves whole chunks (``tokens_per_chunk``), and the blocks past a request's last whole
chunk are served only by vLLM's own prefix cache. Which of them survive vLLM's LRU under a
small GPU pool depends on when requests are admitted, and same-step loads admit a hit a
step or two earlier. With chunks of one block nothing is lost either way; a large GPU pool
keeps the tails too (docs/vllm.md, "Same-step loads and chunk tails").

    .venv/bin/python scripts/bench_same_step.py --gpu-blocks 48 64 96 --tokens-per-chunk 16 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration import vllm_harness as harness  # noqa: E402
from tests.integration.test_vllm_connector import Run, assert_clean, tierkv_config  # noqa: E402

CHAT = dict(num_conversations=6, num_turns=4, system_prompt_len=100, first_user_len=60,
            user_turn_len=40, max_tokens=16)


def served(gpu_blocks: int, tokens_per_chunk: int, sync_load_bytes: int) -> tuple[int, int]:
    """(tokens served at admission: vLLM's local hit and tierkv's, summed over requests;
    tierkv's same-step loads)."""
    cfg = harness.HarnessConfig(
        enable_prefix_caching=True, num_gpu_blocks=gpu_blocks, max_num_batched_tokens=64,
        max_num_seqs=4, kv_transfer_config=tierkv_config(tokens_per_chunk=tokens_per_chunk,
                                                         sync_load_bytes=sync_load_bytes))
    run = Run(cfg)
    local: dict[str, int] = {}
    admitted: dict[str, int] = {}
    connector: Any = run.connector
    ask, admit = connector.get_num_new_matched_tokens, connector.update_state_after_alloc

    def spy_ask(request: Any, num_local: int) -> Any:
        local[request.request_id] = num_local
        return ask(request, num_local)

    def spy_admit(request: Any, blocks: Any, num_external: int) -> None:
        admitted.setdefault(request.request_id, local.get(request.request_id, 0) + num_external)
        admit(request, blocks, num_external)

    connector.get_num_new_matched_tokens, connector.update_state_after_alloc = spy_ask, spy_admit
    result = run.run(harness.MultiTurnWorkload(**CHAT))  # type: ignore[arg-type]
    assert_clean(result, cfg.vocab_size)
    sync_loads = int(run.side.statistics()["sync_loads"])
    run.shutdown()
    return sum(admitted.values()), sync_loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-blocks", type=int, nargs="+", default=[48, 64, 96])
    parser.add_argument("--tokens-per-chunk", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    print("| GPU blocks | tokens_per_chunk | served, async loads | served, same-step "
          "| same-step loads |")
    print("|---|---|---|---|---|")
    for blocks in args.gpu_blocks:
        for tpc in args.tokens_per_chunk:
            off, _ = served(blocks, tpc, 0)
            on, loads = served(blocks, tpc, 64 << 20)
            print(f"| {blocks} | {tpc} | {off} | {on} | {loads} |", flush=True)


if __name__ == "__main__":
    main()
