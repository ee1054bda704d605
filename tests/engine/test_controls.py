"""Per-request controls on the real engine, in one engine start: ``kv_transfer_params``
with tierkv's ``skip_store``, ``skip_load`` and ``load_deadline_ms``, vLLM's own
``kv_load_tiers``, and a value tierkv does not understand (the request is served without
the cache, and says why), under the example of an operator's own load_policy. Greedy
tokens equal vLLM alone in every case.

The deadline's load reads from disk, and the disk answers no read until the test says so
(no wall clock): the request is served by recomputing, and the chunks land in the CPU tier
afterwards, where the next request loads them."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from tests.engine.conftest import References
from tests.engine.engines import Engine, prompt

SETTINGS = {"cpu_bytes": 2 << 20,  # 4 chunks of the tiny llama (512 KiB each)
            # The operator's own policy (its example loads every local chunk, as "always").
            "load_policy": "tierkv.engine.example_load_policy:LocalFirst",
            "load_deadline_ms": 600_000.0,
            "eviction_policy": "lru"}  # the fillers below evict the prompt's chunks


class Heard(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_each_control_of_a_request(models: dict[str, Path], reference: References,
                                   tmp_path: Path) -> None:
    tokens = prompt(300, seed=45)  # 2 whole chunks of 128 tokens: a hit of 256
    fillers = [prompt(300, seed=seed) for seed in (46, 47, 48)]
    [ref] = reference("llama", [tokens])
    with Engine(models["llama"], tierkv={**SETTINGS, "disk_path": str(tmp_path / "kv")}) \
            as engine:
        def run(params: dict[str, Any] | None, cached: int, what: str) -> None:
            output = engine.one(tokens, transfer_params=params)
            assert output.tokens == ref.tokens, what
            assert output.num_cached_tokens == cached, what

        policy = engine.connector._scheduler_side().adapter.policy.custom
        assert type(policy).__name__ == "LocalFirst"
        run({"tierkv": {"skip_store": True}}, 0, "skip_store")
        run(None, 0, "after skip_store: nothing was stored")
        run({"tierkv": {"skip_load": True}}, 0, "skip_load")
        run({"kv_load_tiers": [{"medium": "storage"}]}, 0, "kv_load_tiers: storage only")
        heard = Heard()  # tierkv's logger does not propagate under vLLM (follow_vllm_logging)
        logging.getLogger("tierkv.vllm").addHandler(heard)
        try:
            run({"kv_load_tiers": ["nvme"]}, 0, "kv_load_tiers not understood")
        finally:
            logging.getLogger("tierkv.vllm").removeHandler(heard)
        assert any("served without tierkv's cache" in line and "kv_load_tiers" in line
                   for line in heard.lines)
        run({"kv_load_tiers": [{"medium": "cpu", "locality": "local"}]}, 256, "CPU only")

        # The deadline: the chunks leave the CPU tier (on disk: write-through), then the
        # disk holds its reads back and the request asks for 50 ms.
        engine.settle()
        for filler in fillers:
            engine.one(filler)
            engine.settle()
        worker = engine.worker()._worker
        disk, gate = worker._stack.disk, threading.Event()
        read_many_into = disk.read_many_into  # the I/O threads' reads

        def gated(items: Any) -> Any:
            gate.wait()
            return read_many_into(items)

        disk.read_many_into = gated
        try:
            output = engine.one(tokens, transfer_params={"tierkv": {"load_deadline_ms": 50}})
        finally:
            gate.set()
        assert output.tokens == ref.tokens, "load_deadline_ms"
        assert worker.worker.loads_cut == 1
        figures = engine.figures()
        assert figures["hit_tokens_disk"] == 256 and figures["loads_failed"] == 0
        engine.settle()  # the cut load's reads land in the CPU tier
        run(None, 256, "after the cut: the chunks are in the CPU tier")
        assert engine.figures()["hit_tokens_cpu"] == 2 * 256
