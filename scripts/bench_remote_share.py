"""The hit-fraction section of ``scripts/bench_remote.py``: engines A and B that share the
remote tier against one engine that sees every turn (that script's docstring says what is
measured). A module of its own, imported by that script; it runs nothing by itself."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.redis_cluster import RedisCluster  # noqa: E402
from tierkv.config import CpuTierConfig, RemoteTierConfig, StoreConfig  # noqa: E402
from tierkv.keys import chunk_keys  # noqa: E402

SHARE_BLOCK, SHARE_BPC, SHARE_HEADS, SHARE_HEAD_DIM = 16, 4, 4, 64
SHARE_PAGE = (2, SHARE_HEADS, SHARE_BLOCK, SHARE_HEAD_DIM)  # as tierkv demo
SHARE_BLOCKS = 512


def share_prompts(seed: int, conversations: int, turns: int) -> list[tuple[int, int, list[int]]]:
    """(turn, conversation, prompt tokens) of the ``tierkv demo`` workload, turn by turn
    (:func:`tierkv.demo.chat_prompts`)."""
    from tierkv.demo import chat_prompts

    return list(chat_prompts(seed, conversations, turns, SHARE_BLOCK * SHARE_BPC))


class ShareEngine:
    """One engine of the hit-fraction measurement: a TierKVStore on CPU tensors (no disk
    tier), optionally on the remote tier; ``step(prompt)`` loads what the tiers have (every
    loaded byte checked), "computes" the rest, stores the prompt's chunks, and returns
    (chunks asked, chunks served from a tier)."""

    def __init__(self, layers: int, cpu_chunks: int, url: str | None, key_prefix: str) -> None:
        import torch

        from tierkv.engine.store import TierKVStore

        self.kv = [torch.zeros((SHARE_BLOCKS, *SHARE_PAGE), dtype=torch.float16)
                   for _ in range(layers)]
        chunk_bytes = layers * SHARE_BPC * self.kv[0][0].numel() * 2
        remote = None if url is None else RemoteTierConfig(url=url, key_prefix=key_prefix)
        config = StoreConfig(blocks_per_chunk=SHARE_BPC,
                             cpu=CpuTierConfig(max_bytes=cpu_chunks * chunk_bytes),
                             device="cpu", remote=remote)
        self.store = TierKVStore(self.kv, model_id="bench-share", tokens_per_block=SHARE_BLOCK,
                                 config=config)
        self.free = list(range(SHARE_BLOCKS))

    def step(self, prompt: list[int]) -> tuple[int, int]:
        from tierkv.demo import serve_prompt

        served = serve_prompt(self.store, self.kv, chunk_keys(prompt, SHARE_BLOCK * SHARE_BPC),
                              self.free, SHARE_PAGE)
        if served.wrong:
            raise SystemExit("bench_remote: wrong KV loaded")
        return served.asked, served.landed

    def not_yet(self) -> int:
        remote = self.store.statistics().remote
        return remote.lookup_not_yet if remote is not None else 0

    def close(self) -> None:
        self.store.close()


def owner(split: str, turn: int, conversation: int, turns: int) -> str:
    """Which of A and B serves this turn of this conversation."""
    if split == "alternate":
        return "AB"[(turn + conversation) % 2]
    return "A" if turn < turns // 2 else "B"


def share_round(cluster: RedisCluster, args: argparse.Namespace,
                round_number: int) -> dict[str, float]:
    """Hit fractions of one round: the one engine once, then each split with and without
    the remote tier (see the module docstring); fresh keys (a prefix per run)."""
    prompts = share_prompts(round_number, args.share_conversations, args.share_turns)
    seen: set[bytes] = set()
    before = []  # per prompt: (chunks, chunks some earlier prompt had): what any cache can hit
    for _, _, prompt in prompts:
        keys = chunk_keys(prompt, SHARE_BLOCK * SHARE_BPC)
        before.append((len(keys), sum(key in seen for key in keys)))
        seen.update(keys)
    result: dict[str, float] = {}
    one: dict[str, list[tuple[int, int]]] = {}
    for label in ("", " [no remote tier]"):
        url = None if label else cluster.url
        engine = ShareEngine(args.share_layers, args.share_cpu_chunks, url,
                             f"share{round_number}one{len(one)}:")
        try:
            one[label] = [engine.step(prompt) for _, _, prompt in prompts]
        finally:
            engine.close()
    for split in args.share_splits:
        b_prompts = [i for i, (turn, conv, _) in enumerate(prompts)
                     if owner(split, turn, conv, args.share_turns) == "B"]
        result[f"{split}: bound (chunks seen before), B's prompts"] = \
            sum(before[i][1] for i in b_prompts) / sum(before[i][0] for i in b_prompts)
        for label, served in one.items():
            result[f"{split}: one engine, on B's prompts{label}"] = \
                sum(served[i][1] for i in b_prompts) / sum(served[i][0] for i in b_prompts)
        for remote in (True, False):
            url = cluster.url if remote else None
            name = "A+B, shared remote tier" if remote else "A+B, no remote tier"
            engines = {who: ShareEngine(args.share_layers, args.share_cpu_chunks // 2, url,
                                        f"share{round_number}{split}{int(remote)}:")
                       for who in "AB"}
            try:
                asked = hits = 0
                for turn, conv, prompt in prompts:
                    who = owner(split, turn, conv, args.share_turns)
                    num, got = engines[who].step(prompt)
                    if who == "B":
                        asked, hits = asked + num, hits + got
                result[f"{split}: {name}, B"] = hits / asked
                if remote:
                    result[f"{split}: lookups not yet (A+B)"] = sum(
                        e.not_yet() for e in engines.values())
            finally:
                for e in engines.values():
                    e.close()
    return result
