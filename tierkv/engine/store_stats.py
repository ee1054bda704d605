"""What :class:`~tierkv.engine.store.TierKVStore` reports: plain frozen dataclasses.

- :class:`LoadHandle` what ``load()`` started.
- :class:`PathCounts` bytes, seconds and failed jobs per path (``bytes_gpu_to_cpu``, ...),
  counted by ``add(completion)``: the store's and the worker's one accounting. A byte moves
  on one path once: a load from disk counts its read on ``disk_to_cpu`` and its copy on
  ``cpu_to_gpu``.
- :class:`CompletionCounts` the vLLM scheduler side's ``bytes_completed``.
- :class:`StoreStats` ``statistics()``: the index's counters, bytes and seconds per path
  (:class:`PathStats`), the remote tier's (:class:`RemoteStats`) and the load shortfall
  by cause (:class:`LoadShortfall`, a snapshot of the store's :class:`ShortfallCounts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.core.figures import Snapshot, counter
from tierkv.core.stats import IndexStats
from tierkv.core.jobs import Completion, JobId, JobKind

if TYPE_CHECKING:
    from tierkv.tiers.remote.stats import RemoteStatistics
    from tierkv.tiers.remote.pushes import RemoteIOStatistics
    from tierkv.tiers.remote.lookup import RemoteLookupStatistics


@dataclass(frozen=True)
class LoadHandle:
    """What ``load()`` started: its job (None: nothing to load) and how many chunks of the
    keys' prefix it loads, from which tier."""

    job_id: JobId | None
    num_chunks: int  # chunks the job loads (a prefix of the keys asked for)
    num_from_disk: int
    num_from_remote: int = 0


@dataclass
class PathCounts:
    """Bytes, seconds and failed jobs of finished jobs, per path (a job's kind: a store
    moves GPU -> CPU, a load CPU -> GPU, a spill CPU -> disk; a load's reads from the disk
    and remote tiers into CPU slots have paths of their own, disk -> CPU and remote -> CPU):
    figures ``bytes_<path>``, ``seconds_<path>`` and ``failed_jobs_<path>`` (the jobs'
    paths), counted once per job by :meth:`add`, each byte on one path."""

    bytes_gpu_to_cpu: int = counter("Bytes moved by finished stores (GPU -> CPU)")
    seconds_gpu_to_cpu: float = counter("Seconds spent in finished stores (GPU -> CPU)")
    failed_jobs_gpu_to_cpu: int = counter("Stores that failed (GPU -> CPU)")
    bytes_cpu_to_gpu: int = counter("Bytes moved by finished loads (CPU -> GPU)")
    seconds_cpu_to_gpu: float = counter("Seconds spent in finished loads' copies (CPU -> GPU)")
    failed_jobs_cpu_to_gpu: int = counter("Loads that failed (their chunks are misses)")
    bytes_cpu_to_disk: int = counter("Bytes moved by finished spills (CPU -> disk)")
    seconds_cpu_to_disk: float = counter("Seconds spent in finished spills (CPU -> disk)")
    failed_jobs_cpu_to_disk: int = counter("Spills that failed (CPU -> disk)")
    bytes_disk_to_cpu: int = counter("Bytes finished loads read from disk into CPU slots")
    seconds_disk_to_cpu: float = counter("Seconds finished loads spent reading from disk")
    bytes_remote_to_cpu: int = counter("Bytes finished loads read from the remote tier into "
                                       "CPU slots")
    seconds_remote_to_cpu: float = counter("Seconds finished loads spent reading from the "
                                           "remote tier")

    def add(self, completion: Completion) -> None:
        """Count one finished job on its path."""
        kind, failed = completion.kind, not completion.ok
        if kind is JobKind.STORE:
            self.bytes_gpu_to_cpu += completion.num_bytes
            self.seconds_gpu_to_cpu += completion.seconds
            self.failed_jobs_gpu_to_cpu += failed
        elif kind is JobKind.LOAD:
            reads = completion.reads  # in parallel, before the copy
            self.bytes_cpu_to_gpu += completion.num_bytes
            self.seconds_cpu_to_gpu += max(
                completion.seconds - max((read.seconds for read in reads), default=0.0), 0.0)
            self.failed_jobs_cpu_to_gpu += failed
            for read in reads:
                if read.tier == "disk":
                    self.bytes_disk_to_cpu += read.num_bytes
                    self.seconds_disk_to_cpu += read.seconds
                else:
                    self.bytes_remote_to_cpu += read.num_bytes
                    self.seconds_remote_to_cpu += read.seconds
        else:
            self.bytes_cpu_to_disk += completion.num_bytes
            self.seconds_cpu_to_disk += completion.seconds
            self.failed_jobs_cpu_to_disk += failed

    def path(self, kind: JobKind) -> PathStats:
        """The bytes and seconds of ``kind``'s path."""
        if kind is JobKind.STORE:
            return PathStats(self.bytes_gpu_to_cpu, self.seconds_gpu_to_cpu)
        if kind is JobKind.LOAD:
            return PathStats(self.bytes_cpu_to_gpu, self.seconds_cpu_to_gpu)
        return PathStats(self.bytes_cpu_to_disk, self.seconds_cpu_to_disk)

    def read_path(self, tier: str) -> PathStats:
        """The bytes and seconds loads read from ``tier`` (``"disk"``, ``"remote"``)."""
        if tier == "disk":
            return PathStats(self.bytes_disk_to_cpu, self.seconds_disk_to_cpu)
        return PathStats(self.bytes_remote_to_cpu, self.seconds_remote_to_cpu)


@dataclass
class CompletionCounts:
    """The vLLM scheduler side's own figure (the index's and the adapter's are on their
    records; the workers count :class:`PathCounts`)."""

    bytes_completed: int = counter("Bytes moved by the jobs the workers reported finished, "
                                   "every path (a load's reads included)")


@dataclass
class ShortfallCounts:
    """Chunks a ``lookup()`` counted as hits that the ``load()`` of the same keys (the
    next one starting with the same key) did not deliver, by cause: the store's running
    counts (:class:`LoadShortfall` is their snapshot)."""

    gone: int = counter("Hits gone when the load came (evicted or deleted meanwhile)")
    no_room: int = counter("Hits not loaded for want of a CPU slot to load them through "
                           "(every slot in use by jobs in flight)")
    failed: int = counter("Hits planned that did not land (corrupt, missing on disk, a "
                          "failed copy)")


@dataclass(unsafe_hash=True)
class LoadShortfall(Snapshot, ShortfallCounts):
    """``statistics().load_shortfall``: a read-only snapshot of :class:`ShortfallCounts`."""


@dataclass(frozen=True)
class PathStats:
    num_bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class StoreStats:
    index: IndexStats
    gpu_to_cpu: PathStats
    cpu_to_gpu: PathStats  # the copies only: a load's reads are on disk_to_cpu, remote_to_cpu
    cpu_to_disk: PathStats
    chunk_bytes: int
    remote: RemoteStats | None = None  # None: no remote tier
    load_shortfall: LoadShortfall = LoadShortfall()
    disk_to_cpu: PathStats = PathStats(0, 0.0)
    remote_to_cpu: PathStats = PathStats(0, 0.0)


@dataclass(frozen=True)
class RemoteStats:
    """The remote tier's figures: its counters, its pushes and the lookups asked of it."""

    tier: RemoteStatistics
    pushes: RemoteIOStatistics | None  # None: remote.push="read_only"
    lookups: RemoteLookupStatistics
