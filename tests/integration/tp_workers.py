"""Tensor parallelism with each rank's worker role in a process of its own, as vLLM's
multiprocess executor runs them: the scheduler process keeps the real Scheduler and the
connector's scheduler role; every step's ``SchedulerOutput`` (with tierkv's metadata) is
pickled to each rank's process, each rank runs the fake forward (exact KV checks of every
earlier slot of its own heads) around its worker connector, and the ranks' pickled
``ModelRunnerOutput`` come back to vLLM's ``KVOutputAggregator`` (``world_size`` ranks),
which hands one output to the scheduler.

Each rank holds ``num_kv_heads / tp`` heads, and its KV values are salted with its rank, so a
chunk that reached another rank's slots fails the check.
"""

from __future__ import annotations

import traceback
from copy import deepcopy
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from .. import forkserver
from . import vllm_harness as harness_lib

forkserver.preload("tests.integration.tp_workers")  # vLLM and the harness, imported once

STEP_TIMEOUT_SECONDS = 120.0


def _rank_main(conn: Connection, cfg: harness_lib.HarnessConfig, model_dir: str, rank: int) -> None:
    try:
        vllm_config = harness_lib.build_vllm_config(cfg, Path(model_dir))
        vllm_config.parallel_config.rank = rank
        kv_cache_config, layout = harness_lib.build_kv_cache_config(cfg, vllm_config)
        connector = harness_lib.create_connector(vllm_config, KVConnectorRole.WORKER,
                                                 deepcopy(kv_cache_config))
        # MLA ranks hold the same latent KV; other ranks hold their own heads.
        runner = harness_lib.FakeModelRunner(cfg, vllm_config, kv_cache_config, layout,
                                             connector=connector, rank=0 if cfg.mla else rank)
        conn.send(("ready", rank))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        message = conn.recv()
        try:
            if message[0] == "step":
                output = runner.execute_model(message[1])
                conn.send(("ok", output, runner.num_checked_slots))
            else:  # shutdown: drain, flush unspilled chunks to disk, stop threads
                side = connector._worker  # type: ignore[attr-defined]
                flushed = side.shutdown() if side is not None else 0
                conn.send(("ok", flushed, runner.num_checked_slots))
                return
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            return


class ProcessRanks:
    """Stands in for the harness's runner: ``execute_model`` runs the step on every rank's
    process and returns the aggregated output."""

    def __init__(self, harness: harness_lib.Harness, model_dir: Path) -> None:
        cfg = harness.cfg
        tp = cfg.tensor_parallel_size
        context = forkserver.context()  # a rank starts in ms, not seconds
        self.pipes: list[Connection] = []
        self.processes: list[Any] = []
        rank_cfg = replace(cfg, create_worker_connector=True)
        for rank in range(tp):
            ours, theirs = context.Pipe()
            process = context.Process(target=_rank_main, args=(theirs, rank_cfg, str(model_dir), rank),
                                      daemon=True, name=f"tierkv-tp-rank-{rank}")
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)
        for conn in self.pipes:
            self._answer(conn)
        connector = harness.scheduler_connector
        assert connector is not None
        self.aggregator = KVOutputAggregator.from_connector(connector, world_size=tp)
        self.num_checked_slots = 0
        self.flushed = 0
        self.pids = [process.pid for process in self.processes]

    def _answer(self, conn: Connection) -> Any:
        if not conn.poll(STEP_TIMEOUT_SECONDS):
            raise harness_lib.HarnessError("a rank's process did not answer")
        reply = conn.recv()
        if reply[0] == "error":
            raise harness_lib.HarnessError(f"a rank's process failed:\n{reply[1]}")
        return reply

    def execute_model(self, so: Any) -> Any:
        for conn in self.pipes:
            conn.send(("step", so))  # pickled, as the executor's broadcast does
        replies = [self._answer(conn) for conn in self.pipes]
        self.num_checked_slots = sum(reply[2] for reply in replies)
        aggregated = self.aggregator.aggregate([reply[1] for reply in replies])
        assert aggregated is not None
        return aggregated

    def shutdown(self) -> None:
        try:
            for conn in self.pipes:
                conn.send(("shutdown",))
            # Chunks the ranks wrote to disk at shutdown (counted once: rank 0's, under MLA).
            self.flushed = max(self._answer(conn)[1] for conn in self.pipes)
        finally:
            for process in self.processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
