"""StoreConfig.background_nice: tierkv's write, sync and push threads run that much above
the process's nice value (Linux, per thread), the threads that serve hits never do, and a
flush still completes at nice 19. Each thread's nice value is read from
/proc/self/task/<tid>/stat, as the kernel holds it."""

from __future__ import annotations

import os
import random
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.redis_cluster import RedisCluster
from tierkv.config import DiskTierConfig, RemoteTierConfig, StoreConfig
from tierkv.core.jobs import ChunkCopy, JobId, SlotId, SpillSpec
from tierkv.keys import Namespace, Part
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.cpu import CpuSlab
from tierkv.tiers.disk.tier import DiskTier
from tierkv.tiers.disk.write import PIECE_BYTES
from tierkv.tiers.remote.pushes import RemoteIO
from tierkv.tiers.remote.tier import RemoteTier
from tierkv.transfer.tier_io import TierIO

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")

NS = Namespace(model_id="nice", dtype="float16", kv_layout="NHD", page_bytes=1024,
               tokens_per_chunk=16)
NICE = 5


def nice_of(tid: int) -> int:
    """The kernel's nice value of thread ``tid`` of this process (stat field 19)."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16])


def nices(prefix: str) -> dict[int, int]:
    """Live threads whose name starts with ``prefix``: thread id -> nice value."""
    return {thread.native_id: nice_of(thread.native_id) for thread in threading.enumerate()
            if thread.name.startswith(prefix) and thread.native_id is not None}


@pytest.fixture()
def base() -> int:
    """This thread's nice value: what the others start with."""
    value = nice_of(threading.get_native_id())
    if value + NICE > 19:
        pytest.skip(f"the tests run at nice {value}: no room above it")
    return value


def key_of(i: int) -> bytes:
    return random.Random(i).randbytes(32)


def spill_every_lane(io: TierIO, slab: CpuSlab, tier: DiskTier) -> dict[bytes, bytes]:
    """One spill job whose chunks reach every write lane, each written in pieces (so the
    slab writer threads run too); flushed. Returns what was written."""
    written: dict[bytes, bytes] = {}
    lanes: set[int] = set()
    i = 0
    while len(lanes) < tier.write_lanes or len(written) < 3:
        key = key_of(i)
        if tier.lane_of(key) not in lanes or len(written) < 3:
            lanes.add(tier.lane_of(key))
            slot = len(written)
            data = random.Random(-i).randbytes(slab.slot_bytes)
            slab.memoryview(slot)[:] = data
            written[key] = data
        i += 1
    io.submit_spill(SpillSpec(JobId(1), tuple((key, SlotId(slot)) for slot, key in
                                              enumerate(written)), ()))
    io.flush()
    return written


@contextmanager
def disk_io_over(tmp_path: Path, nice: int) -> Iterator[tuple[DiskTier, CpuSlab, TierIO]]:
    payload = 3 * PIECE_BYTES  # three pieces a chunk: the slab writer threads write them
    config = DiskTierConfig(path=tmp_path, write_batch_bytes=4 * payload)
    tier = DiskTier(tmp_path, NS, 0, config, payload)
    slab = CpuSlab(num_slots=8, slot_bytes=payload, pin_memory="never")
    io = TierIO(tier, slab, write_batch_bytes=4 * payload, nice=nice)
    try:
        yield tier, slab, io
    finally:
        io.shutdown()  # a flush first: it completes whatever the threads' nice value
        tier.close()


def test_the_disk_writers_run_niced_and_the_readers_do_not(tmp_path: Path, base: int) -> None:
    with disk_io_over(tmp_path, NICE) as (tier, slab, io):
        written = spill_every_lane(io, slab, tier)
        assert set(nices("tierkv-disk-writer").values()) == {base + NICE}
        assert len(nices("tierkv-disk-writer")) == tier.write_lanes
        # started by a niced writer: they inherit it
        assert nices("tierkv-slab-writer") and \
            set(nices("tierkv-slab-writer").values()) == {base + NICE}
        done = threading.Event()
        io.submit_read(JobId(2), [ChunkCopy(key, SlotId(4 + n % 4), (), True) for n, key in
                                  enumerate(list(written)[:4])], lambda outcome: done.set())
        io.wait([JobId(2)])
        assert done.is_set()
        assert set(nices("tierkv-disk-reader").values()) == {base}
        assert nice_of(threading.get_native_id()) == base  # the caller is left alone


