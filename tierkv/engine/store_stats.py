"""What :class:`~tierkv.engine.store.TierKVStore` reports: plain frozen dataclasses.

- :class:`LoadHandle` what ``load()`` started.
- :class:`StoreStats` ``statistics()``: the index's counters, bytes and seconds per path
  (:class:`PathStats`), the remote tier's (:class:`RemoteStats`) and the load shortfall
  by cause (:class:`LoadShortfall`, a snapshot of the store's :class:`ShortfallCounts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierkv.core.figures import Snapshot, counter
from tierkv.core.index import IndexStats
from tierkv.core.jobs import JobId

if TYPE_CHECKING:
    from tierkv.tiers.remote.tier import RemoteStatistics
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
    cpu_to_gpu: PathStats  # includes disk -> CPU reads of promoted chunks
    cpu_to_disk: PathStats
    chunk_bytes: int
    remote: RemoteStats | None = None  # None: no remote tier
    load_shortfall: LoadShortfall = LoadShortfall()


@dataclass(frozen=True)
class RemoteStats:
    """The remote tier's figures: its counters, its pushes and the lookups asked of it."""

    tier: RemoteStatistics
    pushes: RemoteIOStatistics | None  # None: remote.push="read_only"
    lookups: RemoteLookupStatistics
