"""A library store that is never closed: interpreter exit flushes it (bounded, logged),
and one collected without ``close()`` warns and is closed (tierkv.engine.store_exit)."""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from tierkv.engine import store_exit

from tests.integration.test_store import keys_for, make_kv, open_store, store_and_wait

NUM_CHUNKS = 4

CHILD = """
import sys
from pathlib import Path
from tests.integration.test_store import keys_for, make_kv, open_store, store_and_wait
kv = make_kv()
store = open_store(Path(sys.argv[1]), kv, cpu_chunks=8)
store_and_wait(store, keys_for(1, {num}), list(range({num} * 2)))
sys.exit(0)  # never closed: its chunks are all in the CPU tier
"""


def hits_after_restart(tmp_path: Path) -> int:
    with open_store(tmp_path, make_kv(), cpu_chunks=8) as store:
        return store.lookup(keys_for(1, NUM_CHUNKS))


def test_store_never_closed_is_flushed_at_exit_and_the_next_run_hits(tmp_path: Path) -> None:
    """Regression: after a plain sys.exit the next run had 0 of 10 hits, with no warning."""
    done = subprocess.run([sys.executable, "-c", CHILD.format(num=NUM_CHUNKS), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "was never closed; flushing its CPU tier" in done.stderr
    assert hits_after_restart(tmp_path) == NUM_CHUNKS


def test_store_collected_without_close_warns_and_is_flushed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(tmp_path, make_kv(), cpu_chunks=8)
    store_and_wait(store, keys_for(1, NUM_CHUNKS), list(range(NUM_CHUNKS * 2)))
    with pytest.warns(ResourceWarning, match="unclosed TierKVStore"), \
            caplog.at_level(logging.WARNING, logger="tierkv"):
        del store
        gc.collect()
    assert "garbage-collected without close()" in caplog.text
    assert hits_after_restart(tmp_path) == NUM_CHUNKS


def test_closed_store_is_not_tracked_and_warns_nothing(tmp_path: Path) -> None:
    store = open_store(tmp_path, make_kv())
    store.close()
    assert store not in store_exit._open
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del store
        gc.collect()


class SlowStore:
    """A store whose close() blocks until released: what exit does with a flush that hangs
    (a disk that stopped answering)."""

    def __init__(self) -> None:
        import os
        self._pid = os.getpid()
        self.release = threading.Event()
        self.closed = False

    def close(self) -> None:
        self.release.wait()
        self.closed = True

    def _describe(self) -> str:
        return "SlowStore"


def test_exit_flush_is_bounded_and_says_what_it_gave_up(caplog: pytest.LogCaptureFixture) -> None:
    slow = SlowStore()
    store_exit.track(slow)
    now = [0.0]
    try:
        with caplog.at_level(logging.WARNING, logger="tierkv"):
            given_up = store_exit.close_at_exit(seconds=0.0, clock=lambda: now[0])
        assert given_up == ["SlowStore"]
        assert "gave up on SlowStore" in caplog.text and "lost" in caplog.text
        assert not slow.closed
    finally:
        slow.release.set()
        store_exit.forget(slow)


def test_a_store_that_failed_to_open_is_not_warned_about(tmp_path: Path) -> None:
    from tierkv.errors import ConfigError
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with open_store(tmp_path, make_kv()):
            with pytest.raises(ConfigError):
                open_store(tmp_path, make_kv())  # the disk environment is held
            gc.collect()
