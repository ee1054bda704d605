"""Misuse fails loudly, at once, with a tierkv error that says what to do, and changes
nothing; a failed construction leaves nothing behind. Before these fixes: a second writer
process broke the first one's disk tier for good, 16-byte keys failed a later unrelated
``wait()``, block ids as numpy arrays raised raw ``ValueError``/``TypeError`` (and floats
were truncated), threads got wrong bytes silently, failed constructions leaked threads and
environments, and write sequences repeated.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.reliability import support
from tierkv.errors import ConfigError, TierKVError, TransferError, UnknownJobError, UsageError
from tierkv.tiers.disk.tier import SHARDS, DiskTier


def _tierkv_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("tierkv")}


def _second_store(root: str, queue: Any) -> None:
    try:
        support.open_store(Path(root)).close()
        queue.put("opened")
    except TierKVError as exc:
        queue.put(f"{type(exc).__name__}: {exc}")


def test_a_second_writer_process_is_refused_and_the_first_goes_on(tmp_path: Path) -> None:
    import os

    kv = support.make_kv()
    keys = support.request_keys(1)
    with support.open_store(tmp_path, kv) as store:
        context = support.forkserver()
        queue = context.Queue()
        child = context.Process(target=_second_store, args=(str(tmp_path), queue))
        child.start()
        answer = queue.get(timeout=60)
        child.join(60)
        assert answer.startswith("ConfigError") and f"process {os.getpid()}" in answer, answer
        with pytest.raises(ConfigError, match="in use by this process"):  # same process too
            support.open_store(tmp_path)
        support.store_chunks(store, kv, keys)
        assert store.lookup(keys) == len(keys)
    support.open_store(tmp_path).close()  # released at close


def _grow(root: str, rounds: int) -> None:
    """Another process (an operator tool, a scheduler-side scan) with a much larger cap
    writes enough to grow data.mdb past the first process's map."""
    config = support.store_config(Path(root), disk_chunks=4096).disk
    with DiskTier(Path(root), support.namespace_of(), support.part(0), config, support.CHUNK_BYTES) as tier:
        for start in range(0, rounds, 16):
            tier.put_many([(support.pool_key(i, b"grow"), support.payload_for(support.pool_key(i, b"grow")))
                           for i in range(start, start + 16)])


