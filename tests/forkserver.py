"""The one forkserver of a test process. multiprocessing has a single forkserver per
process, and its preload list is read once, when it starts: so every suite that forks
children registers the modules it wants imported in the server (``preload``) at import
time, and takes its context here (``context``). A child then starts in milliseconds,
with torch, lmdb and tierkv (and vLLM, where a suite asks) already imported, instead of
importing them for seconds as a spawned child does. The server holds no LMDB
environment: tierkv never forks with one open."""

from __future__ import annotations

import multiprocessing
from typing import Any

_PRELOAD = ["torch", "lmdb", "tierkv.engine.store", "tierkv.transfer.cpu"]
_CONTEXT: Any = None


def preload(*modules: str) -> None:
    """Ask for ``modules`` to be imported in the server. Call at import time: once the
    server has started, a module added here is imported by each child that needs it."""
    for module in modules:
        if module not in _PRELOAD:
            _PRELOAD.append(module)
    if _CONTEXT is not None:
        _CONTEXT.set_forkserver_preload(list(_PRELOAD))


def context() -> Any:
    """The forkserver context, with every module asked for so far preloaded."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(list(_PRELOAD))
    return _CONTEXT
