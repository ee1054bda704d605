"""CpuTransferEngine beyond the contract every engine keeps (test_transfer_contract.py):
one queue for both directions, the ``before_copy`` hook, a copy failing midway, the copy
thread dying, the factory.

Real CPU tensors stand in for the GPU KV cache. Async checks hold a job inside the
``before_copy`` hook, so each race window is as wide as the test needs, without sleeps
deciding the outcome.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tierkv.core.jobs import JobId, LoadSpec, StoreSpec
from tierkv.errors import BrokenError, ConfigError
from tierkv.tiers.cpu import CpuSlab
from tierkv.transfer.cpu import CpuTransferEngine
from tierkv.transfer.executor import JobExecutor
from tierkv.engine.stack import make_transfer_engine
from tests.integration.test_transfer_contract import chunk, drain, load, store
from tierkv.testing import LayoutKV
from tierkv.transfer.layout import KVLayout

LAYERS, BLOCKS, BPC = 3, 16, 4


def KV(kind: str, separate: bool = False) -> LayoutKV:
    """Per layer a logical [B, H, N, C] bfloat16 tensor in one of the four layouts."""
    return LayoutKV(kind, LAYERS, BLOCKS, (4, 2, 8), torch.bfloat16, separate)




class Gate:
    """A before_copy hook that holds chosen jobs until released, and records the order."""

    def __init__(self, hold: set[int] | None = None, fail: set[int] | None = None) -> None:
        self.hold, self.fail = hold or set(), fail or set()
        self.release = threading.Event()
        self.entered = threading.Event()
        self.seen: list[int] = []

    def __call__(self, spec: StoreSpec | LoadSpec) -> None:
        self.seen.append(spec.job_id)
        if spec.job_id in self.hold:
            self.entered.set()
            assert self.release.wait(10), "test gate never released"
        if spec.job_id in self.fail:
            raise RuntimeError(f"boom in job {spec.job_id}")


@pytest.fixture
def kv() -> KV:
    return KV("BLNHC")


def make_engine(kv: KV, gate: Gate | None = None, num_slots: int = 8) -> CpuTransferEngine:
    engine: CpuTransferEngine = kv.engine(BPC, num_slots, before_copy=gate)
    return engine


@pytest.fixture
def engine(kv: KV) -> Iterator[CpuTransferEngine]:
    engine = make_engine(kv)
    yield engine
    engine.shutdown()


def test_one_queue_completes_in_submission_order_across_directions(kv: KV) -> None:
    gate = Gate(hold={1})
    with make_engine(kv, gate) as engine:
        for job in range(1, 11):
            blocks = tuple(range(job % 4 * 4, job % 4 * 4 + 4))
            spec = chunk(job, job % 8, blocks)
            (engine.submit_store if job % 3 else engine.submit_load)(
                store(job, spec) if job % 3 else load(job, spec))
        assert gate.entered.wait(5)
        assert engine.poll_finished() == []  # job 1 holds everything behind it
        gate.release.set()
        finished = drain(engine, 10)
        assert [c.job_id for c in finished] == list(range(1, 11))
        assert all(c.ok for c in finished)


def test_a_failed_copy_is_reported_and_the_engine_goes_on(kv: KV) -> None:
    gate = Gate(fail={2})
    with make_engine(kv, gate) as engine:
        engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
        engine.submit_store(store(2, chunk(2, 1, (4, 5, 6, 7)), chunk(3, 2, (8, 9, 10, 11))))
        engine.submit_store(store(3, chunk(4, 3, (12, 13, 14, 15))))
        engine.wait([JobId(1), JobId(2), JobId(3)])
        first, failed, last = engine.poll_finished()
        assert first.ok and last.ok
        assert not failed.ok and failed.num_bytes == 0
        assert failed.error is not None and "boom in job 2" in failed.error
        assert failed.failed_keys == (bytes([2]) * 32, bytes([3]) * 32)
        assert torch.equal(engine.slab.view(3), kv.chunk((12, 13, 14, 15)))


def test_a_copy_failing_midway_names_the_chunks_that_did_not_land(
        kv: KV, engine: CpuTransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    real_gather = engine._gather

    def gather(slot: int, block_ids: tuple[int, ...]) -> None:
        if slot == 5:
            raise RuntimeError("injected copy fault")
        real_gather(slot, block_ids)

    monkeypatch.setattr(engine, "_gather", gather)
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3)), chunk(2, 5, (4, 5, 6, 7)),
                              chunk(3, 6, (8, 9, 10, 11))))
    engine.wait([JobId(1)])
    [done] = engine.poll_finished()
    assert not done.ok and done.num_bytes == LAYERS * BPC * kv.page  # the first chunk landed
    assert done.failed_keys == (bytes([2]) * 32, bytes([3]) * 32)
    assert done.error is not None and "02020202" in done.error and "injected" in done.error


def test_shutdown_runs_every_queued_job_in_order(kv: KV) -> None:
    gate = Gate(hold={1})
    engine = make_engine(kv, gate)
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    engine.submit_load(load(2, chunk(1, 0, (4, 5, 6, 7))))
    assert gate.entered.wait(5)
    assert engine.num_in_flight == 2
    threading.Timer(0.05, gate.release.set).start()
    engine.shutdown()  # returns only once both jobs ran
    assert engine.num_in_flight == 0 and gate.seen == [1, 2]
    assert torch.equal(kv.chunk((4, 5, 6, 7)), kv.chunk((0, 1, 2, 3)))  # the load ran second


def test_the_executor_names_the_jobs_in_flight_that_touch_given_blocks(kv: KV) -> None:
    gate = Gate(hold={1})
    executor = JobExecutor(make_engine(kv, gate))
    try:
        first, second = store(1, chunk(1, 0, (0, 1, 2, 3))), load(2, chunk(1, 0, (4, 5, 6, 7)))
        executor.submit(first)
        executor.submit(second)
        assert gate.entered.wait(5)
        assert executor.jobs_touching(frozenset({3})) == [1]
        assert executor.jobs_touching({5, 9}) == [2]  # a load writes its blocks
        assert executor.jobs_touching({8, 9}) == []
        assert executor.jobs_touching(None) == [1, 2]
        gate.release.set()
        executor.wait([JobId(1), JobId(2)])
        jobs = executor.poll_finished_jobs()
        assert [(c.job_id, spec) for c, spec in jobs] == [(1, first), (2, second)]  # its spec
        assert executor.jobs_touching(None) == []  # polled: done with
    finally:
        gate.release.set()
        executor.shutdown()


class _Fatal(BaseException):
    pass


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_copy_thread_fails_queued_jobs_and_refuses_more(kv: KV) -> None:
    def die(spec: StoreSpec | LoadSpec) -> None:
        if spec.job_id == 1:
            raise _Fatal("copy thread killed")

    layout = KVLayout.from_tensors(kv.tensors)
    engine = CpuTransferEngine(layout, CpuSlab(4, layout.chunk_bytes(BPC), "never"), BPC, die)
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    engine.wait([JobId(1)], timeout=5)
    [done] = engine.poll_finished()
    assert not done.ok and done.error is not None and "copy thread died" in done.error
    with pytest.raises(BrokenError, match="copy thread died"):
        engine.submit_store(store(2, chunk(1, 0, (0, 1, 2, 3))))
    engine.shutdown()


def test_factory_and_configuration_errors(kv: KV) -> None:
    layout = KVLayout.from_tensors(kv.tensors)
    slab = CpuSlab(2, layout.chunk_bytes(BPC), "never")
    engine = make_transfer_engine("auto", layout, slab, BPC)
    assert isinstance(engine, CpuTransferEngine)
    engine.make_compute_wait([])  # CPU: a host wait, nothing to wait on
    engine.shutdown()
    with pytest.raises(ConfigError, match="device must be one of"):
        make_transfer_engine("tpu", layout, slab, BPC)
    with pytest.raises(ConfigError, match="cannot hold a chunk"):
        CpuTransferEngine(layout, CpuSlab(2, layout.chunk_bytes(BPC) - 1, "never"), BPC)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA"):
            make_transfer_engine("cuda", layout, slab, BPC)


def test_the_cuda_module_imports_without_touching_cuda() -> None:
    import tierkv.transfer.cuda as cuda_module

    assert cuda_module.CudaTransferEngine.__name__ == "CudaTransferEngine"
    assert not torch.cuda.is_initialized()


@contextmanager
def disk_executor(engine: CpuTransferEngine, tmp_path: Path) -> Iterator[JobExecutor]:
    """An executor over ``engine`` and a real disk tier that holds chunk 7 (slot 0's bytes
    after a store of blocks 0-3)."""
    from tierkv.config import DiskTierConfig
    from tierkv.keys import Namespace
    from tierkv.tiers.disk.tier import DiskTier
    from tierkv.transfer.tier_io import TierIO

    size = engine.chunk_bytes
    namespace = Namespace(model_id="tiny", dtype="bfloat16", kv_layout="NHD",
                          page_bytes=size // BPC, tokens_per_chunk=16)
    with DiskTier(tmp_path, namespace, 0, DiskTierConfig(path=tmp_path), size) as tier:
        executor = JobExecutor(engine, TierIO(tier, engine.slab, 4 * size))
        try:
            executor.submit(store(1, chunk(7, 0, (0, 1, 2, 3))))
            executor.wait([JobId(1)])
            tier.put_many([(bytes([7]) * 32, engine.slab.memoryview(0)[:size])])
            executor.poll_finished()
            yield executor
        finally:
            executor.shutdown()


FROM_DISK = LoadSpec(JobId(2), (chunk(7, 1, (4, 5, 6, 7))._replace(from_disk=True),))


def test_a_chained_load_is_advanced_by_the_executor_not_by_a_reader_thread(
        kv: KV, tmp_path: Path) -> None:
    """A load from disk: the reader thread only reads into the slot; the copy to the GPU is
    submitted by the executor, on its caller's thread (it was a callback the reader ran,
    under the executor's lock). Its outcome waits until the caller polls."""
    engine = make_engine(kv)
    submitters: list[str] = []
    submit_load = engine.submit_load

    def recorded(spec: LoadSpec) -> None:
        submitters.append(threading.current_thread().name)
        submit_load(spec)

    engine.submit_load = recorded  # type: ignore[method-assign]
    with disk_executor(engine, tmp_path) as executor:
        executor.submit(FROM_DISK)
        assert executor.disk_io is not None
        executor.disk_io.wait([JobId(2)])  # read: its copy is not submitted yet
        assert submitters == []
        executor.wait([JobId(2)])
        (done,) = executor.poll_finished()
        assert done.ok and [read.tier for read in done.reads] == ["disk"]
        assert submitters == [threading.current_thread().name]
        assert torch.equal(kv.chunk((4, 5, 6, 7)), kv.chunk((0, 1, 2, 3)))