def test_a_map_grown_by_another_process_is_adopted(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process (an operator tool, a warm-up) writes while this one holds the tier
    open; its index grows data.mdb past this process's map, which is
    adopted (format 4's map holds the index only, so this process's map is shrunk to
    64 KiB per shard here, at tierkv's own boundary, for a few hundred entries to pass it)."""
    from tierkv.tiers.disk import tier as disk_module

    config = support.store_config(tmp_path, disk_chunks=4096).disk
    size = support.CHUNK_BYTES
    monkeypatch.setattr(disk_module, "map_size_for", lambda *args: 64 << 10)
    with DiskTier(tmp_path, support.namespace_of(), support.part(0), config, size) as tier:
        child = support.forkserver().Process(target=_grow, args=(str(tmp_path), 1200))
        child.start()
        child.join(120)
        assert child.exitcode == 0
        grown = max(path.stat().st_size for path in support.data_files(tier.path))
        assert grown > tier.map_size // SHARDS  # a shard grown past our map of it
        out = memoryview(bytearray(size))
        theirs = [support.pool_key(i, b"grow") for i in range(0, 1200, 97)]
        for key in theirs:  # was BrokenError (MDB_MAP_RESIZED) for good
            assert tier.read_into(key, out).name == "OK" and bytes(out) == support.payload_for(key)
        more = [support.pool_key(i, b"more") for i in range(4)]
        assert tier.put_many([(key, support.payload_for(key)) for key in more]).written == tuple(more)
        assert tier.statistics().map_adopted >= 1
        for key in [*more, *theirs]:  # the new slots took none of the other process's
            assert tier.read_into(key, out).name == "OK" and bytes(out) == support.payload_for(key)


def test_failed_constructions_release_threads_slab_and_environment(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    before = _tierkv_threads()
    kv = support.make_kv()
    with support.open_store(tmp_path, kv, rank=0) as store:
        support.store_chunks(store, kv, support.request_keys(2))
    import os

    os.chmod(tmp_path, 0o777)  # a root others can write: refused
    for _ in range(20):
        with pytest.raises(ConfigError):
            support.open_store(tmp_path, rank=0)
    os.chmod(tmp_path, 0o700)
    assert _tierkv_threads() == before  # 20 failed opens left 20 copy threads
    from tierkv.errors import BrokenError

    def fail(*args: object, **kwargs: object) -> object:
        raise BrokenError("injected: the disk tier fails during the start-up scan")

    monkeypatch.setattr(DiskTier, "scan", fail)  # late: after threads and slab exist
    for _ in range(5):
        with pytest.raises(BrokenError, match="injected"):
            support.open_store(tmp_path, rank=0)
    assert _tierkv_threads() == before
    monkeypatch.undo()
    with support.open_store(tmp_path, rank=0) as store:  # was "already open in this process"
        assert store.disk is not None


@pytest.mark.parametrize("bad", [b"\x01" * 16, "k" * 32, bytearray(32), b"\x01" * 33, 7, None])
def test_bad_keys_are_refused_at_the_call_and_change_nothing(tmp_path: Path, bad: Any) -> None:
    before = _tierkv_threads()
    kv = support.make_kv()
    store = support.open_store(tmp_path, kv, cpu_chunks=4)
    good = support.request_keys(3)
    for call in (lambda: store.store([good[0], bad], [support.chunk_blocks(0), support.chunk_blocks(1)]),
                 lambda: store.lookup([bad]), lambda: store.load([bad], [support.chunk_blocks(0)])):
        with pytest.raises(UsageError, match="32 bytes|sequence"):
            call()
    assert store.statistics().index.stores_planned == 0
    for seed in range(4):  # spills happen afterwards without a late error
        support.store_chunks(store, kv, support.request_keys(10 + seed))
    store.wait([])
    store.poll()
    store.close()
    assert _tierkv_threads() == before


def test_block_ids_as_numpy_or_tensors_work_and_floats_are_refused(tmp_path: Path) -> None:
    kv = support.make_kv()
    keys = support.request_keys(4, num_chunks=2)
    with support.open_store(tmp_path, kv) as store:
        for position, key in enumerate(keys):
            support.fill_chunk(kv, key, support.chunk_blocks(position))
        flat = list(range(2 * support.BPC))
        for bad in ([float(b) for b in flat], [True] * len(flat), np.array(flat, dtype=np.float32),
                    torch.tensor(flat, dtype=torch.float32), [[1.5] * support.BPC] * 2, "abcdefgh"):
            with pytest.raises(UsageError, match="block id"):
                store.store(keys, bad)  # type: ignore[arg-type]
        assert store.statistics().index.stores_planned == 0
        job = store.store(keys, np.array(flat, dtype=np.int64))
        store.wait([job])
        assert store.lookup(keys) == 2
        for blocks in (np.arange(32, 32 + 2 * support.BPC).reshape(2, support.BPC),
                       torch.arange(40, 40 + 2 * support.BPC),
                       [np.int64(b) for b in range(48, 48 + 2 * support.BPC)]):
            handle = store.load(keys, blocks)  # type: ignore[arg-type]
            store.wait([np.int64(handle.job_id)])  # type: ignore[list-item]
            assert all(c.ok for c in store.poll())
            first = int(np.asarray(blocks).reshape(-1)[0])
            assert support.chunk_matches(kv, keys[0], list(range(first, first + support.BPC)))
        for bad in (["x"], "x", [1.0], [True], [-1]):
            with pytest.raises(UsageError, match="job id|list of job ids"):
                store.wait(bad)  # type: ignore[arg-type]


def test_a_wait_before_its_submit_raises_unknown_job(tmp_path: Path) -> None:
    """A wait on a job id that was never submitted is the race tierkv exists to prevent. The
    worker raised a bare TierKVError for it (the CPU engine TransferError, TierIO
    ConfigError); every component raises UnknownJobError now."""
    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        keys = support.request_keys(7, num_chunks=1)
        support.fill_chunk(kv, keys[0], support.chunk_blocks(0))
        job = store.store(keys, support.chunk_blocks(0))
        assert job is not None
        with pytest.raises(UnknownJobError, match=f"worker: wait on job {job + 100}, which was "
                                                  f"never submitted") as info:
            store.wait([job, job + 100])
        assert isinstance(info.value, TransferError)
        store.wait([job])
        assert [c.job_id for c in store.poll()] == [job]
        store.wait([job])  # finished and polled: returns at once


def test_a_store_used_from_several_threads_fails_loudly_never_with_wrong_bytes(tmp_path: Path) -> None:
    """The store is not thread-safe; threads calling it at once must get UsageError, and a
    load reported ok must have landed exactly."""
    kv = support.make_kv()
    store = support.open_store(tmp_path, kv, cpu_chunks=8)
    pools = [[support.request_keys(100 * t + i, num_chunks=1)[0] for i in range(6)] for t in range(4)]
    for t, pool in enumerate(pools):  # each thread owns 8 blocks of its own
        for key in pool:
            support.fill_chunk(kv, key, support.chunk_blocks(0, 8 * t))
            store.wait([store.store([key], [support.chunk_blocks(0, 8 * t)])])
    refused = [0] * 4
    wrong: list[str] = []
    start = threading.Barrier(4)

    errors: list[str] = []

    def work(t: int) -> None:
        try:
            run(t)
        except BaseException as exc:  # a raw error from a race is a failure too
            errors.append(f"{type(exc).__name__}: {exc}")

    def run(t: int) -> None:
        start.wait()
        target = support.chunk_blocks(0, 8 * t + 4)
        for round_ in range(300):
            key = pools[t][round_ % len(pools[t])]
            try:
                handle = store.load([key], [target])
                if handle.job_id is None:
                    continue
                store.wait([handle.job_id])
            except UsageError:
                refused[t] += 1
                continue
            if not support.chunk_matches(kv, key, target) and store.lookup([key]) == 1:
                wrong.append(key.hex()[:8])

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    store.close()
    assert sum(refused) > 0  # the overlap was seen and refused, not raced
    assert not wrong and not errors, (wrong, errors)


def test_write_sequences_stay_strictly_increasing_across_threads(tmp_path: Path) -> None:
    config = support.store_config(tmp_path).disk
    with DiskTier(tmp_path, support.namespace_of(), support.part(0), config, 4096) as tier:
        def writer(t: int) -> None:
            for i in range(60):
                key = support.pool_key(1000 * t + i, b"seq")
                tier.put_many([(key, bytes(4096))])

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seqs = [record.seq for record in tier.scan()]
    assert len(seqs) == 240 and len(set(seqs)) == 240  # 999 distinct for 1140 before


def _write_seq(root: str, t: int, barrier: Any, refused: Any) -> None:
    config = support.store_config(Path(root)).disk
    with DiskTier(Path(root), support.namespace_of(), support.part(0), config, 4096) as tier:
        barrier.wait(60)  # both processes have the environment open before either writes
        for i in range(80):
            try:
                tier.put_many([(support.pool_key(1000 * t + i, b"proc"), bytes(4096))])
            except ConfigError as exc:  # the other process writes these shards
                assert "in use by" in str(exc) and i == 0, (i, exc)
                refused[t] = 1
                return


def test_write_sequences_stay_strictly_increasing_across_processes(tmp_path: Path) -> None:
    """Two processes on one environment: each numbered values from the sequence it read at
    open, so the numbers repeated. Format 4 allocates slab slots in the writing process,
    so a DiskTier takes the claim at its first write: the second process is refused (a
    ConfigError naming the holder) while the first writes, or writes after it closed;
    either way the numbers are unique and every chunk reads back."""
    context = support.forkserver()
    DiskTier(tmp_path, support.namespace_of(), support.part(0), support.store_config(tmp_path).disk, 4096).close()
    barrier = context.Barrier(2)
    refused = context.Array("i", 2)
    children = [context.Process(target=_write_seq, args=(str(tmp_path), t, barrier, refused))
                for t in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    writers = 2 - sum(refused)
    assert writers >= 1
    with DiskTier(tmp_path, support.namespace_of(), support.part(0), support.store_config(tmp_path).disk,
                  4096) as tier:
        seqs = [record.seq for record in tier.scan()]
        assert tier.verify().bad_keys == ()
    assert len(seqs) == 80 * writers and len(set(seqs)) == 80 * writers


def test_one_environment_opened_twice_in_a_process_says_so(tmp_path: Path) -> None:
    """LMDB forbids it; the message used to blame permissions and free space."""
    config = support.store_config(tmp_path).disk
    with DiskTier(tmp_path, support.namespace_of(), support.part(0), config, 4096) as tier:
        with pytest.raises(UsageError, match="already open in this process") as info:
            DiskTier(tmp_path, support.namespace_of(), support.part(0), config, 4096)
        assert "free space" not in str(info.value)
        key = support.pool_key(1)
        assert tier.put_many([(key, bytes(4096))]).written == (key,)  # the first one is fine


@pytest.mark.parametrize("planted", ["fifo", "symlink", "other user"])
def test_an_untrusted_owner_lock_file_is_moved_aside(tmp_path: Path, planted: str) -> None:
    import os

    if planted == "other user" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    kv = support.make_kv()
    keys = support.request_keys(5)
    with support.open_store(tmp_path, kv) as store:
        support.store_chunks(store, kv, keys)
    lock = support.shard_dirs(support.env_dirs(tmp_path)[0])[0] / "tierkv-owner.lock"
    if planted == "other user":
        os.chown(lock, 4242, 4242)
    else:
        lock.unlink()
        os.mkfifo(lock) if planted == "fifo" else lock.symlink_to(tmp_path / "elsewhere")
    with support.open_store(tmp_path, support.make_kv()) as store:  # refused before
        assert store.lookup(keys) == len(keys)
    assert list(lock.parent.glob("tierkv-owner.lock.foreign-*"))


def test_disk_tier_calls_refuse_bad_buffers_and_batches_with_tierkv_errors(tmp_path: Path) -> None:
    config = support.store_config(tmp_path).disk
    key = support.pool_key(1)
    with DiskTier(tmp_path, support.namespace_of(), support.part(0), config, 4096) as tier:
        payload = np.arange(1024, dtype=np.float32)  # 4096 bytes: any contiguous buffer works
        assert tier.put_many([(key, payload)]).written == (key,)
        out = bytearray(4096)
        assert tier.read_into(key, out).name == "OK" and bytes(out) == payload.tobytes()
        grid = np.zeros((2, 512), dtype=np.float32)
        assert tier.read_into(key, memoryview(grid)).name == "OK"
        assert grid.tobytes() == payload.tobytes()
        for bad in ([0] * 4096, "x" * 4096, np.zeros(8192, dtype=np.uint8)[::2], bytes(4095)):
            with pytest.raises(UsageError):
                tier.put_many([(key, bad)])  # type: ignore[list-item]
        for bad_out in (bytes(4096), memoryview(bytearray(8192))[::2], bytearray(100), 5):
            with pytest.raises(UsageError):
                tier.read_into(key, bad_out)  # type: ignore[arg-type]
        for call in (lambda: list(tier.scan("x")), lambda: tier.verify(batch=None),  # type: ignore[arg-type]
                     lambda: list(tier.scan(0))):
            with pytest.raises(ConfigError):
                call()


def test_a_namespace_that_does_not_describe_the_tensors_is_refused(tmp_path: Path) -> None:
    """TierKVStore(namespace=...) took any namespace: one built for layers in the other order
    served each layer the other's bytes."""
    import dataclasses

    from tierkv.engine.store import TierKVStore, build_namespace
    from tierkv.transfer.layout import KVLayout

    kv = {"a": torch.zeros((8, 4, 64), dtype=torch.uint8), "b": torch.zeros((8, 4, 64), dtype=torch.uint8)}
    config = support.store_config(tmp_path)
    config = dataclasses.replace(config, blocks_per_chunk=2)
    swapped = build_namespace(KVLayout.from_tensors({"b": kv["b"], "a": kv["a"]}), "m", 4, config)
    with pytest.raises(ConfigError, match="layer_names"):
        TierKVStore(kv, namespace=swapped, config=config)
    own = dataclasses.replace(build_namespace(KVLayout.from_tensors(kv), "m", 4, config),
                              extra="tenant-7")  # the caller's fields are the caller's
    TierKVStore(kv, namespace=own, config=config).close()


def test_threads_stop_even_when_waiting_for_the_last_jobs_fails(tmp_path: Path) -> None:
    """The executor waited for its jobs, then stopped its threads: a wait that raised left
    the copy and disk threads running after close()."""
    from tierkv.transfer.executor import JobExecutor
    from tierkv.errors import TransferError
    from tierkv.tiers.cpu import CpuSlab
    from tierkv.transfer.cpu import CpuTransferEngine
    from tierkv.transfer.tier_io import TierIO
    from tierkv.transfer.layout import KVLayout

    class FailingWaits(CpuTransferEngine):  # a transfer engine whose waits fail
        def wait(self, job_ids: Any, timeout: float | None = None) -> None:
            raise TransferError("injected: the device stopped answering")

    before = _tierkv_threads()
    kv = support.make_kv()
    layout = KVLayout.from_tensors(kv)
    slab = CpuSlab(4, layout.chunk_bytes(support.BPC), "never")
    config = support.store_config(tmp_path).disk
    tier = DiskTier(tmp_path, support.namespace_of(), support.part(0), config, slab.slot_bytes)
    executor = JobExecutor(FailingWaits(layout, slab, support.BPC), TierIO(tier, slab, 1 << 20))
    from tierkv.core.jobs import ChunkCopy, JobId, SlotId, StoreSpec

    key = support.request_keys(12, num_chunks=1)[0]
    executor.submit(StoreSpec.of(JobId(1), [ChunkCopy(key, SlotId(0), tuple(support.chunk_blocks(0)))]))
    executor.shutdown()  # logs the failed wait, stops every thread
    tier.close()
    assert _tierkv_threads() == before
