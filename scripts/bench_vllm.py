#!/usr/bin/env python3
"""tierkv's vLLM connector vs vLLM's own OffloadingConnector, under the real vLLM 0.33 Scheduler.

One multi-turn chat workload (turn k+1 = turn k's prompt + its output + a new user
message), run side by side in one process through ``tests/integration/vllm_harness.py``
(vLLM's Scheduler, sync or async scheduling, a fake model runner on CPU tensors):

- ``gpu-only``               no connector: vLLM's GPU prefix cache alone (baseline).
- ``vllm-offloading``        vLLM's OffloadingConnector with its real CPUOffloadingManager
                             and scheduler logic, defaults (``offload_prompt_only=True``);
                             its worker is the harness's CPU stand-in that completes jobs
                             without copying (vLLM's own worker needs CUDA).
- ``vllm-offloading-all``    the same with ``offload_prompt_only=False`` (decode tokens too).
- ``tierkv-cpu``             tierkv with the same CPU bytes.
- ``tierkv-cpu+disk``        tierkv with the same CPU bytes and an LMDB disk tier
                             (write-behind: every stored chunk is written, the default).
- ``tierkv-cpu+disk-wb``     the same with write-back (``write_through: false``): chunks
                             are written as they age out of the CPU tier, and at shutdown.

Each tierkv configuration runs once per eviction policy in ``--policies`` (named
``tierkv-cpu/lru``, ``tierkv-cpu/arc``, ...). ``--scan-prompts N`` turns the workload
scan-heavy: before each next chat turn, N one-off prompts of ``--scan-len`` fresh tokens
(a document read once) are added, so they are scheduled between the turns and compete
for the CPU tier; they are never reused, so they add nothing to the reusable tokens.

Both connectors use the same chunk size (``--tokens-per-chunk``). The GPU block pool is
too small to keep earlier turns (so reuse must come from the connector), and the CPU
bytes hold about a third of the workload's chunks.

Reported per configuration (median over ``--runs``; the first, warm-up run of each is
dropped):
- hit tokens: each request's ``num_computed_tokens`` when it is first scheduled (vLLM's
  local prefix hit plus the connector's external hit);
- reusable tokens: per request, the longest prefix its prompt shares with the token
  sequence an earlier-added request computed (its prompt and outputs but the last token),
  floored to the block size and capped at ``prompt - 1``;
- scheduler-side time per step: time inside the connector's scheduler-role methods
  (``conn ms/step``), and inside ``Scheduler.schedule`` + ``update_from_output``
  (``sched ms/step``, which includes the connector).

    .venv/bin/python scripts/bench_vllm.py            # defaults as shown by --help
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tierkv and tests
from tests.integration import vllm_harness as harness_lib  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402

SCHEDULER_METHODS = (
    "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
    "get_external_cache_hit_sources", "build_connector_meta", "update_connector_output",
    "request_finished", "take_events", "get_kv_connector_stats", "has_pending_push_work",
)


@dataclass
class Outcome:
    hit_tokens: int
    reusable_tokens: int
    steps: int
    connector_seconds: float
    scheduler_seconds: float
    wall_seconds: float
    mismatched: int
    disk_writes: int = 0  # chunks written to disk: spills while it ran, the shutdown flush

    @property
    def hit_fraction(self) -> float:
        return self.hit_tokens / self.reusable_tokens if self.reusable_tokens else 0.0


class Timer:
    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, target: Any, name: str) -> None:
        original: Callable[..., Any] = getattr(target, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(target, name, timed)


class ScanWorkload(harness_lib.Workload):
    """The chat workload with one-off long prompts between its turns: when a chat turn
    finishes and has a next turn, ``num_scans`` prompts of ``scan_len`` fresh random tokens
    are added first, then the next turn (vLLM schedules them in that order)."""

    def __init__(self, chat: harness_lib.MultiTurnWorkload, num_scans: int, scan_len: int,
                 max_tokens: int, seed: int, vocab_size: int = 1000) -> None:
        self.chat = chat
        self.num_scans = num_scans
        self.scan_len = scan_len
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self._rng = random.Random(seed + 1_000_003)  # the chat's own tokens stay the same
        self._next = 0

    def initial_requests(self) -> list[harness_lib.RequestSpec]:
        return self.chat.initial_requests()

    def on_finished(self, request_id: str, all_token_ids: list[int]) -> list[harness_lib.RequestSpec]:
        if request_id.startswith("scan"):
            return []
        follow_ups = self.chat.on_finished(request_id, all_token_ids)
        if not follow_ups:
            return []
        scans = []
        for _ in range(self.num_scans):
            tokens = [self._rng.randrange(self.vocab_size) for _ in range(self.scan_len)]
            scans.append(harness_lib.RequestSpec(f"scan{self._next}", tokens, self.max_tokens))
            self._next += 1
        return scans + follow_ups


def tierkv_transfer(args: argparse.Namespace, disk: Path | None, policy: str,
                    write_through: bool = True) -> KVTransferConfig:
    # load_policy "always": the harness's forward is simulated, so cost-aware loads would
    # decline hits this benchmark counts (they are measured on the real engine, bench_ttft).
    extra: dict[str, Any] = {"cpu_bytes": args.cpu_bytes, "tokens_per_chunk": args.tokens_per_chunk,
                             "eviction_policy": policy, "load_policy": "always"}
    if disk is not None:
        extra.update(disk_path=str(disk), disk_bytes=1 << 30, write_through=write_through)
    return KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.integrations.vllm",
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=extra)


def transfer_for(name: str, args: argparse.Namespace, tmp: Path) -> KVTransferConfig | None:
    if name == "gpu-only":
        return None
    if name.startswith("vllm-offloading"):
        return harness_lib.offloading_transfer_config(
            cpu_bytes_to_use=args.cpu_bytes, copy=False, block_size=args.tokens_per_chunk,
            offload_prompt_only=(name == "vllm-offloading"))
    config, _, policy = name.partition("/")
    if config == "tierkv-cpu":
        return tierkv_transfer(args, None, policy)
    return tierkv_transfer(args, Path(tempfile.mkdtemp(dir=tmp)), policy,
                           write_through=config != "tierkv-cpu+disk-wb")


def reusable_tokens(result: harness_lib.RunResult, order: list[str], block_size: int) -> dict[str, int]:
    computed: list[list[int]] = []
    out: dict[str, int] = {}
    for req_id in order:
        prompt = result.prompts[req_id].prompt_token_ids
        best = 0
        for sequence in computed:
            limit = min(len(sequence), len(prompt))
            shared = 0
            while shared < limit and sequence[shared] == prompt[shared]:
                shared += 1
            best = max(best, shared)
        best = min(best, len(prompt) - 1)
        out[req_id] = best // block_size * block_size
        full = list(prompt) + result.outputs[req_id]
        computed.append(full[:-1])
    return out


def run_once(name: str, args: argparse.Namespace, tmp: Path) -> Outcome:
    cfg = harness_lib.HarnessConfig(
        block_size=args.block_size, num_gpu_blocks=args.gpu_blocks,
        max_num_batched_tokens=args.batch_tokens, max_num_seqs=args.max_seqs,
        max_model_len=args.max_model_len, async_scheduling=args.async_scheduling,
        kv_transfer_config=transfer_for(name, args, tmp))
    harness = harness_lib.build_harness(cfg, check=args.check and not name.startswith("vllm"))
    engine = harness_lib.HarnessEngine(harness)
    connector_timer, scheduler_timer = Timer(), Timer()
    connector = harness.scheduler_connector
    if connector is not None:
        for method in SCHEDULER_METHODS:
            connector_timer.wrap(connector, method)
    scheduler_timer.wrap(harness.scheduler, "schedule")
    scheduler_timer.wrap(harness.scheduler, "update_from_output")
    workload: harness_lib.Workload = harness_lib.MultiTurnWorkload(
        num_conversations=args.conversations, num_turns=args.turns, system_prompt_len=args.system,
        first_user_len=args.first_user, user_turn_len=args.user_turn, max_tokens=args.max_tokens,
        seed=args.seed)
    if args.scan_prompts:
        assert isinstance(workload, harness_lib.MultiTurnWorkload)
        workload = ScanWorkload(workload, args.scan_prompts, args.scan_len, args.scan_max_tokens, args.seed)
    order: list[str] = []
    add_request = engine.add_request

    def add_in_order(spec: harness_lib.RequestSpec) -> Any:
        order.append(spec.request_id)
        return add_request(spec)

    engine.add_request = add_in_order  # type: ignore[method-assign]
    start = time.perf_counter()
    result = engine.run(workload, max_steps=100_000)
    wall = time.perf_counter() - start
    first: dict[str, int] = {}
    for record in result.records:
        for req_id, computed in record.computed_before.items():
            first.setdefault(req_id, computed)
    reusable = reusable_tokens(result, order, args.block_size)
    worker = harness.worker_connector
    disk_writes = 0  # chunks written while it ran, and by the shutdown flush
    if name.startswith("tierkv-cpu+disk"):
        disk_writes = int(connector._scheduler_side().statistics().get("spills_ok", 0))
        disk_writes += len(worker._worker.unspilled_chunks())
    if worker is not None:
        worker.shutdown()
    harness.scheduler.shutdown()
    return Outcome(
        hit_tokens=sum(first.values()), reusable_tokens=sum(reusable.values()), steps=result.num_steps,
        connector_seconds=connector_timer.seconds, scheduler_seconds=scheduler_timer.seconds,
        wall_seconds=wall, mismatched=len(result.mismatched_outputs(cfg.vocab_size)),
        disk_writes=disk_writes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system", type=int, default=200, help="shared system prompt tokens")
    parser.add_argument("--first-user", type=int, default=160)
    parser.add_argument("--user-turn", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--tokens-per-chunk", type=int, default=64)
    parser.add_argument("--gpu-blocks", type=int, default=192, help="GPU block pool (small on purpose)")
    parser.add_argument("--cpu-bytes", type=int, default=1 << 20,
                        help="CPU tier bytes for both connectors (8 KiB chunks: 128 chunks)")
    parser.add_argument("--batch-tokens", type=int, default=256)
    parser.add_argument("--max-seqs", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--check", action="store_true", help="check KV slots in the tierkv runs (slower)")
    parser.add_argument("--runs", type=int, default=3, help="measured runs per configuration (+1 warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--configs", default="gpu-only,vllm-offloading,vllm-offloading-all,tierkv-cpu,tierkv-cpu+disk")
    parser.add_argument("--policies", default="lru,arc",
                        help="tierkv eviction policies; each tierkv config runs once per policy")
    parser.add_argument("--scan-prompts", type=int, default=0,
                        help="one-off prompts added before each next chat turn (0: chat only)")
    parser.add_argument("--scan-len", type=int, default=1024, help="tokens per one-off prompt")
    parser.add_argument("--scan-max-tokens", type=int, default=4, help="output tokens per one-off prompt")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [f"{name}/{policy}" if name.startswith("tierkv") else name
             for name in args.configs.split(",")
             for policy in (args.policies.split(",") if name.startswith("tierkv") else [""])]
    outcomes: dict[str, list[Outcome]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-vllm-") as tmp:
        for run in range(args.runs + 1):  # interleaved, so drift hits every configuration
            for name in names:
                outcome = run_once(name, args, Path(tmp))
                if run > 0:
                    outcomes[name].append(outcome)
    if args.scan_prompts:
        print(f"scan-heavy: {args.scan_prompts} one-off prompt(s) of {args.scan_len} tokens before each "
              f"next chat turn")
    header = (f"{'config':<22} {'hit tokens':>10} {'reusable':>9} {'hit/reusable':>12} {'steps':>6} "
              f"{'conn ms/step':>12} {'sched ms/step':>13} {'wall s':>7} {'bad outputs':>11} "
              f"{'disk writes':>11}")
    print(header)
    print("-" * len(header))
    for name, runs in outcomes.items():
        def med(value: Callable[[Outcome], float]) -> float:
            return statistics.median(value(o) for o in runs)

        def spread(value: Callable[[Outcome], float]) -> str:
            values = [value(o) for o in runs]
            return f"{min(values):.3f}-{max(values):.3f}"

        per_step_conn = med(lambda o: 1e3 * o.connector_seconds / o.steps)
        per_step_sched = med(lambda o: 1e3 * o.scheduler_seconds / o.steps)
        print(f"{name:<22} {med(lambda o: o.hit_tokens):>10.0f} {med(lambda o: o.reusable_tokens):>9.0f} "
              f"{med(lambda o: o.hit_fraction):>12.3f} {med(lambda o: o.steps):>6.0f} "
              f"{per_step_conn:>12.3f} {per_step_sched:>13.3f} {med(lambda o: o.wall_seconds):>7.2f} "
              f"{max(o.mismatched for o in runs):>11} {med(lambda o: o.disk_writes):>11.0f}")
        print(f"{'':<22} spread: hit/reusable {spread(lambda o: o.hit_fraction)}, "
              f"conn ms/step {spread(lambda o: 1e3 * o.connector_seconds / o.steps)}, "
              f"sched ms/step {spread(lambda o: 1e3 * o.scheduler_seconds / o.steps)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
