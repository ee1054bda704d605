"""tierkv's log lines under vLLM's own logging setup (as ``vllm serve`` configures it): its
INFO lines show, with vLLM's prefix (process name, pid, time, file), and a store reopened
under other settings is a warning that names them. Run in a child process, because vLLM's
``configure_logging`` changes the process's logging for good."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tierkv.integrations.vllm import follow_vllm_logging

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import sys
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig(log_level="INFO"))

from tests.integration.test_vllm_connector import (CHAT, TPC, HarnessConfig, MultiTurnWorkload,
                                                   Run, assert_clean, tierkv_config)

def run(**extra):
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config(disk_path=sys.argv[1], **extra))
    engine = Run(cfg)
    assert_clean(engine.run(MultiTurnWorkload(**{**CHAT, "num_turns": 1})), cfg.vocab_size)
    engine.shutdown()

run()
print("--- second start", flush=True)  # where vLLM logs (VLLM_LOGGING_STREAM)
run()
print("--- other settings", flush=True)  # where vLLM logs (VLLM_LOGGING_STREAM)
run(tokens_per_chunk=2 * TPC)
"""

PREFIX = r"\((?P<process>[\w-]+) pid=\d+\) (?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+:\d+\] "


def test_info_lines_and_the_namespace_warning_show_under_vllm_logging(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "store")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    first, rest = done.stdout.split("--- second start\n")
    second, other = rest.split("--- other settings\n")
    found = re.search(PREFIX + r"tierkv: (\d+) chunk\(s\) of namespace \w+ found on disk", second)
    assert found and found["level"] == "INFO" and int(found.group(3)) > 0, second[-3000:]
    warning = re.search(PREFIX + r"tierkv: 0 chunks found .*tokens_per_chunk is 32 there, 64 "
                                 r"here", other)
    assert warning and warning["level"] == "WARNING", other[-3000:]
    # Each rank's store says what it opened, in binary units (it said "1024 CPU slots of
    # 262144 bytes" and no disk cap).
    opened = re.search(PREFIX + r"tierkv: rank 0 open, namespace [0-9a-f]{8}: CPU [\d.]+ "
                                r"[KMG]iB \(\d+ chunks\), disk at \S+ capped at [\d.]+ [KMG]iB; "
                                r"32 tokens a chunk of [\d.]+ [KMG]iB", first)
    assert opened and opened["level"] == "INFO", first[-3000:]
    # One copy of each line: tierkv's records do not also reach the root logger.
    assert len(re.findall(r"0 chunks found", other)) == 1


def test_an_operators_own_tierkv_logging_is_left_alone() -> None:
    ours = logging.getLogger("tierkv")
    vllm_logger = logging.getLogger("vllm")
    handler = logging.NullHandler()
    saved = (ours.level, list(ours.handlers), ours.propagate, list(vllm_logger.handlers))
    try:
        vllm_logger.handlers = []
        assert not follow_vllm_logging()  # vLLM configured no logging: nothing to follow
        vllm_logger.handlers = [handler]
        ours.setLevel(logging.DEBUG)  # the operator's level for tierkv
        assert not follow_vllm_logging()
        assert ours.handlers == saved[1] and ours.propagate == saved[2]
    finally:
        ours.setLevel(saved[0])
        ours.handlers, ours.propagate, vllm_logger.handlers = saved[1], saved[2], saved[3]


@pytest.mark.parametrize("level", [logging.INFO, logging.WARNING])
def test_records_follow_vllms_handlers_at_their_levels(level: int) -> None:
    ours, vllm_logger = logging.getLogger("tierkv"), logging.getLogger("vllm")
    saved = (ours.level, list(ours.handlers), ours.propagate, list(vllm_logger.handlers),
             vllm_logger.level)
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    try:
        ours.handlers, vllm_logger.handlers = [], [Keep(level)]
        vllm_logger.setLevel(level)
        ours.setLevel(logging.NOTSET)
        assert follow_vllm_logging() and follow_vllm_logging()  # once, however often called
        assert len(ours.handlers) == 1
        later = Keep(level)
        vllm_logger.handlers = [later]  # vLLM configures logging again: the new handler serves
        logging.getLogger("tierkv.vllm").info("info line")
        logging.getLogger("tierkv.disk").warning("warning line")
        assert seen == (["info line", "warning line"] if level == logging.INFO
                        else ["warning line"])
    finally:
        ours.setLevel(saved[0])
        ours.handlers, ours.propagate, vllm_logger.handlers = saved[1], saved[2], saved[3]
        vllm_logger.setLevel(saved[4])
