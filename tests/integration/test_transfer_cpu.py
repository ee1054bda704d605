"""CpuTransferEngine with real CPU tensors standing in for the GPU KV cache.

Byte checks use a reference independent of the layout code: the KV tensors are views over
raw uint8 buffers and the page of (layer, block) is found by offset arithmetic. Async
checks hold a job inside the ``before_copy`` hook, so each race window is as wide as the
test needs, without sleeps deciding the outcome.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from tierkv.core.jobs import ChunkCopy, Completion, JobId, LoadSpec, SlotId, StoreSpec
from tierkv.errors import (
    BrokenError,
    ClosedError,
    ConfigError,
    JobTimeoutError,
    TransferError,
    UnknownJobError,
)
from tierkv.tiers.cpu import CpuSlab
from tierkv.transfer.cpu import CpuTransferEngine
from tierkv.transfer.factory import make_transfer_engine
from tierkv.testing import LayoutKV
from tierkv.transfer.layout import KVLayout

LAYERS, BLOCKS, BPC = 3, 16, 4


def KV(kind: str, separate: bool = False) -> LayoutKV:
    """Per layer a logical [B, H, N, C] bfloat16 tensor in one of the four layouts."""
    return LayoutKV(kind, LAYERS, BLOCKS, (4, 2, 8), torch.bfloat16, separate)

def chunk(key: int, slot: int, blocks: tuple[int, ...], skip: int = 0) -> ChunkCopy:
    return ChunkCopy(bytes([key]) * 32, SlotId(slot), blocks, skip_blocks=skip)


def store(job: int, *chunks: ChunkCopy) -> StoreSpec:
    return StoreSpec.of(JobId(job), chunks)


def load(job: int, *chunks: ChunkCopy) -> LoadSpec:
    return LoadSpec(JobId(job), chunks)


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
    layout = KVLayout.from_tensors(kv.tensors)
    slab = CpuSlab(num_slots, layout.chunk_bytes(BPC), pin_memory="never")
    slab.tensor.zero_()
    return CpuTransferEngine(layout, slab, BPC, before_copy=gate)


@pytest.fixture
def engine(kv: KV) -> Iterator[CpuTransferEngine]:
    engine = make_engine(kv)
    yield engine
    engine.shutdown()


def drain(engine: CpuTransferEngine, count: int) -> list[Completion]:
    finished: list[Completion] = []
    deadline = time.monotonic() + 10
    while len(finished) < count and time.monotonic() < deadline:
        finished.extend(engine.poll_finished())
        time.sleep(0.001)
    return finished


@pytest.mark.parametrize("kind", ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "LBHNC-separate"])
def test_round_trip_is_byte_exact(kind: str) -> None:
    kv = KV(kind.split("-")[0], separate=kind.endswith("separate"))
    with make_engine(kv) as engine:
        # (0, 1, 2, 3): one run, copied by slices; (9, 4, 12, 6): scattered, index_select
        engine.submit_store(store(1, chunk(1, 3, (0, 1, 2, 3)), chunk(2, 1, (9, 4, 12, 6))))
        engine.wait([JobId(1)])
        [done] = engine.poll_finished()
        chunk_bytes = LAYERS * BPC * kv.page
        assert done.ok and done.num_bytes == 2 * chunk_bytes and done.seconds > 0
        assert torch.equal(engine.slab.view(3), kv.chunk((0, 1, 2, 3)))
        assert torch.equal(engine.slab.view(1), kv.chunk((9, 4, 12, 6)))
        stored = [kv.chunk((0, 1, 2, 3)), kv.chunk((9, 4, 12, 6))]
        untouched = kv.chunk((13,)).clone()

        # (14, 15, 7, 8): two runs, slices; (12, 5, 10, 0): scattered, fancy assignment
        engine.submit_load(load(2, chunk(1, 3, (14, 15, 7, 8)), chunk(2, 1, (12, 5, 10, 0))))
        engine.wait([JobId(2)])
        [done] = engine.poll_finished()
        assert done.ok and done.num_bytes == 2 * chunk_bytes
        assert torch.equal(kv.chunk((14, 15, 7, 8)), stored[0])
        assert torch.equal(kv.chunk((12, 5, 10, 0)), stored[1])
        assert torch.equal(kv.chunk((13,)), untouched)


@pytest.mark.parametrize("targets", [(8, 9, 10, 11), (8, 13, 10, 15)],
                         ids=["consecutive-copy_", "scattered-numpy"])
def test_load_leaves_skipped_blocks_untouched(kv: KV, engine: CpuTransferEngine,
                                              targets: tuple[int, ...]) -> None:
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    engine.wait([JobId(1)])
    kept = kv.chunk(targets[:1]).clone()
    engine.submit_load(load(2, chunk(1, 0, targets, skip=1)))
    engine.wait([JobId(2)])
    done = engine.poll_finished()[-1]
    assert done.ok and done.num_bytes == 3 * LAYERS * kv.page  # only the written blocks
    assert torch.equal(kv.chunk(targets[:1]), kept)  # the engine's local prefix: not written
    for layer in range(LAYERS):
        for source, target in zip((1, 2, 3), targets[1:]):
            assert torch.equal(kv.page_at(layer, target), kv.page_at(layer, source))


def test_submit_returns_before_the_copy_finishes(kv: KV) -> None:
    gate = Gate(hold={1})
    with make_engine(kv, gate) as engine:
        started = time.monotonic()
        engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
        assert time.monotonic() - started < 1.0  # returned while the copy is held
        assert gate.entered.wait(5)
        assert engine.poll_finished() == []  # in flight: nothing finished yet
        assert not engine.slab.view(0).any()  # and the slot is not written yet
        with pytest.raises(JobTimeoutError, match="still running"):
            engine.wait([JobId(1)], timeout=0.05)
        gate.release.set()
        engine.wait([JobId(1)])  # now it finishes
        assert torch.equal(engine.slab.view(0), kv.chunk((0, 1, 2, 3)))
        assert [c.job_id for c in engine.poll_finished()] == [1]
        assert engine.poll_finished() == []  # exactly once


def test_wait_blocks_until_the_job_finished(kv: KV) -> None:
    gate = Gate(hold={1})
    with make_engine(kv, gate) as engine:
        engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
        assert gate.entered.wait(5)
        threading.Timer(0.05, gate.release.set).start()
        engine.wait([JobId(1)])
        assert torch.equal(engine.slab.view(0), kv.chunk((0, 1, 2, 3)))
        assert [c.job_id for c in engine.poll_finished()] == [1]  # still returned by poll


def test_polling_is_fifo(kv: KV) -> None:
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


def test_wait_on_a_job_never_submitted_raises(engine: CpuTransferEngine) -> None:
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    with pytest.raises(UnknownJobError, match="job 2, which was never submitted"):
        engine.wait([JobId(1), JobId(2)])
    engine.wait([JobId(1)])
    assert [c.job_id for c in engine.poll_finished()] == [1]
    engine.wait([JobId(1)])  # polled: finished, returns at once
    with pytest.raises(TransferError, match="already submitted"):
        engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))


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


def test_a_store_of_chunks_with_uneven_block_counts_cannot_be_built() -> None:
    # Flat block ids cannot tell a 3-block chunk and a 1-block chunk from two 2-block ones:
    # the second key would be stored with the first chunk's last block.
    with pytest.raises(ValueError, match=r"\[1, 3\] block ids"):
        store(1, chunk(1, 0, (0, 1, 2)), chunk(2, 1, (3,)))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (store(1, chunk(1, 0, (0, 1, 2))), "has 3 block ids"),
        (store(1, chunk(1, 0, (0, 1, 2, 99))), "block id 99 out of range"),
        (store(1, chunk(1, 8, (0, 1, 2, 3))), "slot 8 out of range"),
        (store(1, chunk(1, 2, (0, 1, 2, 3)), chunk(2, 2, (4, 5, 6, 7))), "stored twice"),
        (load(1, chunk(1, 0, (0, 1, 2, 3)), chunk(2, 1, (3, 4, 5, 6))), "writes some block twice"),
        (load(1, chunk(1, 0, (0, 1, 2, 3), skip=5)), "skip_blocks 5"),
    ],
)
def test_a_spec_that_cannot_run_fails_its_job(engine: CpuTransferEngine,
                                              spec: StoreSpec | LoadSpec, message: str) -> None:
    if isinstance(spec, StoreSpec):
        engine.submit_store(spec)
    else:
        engine.submit_load(spec)
    engine.wait([spec.job_id])
    [done] = engine.poll_finished()
    assert not done.ok and done.error is not None and message in done.error
    assert set(done.failed_keys) == {c.key for c in spec.chunks}


def test_concurrent_submits_from_threads(kv: KV) -> None:
    engine = make_engine(kv, num_slots=64)
    threads_n, jobs_n = 4, 16
    errors: list[BaseException] = []

    def submitter(thread: int) -> None:
        try:
            for index in range(jobs_n):
                job = thread * 100 + index + 1
                slot = thread * jobs_n + index
                blocks = tuple((slot + step) % BLOCKS for step in range(BPC))
                engine.submit_store(store(job, chunk(slot % 250, slot, blocks)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    engine.wait([JobId(t * 100 + i + 1) for t in range(threads_n) for i in range(jobs_n)])
    finished = drain(engine, threads_n * jobs_n)
    engine.shutdown()
    assert len(finished) == threads_n * jobs_n and all(c.ok for c in finished)
    for thread in range(threads_n):  # each thread's jobs in its submission order
        mine = [c.job_id for c in finished if c.job_id // 100 == thread]
        assert mine == sorted(mine)
    for slot in range(threads_n * jobs_n):
        blocks = tuple((slot + step) % BLOCKS for step in range(BPC))
        assert torch.equal(engine.slab.view(slot), kv.chunk(blocks))


def test_shutdown_waits_for_jobs_in_flight_and_is_idempotent(kv: KV) -> None:
    gate = Gate(hold={1})
    engine = make_engine(kv, gate)
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    engine.submit_load(load(2, chunk(1, 0, (4, 5, 6, 7))))
    assert gate.entered.wait(5)
    threading.Timer(0.05, gate.release.set).start()
    engine.shutdown()  # returns only once both jobs ran
    assert engine.num_in_flight == 0
    engine.shutdown()
    with pytest.raises(ClosedError, match="after shutdown"):
        engine.submit_store(store(3, chunk(1, 0, (0, 1, 2, 3))))
    assert [c.job_id for c in engine.poll_finished()] == [1, 2]  # still polled after
    assert torch.equal(kv.chunk((4, 5, 6, 7)), kv.chunk((0, 1, 2, 3)))


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
