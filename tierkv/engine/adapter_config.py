"""AdapterConfig: the engine adapter's settings, checked once (and the load policies).

The settings' meaning is in the comments beside them; docs/engine-adapter.md shows them in
use. :mod:`tierkv.engine.adapter` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.core.costs import DEFAULT_CHUNK_BYTES, CostPriors
from tierkv.errors import ConfigError

__all__ = ["LOAD_POLICIES", "REQUEST_LOAD_POLICIES", "AdapterConfig"]

LOAD_POLICIES = ("always", "cost")
# What one request may ask for itself (RequestView.load_policy): an engine's policy, or
# "recompute": load nothing, ask no tier (the counterfactual of a load, in the same engine).
REQUEST_LOAD_POLICIES = (*LOAD_POLICIES, "recompute")


@dataclass(frozen=True)
class AdapterConfig:
    tokens_per_block: int
    blocks_per_chunk: int
    world_size: int = 1
    offload_prompt_only: bool = False
    max_chunks_per_request: int | None = None
    promotion_wait_seconds: float = 5.0
    wait_for_stores: bool = False
    # Block ids per token block: one per KV cache group of the engine. A request's block
    # ids are then one list per group (position p's ids at index p of each, as vLLM gives
    # them); NO_BLOCK where a group holds no page (a sliding-window group before its
    # window). A chunk's jobs list its ids group after group (blocks_per_chunk ids of
    # group 0, then of group 1, ...).
    groups: int = 1
    # The engine may free a running request's blocks (a sliding-window group frees those
    # that left the window): a block handed out again while a store job still reads it
    # waits for that job (a fence), as for the blocks of requests that finished.
    frees_running_blocks: bool = False
    # Same-step loads: a hit whose chunks all sit in the CPU tier is copied before this
    # step's forward pass, up to this many chunks per step (0: every load is asynchronous
    # and the request waits a step or two for it). See sync_load().
    sync_load_chunks: int = 0
    # Cost-aware loads: "always" loads every hit; "cost" loads the prefix of a hit whose
    # estimated load time plus the compute time of the rest is least (tierkv.core.costs:
    # measured per tier and from the engine's steps, priors until then). load_bias scales
    # the load estimates (above 1 favours recompute).
    load_policy: str = "always"
    load_bias: float = 1.0
    cost_priors: CostPriors = field(default_factory=CostPriors)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # one chunk on one rank (the priors' unit)
    # A tier whose loads were declined for this long is tried again with the next hit
    # on it (a slow node may have recovered): one load is its new measurement. So is one
    # declined for probe_requests requests in a row (0: never), a number that doubles
    # with each probe until the model itself loads from the tier again: one slow load
    # (a spike) costs a fast tier a few requests, not probe_seconds of them, and a slow
    # tier's probes thin out.
    probe_seconds: float = 30.0
    probe_requests: int = 8

    def __post_init__(self) -> None:
        if self.load_policy not in LOAD_POLICIES:
            raise ConfigError(f"adapter: load_policy must be one of {list(LOAD_POLICIES)}, got "
                              f"{self.load_policy!r}")
        if isinstance(self.load_bias, bool) or not isinstance(self.load_bias, (int, float)) \
                or not self.load_bias > 0:
            raise ConfigError(f"adapter: load_bias must be a number > 0, got {self.load_bias!r}")
        if isinstance(self.chunk_bytes, bool) or not isinstance(self.chunk_bytes, int) \
                or self.chunk_bytes <= 0:
            raise ConfigError(f"adapter: chunk_bytes must be a positive int, got "
                              f"{self.chunk_bytes!r}")
        if isinstance(self.probe_requests, bool) or not isinstance(self.probe_requests, int) \
                or self.probe_requests < 0:
            raise ConfigError(f"adapter: probe_requests must be an int >= 0, got "
                              f"{self.probe_requests!r}")
        if isinstance(self.sync_load_chunks, bool) or not isinstance(self.sync_load_chunks, int) \
                or self.sync_load_chunks < 0:
            raise ConfigError(f"adapter: sync_load_chunks must be an int >= 0, got "
                              f"{self.sync_load_chunks!r}")
        for name in ("tokens_per_block", "blocks_per_chunk", "world_size", "groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"adapter.{name} must be a positive int, got {value!r}")
        if self.max_chunks_per_request is not None and self.max_chunks_per_request < 0:
            raise ConfigError(
                f"adapter.max_chunks_per_request must be >= 0, got {self.max_chunks_per_request!r}"
            )

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk
