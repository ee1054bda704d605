"""vLLM's OpenAI server with tierkv: a restart is warm under ``vllm serve``'s defaults
(``--shutdown-timeout 0``: a SIGTERM kills the workers before any shutdown flush) and after
a SIGKILL, because every stored chunk is written behind to disk (the connector's
``write_through``, on by default); its ``/metrics`` has the ``tierkv:*`` series.

One test, three server starts (each costs tens of seconds on 2 cores): the first is stopped
by SIGTERM with the default shutdown timeout, the second by SIGKILL, the third drains with
``--shutdown-timeout 30``.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

from tests.engine.conftest import References
from tests.engine.engines import prompt
from tests.engine.processes import Server, disk_chunks, parse_metrics

FIRST = [prompt(300 + 131 * seed, seed=20 + seed) for seed in range(4)]
SECOND = [prompt(420 + 97 * seed, seed=30 + seed) for seed in range(3)]
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


def series(figures: dict[str, float], name: str, label: str) -> list[float]:
    return [value for key, value in figures.items() if key.startswith(name) and label in key]


def test_a_server_restarts_warm_after_sigterm_and_sigkill(
        models: dict[str, Path], reference: References, tmp_path: Path) -> None:
    first_refs = reference("llama", FIRST, max_tokens=4)
    second_refs = reference("llama", SECOND, max_tokens=4)
    disk = tmp_path / "kv"
    # Every hit loaded: near parity "cost" may decline (test_multiprocess.ALWAYS says why).
    settings = {"cpu_bytes": 64 << 20, "disk_path": str(disk), "load_policy": "always"}
    first_chunks = sum(prompt_chunks(tokens) for tokens in FIRST)
    second_chunks = sum(prompt_chunks(tokens) for tokens in SECOND)

    with Server(models["llama"], tmp_path / "first.log", settings) as server:
        for tokens, ref in zip(FIRST, first_refs):
            assert server.complete(tokens).tokens == ref.tokens
        seconds = wait_for_disk(disk, first_chunks)
        print(f"stored chunks on disk {seconds:.2f} s after the last response")
        server.stop(signal.SIGTERM)  # vllm serve's default: --shutdown-timeout 0

    with Server(models["llama"], tmp_path / "second.log", settings) as server:
        for tokens, ref in zip(FIRST, first_refs):
            hit = server.complete(tokens)
            assert hit.tokens == ref.tokens, "wrong tokens after a SIGTERM restart"
            assert hit.cached_tokens == prompt_chunks(tokens) * TOKENS_PER_CHUNK
        server.complete(prompt(10, seed=39))  # one more step: the last figures reported
        text = server.metrics()
        figures = parse_metrics(text)
        for name in ("tierkv:hit_tokens_total", "tierkv:transfer_bytes_total",
                     "tierkv:usage_bytes", "tierkv:capacity_bytes",
                     "tierkv:queried_tokens_total", "tierkv:declined_tokens_total"):
            assert any(key.startswith(name) for key in figures), f"{name} missing"
        assert "# TYPE tierkv:hit_tokens_total counter" in text
        assert series(figures, "tierkv:hit_tokens_total", 'tier="disk"') == \
            [float(first_chunks * TOKENS_PER_CHUNK)]
        for tokens, ref in zip(SECOND, second_refs):
            assert server.complete(tokens).tokens == ref.tokens
        wait_for_disk(disk, first_chunks + second_chunks)
        server.stop(signal.SIGKILL)

    with Server(models["llama"], tmp_path / "third.log", settings,
                args=["--shutdown-timeout", "30"]) as server:
        for tokens, ref in zip(SECOND + FIRST, second_refs + first_refs):
            hit = server.complete(tokens)
            assert hit.tokens == ref.tokens, "wrong tokens after a SIGKILL restart"
            assert hit.cached_tokens == prompt_chunks(tokens) * TOKENS_PER_CHUNK
        assert server.stop(signal.SIGTERM) < 60  # a graceful drain, within its timeout


def test_a_server_whose_port_was_taken_starts_on_another(
        models: dict[str, Path], tmp_path: Path) -> None:
    # make test runs the integration suite beside this one: a port found free can be
    # taken (a Redis node, a client's socket) before the server binds it. The server
    # exited at start ("address already in use") and failed the test; it moves on now.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = int(squatter.getsockname()[1])
        with Server(models["llama"], tmp_path / "server.log", {"cpu_bytes": 64 << 20},
                    port=taken) as server:
            assert server.port != taken
            assert "address already in use" in server.log.read_text(errors="replace").lower()
            assert len(server.complete(prompt(64, seed=3)).tokens) == 4
