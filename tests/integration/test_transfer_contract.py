"""The TransferEngine contract (tierkv/transfer/base.py), run against every engine.

Each test takes ``harness``: the CPU engine always, the CUDA engine where a GPU exists
(its cases are marked ``cuda`` and skip with the reason printed, see tests/conftest.py).
Engine-specific behaviour stays beside its engine: tests/integration/test_transfer_cpu.py
(the copy thread, the ``before_copy`` hook, numpy paths, the factory) and
tests/gpu/test_transfer_cuda.py (streams, events, staging batches).

Byte checks use a reference independent of the layout code (:class:`LayoutKV`: the page of
(layer, block) found by offset arithmetic on raw buffers). A race window is held open by
``harness.hold(engine)``: on the CPU a ``before_copy`` hook keeps jobs until released; on
CUDA a long kernel on both copy streams runs ahead of them (about a second, ended by
itself), so no sleep on the host decides an outcome.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from tierkv.core.jobs import NO_BLOCK, ChunkCopy, Completion, JobId, JobKind, LoadSpec, SlotId, StoreSpec
from tierkv.errors import ClosedError, JobTimeoutError, TransferError, UnknownJobError
from tierkv.testing import LayoutKV
from tierkv.transfer.base import TransferEngine

LAYERS, BLOCKS, BPC = 3, 16, 4
HOLD_CYCLES = 2_000_000_000  # CUDA: ~1 s of GPU time ahead of the held jobs

KINDS = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "LBHNC-separate"]


def chunk(key: int, slot: int, blocks: tuple[int, ...], skip: int = 0) -> ChunkCopy:
    return ChunkCopy(bytes([key]) * 32, SlotId(slot), blocks, skip_blocks=skip)


def store(job: int, *chunks: ChunkCopy) -> StoreSpec:
    return StoreSpec.of(JobId(job), chunks)


def load(job: int, *chunks: ChunkCopy) -> LoadSpec:
    return LoadSpec(JobId(job), chunks)


def submit(engine: TransferEngine, spec: StoreSpec | LoadSpec) -> None:
    if isinstance(spec, StoreSpec):
        engine.submit_store(spec)
    else:
        engine.submit_load(spec)


class Hold:
    """Jobs submitted after ``harness.hold(engine)`` do not finish before ``release()``
    (CPU) or for about a second (CUDA)."""

    def __init__(self, entered: Callable[[], bool], release: Callable[[], None]) -> None:
        self.entered, self.release = entered, release


class _Gate:
    """The CPU engine's before_copy hook: while holding, a job waits until released."""

    def __init__(self) -> None:
        self.holding = False
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self, spec: StoreSpec | LoadSpec) -> None:
        if self.holding:
            self.entered.set()
            assert self.released.wait(10), "test gate never released"


