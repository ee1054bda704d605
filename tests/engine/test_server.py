"""vLLM's OpenAI server with tierkv: its ``/metrics`` has the ``tierkv:*`` series, and a
restart is warm under ``vllm serve``'s defaults (``--shutdown-timeout 0``: a SIGTERM kills
the workers before any shutdown flush) and after a SIGKILL, because every stored chunk is
written behind to disk (the connector's ``write_through``, on by default).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.engine.conftest import References
from tests.engine.engines import prompt
from tests.engine.processes import Server, disk_chunks, parse_metrics

PROMPTS = [prompt(300 + 131 * seed, seed=20 + seed) for seed in range(5)]
TOKENS_PER_CHUNK = 128  # the connector's default: 128 rounded up to vLLM's CPU block size, 128
WAIT_FOR_DISK_SECONDS = 120.0


def prompt_chunks(tokens: list[int]) -> int:
    return (len(tokens) - 1) // TOKENS_PER_CHUNK


def wait_for_disk(disk: Path, chunks: int) -> float:
    """Poll ``tierkv inspect`` until the disk holds ``chunks``; returns the seconds it took
    (a state the test waits for, not a time it assumes)."""
    started = time.monotonic()
    while disk_chunks(disk) < chunks:
        assert time.monotonic() - started < WAIT_FOR_DISK_SECONDS, (
            f"only {disk_chunks(disk)} of {chunks} stored chunks reached the disk in "
            f"{WAIT_FOR_DISK_SECONDS:.0f} s: write-behind is not running")
        time.sleep(0.2)  # polling the disk, not ordering the test
    return time.monotonic() - started


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_restart_is_warm_after_a_signal(sig: signal.Signals, models: dict[str, Path],
                                          reference: References, tmp_path: Path) -> None:
    """SIGTERM with the default --shutdown-timeout, or SIGKILL: every chunk the first server
    stored is on disk before the signal, and the next server hits all of them with the
    greedy tokens of an engine without tierkv."""
    refs = reference("llama", PROMPTS, max_tokens=4)
    disk = tmp_path / "kv"
    settings = {"cpu_bytes": 64 << 20, "disk_path": str(disk)}
    expected_chunks = sum(prompt_chunks(tokens) for tokens in PROMPTS)
    with Server(models["llama"], tmp_path / "first.log", settings) as first:
        for tokens, ref in zip(PROMPTS, refs):
            assert first.complete(tokens).tokens == ref.tokens
        seconds = wait_for_disk(disk, expected_chunks)
        print(f"stored chunks on disk {seconds:.2f} s after the last response")
        first.stop(sig)
    with Server(models["llama"], tmp_path / "second.log", settings) as second:
        for tokens, ref in zip(PROMPTS, refs):
            hit = second.complete(tokens)
            assert hit.tokens == ref.tokens, "wrong tokens after a restart"
            assert hit.cached_tokens == prompt_chunks(tokens) * TOKENS_PER_CHUNK
        figures = parse_metrics(second.metrics())
        disk_hits = [value for name, value in figures.items()
                     if name.startswith("tierkv:hit_tokens_total") and 'tier="disk"' in name]
        # Reported at most once a second: a scrape may lag the last request.
        assert disk_hits and 0 < disk_hits[0] <= expected_chunks * TOKENS_PER_CHUNK
        second.stop(signal.SIGTERM)


def test_the_openai_servers_metrics_have_tierkvs_series(models: dict[str, Path],
                                                        tmp_path: Path) -> None:
    with Server(models["llama"], tmp_path / "server.log", {"cpu_bytes": 64 << 20},
                args=["--shutdown-timeout", "30"]) as server:
        tokens = prompt(800, seed=30)
        server.complete(tokens)
        hit = server.complete(tokens)
        assert hit.cached_tokens == prompt_chunks(tokens) * TOKENS_PER_CHUNK
        server.complete(prompt(10, seed=31))  # one more step after the stats interval
        text = server.metrics()
        figures = parse_metrics(text)
        for series in ("tierkv:hit_tokens_total", "tierkv:transfer_bytes_total",
                       "tierkv:usage_bytes", "tierkv:capacity_bytes", "tierkv:queried_tokens_total"):
            assert any(name.startswith(series) for name in figures), f"{series} missing"
        cpu_hits = [value for name, value in figures.items()
                    if name.startswith("tierkv:hit_tokens_total") and 'tier="cpu"' in name]
        assert cpu_hits == [float(hit.cached_tokens)]
        assert "# TYPE tierkv:hit_tokens_total counter" in text
        assert server.stop(signal.SIGTERM) < 60
