"""tierkv's log lines under vLLM's logging setup.

vLLM configures the ``vllm`` logger only (a stream handler with time, process name and pid;
``VLLM_LOGGING_LEVEL``, ``--logging-config``). tierkv logs to ``tierkv.*``, which then has no
handler: its INFO lines were dropped and its warnings printed bare by Python's last-resort
handler. :func:`follow_vllm_logging` hands tierkv's records to the handlers the ``vllm``
logger has at the time of each record (vLLM may configure logging again later), at vLLM's
level.

It changes nothing when the ``tierkv`` logger already has handlers or a level of its own
(an operator's ``--logging-config`` / ``VLLM_LOGGING_CONFIG_PATH`` that names it wins) or when
vLLM configures no logging (``VLLM_CONFIGURE_LOGGING=0``).
"""

from __future__ import annotations

import logging

TIERKV = "tierkv"
VLLM = "vllm"


class _ToVllmHandlers(logging.Handler):
    """Emits each record through the ``vllm`` logger's handlers (each applies its level)."""

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger(VLLM).handlers
        if not handlers and record.levelno >= logging.WARNING and logging.lastResort is not None:
            logging.lastResort.handle(record)  # what Python prints with no handler at all
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def follow_vllm_logging() -> bool:
    """Route ``tierkv.*`` records to vLLM's handlers; True when it did (now or before)."""
    ours, theirs = logging.getLogger(TIERKV), logging.getLogger(VLLM)
    if any(isinstance(handler, _ToVllmHandlers) for handler in ours.handlers):
        return True
    if ours.handlers or ours.level != logging.NOTSET or not theirs.handlers:
        return False
    ours.addHandler(_ToVllmHandlers())
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False  # as vLLM's own logger: no second copy through the root logger
    return True


__all__ = ["follow_vllm_logging"]
