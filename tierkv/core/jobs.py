"""Plain-data job specs and completions: the only things that cross the seam between
the scheduler side (decides) and the worker side (moves bytes).

- :class:`StoreSpec`  GPU blocks -> CPU slots (one chunk per slot).
- :class:`LoadSpec`   CPU slots -> GPU blocks; a chunk with ``from_disk`` (``from_remote``)
  is first read from the disk (remote) tier into its slot.
- :class:`SpillSpec`  CPU slots -> disk tier, plus disk deletes chosen by the scheduler
  side (deletes run before writes).
- :class:`Completion` what the worker reports for one job: its kind and the bytes it
  moved travel with it, so whoever receives one routes and counts it without a table of
  job id -> kind.

Job ids are allocated by :class:`JobIds` (monotonic, never reused in one process).
Specs are NamedTuples: immutable plain data, and about 3x cheaper to build than frozen
dataclasses. A store spec is columnar (keys, slots, flat block ids): the scheduler side
builds it for every running request each step without an object per chunk.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import NamedTuple, NewType

JobId = NewType("JobId", int)
SlotId = NewType("SlotId", int)
Key = bytes
# A load's block id for a page the engine does not hold there (a sliding-window group's
# block before the window, a page of the engine's own prefix hit): left untouched.
NO_BLOCK = -1


class JobKind(Enum):
    STORE = "store"
    LOAD = "load"
    SPILL = "spill"


class ChunkCopy(NamedTuple):
    """One chunk moving between GPU blocks and a CPU slot."""

    key: Key
    slot: SlotId
    block_ids: tuple[int, ...]
    from_disk: bool = False  # loads only: read the disk tier into the slot first
    # Loads only: the first ``skip_blocks`` blocks of the chunk are already on the GPU
    # (the engine's local prefix hit) and must not be written; so is every ``NO_BLOCK``.
    skip_blocks: int = 0
    from_remote: bool = False  # loads only: read the remote tier into the slot first
    # Loads from disk or remote only: the part count the chunk is read from, when it is not
    # this engine's own (0): a writer at another tensor-parallel size (docs/on-disk-format.md,
    # "Parts"); the worker re-slices its heads from those parts.
    parts: int = 0


class StoreSpec(NamedTuple):
    """GPU blocks -> CPU slots, by columns (see the module docstring): chunk ``i`` is
    ``keys[i]``, copied into ``slots[i]`` from ``block_ids[i * n : (i + 1) * n]``, n =
    blocks per chunk; ``chunks`` is the per-chunk view for the worker side."""

    job_id: JobId
    keys: tuple[Key, ...]
    slots: tuple[SlotId, ...]
    block_ids: tuple[int, ...]
    kind: JobKind = JobKind.STORE

    @classmethod
    def of(cls, job_id: JobId, chunks: Iterable[ChunkCopy]) -> StoreSpec:
        """A store spec from per-chunk copies, which must all have as many blocks (the
        flat block ids could not tell where a shorter chunk ends)."""
        chunks = tuple(chunks)
        lengths = {len(c.block_ids) for c in chunks}
        if len(lengths) > 1:
            raise ValueError(f"store job {job_id}: its chunks have {sorted(lengths)} block ids; "
                             f"every chunk of a store has blocks_per_chunk of them")
        return cls(job_id, tuple(c.key for c in chunks), tuple(c.slot for c in chunks),
                   tuple(block for c in chunks for block in c.block_ids))

    @property
    def blocks_per_chunk(self) -> int:
        return len(self.block_ids) // len(self.keys) if self.keys else 0

    @property
    def chunks(self) -> tuple[ChunkCopy, ...]:
        """One :class:`ChunkCopy` per chunk (built on each access)."""
        n = self.blocks_per_chunk
        blocks = self.block_ids
        return tuple(ChunkCopy(key, slot, blocks[i * n : (i + 1) * n])
                     for i, (key, slot) in enumerate(zip(self.keys, self.slots)))


class LoadSpec(NamedTuple):
    job_id: JobId
    chunks: tuple[ChunkCopy, ...]
    kind: JobKind = JobKind.LOAD


class SpillSpec(NamedTuple):
    job_id: JobId
    writes: tuple[tuple[Key, SlotId], ...]
    deletes: tuple[Key, ...] = ()
    kind: JobKind = JobKind.SPILL


JobSpec = StoreSpec | LoadSpec | SpillSpec


class TierRead(NamedTuple):
    """What a load read from a lower tier (``tier``: ``"disk"`` or ``"remote"``) into CPU
    slots before its copy to the GPU: a path of its own (``disk_to_cpu``,
    ``remote_to_cpu``), never counted in the copy's bytes."""

    tier: str
    num_bytes: int
    seconds: float


