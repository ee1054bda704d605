"""What :class:`~tierkv.engine.store.TierKVStore` reports, one record per object
(:mod:`tierkv.core.figures`).

- :class:`LoadHandle`    what ``load()`` started.
- :class:`StoreStats`    the store's record (and the worker's): per path (``path[...]``,
  :data:`TRANSFER_PATHS`) a :class:`PathStats`, counted by ``add(completion)``: the store's
  and the worker's one accounting; the load shortfall by cause (:class:`LoadShortfall`).
  ``statistics()`` is its snapshot, with the index's and the remote tier's snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.core.figures import Record, counter, per
from tierkv.core.jobs import Completion, JobId, JobKind
from tierkv.core.stats import IndexStats
from tierkv.tiers.remote.stats import RemoteStatistics

# A job's path by its kind: figure keys bytes_<path>, seconds_<path>, durations_<path>, ...
PATH_NAMES = {JobKind.STORE: "gpu_to_cpu", JobKind.LOAD: "cpu_to_gpu", JobKind.SPILL: "cpu_to_disk"}
PATHS = tuple(PATH_NAMES.values())
# A load's reads into CPU slots, by the tier read: paths of their own (a byte is counted on
# one path only).
READ_PATHS = {"disk": "disk_to_cpu", "remote": "remote_to_cpu"}
TRANSFER_PATHS = (*PATHS, *READ_PATHS.values())


@dataclass(frozen=True)
class LoadHandle:
    """What ``load()`` started: its job (None: nothing to load) and how many chunks of the
    keys' prefix it loads, from which tier."""

    job_id: JobId | None
    num_chunks: int  # chunks the job loads (a prefix of the keys asked for)
    num_from_disk: int
    num_from_remote: int = 0


@dataclass(eq=False)
class PathStats(Record):
    """Bytes, seconds and failed jobs of the finished jobs on one path (a store moves
    GPU -> CPU, a load CPU -> GPU, a spill CPU -> disk; a load's reads from the disk and
    remote tiers into CPU slots have paths of their own, whose failures count with the
    load's copy on cpu_to_gpu)."""

    bytes: int = counter("Bytes moved by finished jobs on the path")
    seconds: float = counter("Seconds finished jobs spent on the path", default=0.0)
    failed_jobs: int = counter("Jobs on the path that failed (their chunks are misses)")

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(eq=False)
class LoadShortfall(Record):
    """Chunks a ``lookup()`` counted as hits that the ``load()`` of the same keys (the
    next one starting with the same key) did not deliver, by cause
    (``statistics().load_shortfall``)."""

    gone: int = counter("Hits gone when the load came (evicted or deleted meanwhile)")
    no_room: int = counter("Hits not loaded for want of a CPU slot to load them through "
                           "(every slot in use by jobs in flight)")
    failed: int = counter("Hits planned that did not land (corrupt, missing on disk, a "
                          "failed copy)")


@dataclass(eq=False, kw_only=True)
class StoreStats(Record):
    """The store's record (the worker's too: its paths); ``statistics()`` is a snapshot
    with ``index``, ``chunk_bytes`` and ``remote`` (None: no remote tier) set."""

    path: dict[str, PathStats] = per(TRANSFER_PATHS, PathStats)
    load_shortfall: LoadShortfall = field(default_factory=LoadShortfall)
    index: IndexStats = field(default_factory=IndexStats)
    chunk_bytes: int = 0
    remote: RemoteStatistics | None = None

    def add(self, completion: Completion) -> None:
        """Count one finished job on its path, and a load's reads on theirs."""
        path = self.path[PATH_NAMES[completion.kind]]
        path.bytes += completion.num_bytes
        path.failed_jobs += not completion.ok
        if completion.kind is JobKind.LOAD:
            reads = completion.reads  # in parallel, before the copy
            path.seconds += max(
                completion.seconds - max((read.seconds for read in reads), default=0.0), 0.0)
            for read in reads:
                read_path = self.path[READ_PATHS[read.tier]]
                read_path.bytes += read.num_bytes
                read_path.seconds += read.seconds
        else:
            path.seconds += completion.seconds


__all__ = ["LoadHandle", "LoadShortfall", "PATHS", "PATH_NAMES", "PathStats", "READ_PATHS",
           "StoreStats", "TRANSFER_PATHS"]