def test_a_load_whose_read_ended_is_reported_at_the_next_poll_not_one_later(
        kv: KV, tmp_path: Path) -> None:
    """The read ended before the poll: the poll starts the copy and waits for it, so the load
    is reported by this poll, as when the reader started the copy at once (before, the copy
    started in the poll that then looked past it: the load came a step late). The copy is
    held until someone waits on it, so without that wait this poll reports nothing."""
    gate = Gate(hold={2})
    engine = make_engine(kv, gate)
    wait = engine.wait

    def release_then_wait(job_ids: Iterable[JobId], timeout: float | None = None) -> None:
        gate.release.set()
        wait(job_ids, timeout)

    engine.wait = release_then_wait  # type: ignore[method-assign]
    with disk_executor(engine, tmp_path) as executor:
        executor.submit(FROM_DISK)
        assert executor.disk_io is not None
        executor.disk_io.wait([JobId(2)])  # the read ended; its copy is not submitted yet
        (done,) = executor.poll_finished()
        assert done.job_id == 2 and done.ok and [read.tier for read in done.reads] == ["disk"]
        assert torch.equal(kv.chunk((4, 5, 6, 7)), kv.chunk((0, 1, 2, 3)))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_chained_load_whose_copy_is_refused_completes_failed(
        kv: KV, tmp_path: Path) -> None:
    """The copy thread died between the load's read and its copy: the load completes, its
    chunk failed, with the copy's error (the reader thread raised it, and the load never
    completed)."""
    def die(spec: StoreSpec | LoadSpec) -> None:
        if spec.job_id == 3:
            raise _Fatal("copy thread killed")

    engine = make_engine(kv, gate=die)  # type: ignore[arg-type]
    with disk_executor(engine, tmp_path) as executor:
        executor.submit(store(3, chunk(8, 2, (8, 9, 10, 11))))
        executor.wait([JobId(3)])
        executor.submit(FROM_DISK)
        executor.wait([JobId(2)])
        done = {c.job_id: c for c in executor.poll_finished()}[JobId(2)]
        assert not done.ok and done.failed_keys == (bytes([7]) * 32,)
        assert done.error is not None and "copy thread died" in done.error