class Completion(NamedTuple):
    """A finished job. ``kind`` is its spec's kind (its creator copies it from the spec);
    ``num_bytes``: the bytes that reached its destination (a load: the GPU; what it read
    from disk or the remote tier first is in ``reads``, each path counted once);
    ``seconds``: the whole job (a load: its reads, then its copy). ``failed_keys`` did not land;
    ``corrupt_keys`` (loads) failed their checks on disk and were deleted there;
    ``full_keys`` (spills) found the disk full; ``missing_keys`` (loads) were not on disk
    at all (gone behind the index's back)."""

    job_id: JobId
    kind: JobKind
    ok: bool
    num_bytes: int = 0
    seconds: float = 0.0
    failed_keys: tuple[Key, ...] = ()
    corrupt_keys: tuple[Key, ...] = ()
    full_keys: tuple[Key, ...] = ()
    error: str | None = None
    missing_keys: tuple[Key, ...] = ()
    reads: tuple[TierRead, ...] = ()

    @property
    def bytes_moved(self) -> int:
        """Bytes the job moved on every path: its own and its reads'."""
        return self.num_bytes + sum(read.num_bytes for read in self.reads)


def failed_set(completion: Completion, keys: tuple[Key, ...]) -> set[Key]:
    """The keys of a job that did not land (failed, corrupt, full or missing). A completion
    that is not ok and names no keys failed as a whole; one that names keys failed for
    exactly those."""
    named = set(completion.failed_keys) | set(completion.corrupt_keys) | \
        set(completion.full_keys) | set(completion.missing_keys)
    if not named:
        return set() if completion.ok else set(keys)
    return named


class JobIds:
    """Monotonic job ids."""

    def __init__(self, start: int = 1) -> None:
        self._next = start

    def allocate(self) -> JobId:
        job_id = JobId(self._next)
        self._next += 1
        return job_id


class CompletionTracker:
    """A job is complete only when every one of ``world_size`` workers reported it.

    ``report`` returns the merged completion once the last rank reports, else None.
    The merge is ok only if every rank was ok; failed/corrupt/full keys are unioned.
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._pending: dict[JobId, list[Completion]] = {}  # job -> the ranks' reports so far

    def report(self, completion: Completion) -> Completion | None:
        if self.world_size == 1:
            return completion
        parts = self._pending.setdefault(completion.job_id, [])
        parts.append(completion)
        if len(parts) < self.world_size:
            return None
        del self._pending[completion.job_id]
        return merge_completions(parts)


def _union(groups: list[tuple[Key, ...]]) -> tuple[Key, ...]:
    return tuple(dict.fromkeys(key for group in groups for key in group))


def merge_completions(parts: list[Completion]) -> Completion:
    """One completion from every rank's report of one job (see CompletionTracker)."""
    errors = [p.error for p in parts if p.error]
    assert all(p.kind is parts[0].kind for p in parts), "a job's ranks report one kind"
    return Completion(
        job_id=parts[0].job_id,
        kind=parts[0].kind,
        ok=all(p.ok for p in parts),
        num_bytes=sum(p.num_bytes for p in parts),
        seconds=max(p.seconds for p in parts),
        failed_keys=_union([p.failed_keys for p in parts]),
        corrupt_keys=_union([p.corrupt_keys for p in parts]),
        full_keys=_union([p.full_keys for p in parts]),
        error="; ".join(errors) if errors else None,
        missing_keys=_union([p.missing_keys for p in parts]),
        reads=tuple(read for p in parts for read in p.reads),
    )