class Harness:
    """Builds one kind of engine over :class:`LayoutKV` tensors; shuts them down after."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.engines: list[TransferEngine] = []
        self._gates: dict[int, _Gate] = {}

    def kv(self, kind: str = "BLNHC") -> LayoutKV:
        """Per layer a logical [B, H, N, C] bfloat16 tensor in one of the layouts."""
        return LayoutKV(kind.split("-")[0], LAYERS, BLOCKS, (4, 2, 8), torch.bfloat16,
                        kind.endswith("separate"), device=self.device)

    def engine(self, kv: LayoutKV, num_slots: int = 8) -> TransferEngine:
        if self.device == "cuda":
            engine: TransferEngine = kv.engine(BPC, num_slots, staging_chunks=4)
        else:
            gate = _Gate()
            engine = kv.engine(BPC, num_slots, before_copy=gate)
            self._gates[id(engine)] = gate
        self.engines.append(engine)
        return engine

    def hold(self, engine: TransferEngine) -> Hold:
        if self.device == "cuda":
            for direction in (engine._store, engine._load):  # type: ignore[attr-defined]
                with torch.cuda.stream(direction.stream):
                    torch.cuda._sleep(HOLD_CYCLES)
            return Hold(lambda: True, lambda: None)
        gate = self._gates[id(engine)]
        gate.holding = True
        return Hold(lambda: gate.entered.wait(5), gate.released.set)

    def close(self) -> None:
        for gate in self._gates.values():
            gate.released.set()
        for engine in self.engines:
            engine.shutdown()
        if self.device == "cuda":
            torch.cuda.synchronize()  # no CUDA error leaks into the next test


@pytest.fixture(params=[pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    made = Harness(request.param)
    yield made
    made.close()


@pytest.fixture
def kv(harness: Harness) -> LayoutKV:
    return harness.kv()


@pytest.fixture
def engine(harness: Harness, kv: LayoutKV) -> TransferEngine:
    return harness.engine(kv)


def drain(engine: TransferEngine, count: int) -> list[Completion]:
    finished: list[Completion] = []
    deadline = time.monotonic() + 10
    while len(finished) < count and time.monotonic() < deadline:
        finished.extend(engine.poll_finished())
        time.sleep(0.001)
    return finished


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_byte_exact(harness: Harness, kind: str) -> None:
    kv = harness.kv(kind)
    engine = harness.engine(kv)
    # (0, 1, 2, 3): one run of blocks; (9, 4, 12, 6): scattered
    engine.submit_store(store(1, chunk(1, 3, (0, 1, 2, 3)), chunk(2, 1, (9, 4, 12, 6))))
    engine.wait([JobId(1)])
    [done] = engine.poll_finished()
    chunk_bytes = LAYERS * BPC * kv.page
    assert done.ok and done.num_bytes == 2 * chunk_bytes and done.seconds > 0
    assert done.kind is JobKind.STORE  # a completion says what kind of job it was
    assert torch.equal(engine.slab.view(3), kv.chunk((0, 1, 2, 3)))
    assert torch.equal(engine.slab.view(1), kv.chunk((9, 4, 12, 6)))
    stored = [kv.chunk((0, 1, 2, 3)), kv.chunk((9, 4, 12, 6))]
    untouched = kv.chunk((13,)).clone()

    # (14, 15, 7, 8): two runs; (12, 5, 10, 0): scattered
    engine.submit_load(load(2, chunk(1, 3, (14, 15, 7, 8)), chunk(2, 1, (12, 5, 10, 0))))
    engine.wait([JobId(2)])
    [done] = engine.poll_finished()
    assert done.ok and done.num_bytes == 2 * chunk_bytes and done.kind is JobKind.LOAD
    assert torch.equal(kv.chunk((14, 15, 7, 8)), stored[0])
    assert torch.equal(kv.chunk((12, 5, 10, 0)), stored[1])
    assert torch.equal(kv.chunk((13,)), untouched)


@pytest.mark.parametrize("targets", [(8, 9, 10, 11), (8, 13, 10, 15)],
                         ids=["consecutive-copy_", "scattered-numpy"])
def test_load_leaves_skipped_blocks_untouched(kv: LayoutKV, engine: TransferEngine,
                                              targets: tuple[int, ...]) -> None:
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    engine.wait([JobId(1)])
    kept = kv.chunk(targets[:1]).clone()
    engine.submit_load(load(2, chunk(1, 0, targets, skip=1)))
    engine.wait([JobId(2)])
    done = drain(engine, 2)[-1]
    assert done.job_id == 2
    assert done.ok and done.num_bytes == 3 * LAYERS * kv.page  # only the written blocks
    assert torch.equal(kv.chunk(targets[:1]), kept)  # the engine's local prefix: not written
    for layer in range(LAYERS):
        for source, target in zip((1, 2, 3), targets[1:]):
            assert torch.equal(kv.page_at(layer, target).cpu(), kv.page_at(layer, source).cpu())


@pytest.mark.parametrize("targets", [(NO_BLOCK, 9, NO_BLOCK, 11), (8, 9, NO_BLOCK, NO_BLOCK),
                                     (NO_BLOCK, 13, 10, NO_BLOCK)],
                         ids=["alternating", "tail", "middle"])
def test_load_leaves_no_block_positions_untouched(kv: LayoutKV, engine: TransferEngine,
                                                  targets: tuple[int, ...]) -> None:
    # A hybrid model's sliding-window group holds no block before its window: a load
    # writes the other positions of the chunk, in as many runs as they make, and twice
    # in a row (the CUDA engine batches chunks that write the same positions).
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3)), chunk(2, 1, (0, 1, 2, 3))))
    engine.wait([JobId(1)])
    second = tuple(b if b == NO_BLOCK else b - 4 for b in targets)  # blocks 4..7
    others = [b for b in range(4, BLOCKS) if b not in targets + second]
    kept = {b: kv.chunk((b,)).clone() for b in others}
    engine.submit_load(load(2, chunk(1, 0, targets), chunk(2, 1, second)))
    engine.wait([JobId(2)])
    done = drain(engine, 2)[-1]
    written = sum(b != NO_BLOCK for b in targets)
    assert done.job_id == 2 and done.ok, done.error
    assert done.num_bytes == 2 * written * LAYERS * kv.page
    for layer in range(LAYERS):
        for source, target in [*enumerate(targets), *enumerate(second)]:
            if target != NO_BLOCK:
                assert torch.equal(kv.page_at(layer, target).cpu(), kv.page_at(layer, source).cpu())
    for block in others:
        assert torch.equal(kv.chunk((block,)), kept[block]), block


def test_a_store_of_a_missing_page_fails_its_job(engine: TransferEngine) -> None:
    submit(engine, store(1, chunk(1, 0, (0, NO_BLOCK, 2, 3))))
    engine.wait([JobId(1)])
    [done] = drain(engine, 1)
    assert not done.ok and done.error is not None and "block id -1 out of range" in done.error


def test_submit_returns_before_the_copy_finishes(harness: Harness, kv: LayoutKV,
                                                 engine: TransferEngine) -> None:
    hold = harness.hold(engine)
    started = time.monotonic()
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    assert time.monotonic() - started < 0.5  # returned while the copy is held
    assert hold.entered()
    assert engine.poll_finished() == []  # in flight: nothing finished yet
    assert not engine.slab.view(0).any()  # and the slot is not written yet
    with pytest.raises(JobTimeoutError, match="job\\(s\\) \\[1\\] still running after 0.05 s") \
            as timed_out:
        engine.wait([JobId(1)], timeout=0.05)
    assert isinstance(timed_out.value, TimeoutError) and "transfer engine" in str(timed_out.value)
    hold.release()
    engine.wait([JobId(1)])  # now it finishes
    assert torch.equal(engine.slab.view(0), kv.chunk((0, 1, 2, 3)))
    assert [c.job_id for c in engine.poll_finished()] == [1]
    assert engine.poll_finished() == []  # exactly once


def test_wait_blocks_until_the_job_finished(harness: Harness, kv: LayoutKV,
                                            engine: TransferEngine) -> None:
    hold = harness.hold(engine)
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    assert hold.entered()
    threading.Timer(0.05, hold.release).start()
    engine.wait([JobId(1)])
    assert torch.equal(engine.slab.view(0), kv.chunk((0, 1, 2, 3)))
    assert [c.job_id for c in engine.poll_finished()] == [1]  # still returned by poll


def test_completions_are_fifo_per_direction_with_failures_among_them(
        harness: Harness, engine: TransferEngine) -> None:
    hold = harness.hold(engine)
    for job in range(1, 11):
        blocks = tuple(range(job % 4 * 4, job % 4 * 4 + 4))
        spec = chunk(job, job % 8, blocks)
        submit(engine, store(job, spec) if job % 3 else load(job, spec))
    submit(engine, store(11, chunk(11, 99, (0, 1, 2, 3))))  # cannot run: fails in its turn
    submit(engine, load(12, chunk(12, 0, (0, 1, 2, 3))))
    assert hold.entered()
    assert engine.poll_finished() == []  # all held behind the first jobs
    hold.release()
    finished = drain(engine, 12)
    stores = [c.job_id for c in finished if c.job_id % 3 and c.job_id != 12]
    loads = [c.job_id for c in finished if not c.job_id % 3 or c.job_id == 12]
    assert stores == [1, 2, 4, 5, 7, 8, 10, 11]  # each direction in submission order
    assert loads == [3, 6, 9, 12]
    by_id = {c.job_id: c for c in finished}
    assert all(by_id[job].ok for job in range(1, 11)) and by_id[12].ok
    failed = by_id[11]
    assert not failed.ok and failed.error is not None and "slot 99 out of range" in failed.error


def test_wait_on_a_job_never_submitted_raises(harness: Harness, engine: TransferEngine) -> None:
    hold = harness.hold(engine)
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    with pytest.raises(UnknownJobError, match="job 2, which was never submitted"):
        engine.wait([JobId(1), JobId(2)])  # at once, though job 1 is held
    with pytest.raises(UnknownJobError, match="transfer engine: wait on job 42"):
        engine.wait([JobId(42)])
    hold.release()
    engine.wait([JobId(1)])
    assert [c.job_id for c in engine.poll_finished()] == [1]
    engine.wait([JobId(1)])  # polled: finished, returns at once
    with pytest.raises(TransferError, match="already submitted"):
        engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))


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
def test_a_spec_that_cannot_run_fails_its_job(engine: TransferEngine,
                                              spec: StoreSpec | LoadSpec, message: str) -> None:
    submit(engine, spec)  # not raised: the job completes with ok=False
    engine.wait([spec.job_id])
    [done] = drain(engine, 1)
    assert not done.ok and done.error is not None and message in done.error
    assert set(done.failed_keys) == {c.key for c in spec.chunks} and done.kind is spec.kind


def test_concurrent_submits_from_threads(harness: Harness, kv: LayoutKV) -> None:
    engine = harness.engine(kv, num_slots=64)
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


def test_shutdown_waits_for_jobs_in_flight_and_is_idempotent(
        harness: Harness, kv: LayoutKV, engine: TransferEngine) -> None:
    loaded = kv.chunk((8, 9, 10, 11))
    engine.slab.view(1).copy_(loaded)  # the two directions need not run in order: no overlap
    hold = harness.hold(engine)
    engine.submit_store(store(1, chunk(1, 0, (0, 1, 2, 3))))
    engine.submit_load(load(2, chunk(2, 1, (4, 5, 6, 7))))
    assert hold.entered()
    threading.Timer(0.05, hold.release).start()
    engine.shutdown()  # returns only once both jobs ran
    assert [c.job_id for c in engine.poll_finished()] == [1, 2]  # all done, still polled after
    engine.shutdown()
    with pytest.raises(ClosedError, match="after shutdown"):
        engine.submit_store(store(3, chunk(1, 0, (0, 1, 2, 3))))
    engine.wait([JobId(1), JobId(2)])  # finished before the shutdown: returns at once
    assert torch.equal(engine.slab.view(0), kv.chunk((0, 1, 2, 3)))
    assert torch.equal(kv.chunk((4, 5, 6, 7)), loaded)
