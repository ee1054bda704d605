"""AdapterConfig: the engine adapter's settings, checked once (and the load policies).

The settings' meaning is in the comments beside them; docs/engine-adapter.md shows them in
use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tierkv.core.costs import DEFAULT_CHUNK_BYTES, CostPriors, check_priors
from tierkv.errors import ConfigError
from tierkv.settings import check_settings, required, setting

__all__ = ["LOAD_POLICIES", "REQUEST_LOAD_POLICIES", "AdapterConfig", "is_policy_path"]

LOAD_POLICIES = ("always", "cost")
# What one request may ask for itself (RequestView.load_policy): an engine's policy, or
# "recompute": load nothing, ask no tier (the counterfactual of a load, in the same engine).
REQUEST_LOAD_POLICIES = (*LOAD_POLICIES, "recompute")

_POLICY_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


def is_policy_path(value: str) -> bool:
    """Whether ``value`` names a class as ``module:Class`` (an operator's load policy)."""
    return _POLICY_PATH.fullmatch(value) is not None


@dataclass(frozen=True)
class AdapterConfig:
    tokens_per_block: int = field(metadata=required("int", low=1, help="the engine's block "
                                                                        "size in tokens"))
    blocks_per_chunk: int = field(metadata=required("int", low=1, help="engine blocks per "
                                                                        "chunk"))
    world_size: int = setting(1, low=1, help="workers that must report a job before it "
                                              "counts as complete")
    offload_prompt_only: bool = setting(False, help="never store decode tokens")
    max_chunks_per_request: int | None = setting(None, kind="int", low=0,
                                                 help="chunks stored per request at most; "
                                                      "None: no limit")
    promotion_wait_seconds: float = setting(5.0, low=0, unit="seconds",
                                            help="how long a lookup waits on a promotion")
    wait_for_stores: bool = setting(False, help="also wait on the stores of the chunk after "
                                                "a hit")
    # Block ids per token block: one per KV cache group of the engine. A request's block
    # ids are then one list per group (position p's ids at index p of each, as vLLM gives
    # them); NO_BLOCK where a group holds no page (a sliding-window group before its
    # window). A chunk's jobs list its ids group after group (blocks_per_chunk ids of
    # group 0, then of group 1, ...).
    groups: int = setting(1, low=1, help="block ids per token block (KV cache groups)")
    # The engine may free a running request's blocks (a sliding-window group frees those
    # that left the window): a block handed out again while a store job still reads it
    # waits for that job (a fence), as for the blocks of requests that finished.
    frees_running_blocks: bool = setting(False, help="the engine frees running requests' "
                                                     "blocks")
    # Same-step loads: a hit whose chunks all sit in the CPU tier is copied before this
    # step's forward pass, up to this many chunks per step (0: every load is asynchronous
    # and the request waits a step or two for it). See sync_load().
    sync_load_chunks: int = setting(0, low=0, help="chunks per step loaded before the "
                                                   "step's forward pass")
    # Cost-aware loads: "always" loads every hit; "cost" loads the prefix of a hit whose
    # estimated load time plus the compute time of the rest is least (tierkv.core.costs:
    # measured per tier and from the engine's steps, priors until then). load_bias scales
    # the load estimates (above 1 favours recompute). cost_priors: a CostPriors, whose
    # fields are settings too (cost_priors.<name>, checked when it is made). "module:Class":
    # the operator's own policy (tierkv.engine.load_policy.LoadPolicy), given the cost
    # model's inputs; docs/engine-adapter.md, "Your own load policy".
    load_policy: str = setting("always", kind="str",
                               help="'always' loads every hit; 'cost' declines what is "
                                    "faster to compute; 'module:Class' your own policy")
    load_bias: float = setting(1.0, low=0.01, high=100.0,
                               help="scales the load estimates: above 1 favours recompute")
    cost_priors: CostPriors = field(default_factory=CostPriors)
    chunk_bytes: int = setting(DEFAULT_CHUNK_BYTES, kind="int", low=1, unit="bytes",
                               help="one chunk on one rank (the priors' unit)")
    # A tier whose loads were declined for this long is tried again with the next hit
    # on it (a slow node may have recovered): one load is its new measurement. So is one
    # declined for probe_requests requests in a row (0: never), a number that doubles
    # with each probe until the model itself loads from the tier again: one slow load
    # (a spike) costs a fast tier a few requests, not probe_seconds of them, and a slow
    # tier's probes thin out.
    probe_seconds: float = setting(30.0, low=0, unit="seconds",
                                   help="a declined tier is tried again after this long")
    probe_requests: int = setting(8, low=0, help="or after this many declined requests "
                                                 "(0: never)")
    # A load still reading when this many milliseconds have passed since it started is
    # cut: what it copied is served, the rest recomputed (a request's own
    # load_deadline_ms wins). None: a load is waited for (docs/engine-adapter.md,
    # "Per-request controls").
    load_deadline_ms: float | None = setting(None, kind="number", low=0, unit="ms",
                                             help="a load's deadline; None: none")

    def __post_init__(self) -> None:
        check_settings(self, "adapter")
        if self.load_policy not in LOAD_POLICIES and not is_policy_path(self.load_policy):
            raise ConfigError(f"adapter.load_policy must be one of {list(LOAD_POLICIES)} or "
                              f"'module:Class' (your own load policy), got "
                              f"{self.load_policy!r:.80}")
        check_priors(self.cost_priors, "adapter.cost_priors")

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def sparse_blocks(self) -> bool:
        """Block lists may lack pages (NO_BLOCK, released blocks): checked per chunk."""
        return self.groups > 1 or self.frees_running_blocks

    @property
    def chunk_limit(self) -> int:
        """Chunks stored per request at most (``max_chunks_per_request``; no limit: huge)."""
        limit = self.max_chunks_per_request
        return limit if limit is not None else 1 << 62
