"""The parts of ``scripts/bench_serve.py`` that talk to vLLM's OpenAI server: the workloads
(token-id sessions), the server process (with or without tierkv's connector), the streaming
client (asyncio + aiohttp, N concurrent sessions) and the server's ``/metrics`` and RSS.

Prompts are token ids (the server runs with ``--skip-tokenizer-init``); the assistant's
replies in a session's history are fixed tokens of the session, not the generated ones, so
every arm sends the same prompts whatever it generates.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.engine.processes import Server, parse_metrics  # noqa: E402

REQUEST_SECONDS = 300.0
WORKLOADS = ("chat", "agentic", "pressure", "unique", "restart")


# -- workloads -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Turn:
    """One request: its prompt, and where it belongs (session, turn, phase)."""

    session: int
    turn: int
    phase: str  # "run", or for pressure "store"/"reread", for restart "cold"/"replay"
    prompt: tuple[int, ...]


@dataclass(frozen=True)
class Sizes:
    sessions: int = 24
    turns: int = 4
    system_prompts: int = 4
    system_tokens: int = 512
    user_tokens: int = 64
    reply_tokens: int = 32  # the fixed assistant reply kept in a session's history
    context_tokens: int = 1024  # agentic: the long shared context
    tool_tokens: int = 32  # agentic: a tool call's output, per turn
    agentic_turns: int = 8
    documents: int = 32  # pressure: long documents, each read twice
    document_tokens: int = 1536
    unique_tokens: int = 1024


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randint(1, 4000) for _ in range(count)]


def _chat(sizes: Sizes, rng: random.Random, phase: str) -> list[list[list[Turn]]]:
    """Waves: every session's turn k, then turn k+1 (a user reads and types between turns,
    while the other sessions go on)."""
    systems = [_tokens(rng, sizes.system_tokens) for _ in range(sizes.system_prompts)]
    histories = [list(systems[s % sizes.system_prompts]) for s in range(sizes.sessions)]
    waves = []
    for turn in range(sizes.turns):
        wave = []
        for session, history in enumerate(histories):
            history += _tokens(rng, sizes.user_tokens)
            wave.append([Turn(session, turn, phase, tuple(history))])
            history += _tokens(rng, sizes.reply_tokens)
        waves.append(wave)
    return waves


def workload(name: str, sizes: Sizes, seed: int = 0) -> list[list[list[Turn]]]:
    """The phases of workload ``name``; a phase is a list of sessions, a session its turns
    in order. The client runs a phase's sessions concurrently and the phases one after
    another. ``chat`` and ``agentic`` run their turns in waves, a phase each (every
    session's turn k, then turn k+1: a session pauses while the others work, and comes
    back)."""
    rng = random.Random(f"{name}-{seed}")
    if name == "chat":
        return _chat(sizes, rng, "run")
    if name == "restart":  # the same sessions before and after a restart
        cold = _chat(sizes, rng, "cold")
        return cold + [[[Turn(t.session, t.turn, "replay", t.prompt) for t in s] for s in wave]
                       for wave in cold]
    if name == "agentic":
        context = _tokens(rng, sizes.context_tokens)
        histories = [context + _tokens(rng, sizes.user_tokens) for _ in range(sizes.sessions)]
        waves = []
        for turn in range(sizes.agentic_turns):
            wave = []
            for session, history in enumerate(histories):
                history += _tokens(rng, sizes.tool_tokens)
                wave.append([Turn(session, turn, "run", tuple(history))])
                history += _tokens(rng, sizes.reply_tokens)
            waves.append(wave)
        return waves
    if name == "pressure":
        documents = [_tokens(rng, sizes.document_tokens) for _ in range(sizes.documents)]
        return [[[Turn(doc, step, phase, tuple(documents[doc] + _tokens(rng, 16)))]
                 for doc in range(sizes.documents)]
                for step, phase in enumerate(("store", "reread"))]
    if name == "unique":
        return [[[Turn(session, 0, "run", tuple(_tokens(rng, sizes.unique_tokens)))]
                 for session in range(sizes.sessions)]]
    raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


# -- the server ------------------------------------------------------------------------------

def start_server(model: Path, log: Path, tierkv: Mapping[str, Any] | None, *,
                 kv_cache_bytes: int) -> Server:
    """vLLM's OpenAI server with its prefix cache on, as ``vllm serve`` has it; with
    tierkv's connector when ``tierkv`` is given (tests/engine/processes.py starts it)."""
    return Server(model, log, tierkv, kv_cache_bytes=kv_cache_bytes, prefix_caching=True)


