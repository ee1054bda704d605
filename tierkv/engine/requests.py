"""Engine-neutral inputs and outputs of the engine adapter (plain data only).

- :class:`RequestView`  one request as the scheduler sees it now.
- :class:`StepInput`    what the scheduler did this step.
- :class:`LoadRequest`  a request's load: its job (if any) and blocks known to be lost.
- :class:`StepPlan`     the adapter's answer: loads, stores, spills, ``jobs_to_flush``.
- :class:`WorkerReport` what a worker tells the scheduler side after a step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

from tierkv.core.controls import NO_CONTROLS, RequestControls
from tierkv.core.jobs import Completion, JobId, LoadSpec, SpillSpec, StoreSpec

# A request's block ids: one list per KV cache group (vLLM's form: a block position's ids
# at the same index of each), or, with one group, a flat list of ids.
BlockIds = Union[Sequence[Sequence[int]], Sequence[int]]


@dataclass(frozen=True)
class RequestView:
    """A request now. ``chunk_keys`` are the keys of its full chunks so far (they may grow
    as tokens arrive). ``num_tokens`` counts prompt and output tokens, including the last
    sampled token, whose KV no forward pass has written yet."""

    req_id: str
    chunk_keys: Sequence[bytes]
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    # Leading block positions whose pages the engine released for some KV cache group
    # (a sliding window that moved on): chunks over them can no longer be stored.
    num_released_blocks: int = 0
    # This request's own load policy ("always", "cost" or "recompute": load nothing, ask
    # no tier); None: the adapter's (AdapterConfig.load_policy).
    load_policy: str | None = None
    # What the request asks of the cache (skip_load, skip_store, load_tiers,
    # load_deadline_ms: tierkv.core.controls).
    controls: RequestControls = NO_CONTROLS


@dataclass(frozen=True)
class StepInput:
    """One scheduler step.

    ``requests`` holds a view of every scheduled request as of *before* this step's
    tokens are computed; ``num_scheduled_tokens`` the tokens each computes this step.
    ``new_block_ids`` lists blocks allocated to a request this step (appended to its
    block lists, group by group: :data:`BlockIds`); for a request in ``replaced_blocks``
    (new, or resumed after a preemption) they are the request's whole block lists. ``finished``: requests whose
    ``request_finished`` was called since the last step; ``preempted``: requests whose
    blocks the engine took back this step."""

    requests: Mapping[str, RequestView] = field(default_factory=dict)
    num_scheduled_tokens: Mapping[str, int] = field(default_factory=dict)
    new_block_ids: Mapping[str, BlockIds] = field(default_factory=dict)
    replaced_blocks: frozenset[str] = frozenset()
    preempted: Sequence[str] = ()


@dataclass(frozen=True)
class LoadRequest:
    req_id: str
    spec: LoadSpec | None  # None: nothing could be loaded; report at once
    failed_block_ids: tuple[int, ...] = ()  # promised blocks the plan could not load
    # Same-step load: the request computes in this very step, so the worker copies it before
    # the forward pass and reports no finished load for it (failed blocks still).
    sync: bool = False
    # Seconds the worker waits for the load (from its start): then what has not been copied
    # to the GPU is reported failed (recomputed) and never copied later. None: no deadline.
    deadline_seconds: float | None = None


@dataclass(frozen=True)
class StepPlan:
    loads: tuple[LoadRequest, ...] = ()
    stores: tuple[StoreSpec, ...] = ()
    spills: tuple[SpillSpec, ...] = ()
    jobs_to_flush: tuple[JobId, ...] = ()
    idle: bool = False  # the engine computes nothing this step (no forward pass)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.stores or self.spills or self.jobs_to_flush)


@dataclass(frozen=True)
class WorkerReport:
    rank: int
    completions: tuple[Completion, ...] = ()
    finished_loads: tuple[str, ...] = ()  # requests whose load finished (ok or not)
    failed_block_ids: tuple[int, ...] = ()  # blocks the engine must recompute
    failed_loads: tuple[str, ...] = ()  # requests with some of those blocks
