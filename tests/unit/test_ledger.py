"""JobLedger: one record of submitted and finished job ids for every worker-side component."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.profiles import thorough
from tierkv.core.jobs import JobId
from tierkv.errors import ConfigError, JobTimeoutError, TransferError, UnknownJobError
from tierkv.transfer.ledger import JobLedger


def ids(*numbers: int) -> list[JobId]:
    return [JobId(number) for number in numbers]


def test_a_job_is_live_until_it_finishes_then_remembered() -> None:
    ledger: JobLedger[str] = JobLedger("test")
    ledger.add(JobId(1), "one")
    ledger.add(JobId(3), "three")
    assert ledger.record(JobId(1)) == "one" and ledger.live_ids() == [1, 3]
    assert ledger.pending(ids(1, 3)) == {1: "one", 3: "three"}
    ledger.finish(JobId(3))  # out of order
    assert ledger.is_finished(JobId(3)) and not ledger.is_finished(JobId(1))
    assert ledger.live_ids() == [1] and ledger.record(JobId(3)) is None
    assert ledger.pending(ids(1, 3)) == {1: "one"}  # finished ids are skipped
    ledger.finish(JobId(1))
    assert ledger.pending(ids(1, 3)) == {} and ledger.live_ids() == []
    assert JobId(1) in ledger and JobId(2) not in ledger


def test_unknown_and_reused_ids_raise_naming_the_component_and_the_job() -> None:
    ledger: JobLedger[None] = JobLedger("disk io")
    ledger.add(JobId(1), None)
    with pytest.raises(UnknownJobError, match="disk io: wait on job 2, which was never "
                                              "submitted .submit every pending store"):
        ledger.pending(ids(1, 2))
    for _ in range(2):  # live, then finished
        with pytest.raises(TransferError, match="disk io: job 1 was already submitted"):
            ledger.add(JobId(1), None)
        with pytest.raises(TransferError, match="already submitted"):
            ledger.check_new(JobId(1))
        ledger.finish(JobId(1))
    ledger.check_new(JobId(2))  # free: no error, nothing added
    assert JobId(2) not in ledger
    with pytest.raises(ConfigError, match="remember_finished must be >= 0"):
        JobLedger("test", remember=-1)


def test_wait_blocks_until_another_thread_finishes_and_times_out_naming_the_rest() -> None:
    ledger: JobLedger[None] = JobLedger("cpu transfer engine")
    cond = threading.Condition()
    for job_id in ids(1, 2, 3):
        ledger.add(job_id, None)
    ledger.finish(JobId(1))

    def finish_later() -> None:
        with cond:
            ledger.finish(JobId(2))
            cond.notify_all()

    threading.Timer(0.05, finish_later).start()
    with cond:
        ledger.wait(cond, ids(1, 2))  # 1 is done, 2 finishes in the other thread
        with pytest.raises(JobTimeoutError, match=r"cpu transfer engine: job\(s\) \[3\] still "
                                                  r"running after 0.01 s .wait longer") as info:
            ledger.wait(cond, ids(2, 3), timeout=0.01)
        with pytest.raises(UnknownJobError):
            ledger.wait(cond, ids(9), timeout=5)  # at once, not after the timeout
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, TransferError)


def test_dense_ids_are_remembered_by_a_floor_others_up_to_the_bound() -> None:
    """An executor sees every id of its store: those stay known however many finish. An
    engine sees only some ids: the last ``remember`` finished of them stay known."""
    ledger: JobLedger[None] = JobLedger("test", remember=4)
    for job_id in range(1, 1001):
        ledger.add(JobId(job_id), None)
    for pair in range(1, 1001, 2):  # a little out of order, as stores and spills finish
        ledger.finish(JobId(pair + 1))
        ledger.finish(JobId(pair))
    assert ledger.pending(ids(*range(1, 1001))) == {}  # every one still known as finished
    assert not ledger._finished  # by the floor alone
    sparse: JobLedger[None] = JobLedger("test", remember=4)
    for job_id in range(2, 40, 2):  # id 1 never comes: no floor to lean on
        sparse.add(JobId(job_id), None)
        sparse.finish(JobId(job_id))
    assert sparse.pending(ids(32, 34, 36, 38)) == {}  # the last four
    with pytest.raises(UnknownJobError):
        sparse.pending(ids(30))  # forgotten
    assert len(sparse._finished) == 4


@thorough(200)
@given(st.permutations(range(1, 41)), st.sets(st.integers(1, 40)), st.integers(0, 45))
def test_never_claims_an_unfinished_job_and_keeps_what_it_promises(
        finish_order: list[int], skipped: set[int], remember: int) -> None:
    """Against a plain model: what the ledger calls finished did finish; the last
    ``remember`` finished are remembered, and all of them while no more than ``remember``
    wait above the floor (the ids below the first unfinished one); memory stays bounded."""
    ledger: JobLedger[None] = JobLedger("test", remember=remember)
    submitted = [job_id for job_id in range(1, 41) if job_id not in skipped]
    for job_id in submitted:
        ledger.add(JobId(job_id), None)
    finished: list[int] = []
    most_ahead = 0
    for job_id in finish_order:
        if job_id in skipped:
            continue
        ledger.finish(JobId(job_id))
        finished.append(job_id)
        done = set(finished)
        floor = 1
        while floor in done:
            floor += 1
        most_ahead = max(most_ahead, sum(1 for other in done if other > floor))
        for other in range(0, 42):
            if ledger.is_finished(JobId(other)):
                assert other in done
        for recent in finished[len(finished) - remember:] if remember else []:
            assert ledger.is_finished(JobId(recent))
        if most_ahead <= remember:
            assert all(ledger.is_finished(JobId(other)) for other in done)
        assert len(ledger._finished) <= remember
        assert sorted(ledger.live_ids()) == sorted(set(submitted) - done)
