#!/usr/bin/env python3
"""Benchmark the disk tier (slab files indexed by LMDB) against baselines measured in the same run.

The whole comparison runs once per chunk size (``--chunk-sizes``, MiB; default 0.5, 2, 8)
over ``--total-mib`` of chunks per method (``--chunks`` sets the count instead).

Write paths (each run writes every chunk into a fresh place and ends durable, i.e. after an
fsync of everything it wrote, inside the timed part):

- tierkv periodic   ``DiskTier.put_many`` in batches of ``--batch-mib``, then ``sync()``
                    (the default policy: no fsync per transaction)
- tierkv TierIO     the same through ``TierIO``'s writer thread, one spill job per
                    ``--batch-mib``, then ``flush()``
- tierkv one job    ``TierIO``: one ``SpillSpec`` of every chunk, then ``flush()``
- tierkv many jobs  ``TierIO``: one ``SpillSpec`` of one chunk per chunk, all submitted at
                    once, then ``flush()`` (the writer groups queued jobs into transactions)
- tierkv ..., slots reused  the one-job and many-jobs spills into a store that held these
                    chunks and deleted them before the timed part: slots are overwritten
                    (a store at its cap, evicting), not grown into fresh extents
- tierkv always     ``sync_mode='always'`` (LMDB fsyncs every transaction), through TierIO
                    (the engine's path: one job of every chunk, a writer per shard)
- tierkv always, put_many  the same from one thread calling ``put_many`` (one
                    transaction, and fsync, per shard a batch touches)
- vLLM fs one job   vLLM's ``FileSystemTierManager`` (the installed vLLM, see below):
                    one ``submit_store`` of a ``TransferJob`` of every chunk,
                    ``drain_jobs()``, then the fsync vLLM does not do (``--vllm-sync``)
- vLLM fs many jobs the same with one ``TransferJob`` of one chunk per chunk, all submitted
                    at once (its pool runs them on its 16 + 16 threads)
- dd fdatasync      ``dd if=/dev/zero of=F bs=<chunk> count=N conv=fdatasync``
- bare slab xN      the tier's slab layout without the tier: each shard's chunks ``pwrite``
                    (``O_DIRECT`` from the page-aligned slab) into one preallocated file per
                    shard by a thread each, then ``fdatasync``: the bound of the slab write path
- bare lmdb         raw payloads, one txn per ``--batch-mib``, ``sync=False``, ``env.sync()``
- bare lmdb xN      the same over the tier's N shards (environments), one thread each
- file per chunk    temp file + fsync + rename per chunk, then one directory fsync

Cold loads (page cache dropped with ``sync; echo 3 > /proc/sys/vm/drop_caches`` before each,
needs root; environments closed so no mapping pins pages): tierkv ``read_into`` of every
chunk in write order and in random order; tierkv ``TierIO`` read jobs (one job of every
chunk, and one job per chunk, all submitted at once) into a second ``CpuSlab``; vLLM fs
``submit_load`` (one job, and one job per chunk) into a second slab; bare file-per-chunk
reads; the bare shards and the bare slabs read by a thread each (``pread``; the load
ceilings); ``dd if=F of=/dev/null``.
Every load but dd lands in a slab poisoned beforehand and is checked after the timed part:
byte-exact against the source and xxh3 checksum of every chunk against the one taken of
the source.

The vLLM fs tier is ``vllm.v1.kv_offload.tiering.fs.manager.FileSystemTierManager`` as
installed, built the way ``SecondaryTierFactory`` builds it (its default thread counts, its
``FileMapper`` file layout, its O_DIRECT probe) over a page-aligned mmap slab shaped
``(chunks, chunk_bytes)`` like the ``SharedOffloadRegion`` view vLLM hands it; jobs are the
``TransferJob`` its tiering manager submits, and completion is ``drain_jobs()`` then
``get_finished_jobs()`` (every job must report success). Its C io (``vllm.fs_io_C``:
``O_DIRECT``, 16 threads) links CUDA torch (libtorch_cuda, libnvrtc) without calling it on
this path: where those libraries are missing (a CPU-only torch), the script builds empty
stand-ins with gcc and runs itself again with them on ``LD_LIBRARY_PATH`` (``--vllm-io c``,
the default), so vLLM runs its C io; ``--vllm-io python`` leaves that out, and the tier
then runs its own Python io path (``os.write`` / ``os.readv`` per block). The header says
which ran.

``probe: O_DIRECT, 32 in flight`` reads the very slab files the TierIO loads read, whole,
with ``O_DIRECT`` in 1 MiB pieces on 32 threads: the device's cold-read speed, which the
loads are compared against (target: at least 0.8x). vLLM never fsyncs; to end durable the benchmark adds, inside the timed part,
``syncfs()`` of the filesystem (``--vllm-sync syncfs``, the default: one journal commit) or
an fsync of every file and directory it wrote (``--vllm-sync fsync``). Without vLLM
installed (or with ``--no-vllm``) its rows are left out.

Before each timed write the previous writes' deletions are settled (``sync``), so one
method's fsync does not pay for another's discards. Opening a DiskTier tunes glibc malloc
for the whole process (``tune_malloc``; the bare lmdb baseline shares it); run with
``TIERKV_MALLOPT=0`` to measure without.

Every row also reports the CPU time the process (all its threads, and dd's child) spent
per GiB, median of the rounds: over the whole call (setup, poison, page-cache drop and
verify included) and, for tierkv's TierIO and vLLM's rows, over the timed part alone
(``timed``: what the CPU ratio rows and their targets judge, at most 2x vLLM's for writes
and 1.2x for loads).

All write rounds run first, then all load rounds. Methods run round-robin inside each round,
each round starting one method later, so drift hits all of them alike and no method always
follows the same one; the first round of each phase is a warm-up and is not reported. Prints median MiB/s with min-max spread, then the ratios, per chunk size, then a
summary of the target ratios over all sizes. ``--profile`` adds a cProfile of one tierkv
periodic write (the put_many path TierIO's writer thread runs) per size.

``--parts`` adds cold loads across TP sizes (format 5 stores a chunk as one value per
writer part; docs/on-disk-format.md, "Parts"): each chunk viewed as 64 layer pages of 16
tokens x 8 heads (NHD), stored as 2 parts as well (part-0of2, part-1of2, written before the
timed part). Rows, each the whole chunk's bytes over the time: ``TP 2: own parts`` (each of
two ranks ``read_into`` its own part: what a TP = 2 engine pays for its own chunks), ``TP 2
from 1 part`` (each rank reads the whole one-part value, verifies it, copies its 4 heads:
``PartReader``), ``TP 1 from 2 parts`` (one rank reads both parts, verifies each, copies
them in); and ``tierkv read_into (in order)`` is TP 1's own. Verified byte-exact.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import json
import mmap
import os
import pstats
import random
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_plots

from bench_plots import Panel, lines, pyplot  # noqa: E402

from tierkv.config import DiskTierConfig  # noqa: E402
from tierkv.core.jobs import ChunkCopy, JobId, SlotId, SpillSpec  # noqa: E402
from tierkv.keys import Namespace, Part  # noqa: E402
from tierkv.tiers.cpu import CpuSlab  # noqa: E402
from tierkv.tiers.disk.format import slot_bytes_for  # noqa: E402
from tierkv.tiers.disk.layout import StoreLayout  # noqa: E402
from tierkv.tiers.disk.tier import SHARDS, DiskTier, ReadStatus, shard_of, tune_malloc  # noqa: E402
from tierkv.transfer.tier_io import TierIO, ReadOutcome  # noqa: E402
from tierkv.transfer.parts import HeadLayout, PartReader, split_heads  # noqa: E402

MiB = 1 << 20
ALIGN = 4096  # O_DIRECT (vLLM's fs tier) needs block-aligned sizes and buffers
POISON = 0xA5
REPO = Path(__file__).resolve().parents[1]

PROBE = "probe: O_DIRECT, 32 in flight"  # the device's own cold-read speed, same files
PROBE_THREADS, PROBE_PIECE = 32, 1 << 20
# (label, numerator row, denominator row, target or None); rows missing from a run are skipped
RATIOS: list[tuple[str, str, str, float | None]] = [
    ("tierkv one job / vLLM fs one job", "tierkv TierIO one job", "vLLM fs one job", 1.0),
    ("tierkv many / vLLM fs many jobs", "tierkv TierIO many jobs", "vLLM fs many jobs", 0.9),
    ("tierkv always / dd write", "tierkv sync_mode=always", "dd conv=fdatasync", 0.8),
    ("cold: tierkv one / vLLM fs one", "load: tierkv TierIO one job", "load: vLLM fs one job",
     1.0),
    ("cold: tierkv many / vLLM fs many", "load: tierkv TierIO many jobs",
     "load: vLLM fs many jobs", 1.0),
    ("cold: tierkv one / device probe", "load: tierkv TierIO one job", PROBE, 0.8),
    ("cold: tierkv many / device probe", "load: tierkv TierIO many jobs", PROBE, 0.8),
    ("tierkv periodic / dd write", "tierkv periodic + sync", "dd conv=fdatasync", 0.7),
    ("tierkv periodic / file-per-chunk", "tierkv periodic + sync", "file per chunk + fsync",
     3.0),
    ("tierkv TierIO / dd write", "tierkv TierIO + flush", "dd conv=fdatasync", 0.7),
    ("tierkv one job / dd write", "tierkv TierIO one job", "dd conv=fdatasync", None),
    ("vLLM fs one job / dd write", "vLLM fs one job", "dd conv=fdatasync", None),
    ("tierkv always put_many / dd", "tierkv always, put_many", "dd conv=fdatasync", None),
    ("tierkv always / file-per-chunk", "tierkv sync_mode=always", "file per chunk + fsync",
     None),
    ("tierkv / bare lmdb write", "tierkv periodic + sync", "bare lmdb + sync", None),
    ("tierkv one job / bare lmdb shards", "tierkv TierIO one job",
     f"bare lmdb x{SHARDS} threads", None),
    ("bare lmdb shards / vLLM fs one job", f"bare lmdb x{SHARDS} threads", "vLLM fs one job",
     None),
    ("bare lmdb shards / vLLM fs many", f"bare lmdb x{SHARDS} threads", "vLLM fs many jobs", None),
    ("tierkv / dd cold read", "tierkv read_into (in order)", "dd of=/dev/null", 0.7),
    ("cold: tierkv one / bare lmdb shards", "load: tierkv TierIO one job",
     f"bare lmdb x{SHARDS} threads read", None),
    ("cold: bare lmdb shards / vLLM one", f"bare lmdb x{SHARDS} threads read",
     "load: vLLM fs one job", None),
    ("tierkv random / dd cold read", "tierkv read_into (random)", "dd of=/dev/null", None),
    ("tierkv / file-per-chunk cold read", "tierkv read_into (in order)", "file per chunk",
     None),
    ("cold: vLLM fs one / dd", "load: vLLM fs one job", "dd of=/dev/null", None),
]
TARGET_RATIOS = 7  # the first rows of RATIOS are the targets, summarised at the end
RATIOS += [
    ("reused slots: tierkv one / vLLM one", "tierkv one job, slots reused", "vLLM fs one job",
     None),
    ("reused slots: tierkv many / vLLM many", "tierkv many jobs, slots reused",
     "vLLM fs many jobs", None),
    ("tierkv one job / bare slab shards", "tierkv TierIO one job", f"bare slab x{SHARDS} threads",
     None),
    ("bare slab shards / vLLM fs one job", f"bare slab x{SHARDS} threads", "vLLM fs one job",
     None),
    ("cold: tierkv one / bare slab shards", "load: tierkv TierIO one job",
     f"bare slab x{SHARDS} threads read", None),
    ("parts: TP 2 from 1 / TP 2 own", "parts: TP 2 from 1 part", "parts: TP 2 own parts", None),
    ("parts: TP 1 from 2 / TP 1 own", "parts: TP 1 from 2 parts", "tierkv read_into (in order)",
     None),
]
# (label, numerator row, denominator row, most): CPU seconds per GiB written, tierkv / vLLM
CPU_RATIOS: list[tuple[str, str, str, float]] = [
    ("CPU/GiB tierkv one / vLLM fs one", "tierkv TierIO one job", "vLLM fs one job", 2.0),
    ("CPU/GiB tierkv many / vLLM fs many", "tierkv TierIO many jobs", "vLLM fs many jobs", 2.0),
    ("CPU/GiB load: tierkv one / vLLM one", "load: tierkv TierIO one job",
     "load: vLLM fs one job", 1.2),
    ("CPU/GiB load: tierkv many / vLLM many", "load: tierkv TierIO many jobs",
     "load: vLLM fs many jobs", 1.2),
]


def cpu_seconds() -> float:
    """CPU time of this process (every thread) and of its waited-for children."""
    own, children = (resource.getrusage(who) for who in
                     (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--chunk-sizes: {exc}") from exc
    if not sizes or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError("--chunk-sizes: positive MiB values, e.g. 0.5,2,8")
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--chunk-sizes", type=parse_sizes, default=[0.5, 2.0, 8.0],
                        help="comma-separated chunk payload sizes in MiB; the whole comparison "
                             "runs once per size (rounded down to 4 KiB multiples)")
    parser.add_argument("--chunk-mib", type=float, default=None,
                        help="a single chunk size in MiB (overrides --chunk-sizes)")
    parser.add_argument("--total-mib", type=float, default=1024.0,
                        help="bytes of chunks each method writes and loads per run")
    parser.add_argument("--chunks", type=int, default=None,
                        help="chunks per run (overrides --total-mib)")
    parser.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=5,
                        help="measured rounds (after warm-up), methods interleaved in each")
    parser.add_argument("--batch-mib", type=float, default=8.0,
                        help="bytes per write transaction (disk.write_batch_bytes)")
    parser.add_argument("--dir", type=Path, default=REPO / ".bench",
                        help="scratch directory (must be on the disk under test, not tmpfs)")
    parser.add_argument("--no-always", action="store_true", help="skip sync_mode='always'")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-load section")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM fs tier rows")
    parser.add_argument("--read-mib-in-flight", type=float,
                        default=DiskTierConfig.read_bytes_in_flight / MiB,
                        help="the tier's disk.read_bytes_in_flight, in MiB")
    parser.add_argument("--vllm-io", choices=("c", "python"), default="c",
                        help="vLLM fs tier's io: its C io (vllm.fs_io_C, CUDA libraries it "
                             "links stubbed where missing) or its Python io")
    parser.add_argument("--vllm-sync", choices=("syncfs", "fsync"), default="syncfs",
                        help="how the vLLM fs rows are made durable at the end of a round")
    parser.add_argument("--parts", action="store_true",
                        help="also cold loads across TP sizes (one value per writer part)")
    parser.add_argument("--out-json", type=Path, default=None,
                        help="write every median (MiB/s, CPU s/GiB) per chunk size here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="a PNG of the cold loads and durable writes per chunk size")
    parser.add_argument("--profile", action="store_true",
                        help="also cProfile one tierkv periodic write per chunk size")
    args = parser.parse_args(argv)
    if args.chunk_mib is not None:
        args.chunk_sizes = [args.chunk_mib]
    if args.chunks is not None and args.chunks < 1:
        parser.error("--chunks must be >= 1")
    return args


# -- vLLM's fs tier ------------------------------------------------------------------------


class VllmFs:
    """The installed vLLM fs tier, imported lazily (the import pulls in much of vLLM)."""

    def __init__(self) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm.v1.kv_offload import base, config
        from vllm.v1.kv_offload.tiering import base as tiering_base
        from vllm.v1.kv_offload.tiering.fs import io as fs_io
        from vllm.v1.kv_offload.tiering.fs import manager
        import vllm

        self.version = vllm.__version__
        self.config = config
        self.base = base
        self.TransferJob = tiering_base.TransferJob
        self.Manager = manager.FileSystemTierManager
        self.has_c_io = fs_io._HAS_FSIO_C
        self.probe_o_direct = fs_io.probe_o_direct
        self.c_io_problem = ""
        if not self.has_c_io:
            try:
                import vllm.fs_io_C  # noqa: F401
            except ImportError as exc:
                self.c_io_problem = str(exc)

        class Spec(base.OffloadingSpec):  # the spec only configures; nothing else is used
            def get_manager(self) -> Any:
                raise NotImplementedError

            def get_worker(self, kv_caches: Any) -> Any:
                raise NotImplementedError

        self.Spec = Spec
        self.req = base.ReqContext(req_id="bench")

    @property
    def io_path(self) -> str:
        if self.has_c_io:
            return "C io (vllm.fs_io_C)"
        return f"Python io (vllm.fs_io_C unavailable: {self.c_io_problem or 'not built'})"

    def spec(self, chunk_bytes: int) -> Any:
        c = self.config
        offloading = c.OffloadingConfig(
            groups=(c.OffloadingGroupConfig(tokens_per_block=256, layer_names=("layer0",),
                                            group_id=0),),
            worker_kv_bytes_per_block=chunk_bytes, enable_kv_cache_events=False,
            extra_config={}, engine_id="bench",
            model=c.OffloadingModelConfig(name="bench", dtype="bfloat16"),
            cache=c.OffloadingCacheConfig(tokens_per_hash=256, blocks_per_chunk=1),
            parallel=c.OffloadingParallelConfig(
                rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                is_parallelism_agnostic=True))
        return self.Spec(offloading)

    def manager(self, root: Path, view: memoryview, chunk_bytes: int) -> Any:
        # What SecondaryTierFactory.create_secondary_tier({"type": "fs", "root_dir": ...})
        # builds: the tier's own defaults for everything else.
        return self.Manager(offloading_spec=self.spec(chunk_bytes), primary_kv_view=view,
                            tier_type="fs", root_dir=str(root))

    def job(self, job_id: int, keys: list[Any], chunk_ids: Sequence[int],
            promotion: bool) -> Any:
        return self.TransferJob(job_id=job_id, keys=keys,
                                chunk_ids=np.asarray(chunk_ids, dtype=np.int32),
                                is_promotion=promotion, req_context=self.req)

    @staticmethod
    def finish(tier: Any, num_jobs: int) -> None:
        """Wait for every submitted job (the tier's own drain), then check each succeeded."""
        tier.drain_jobs()
        results = list(tier.get_finished_jobs())
        assert len(results) == num_jobs, (len(results), num_jobs)
        failed = [r.job_id for r in results if not r.success]
        assert not failed, f"vLLM fs jobs failed: {failed[:5]}"


def load_vllm() -> tuple[VllmFs | None, str]:
    try:
        return VllmFs(), ""
    except Exception as exc:  # not installed, or another version's API
        return None, f"{type(exc).__name__}: {exc}"


_libc = ctypes.CDLL(None, use_errno=True)


def syncfs(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(path))
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MmapSlab:
    """A page-aligned anonymous mmap shaped (chunks, chunk_bytes): what vLLM's primary tier
    hands its secondary tiers (a view over its SharedOffloadRegion mmap)."""

    def __init__(self, num_chunks: int, chunk_bytes: int) -> None:
        self.mmap = mmap.mmap(-1, num_chunks * chunk_bytes)
        self.array = np.frombuffer(self.mmap, dtype=np.uint8).reshape(num_chunks, chunk_bytes)
        self.view = memoryview(self.array)  # type: ignore[arg-type]  # 2-D, strides[0] = chunk


# -- the benchmark -------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, chunk_mib: float, vllm: VllmFs | None) -> None:
        self.args = args
        self.vllm = vllm
        self.chunk_bytes = max(ALIGN, int(chunk_mib * MiB) // ALIGN * ALIGN)
        self.chunk_mib = self.chunk_bytes / MiB
        self.batch_bytes = int(args.batch_mib * MiB)
        self.num_chunks = args.chunks or max(1, int(args.total_mib * MiB) // self.chunk_bytes)
        self.total = self.chunk_bytes * self.num_chunks
        self.dir: Path = args.dir / f"bench_disk-{os.getpid()}"  # only this is created and removed
        self.slab = CpuSlab(self.num_chunks, self.chunk_bytes, pin_memory="never")
        self.source = self.slab.tensor.numpy()
        rng = np.random.default_rng(1234)
        self.source[:] = rng.integers(0, 256, self.source.shape, np.uint8)
        self.checksums = [xxhash.xxh3_64_intdigest(row) for row in self.source]
        # loads land here (poisoned first), never in the source
        self.dest = CpuSlab(self.num_chunks, self.chunk_bytes, pin_memory="never")
        self.keys = [rng.bytes(32) for _ in range(self.num_chunks)]
        self.namespace = Namespace(model_id="bench", dtype="bfloat16", kv_layout="NHD",
                                   page_bytes=self.chunk_bytes, tokens_per_chunk=256)
        self.per_txn = max(1, self.batch_bytes // self.chunk_bytes)
        self.can_drop = True
        self.o_direct: bool | None = None
        self.window_cpu: float | None = None  # the last timed window's CPU seconds
        self._window_cpu0 = 0.0
        if vllm is not None:
            self.vsource = MmapSlab(self.num_chunks, self.chunk_bytes)
            self.vsource.array[:] = self.source
            self.vdest = MmapSlab(self.num_chunks, self.chunk_bytes)
            self.vkeys = [vllm.base.make_offload_key(key, 0) for key in self.keys]

    # -- helpers ---------------------------------------------------------------------------

    def window_start(self) -> float:
        """Start a timed window: its wall clock, and (read by ``window_end``) the CPU."""
        self._window_cpu0 = cpu_seconds()
        return time.perf_counter()

    def window_end(self, start: float) -> float:
        """The window's seconds; its CPU seconds go to ``window_cpu`` (the work timed only:
        not the poison, page-cache drop, open and verify around it)."""
        seconds = time.perf_counter() - start
        self.window_cpu = cpu_seconds() - self._window_cpu0
        return seconds

    def fresh(self, name: str) -> Path:
        path = self.dir / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        os.sync()  # settle the deletion (ext4 discards at commit) before the timed part
        return path

    def tier(self, root: Path, sync_mode: str = "periodic") -> DiskTier:
        config = DiskTierConfig(path=root, max_bytes=self.total * 2, sync_mode=sync_mode,
                                write_batch_bytes=self.batch_bytes,
                                read_bytes_in_flight=int(self.args.read_mib_in_flight * MiB))
        return DiskTier(root, self.namespace, 0, config, self.chunk_bytes)

    def drop_caches(self) -> None:
        os.sync()
        try:
            with open("/proc/sys/vm/drop_caches", "w") as handle:
                handle.write("3\n")
        except OSError as exc:
            if self.can_drop:
                print(f"note: cannot drop the page cache ({exc}): cold numbers are warm")
            self.can_drop = False

    def poison(self, array: np.ndarray) -> None:
        array.fill(POISON)

    def verify(self, array: np.ndarray, order: Sequence[int] | None = None,
               what: str = "") -> None:
        """Slot ``s`` must hold chunk ``order[s]`` (``s`` itself by default): byte for byte,
        and by checksum."""
        for slot in range(self.num_chunks):
            chunk = slot if order is None else order[slot]
            row = array[slot]
            if xxhash.xxh3_64_intdigest(row) != self.checksums[chunk] or \
                    not np.array_equal(row, self.source[chunk]):
                raise AssertionError(f"{what}: slot {slot} does not hold chunk {chunk}")

    # -- writes ----------------------------------------------------------------------------

    def write_tierkv(self, sync_mode: str, profiler: cProfile.Profile | None = None) -> float:
        root = self.fresh(f"tierkv-{sync_mode}")
        tier = self.tier(root, sync_mode)
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        for first in range(0, self.num_chunks, self.per_txn):
            items = [(self.keys[i], self.slab.memoryview(i))
                     for i in range(first, min(first + self.per_txn, self.num_chunks))]
            result = tier.put_many(items)
            assert not result.full, result.message
        tier.sync()
        seconds = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
        tier.close()
        return seconds

    def _spill(self, name: str, specs: list[SpillSpec], sync_mode: str = "periodic",
               tier: DiskTier | None = None) -> float:
        """``specs`` through TierIO into a fresh store (or ``tier``), timed to durable."""
        if tier is None:
            tier = self.tier(self.fresh(name), sync_mode)
        disk_io = TierIO(tier, self.slab, self.batch_bytes)
        start = self.window_start()
        for spec in specs:
            disk_io.submit_spill(spec)
        disk_io.flush()
        seconds = self.window_end(start)
        done = disk_io.poll_finished()
        assert len(done) == len(specs) and all(c.ok for c in done), \
            [c for c in done if not c.ok][:3]
        disk_io.shutdown()
        tier.close()
        return seconds

    def write_disk_io(self) -> float:
        specs = [SpillSpec(JobId(first + 1), tuple(
                     (self.keys[i], SlotId(i))
                     for i in range(first, min(first + self.per_txn, self.num_chunks))))
                 for first in range(0, self.num_chunks, self.per_txn)]
        return self._spill("tierkv-diskio", specs)

    def write_disk_io_one(self, sync_mode: str = "periodic") -> float:
        writes = tuple((self.keys[i], SlotId(i)) for i in range(self.num_chunks))
        name = "tierkv-one" if sync_mode == "periodic" else f"tierkv-one-{sync_mode}"
        return self._spill(name, [SpillSpec(JobId(1), writes)], sync_mode)

    def write_disk_io_reused(self, many: bool) -> float:
        """TierIO into a store that already held these chunks and deleted them (outside the
        timed part, synced): the slots are reused, as in a store that evicts to make room,
        instead of grown into fresh (unwritten) extents. The warm-up round makes the store."""
        root = self.dir / ("tierkv-reused-many" if many else "tierkv-reused-one")
        root.mkdir(parents=True, exist_ok=True)
        tier = self.tier(root)
        tier.delete_many(self.keys)
        tier.sync()
        os.sync()
        specs = [SpillSpec(JobId(i + 1), ((self.keys[i], SlotId(i)),))
                 for i in range(self.num_chunks)] if many else [SpillSpec(JobId(1), tuple(
                     (self.keys[i], SlotId(i)) for i in range(self.num_chunks)))]
        return self._spill(root.name, specs, tier=tier)

    def write_disk_io_many(self) -> float:
        specs = [SpillSpec(JobId(i + 1), ((self.keys[i], SlotId(i)),))
                 for i in range(self.num_chunks)]
        return self._spill("tierkv-many", specs)

    def _vllm_durable(self, root: Path, tier: Any) -> None:
        if self.args.vllm_sync == "syncfs":
            syncfs(root)
            return
        dirs: set[str] = set()
        for key in self.vkeys:
            path = tier.file_mapper.get_file_name(key)
            fsync_path(path)
            dirs.add(os.path.dirname(path))
        parents = {os.path.dirname(d) for d in dirs}
        for path in sorted(dirs | parents | {os.path.dirname(p) for p in parents}):
            fsync_path(path)

    def _vllm_jobs(self, many: bool, load: bool) -> list[Any]:
        """One vLLM job of every chunk, or (``many``) one job per chunk."""
        assert self.vllm is not None
        if many:
            return [self.vllm.job(i + 1, [self.vkeys[i]], [i], load)
                    for i in range(self.num_chunks)]
        return [self.vllm.job(1, list(self.vkeys), range(self.num_chunks), load)]

    def write_vllm(self, many: bool) -> float:
        assert self.vllm is not None
        root = self.fresh("vllm-many" if many else "vllm-one")
        tier = self.vllm.manager(root, self.vsource.view, self.chunk_bytes)
        self.o_direct = tier._use_o_direct
        jobs = self._vllm_jobs(many, load=False)
        start = self.window_start()
        for job in jobs:
            tier.submit_store(job)
        self.vllm.finish(tier, len(jobs))
        self._vllm_durable(root, tier)
        seconds = self.window_end(start)
        tier.shutdown()
        return seconds

    def write_dd(self) -> float:
        target = self.fresh("dd") / "dd.bin"
        command = ["dd", "if=/dev/zero", f"of={target}", f"bs={self.chunk_bytes}",
                   f"count={self.num_chunks}", "conv=fdatasync", "status=none"]
        start = time.perf_counter()
        subprocess.run(command, check=True)
        return time.perf_counter() - start

    def write_bare_lmdb(self) -> float:
        root = self.fresh("lmdb")
        env = lmdb.open(str(root), map_size=self.total * 2, sync=False, metasync=False,
                        writemap=False, readahead=True)
        start = time.perf_counter()
        for first in range(0, self.num_chunks, self.per_txn):
            with env.begin(write=True) as txn:
                for i in range(first, min(first + self.per_txn, self.num_chunks)):
                    txn.put(self.keys[i], self.slab.memoryview(i))
        env.sync(True)
        seconds = time.perf_counter() - start
        env.close()
        return seconds

    def write_bare_lmdb_shards(self) -> float:
        """The ceiling of the sharded layout: a chunk per environment by its key's shard,
        one thread per environment, each ending with its own fsync."""
        root = self.fresh("lmdb-shards")
        envs = [lmdb.open(str(root / StoreLayout.shard_name(shard)), map_size=self.total * 2, sync=False,
                          metasync=False, writemap=False, readahead=True)
                for shard in range(SHARDS)]

        def write(shard: int) -> None:
            mine = [i for i in range(self.num_chunks) if shard_of(self.keys[i]) == shard]
            for first in range(0, len(mine), self.per_txn):
                with envs[shard].begin(write=True) as txn:
                    for i in mine[first : first + self.per_txn]:
                        txn.put(self.keys[i], self.slab.memoryview(i))
            envs[shard].sync(True)

        return self._per_shard(write, envs)

    @staticmethod
    def _per_shard(work: Callable[[int], None], envs: list[Any]) -> float:
        """Seconds for ``work(shard)`` on a thread per shard; the environments closed after."""
        threads = [threading.Thread(target=work, args=(shard,)) for shard in range(SHARDS)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
        for env in envs:
            env.close()
        return seconds

    def _slab_parts(self) -> list[list[int]]:
        return [[i for i in range(self.num_chunks) if shard_of(self.keys[i]) == shard]
                for shard in range(SHARDS)]

    def write_bare_slabs(self) -> float:
        """The bound of the slab layout: each shard's chunks ``pwrite`` from the slab (with
        O_DIRECT where the filesystem takes it) into one preallocated file per shard, by a
        thread each, then ``fdatasync``; no header, no checksum, no index."""
        root = self.fresh("slabs")
        parts = self._slab_parts()
        fds = []
        for shard in range(SHARDS):
            path = root / f"slab-{shard}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            os.posix_fallocate(fd, 0, max(1, len(parts[shard])) * self.chunk_bytes)
            os.close(fd)
            try:
                fds.append(os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0)))
            except OSError:
                fds.append(os.open(path, os.O_RDWR))

        def write(shard: int) -> None:
            for position, i in enumerate(parts[shard]):
                os.pwrite(fds[shard], self.slab.memoryview(i), position * self.chunk_bytes)
            os.fdatasync(fds[shard])

        seconds = self._per_shard(write, [])
        for fd in fds:
            os.close(fd)
        return seconds

    def read_bare_slabs(self) -> float:
        """The load ceiling of the slab layout: the bare slabs read by a thread each
        (``pread`` into the slot, buffered)."""
        self.poison(self.dest.tensor.numpy())
        self.drop_caches()
        root = self.dir / "slabs"
        parts = self._slab_parts()
        fds = [os.open(root / f"slab-{shard}", os.O_RDONLY) for shard in range(SHARDS)]

        def read(shard: int) -> None:
            for position, i in enumerate(parts[shard]):
                os.preadv(fds[shard], [self.dest.memoryview(i)], position * self.chunk_bytes)

        seconds = self._per_shard(read, [])
        for fd in fds:
            os.close(fd)
        self.verify(self.dest.tensor.numpy(), None, "bare slabs read")
        return seconds

    def write_files(self) -> float:
        root = self.fresh("files")
        start = time.perf_counter()
        for i in range(self.num_chunks):
            final = root / self.keys[i].hex()
            tmp = root / f".{final.name}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = self.slab.memoryview(i)
                written = 0
                while written < len(view):
                    written += os.write(fd, view[written:])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, final)
        dir_fd = os.open(root, os.O_RDONLY)
        os.fsync(dir_fd)
        os.close(dir_fd)
        return time.perf_counter() - start

    # -- cold loads ------------------------------------------------------------------------

    def read_tierkv(self, shuffled: bool) -> float:
        order = list(range(self.num_chunks))
        if shuffled:
            random.Random(7).shuffle(order)
        self.poison(self.dest.tensor.numpy())
        self.drop_caches()
        tier = self.tier(self.dir / "tierkv-periodic")
        start = time.perf_counter()
        for slot, i in enumerate(order):
            status = tier.read_into(self.keys[i], self.dest.memoryview(slot))
            assert status is ReadStatus.OK, status
        seconds = time.perf_counter() - start
        tier.close()
        self.verify(self.dest.tensor.numpy(), order, "tierkv read_into")
        return seconds

    # -- across TP sizes (--parts) ---------------------------------------------------------

    def head_layout(self) -> HeadLayout:
        pieces, outer, heads = 64, 16, 8
        return HeadLayout(pieces, outer, self.chunk_bytes // (pieces * outer * heads), heads)

    def _part_tiers(self, count: int) -> list[DiskTier]:
        root = self.dir / f"parts-{count}"
        config = DiskTierConfig(path=root, max_bytes=self.total * 2,
                                write_batch_bytes=self.batch_bytes)
        return [DiskTier(root, self.namespace, Part(index, count), config,
                         self.chunk_bytes // count) for index in range(count)]

    def write_two_parts(self) -> None:
        """The chunks as 2 parts (untimed, once)."""
        if (self.dir / "parts-2").exists():
            return
        layout = self.head_layout()
        tiers = self._part_tiers(2)
        import torch

        for first in range(0, self.num_chunks, self.per_txn):
            batch = range(first, min(first + self.per_txn, self.num_chunks))
            halves = [split_heads(layout, torch.from_numpy(self.source[i]), 2) for i in batch]
            for index, tier in enumerate(tiers):
                tier.put_many([(self.keys[i], halves[n][index].numpy())
                               for n, i in enumerate(batch)])
        for tier in tiers:
            tier.close()

    def _verify_halves(self, halves: np.ndarray, what: str) -> None:
        import torch

        layout = self.head_layout()
        for chunk in range(self.num_chunks):
            want = split_heads(layout, torch.from_numpy(self.source[chunk]), 2)
            for index in range(2):
                if not np.array_equal(halves[chunk, index], want[index].numpy()):
                    raise AssertionError(f"{what}: chunk {chunk} part {index} differs")

    def read_own_parts(self) -> float:
        """TP 2, each rank its own part."""
        self.write_two_parts()
        halves = np.full((self.num_chunks, 2, self.chunk_bytes // 2), POISON, np.uint8)
        self.drop_caches()
        tiers = self._part_tiers(2)
        start = time.perf_counter()
        for i in range(self.num_chunks):
            for index, tier in enumerate(tiers):
                assert tier.read_into(self.keys[i], memoryview(halves[i, index])) is ReadStatus.OK
        seconds = time.perf_counter() - start
        for tier in tiers:
            tier.close()
        self._verify_halves(halves, "TP 2 own parts")
        return seconds

    def read_tp2_from_one(self) -> float:
        """TP 2, each rank from the one-part value (read whole, verified, its heads copied)."""
        halves = np.full((self.num_chunks, 2, self.chunk_bytes // 2), POISON, np.uint8)
        self.drop_caches()
        tier = self.tier(self.dir / "tierkv-periodic")

        class One:
            def read_part_into(self, key: bytes, part: Part, out: Any) -> ReadStatus:
                return tier.read_into(key, out)

        one = One()
        readers = [PartReader(self.head_layout(), Part(index, 2), lambda count: one)
                   for index in range(2)]
        start = time.perf_counter()
        for i in range(self.num_chunks):
            for index, reader in enumerate(readers):
                assert reader.read(self.keys[i], 1, memoryview(halves[i, index])) is ReadStatus.OK
        seconds = time.perf_counter() - start
        tier.close()
        self._verify_halves(halves, "TP 2 from 1 part")
        return seconds

    def read_tp1_from_two(self) -> float:
        """TP 1 from the two parts (each read whole and verified, both copied in)."""
        self.write_two_parts()
        self.poison(self.dest.tensor.numpy())
        self.drop_caches()
        tiers = self._part_tiers(2)

        class Two:
            def read_part_into(self, key: bytes, part: Part, out: Any) -> ReadStatus:
                return tiers[part.index].read_into(key, out)

        two = Two()
        reader = PartReader(self.head_layout(), Part(0, 1), lambda count: two)
        start = time.perf_counter()
        for i in range(self.num_chunks):
            assert reader.read(self.keys[i], 2, self.dest.memoryview(i)) is ReadStatus.OK
        seconds = time.perf_counter() - start
        for tier in tiers:
            tier.close()
        self.verify(self.dest.tensor.numpy(), None, "TP 1 from 2 parts")
        return seconds

    def load_disk_io(self, many: bool) -> float:
        self.poison(self.dest.tensor.numpy())
        self.drop_caches()
        tier = self.tier(self.dir / "tierkv-one")
        disk_io = TierIO(tier, self.dest, self.batch_bytes)
        chunks = [ChunkCopy(self.keys[i], SlotId(i), ()) for i in range(self.num_chunks)]
        jobs = [(JobId(i + 1), [chunk]) for i, chunk in enumerate(chunks)] if many else \
            [(JobId(1), chunks)]
        start = self.window_start()
        for job_id, job_chunks in jobs:
            disk_io.submit_read(job_id, job_chunks)
        disk_io.wait([job_id for job_id, _ in jobs])
        seconds = self.window_end(start)
        outcomes: list[ReadOutcome] = disk_io.poll_reads()
        disk_io.shutdown()
        tier.close()
        assert len(outcomes) == len(jobs) and all(o.ok for o in outcomes), \
            [o for o in outcomes if not o.ok][:3]
        self.verify(self.dest.tensor.numpy(), None, "tierkv TierIO load")
        return seconds

    def load_vllm(self, many: bool) -> float:
        assert self.vllm is not None
        self.poison(self.vdest.array)
        self.drop_caches()
        tier = self.vllm.manager(self.dir / "vllm-one", self.vdest.view, self.chunk_bytes)
        jobs = self._vllm_jobs(many, load=True)
        start = self.window_start()
        for job in jobs:
            tier.submit_load(job)
        self.vllm.finish(tier, len(jobs))
        seconds = self.window_end(start)
        tier.shutdown()
        self.verify(self.vdest.array, None, "vLLM fs load")
        return seconds

    def read_probe(self) -> float:
        """The device's cold-read speed over the same bytes: every slab file of the store
        the TierIO loads read, read whole with ``O_DIRECT`` in 1 MiB pieces, 32 in flight
        (no index, no checks: what the device gives a reader that keeps it busy)."""
        self.drop_caches()
        from concurrent.futures import ThreadPoolExecutor

        files = sorted((self.dir / "tierkv-one").rglob("slab-0.kv"))
        fds = [os.open(path, os.O_RDONLY | os.O_DIRECT) for path in files]
        # The slots the chunks fill (a shard's are its first ones), not the file's
        # preallocated tail: the bytes the loads read, and their headers.
        used = [sum(1 for key in self.keys if shard_of(key) == shard) * slot_bytes_for(
            self.chunk_bytes) for shard in range(SHARDS)]
        local = threading.local()

        def read(fd: int, offset: int) -> int:
            if not hasattr(local, "buffer"):
                local.buffer = memoryview(mmap.mmap(-1, PROBE_PIECE))
            return os.preadv(fd, [local.buffer], offset)

        pieces = [(fd, offset) for fd, end in zip(fds, used)
                  for offset in range(0, end, PROBE_PIECE)]
        start = time.perf_counter()
        with ThreadPoolExecutor(PROBE_THREADS) as pool:
            total = sum(pool.map(lambda piece: read(*piece), pieces))
        seconds = time.perf_counter() - start
        for fd in fds:
            os.close(fd)
        assert total >= self.total, (total, self.total)
        return seconds

    def read_bare_lmdb_shards(self) -> float:
        """The load ceiling of the sharded layout: the bare shards written by
        ``write_bare_lmdb_shards`` read by one thread each, every value copied into its slot
        (no header, no checksum)."""
        self.poison(self.dest.tensor.numpy())
        self.drop_caches()
        root = self.dir / "lmdb-shards"
        envs = [lmdb.open(str(root / StoreLayout.shard_name(shard)), readonly=True, readahead=True)
                for shard in range(SHARDS)]
        dest = self.dest.tensor.numpy()

        def read(shard: int) -> None:
            with envs[shard].begin(buffers=True) as txn:
                for i in range(self.num_chunks):
                    if shard_of(self.keys[i]) == shard:
                        value = txn.get(self.keys[i])
                        assert value is not None
                        dest[i] = np.frombuffer(value, np.uint8)

        seconds = self._per_shard(read, envs)
        self.verify(dest, None, "bare lmdb shards read")
        return seconds

    def read_files(self) -> float:
        self.poison(self.dest.tensor.numpy())
        self.drop_caches()
        root = self.dir / "files"
        start = time.perf_counter()
        for i in range(self.num_chunks):
            with open(root / self.keys[i].hex(), "rb", buffering=0) as handle:
                handle.readinto(self.dest.memoryview(i))
        seconds = time.perf_counter() - start
        self.verify(self.dest.tensor.numpy(), None, "file per chunk")
        return seconds

    def read_dd(self) -> float:
        self.drop_caches()
        command = ["dd", f"if={self.dir / 'dd' / 'dd.bin'}", "of=/dev/null",
                   f"bs={self.chunk_bytes}", "status=none"]
        start = time.perf_counter()
        subprocess.run(command, check=True)
        return time.perf_counter() - start

    # -- driving ---------------------------------------------------------------------------

    def methods(self) -> tuple[dict[str, Callable[[], float]], dict[str, Callable[[], float]]]:
        args = self.args
        writes: dict[str, Callable[[], float]] = {
            "tierkv periodic + sync": lambda: self.write_tierkv("periodic"),
            "tierkv TierIO + flush": self.write_disk_io,
            "tierkv TierIO one job": self.write_disk_io_one,
            "tierkv TierIO many jobs": self.write_disk_io_many,
            "tierkv one job, slots reused": lambda: self.write_disk_io_reused(False),
            "tierkv many jobs, slots reused": lambda: self.write_disk_io_reused(True),
        }
        if self.vllm is not None:
            writes["vLLM fs one job"] = lambda: self.write_vllm(False)
            writes["vLLM fs many jobs"] = lambda: self.write_vllm(True)
        writes.update({
            "dd conv=fdatasync": self.write_dd,
            "bare lmdb + sync": self.write_bare_lmdb,
            f"bare lmdb x{SHARDS} threads": self.write_bare_lmdb_shards,
            f"bare slab x{SHARDS} threads": self.write_bare_slabs,
            "file per chunk + fsync": self.write_files,
        })
        if not args.no_always:
            writes["tierkv sync_mode=always"] = lambda: self.write_disk_io_one("always")
            writes["tierkv always, put_many"] = lambda: self.write_tierkv("always")
        reads: dict[str, Callable[[], float]] = {}
        if not args.no_cold:
            reads = {
                "tierkv read_into (in order)": lambda: self.read_tierkv(False),
                "tierkv read_into (random)": lambda: self.read_tierkv(True),
                "load: tierkv TierIO one job": lambda: self.load_disk_io(False),
                "load: tierkv TierIO many jobs": lambda: self.load_disk_io(True),
            }
            if self.vllm is not None:
                reads["load: vLLM fs one job"] = lambda: self.load_vllm(False)
                reads["load: vLLM fs many jobs"] = lambda: self.load_vllm(True)
            if args.parts:
                reads["parts: TP 2 own parts"] = self.read_own_parts
                reads["parts: TP 2 from 1 part"] = self.read_tp2_from_one
                reads["parts: TP 1 from 2 parts"] = self.read_tp1_from_two
            reads[PROBE] = self.read_probe
            reads[f"bare lmdb x{SHARDS} threads read"] = self.read_bare_lmdb_shards
            reads[f"bare slab x{SHARDS} threads read"] = self.read_bare_slabs
            reads["file per chunk"] = self.read_files
            reads["dd of=/dev/null"] = self.read_dd
        return writes, reads

    def profile(self) -> None:
        profiler = cProfile.Profile()
        seconds = self.write_tierkv("periodic", profiler)
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(12)
        lines = [line for line in out.getvalue().splitlines() if line.strip()]
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        print(f"profile of one tierkv periodic write ({self.total / MiB / seconds:.0f} MiB/s "
              f"under cProfile), by own time:")
        for line in lines[start:]:
            print(f"    {line}")


def summarize(name: str, seconds: list[float], total: int,
              cpu: list[float] | None = None, window: list[float] | None = None) -> float:
    rates = sorted(total / MiB / s for s in seconds)
    median = statistics.median(rates)
    gib = total / (1 << 30)
    per_gib = "" if not cpu else f"   CPU {statistics.median(cpu) / gib:.2f} s/GiB"
    if window:
        per_gib += f" ({statistics.median(window) / gib:.2f} timed)"
    print(f"  {name:<30} {median:8.0f} MiB/s   (min {rates[0]:.0f}, max {rates[-1]:.0f}, "
          f"n={len(rates)}){per_gib}")
    return median


def run_size(args: argparse.Namespace, chunk_mib: float, vllm: VllmFs | None,
             fs_type: str) -> dict[str, float]:
    bench = Bench(args, chunk_mib, vllm)
    bench.dir.mkdir(parents=True, exist_ok=True)
    print(f"\n== chunk {bench.chunk_mib:g} MiB: {bench.num_chunks} chunks = "
          f"{bench.total / MiB:.0f} MiB per run, {args.batch_mib:g} MiB per txn, "
          f"{args.rounds} rounds + 1 warm-up, dir {args.dir} ({fs_type})")
    writes, reads = bench.methods()
    results: dict[str, list[float]] = {name: [] for name in [*writes, *reads]}
    cpu: dict[str, list[float]] = {name: [] for name in [*writes, *reads]}
    window: dict[str, list[float]] = {name: [] for name in [*writes, *reads]}  # timed part
    try:
        # Writes first, then loads: a page-cache drop between writes would hand some writers
        # freshly reclaimed memory and others the pages their own deleted output freed.
        for phase in (writes, reads):
            for round_number in range(args.rounds + 1 if phase else 0):
                # each round starts one method later: no method always runs right after
                # the same other one (a device's lag from one write pattern to the next)
                order = list(phase.items())
                shift = round_number % len(order)
                for name, run in order[shift:] + order[:shift]:
                    bench.window_cpu = None
                    used = cpu_seconds()
                    seconds = run()
                    used = cpu_seconds() - used
                    if round_number > 0:
                        results[name].append(seconds)
                        cpu[name].append(used)
                        if bench.window_cpu is not None:
                            window[name].append(bench.window_cpu)
                label = "warm-up" if round_number == 0 else f"round {round_number}/{args.rounds}"
                kind = "writes" if phase is writes else "cold loads"
                print(f"  ... {bench.chunk_mib:g} MiB {kind} {label} done", file=sys.stderr)
        if args.profile:
            bench.profile()
    finally:
        shutil.rmtree(bench.dir, ignore_errors=True)
    if vllm is not None:
        print(f"  vLLM fs tier: O_DIRECT {'on' if bench.o_direct else 'off (buffered)'}, "
              f"durable by {args.vllm_sync}")
    print("durable writes:")
    medians = {name: summarize(name, results[name], bench.total, cpu[name], window[name])
               for name in writes}
    if reads:
        print("cold loads" + ("" if bench.can_drop else " (page cache NOT dropped: warm)") +
              " (all but dd verified byte-exact and by checksum):")
        medians.update({name: summarize(name, results[name], bench.total, cpu[name],
                                        window[name]) for name in reads})
    # CPU s/GiB: "cpu:" the whole round (poison, cache drop, open, verify included), "timed
    # cpu:" the timed part only (what the targets judge)
    gib = bench.total / (1 << 30)
    for name in [*writes, *reads]:
        if cpu[name]:
            medians[f"cpu: {name}"] = statistics.median(cpu[name]) / gib
        if window[name]:
            medians[f"timed cpu: {name}"] = statistics.median(window[name]) / gib
    print("ratios (of medians):")
    for label, top, bottom, target in RATIOS:
        if top in medians and bottom in medians:
            ratio = medians[top] / medians[bottom]
            verdict = "" if target is None else (
                f"   target >= {target:g}: {'met' if ratio >= target else 'MISSED'}")
            print(f"  {label:<34} {ratio:5.2f}x{verdict}")
    for label, top, bottom, most in CPU_RATIOS:
        for prefix, what in (("timed cpu", "timed"), ("cpu", "round")):
            if f"{prefix}: {top}" in medians and f"{prefix}: {bottom}" in medians:
                ratio = medians[f"{prefix}: {top}"] / medians[f"{prefix}: {bottom}"]
                verdict = "" if prefix == "cpu" else \
                    f"   target <= {most:g}: {'met' if ratio <= most else 'MISSED'}"
                print(f"  {label + ' (' + what + ')':<42} {ratio:5.2f}x{verdict}")
    return medians


STUB_LIBS = ("libnvrtc.so.13", "libc10_cuda.so", "libtorch_cuda.so")


def with_cuda_stubs(args: argparse.Namespace) -> None:
    """vLLM's C io (``vllm.fs_io_C``) links CUDA libraries it never calls on this path; on
    a machine without them, build empty stand-ins (gcc) and run again with them on
    ``LD_LIBRARY_PATH``, so that vLLM's fs tier runs its C io, not its slower Python io."""
    if args.no_vllm or os.environ.get("TIERKV_BENCH_STUBS") or args.vllm_io != "c":
        return
    found = subprocess.run([sys.executable, "-c", "import torch, vllm.fs_io_C"],
                           capture_output=True, text=True)
    if found.returncode == 0 or shutil.which("gcc") is None:
        return
    stubs = args.dir / "cuda-stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    source = stubs / "stub.c"
    source.write_text("void tierkv_bench_cuda_stub(void) {}\n")
    for name in STUB_LIBS:
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(stubs / name), str(source)],
                       check=True)
    environ = dict(os.environ, TIERKV_BENCH_STUBS=str(stubs),
                   LD_LIBRARY_PATH=f"{stubs}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    os.execve(sys.executable, [sys.executable, *sys.argv], environ)


PLOTTED = [
    Panel("cold loads (page cache dropped)", "MiB/s (median)", [
        ("load: tierkv TierIO one job", "tierkv, one request", "C0-o"),
        ("load: tierkv TierIO many jobs", "tierkv, many requests", "C0--o"),
        ("load: vLLM fs one job", "vLLM fs, one request", "C1-s"),
        ("load: vLLM fs many jobs", "vLLM fs, many requests", "C1--s"),
        (PROBE, "device probe (O_DIRECT, 32 in flight)", "k:^"),
        ("dd of=/dev/null", "dd (buffered, sequential)", "C7:v")]),
    Panel("durable writes", "MiB/s (median)", [
        ("tierkv TierIO one job", "tierkv, one request", "C0-o"),
        ("tierkv TierIO many jobs", "tierkv, many requests", "C0--o"),
        ("vLLM fs one job", "vLLM fs, one request", "C1-s"),
        ("vLLM fs many jobs", "vLLM fs, many requests", "C1--s"),
        ("dd conv=fdatasync", "dd conv=fdatasync", "C7:v")]),
]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot is not None:
        pyplot()  # before minutes of measuring
    with_cuda_stubs(args)
    args.dir.mkdir(parents=True, exist_ok=True)
    tuned = tune_malloc(int(args.batch_mib * MiB))  # what opening a DiskTier does; once
    fs_type = subprocess.run(["stat", "-f", "-c", "%T", str(args.dir)], capture_output=True,
                             text=True).stdout.strip()
    vllm, why = (None, "--no-vllm") if args.no_vllm else load_vllm()
    print(f"disk tier benchmark: chunk sizes {', '.join(f'{s:g}' for s in args.chunk_sizes)} "
          f"MiB, {args.rounds} rounds + 1 warm-up, malloc tuned: "
          f"{'yes' if tuned else 'no (TIERKV_MALLOPT=0 or not glibc)'}")
    if vllm is None:
        print(f"vLLM fs tier: left out ({why})")
    else:
        probe = args.dir / f"probe-{os.getpid()}"
        probe.mkdir(exist_ok=True)
        o_direct = vllm.probe_o_direct(str(probe))
        probe.rmdir()
        print(f"vLLM fs tier: vllm {vllm.version} FileSystemTierManager, {vllm.io_path}, "
              f"O_DIRECT {'works' if o_direct else 'refused (buffered)'} in {args.dir}")
    by_size = {size: run_size(args, size, vllm, fs_type) for size in args.chunk_sizes}
    if args.out_json is not None:
        args.out_json.write_text(json.dumps({f"{size:g}": medians
                                             for size, medians in by_size.items()}, indent=1))
    if args.plot is not None:  # median MiB/s against the chunk size
        lines(args.plot, by_size, PLOTTED, xlabel="chunk size (MiB)",
              title=f"disk tier against vLLM's fs tier "
                    f"({vllm.io_path if vllm is not None else 'vLLM left out'})")
    print("\ntargets (ratios of medians) by chunk size, ! = missed:")
    print(f"  {'':<34} " + " ".join(f"{f'{s:g} MiB':>9}" for s in by_size) + "   target")
    for label, top, bottom, target in RATIOS[:TARGET_RATIOS]:
        cells = []
        for medians in by_size.values():
            if top in medians and bottom in medians:
                ratio = medians[top] / medians[bottom]
                missed = target is not None and ratio < target
                cells.append(f"{ratio:5.2f}x{'!' if missed else ' '}".rjust(9))
            else:
                cells.append("-".rjust(9))
        if any(cell.strip() != "-" for cell in cells):
            print(f"  {label:<34} " + " ".join(cells) + f"   >= {target:g}")
    for label, top, bottom, most in CPU_RATIOS:
        cells = []
        for medians in by_size.values():
            if f"timed cpu: {top}" in medians and f"timed cpu: {bottom}" in medians:
                ratio = medians[f"timed cpu: {top}"] / medians[f"timed cpu: {bottom}"]
                cells.append(f"{ratio:5.2f}x{'!' if ratio > most else ' '}".rjust(9))
            else:
                cells.append("-".rjust(9))
        if any(cell.strip() != "-" for cell in cells):
            print(f"  {label:<34} " + " ".join(cells) + f"   <= {most:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