def metrics(server: Server) -> dict[str, float]:
    """The ``vllm:*`` and ``tierkv:*`` samples of the server's ``/metrics``."""
    text = server.metrics()
    return parse_metrics(text, "vllm:") | parse_metrics(text, "tierkv:")


def rss_bytes(server: Server) -> int:
    """Resident bytes of every process of the server's group (API server, engine core,
    workers)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != server.process.pid:  # the process group
                continue
            total += int((entry / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def metric_sum(samples: Mapping[str, float], name: str, label: str = "") -> float:
    """The sum of ``name``'s samples (every label set), those with ``label`` only if given."""
    return sum(value for key, value in samples.items()
               if (key == name or key.startswith(name + "{")) and label in key)


# -- the client ------------------------------------------------------------------------------

@dataclass
class Reply:
    turn: Turn
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # seconds between tokens after the first
    seconds: float = 0.0
    tokens: tuple[int, ...] = ()
    cached_tokens: int = 0
    error: str = ""


async def _one(session: Any, url: str, model: str, turn: Turn, max_tokens: int) -> Reply:
    body = {"model": model, "prompt": list(turn.prompt), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    reply = Reply(turn)
    started = time.perf_counter()
    last = started
    tokens: list[int] = []
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                reply.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return reply
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                for choice in chunk.get("choices") or ():
                    new = choice.get("token_ids") or ()
                    if new:
                        now = time.perf_counter()
                        if not tokens:
                            reply.ttft = now - started
                        else:
                            reply.itl.append((now - last) / len(new))
                        last = now
                        tokens += new
                usage = chunk.get("usage")
                if usage:
                    details = usage.get("prompt_tokens_details") or {}
                    reply.cached_tokens = int(details.get("cached_tokens") or 0)
    except Exception as exc:  # noqa: BLE001  (an error is a figure of the run)
        reply.error = f"{type(exc).__name__}: {exc}"
    reply.seconds = time.perf_counter() - started
    reply.tokens = tuple(tokens)
    if not reply.error and len(tokens) != max_tokens:
        reply.error = f"{len(tokens)} tokens of {max_tokens}"
    return reply


async def _phase(server: Server, sessions: Sequence[Sequence[Turn]], concurrency: int,
                 max_tokens: int) -> list[Reply]:
    import aiohttp

    queue: asyncio.Queue[Sequence[Turn]] = asyncio.Queue()
    for one in sessions:
        queue.put_nowait(one)
    replies: list[Reply] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_SECONDS)
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    async with aiohttp.ClientSession(timeout=timeout) as client:
        async def worker() -> None:
            while not queue.empty():
                for turn in queue.get_nowait():
                    replies.append(await _one(client, url, server.model, turn, max_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return replies


def run_phase(server: Server, sessions: Sequence[Sequence[Turn]], concurrency: int,
              max_tokens: int) -> tuple[list[Reply], float]:
    """Run ``sessions`` with ``concurrency`` clients; returns the replies and the wall
    seconds the phase took."""
    started = time.perf_counter()
    replies = asyncio.run(_phase(server, sessions, concurrency, max_tokens))
    return replies, time.perf_counter() - started


def settle(server: Server, seed: int) -> None:
    """One short unique request: the step that reports the figures of the last ones
    (tierkv's and vLLM's metrics are reported with a step)."""
    rng = random.Random(f"settle-{seed}")
    asyncio.run(_phase(server, [[Turn(-1, 0, "settle", tuple(_tokens(rng, 8)))]], 1, 1))


__all__ = ["Reply", "Server", "Sizes", "Turn", "WORKLOADS", "metric_sum", "metrics", "rss_bytes",
           "run_phase", "settle", "start_server", "workload"]