def test_a_nice_of_0_leaves_the_threads_alone(tmp_path: Path, base: int) -> None:
    with disk_io_over(tmp_path, 0) as (tier, slab, io):
        spill_every_lane(io, slab, tier)
        assert set(nices("tierkv-disk-writer").values()) == {base}
        assert set(nices("tierkv-slab-writer").values()) == {base}


def test_a_flush_and_a_close_complete_at_nice_19(tmp_path: Path, base: int) -> None:
    with disk_io_over(tmp_path, 19) as (tier, slab, io):
        written = spill_every_lane(io, slab, tier)  # flush() returned: every write landed
        assert set(nices("tierkv-disk-writer").values()) == {19}
        out = memoryview(bytearray(tier.payload_bytes))
        for key, data in written.items():
            assert tier.read_into(key, out) is ReadStatus.OK and bytes(out) == data
    assert nices("tierkv-disk-writer") == {}  # shutdown() stopped them


def test_pushes_run_niced_on_threads_of_their_own(redis_cluster: RedisCluster,
                                                  base: int) -> None:
    """On the 3-master cluster a push batch's nodes run at once on the tier's spread
    threads: the niced push thread's parts on niced threads, a lookup's on threads at the
    process's nice value, even when the pushes started theirs first."""
    redis_cluster.flushall()
    payload = 4096
    with RemoteTier(RemoteTierConfig(url=redis_cluster.url, timeout_seconds=5), NS, 0,
                    payload) as tier:
        io = RemoteIO(tier, queue_bytes=64 * payload, batch=16, nice=NICE)
        keys = [key_of(i) for i in range(16)]
        for key in keys:
            assert io.push(key, random.Random(key).randbytes(payload))
        assert io.flush(timeout=30)
        assert io.statistics().pushed == 16
        assert list(nices("tierkv-remote-push").values()) == [base + NICE]
        pushed_on = nices("tierkv-remote-nodes")
        assert pushed_on and set(pushed_on.values()) == {base + NICE}
        found = tier.exists_under(keys, [[Part(0, 1)]])
        assert all(answer == [True] for answer in found)
        looked_up_on = {tid: nice for tid, nice in nices("tierkv-remote-nodes").items()
                        if tid not in pushed_on}
        assert looked_up_on and set(looked_up_on.values()) == {base}
        io.shutdown()


def test_the_setting_is_declared_and_checked() -> None:
    assert StoreConfig().background_nice == 0
    assert StoreConfig(background_nice=19).background_nice == 19
    with pytest.raises(Exception, match="background_nice"):
        StoreConfig(background_nice=20)


def test_a_store_runs_its_disk_writers_at_its_background_nice(tmp_path: Path,
                                                              base: int) -> None:
    """StoreConfig.background_nice reaches the threads the store starts (build_worker)."""
    import torch

    from tierkv.engine.store import TierKVStore

    kv = [torch.zeros(8, 2, 16, 2, 8, dtype=torch.float16)]
    config = StoreConfig(blocks_per_chunk=2, device="cpu", background_nice=NICE,
                         disk=DiskTierConfig(path=tmp_path, sync_mode="always"))
    with TierKVStore(kv, model_id="nice", config=config) as store:
        assert store.disk is not None
        writers = [thread for thread in threading.enumerate()
                   if thread.name.startswith("tierkv-disk-writer")]
        assert writers
        for thread in writers:  # each lowers its own priority first thing: let it run
            for _ in range(10_000):
                if nice_of(thread.native_id or 0) != base:
                    break
                os.sched_yield()
            assert nice_of(thread.native_id or 0) == base + NICE
        assert set(nices("tierkv-disk-reader").values()) <= {base}
