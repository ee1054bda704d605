"""RequestState: the record of one request, everything the engine adapter (and the engine's
integration) keeps of it, from its first lookup until its last job is done; StoreBatch: a
store job's chunks, gathered run by run from the requests' records.

A request's block ids are kept as the engine gives them: one list per KV cache group
(``AdapterConfig.groups``), a block position's ids at the same index of each. A chunk's
jobs list its ids group after group (:meth:`RequestState.chunk_ids`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any, NoReturn, cast

from tierkv.core.jobs import NO_BLOCK, ChunkCopy, JobId
from tierkv.core.plans import LoadPlan
from tierkv.engine.requests import BlockIds, RequestView
from tierkv.errors import UsageError

if TYPE_CHECKING:
    from tierkv.engine.load_policy import Estimate, LoadStarted

__all__ = ["GroupLists", "RequestState", "StoreBatch", "per_group", "refuse_reuse"]

GroupLists = tuple[list[int], ...]  # a request's block ids, one list per group


def per_group(block_ids: BlockIds | Iterable[int], groups: int, req_id: str) -> GroupLists:
    """``block_ids`` as fresh per-group lists: one list per group as given, or a flat list
    of ids with one group. Anything else raises UsageError (nothing was changed)."""
    given: Sequence[object] = block_ids if isinstance(block_ids, (list, tuple)) \
        else list(block_ids)
    if not given:
        return tuple([] for _ in range(groups))
    first = given[0]
    if type(first) is not int and isinstance(first, Iterable):
        lists = tuple(list(ids) for ids in cast(Sequence[Sequence[int]], given))
        if len(lists) == groups:
            return lists
        what = f"{len(lists)} block lists"
    elif groups == 1:
        return (list(cast(Sequence[int], given)),)
    else:
        what = "one flat block list"
    raise UsageError(f"engine adapter: request {req_id!r} was given {what}, but "
                     f"AdapterConfig.groups is {groups}: pass one list of block ids per KV "
                     f"cache group (a flat list only with one group). Nothing was changed.")


def refuse_reuse(req_id: str) -> NoReturn:
    """The adapter's refusal of a request id that came back too soon (nothing changed)."""
    raise UsageError(
        f"engine adapter: request id {req_id!r} came back before the request that "
        f"finished under it was let go (its last stores planned, none of its jobs in "
        f"flight); request ids must be unique (the fence tells requests apart by id: a "
        f"block of the old request handed to the new one would not be flushed). Nothing "
        f"was changed.")


