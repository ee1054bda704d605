"""RequestState: what the engine adapter tracks of one request; StoreBatch: a store job's
chunks, gathered run by run from the requests' states.

A request's block ids are position-major (``AdapterConfig.groups`` ids per block
position); a chunk's jobs list them group-major (:func:`group_major`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tierkv.core.jobs import NO_BLOCK, JobId
from tierkv.engine.requests import RequestView

__all__ = ["RequestState", "StoreBatch", "group_major"]


@dataclass(slots=True)
class RequestState:
    """One request the adapter holds (from its blocks until its last job is done)."""

    view: RequestView
    block_ids: list[int] = field(default_factory=list)
    stored_chunks: int = 0  # chunks [0, stored_chunks) were planned for store (or present)
    jobs: set[JobId] = field(default_factory=set)  # its jobs in flight
    finished: bool = False
    aborted: bool = False
    released: int = 0  # block positions of view.num_released_blocks noted for the fence
    # A load of it lost a chunk: the engine recomputes it, and its next lookups hit nothing
    # (a chunk whose copy keeps failing is not loaded forever).
    reloads_refused: bool = False
    # Its last planned load's tokens by tier (cpu, disk, remote): take_load_sources.
    load_sources: tuple[int, int, int] | None = None


def group_major(ids: list[int], groups: int) -> list[int]:
    """One chunk's position-major block ids, group-major (see AdapterConfig.groups)."""
    out = ids[0::groups]
    for group in range(1, groups):
        out += ids[group::groups]
    return out


class StoreBatch:
    """Chunks to store in one job, laid end to end: a run per request (its keys and GPU
    blocks), ``ends`` where each run ends, ``owners`` the request of each run.
    ``grouped``: block lists that may lack pages (several groups, released blocks): each
    chunk is checked, and ``without_pages`` counts those left out."""

    __slots__ = ("keys", "block_ids", "ends", "owners", "without_pages", "_bpc", "_positions",
                 "_groups", "_grouped", "_contains")

    def __init__(self, blocks_per_chunk: int, groups: int, grouped: bool,
                 contains: Callable[[bytes], bool]) -> None:
        self.keys: list[bytes] = []
        self.block_ids: list[int] = []
        self.ends: list[int] = []
        self.owners: list[RequestState] = []
        self.without_pages = 0
        self._positions = blocks_per_chunk
        self._groups = groups
        self._bpc = blocks_per_chunk * groups  # block ids per chunk
        self._grouped = grouped
        self._contains = contains

    def add(self, state: RequestState, first: int, end: int) -> None:
        """Chunks ``[first, end)`` of ``state``, planned for store from now on."""
        state.stored_chunks = end
        bpc = self._bpc
        if not self._grouped:  # the hot path: one run of keys and of block ids
            keys = self.keys
            keys += state.view.chunk_keys[first:end]
            self.block_ids += state.block_ids[first * bpc : end * bpc]
            self.ends.append(len(keys))
            self.owners.append(state)
            return
        # The chunks with a page the engine no longer holds (NO_BLOCK, or a released block:
        # view.num_released_blocks) are left out: never storable.
        chunk_keys, added = state.view.chunk_keys, False
        released, positions = state.view.num_released_blocks, self._positions
        for chunk in range(first, end):
            ids = state.block_ids[chunk * bpc : (chunk + 1) * bpc]
            if chunk * positions < released or NO_BLOCK in ids:
                if not self._contains(chunk_keys[chunk]):  # stored already: nothing lost
                    self.without_pages += 1
                continue
            self.keys.append(chunk_keys[chunk])
            self.block_ids += group_major(ids, self._groups)
            added = True
        if added:
            self.ends.append(len(self.keys))
            self.owners.append(state)

    def placed(self, placed: Iterable[int]) -> tuple[list[int], list[RequestState]]:
        """The block ids of the chunks ``placed`` (indices into ``keys``, ascending), and
        the requests with a chunk among them."""
        bpc, ends, candidates = self._bpc, self.ends, self.owners
        block_ids: list[int] = []
        owners: list[RequestState] = []
        run = 0
        for i in placed:
            while i >= ends[run]:
                run += 1
            if not owners or owners[-1] is not candidates[run]:
                owners.append(candidates[run])  # only requests with a chunk in the job
            block_ids += self.block_ids[i * bpc : (i + 1) * bpc]
        return block_ids, owners