@dataclass(slots=True, eq=False)
class RequestState:
    """One request's record (``EngineAdapter.records``): created at its first lookup (or when
    the engine first names it), released once it finished and its last job is done."""

    view: RequestView
    block_ids: GroupLists  # one list per KV cache group (position p: index p of each)
    stored_chunks: int = 0  # chunks [0, stored_chunks) were planned for store (or present)
    jobs: set[JobId] = field(default_factory=set)  # its jobs in flight
    finished: bool = False
    aborted: bool = False
    last_plan_due: bool = False  # finished; the next plan stores its last chunks
    released: int = 0  # block positions of view.num_released_blocks noted for the fence
    # A load of it lost a chunk: the engine recomputes it, and its next lookups hit nothing
    # (a chunk whose copy keeps failing is not loaded forever).
    reloads_refused: bool = False
    # Its load in flight: a lookup while it runs (the load was cut at its deadline, and
    # the engine asks again) hits nothing: its chunks are recomputed, never waited for.
    load_job: JobId | None = None
    load_started: LoadStarted | None = None  # that load's timing (a cost-aware load's)
    # Its last planned load's tokens by tier (cpu, disk, remote): take_load_sources.
    load_sources: tuple[int, int, int] | None = None
    # When its lookups first heard "not yet": waiting on a promotion or the remote tier,
    # and on a store of the chunk after its hit (each bounded by promotion_wait_seconds).
    not_yet_since: float | None = None
    store_wait_since: float | None = None
    # Its last lookup's decisions, valid until the plan numbered ``decided`` is built: the
    # chunks of a same-step load (taken from the step's budget) and the load's estimate.
    decided: int = -1
    sync_chunks: int = 0
    estimate: Estimate | None = None
    # What the engine's integration keeps of the request while it runs (the vLLM
    # connector: vLLM's request and its chunk keys); dropped when it finishes.
    engine: Any = None

    def positions(self) -> int:
        """Block positions every group holds an id for (groups may grow unevenly)."""
        return min(map(len, self.block_ids))

    def take_blocks(self, lists: GroupLists, replaced: bool) -> None:
        """The engine's new blocks (``replaced``: its whole block lists) of a step."""
        if replaced:
            self.block_ids, self.released = lists, 0
        else:
            for ids, more in zip(self.block_ids, lists):
                ids += more

    def blocks(self, low: int = 0, high: int | None = None) -> Iterator[int]:
        """The ids of block positions ``[low, high)`` of every group, group after group."""
        if not low and high is None:
            return chain.from_iterable(self.block_ids)
        return chain.from_iterable(ids[low:high] for ids in self.block_ids)

    def load_copies(self, plan: LoadPlan, start: int, first_new: int, num_local_tokens: int,
                    tpc: int, bpc: int, sparse: bool,
                    source_parts: Callable[[bytes, bool], int] | None,
                    ) -> tuple[list[ChunkCopy], tuple[int, int, int]]:
        """The copies of ``plan`` (its chunks from chunk ``start`` on) into this request's
        blocks from position ``first_new`` (``tpc``, ``bpc``: tokens and block positions per
        chunk; ``sparse``: lists that may lack pages), and its tokens from the CPU, disk and
        remote tiers (past ``num_local_tokens``). ``source_parts``: the part count a disk or
        remote chunk is read from (0: this engine's own)."""
        chunks = []
        tokens_by_tier = [0, 0, 0]  # cpu, disk, remote
        skip_first, from_remote = first_new - start * bpc, plan.from_remote
        for position, (key, slot, from_disk) in enumerate(plan.chunks):
            chunk = start + position
            skip = skip_first if position == 0 else 0
            if not sparse:
                blocks = tuple(self.block_ids[0][chunk * bpc : (chunk + 1) * bpc])
            else:  # the local hit's pages (each group's leading ones) as NO_BLOCK: untouched
                blocks = tuple(self.chunk_ids(chunk * bpc, (chunk + 1) * bpc, skip))
                skip = 0
            remote = key in from_remote
            parts = source_parts(key, remote) if (from_disk or remote) \
                and source_parts is not None else 0
            chunks.append(ChunkCopy(key, slot, blocks, from_disk, skip, remote, parts))
            # Only the first chunk is partial (the local hit's tokens are not loaded).
            tokens_by_tier[1 if from_disk else 2 if remote else 0] += \
                min(tpc, (chunk + 1) * tpc - num_local_tokens)
        cpu, disk, remote_tokens = tokens_by_tier
        return chunks, (cpu, disk, remote_tokens)

    def chunk_ids(self, low: int, high: int, skip: int = 0) -> list[int]:
        """Block positions ``[low, high)`` of each group, group after group (a chunk's jobs
        list them so); each group's first ``skip`` positions as NO_BLOCK."""
        out: list[int] = []
        for ids in self.block_ids:
            if skip:
                out += [NO_BLOCK] * skip
            out += ids[low + skip : high]
        return out


class StoreBatch:
    """Chunks to store in one job, laid end to end: a run per request (its keys and GPU
    blocks), ``ends`` where each run ends, ``owners`` the request of each run.
    ``grouped``: block lists that may lack pages (several groups, released blocks): each
    chunk is checked, and ``without_pages`` counts those left out."""

    __slots__ = ("keys", "block_ids", "ends", "owners", "without_pages", "_bpc", "_positions",
                 "_grouped", "_contains")

    def __init__(self, blocks_per_chunk: int, groups: int, grouped: bool,
                 contains: Callable[[bytes], bool]) -> None:
        self.keys: list[bytes] = []
        self.block_ids: list[int] = []
        self.ends: list[int] = []
        self.owners: list[RequestState] = []
        self.without_pages = 0
        self._positions = blocks_per_chunk
        self._bpc = blocks_per_chunk * groups  # block ids per chunk
        self._grouped = grouped
        self._contains = contains

    def add(self, state: RequestState, first: int, end: int) -> None:
        """Chunks ``[first, end)`` of ``state``, planned for store from now on."""
        state.stored_chunks = end
        positions = self._positions
        if not self._grouped:  # the hot path: one group, one run of keys and of block ids
            keys = self.keys
            keys += state.view.chunk_keys[first:end]
            self.block_ids += state.block_ids[0][first * positions : end * positions]
            self.ends.append(len(keys))
            self.owners.append(state)
            return
        # The chunks with a page the engine no longer holds (NO_BLOCK, or a released block:
        # view.num_released_blocks) are left out: never storable.
        chunk_keys, added = state.view.chunk_keys, False
        released = state.view.num_released_blocks
        for chunk in range(first, end):
            ids = state.chunk_ids(chunk * positions, (chunk + 1) * positions)
            if chunk * positions < released or NO_BLOCK in ids:
                if not self._contains(chunk_keys[chunk]):  # stored already: nothing lost
                    self.without_pages += 1
                continue
            self.keys.append(chunk_keys[chunk])
            self.block_ids += ids
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
