"""A small, real engine loop for tests and benchmarks of the engine adapter.

:class:`MiniEngine` schedules requests over a block pool the way a paged-attention engine
does (chunked prefill under a token budget, decode one token per step, preemption when
the pool runs dry, blocks freed at finish and handed out again LIFO so that reuse is
immediate), drives an :class:`EngineAdapter` and a :class:`WorkerAdapter` in the model
runner's order, and "computes" KV: every (position, layer, element) gets a value that is
a pure function of the token prefix up to that position. Before each forward it checks
that every computed position of every scheduled request holds exactly its value, so a
load of wrong bytes, or a block overwritten under a live request, fails at once.

``key_lag_tokens=n`` hides the last n tokens from a running request's chunk keys (an
engine whose block hashes lag the tokens): a chunk completed by the last computed tokens
then gets its key only at finish, and only the finished-request path can store it.

``async_scheduling=True`` delays each sampled token by one step (a placeholder position
is computed in the meantime), as vLLM's async scheduler does; the finish is seen a step
late and the adapter must still store the request's last full chunk, and never the slot
of the last sampled token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.core.controls import NO_CONTROLS, RequestControls
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.requests import RequestView, StepInput, StepPlan
from tierkv.engine.worker import WorkerAdapter
from tierkv.keys import chunk_keys

MASK = (1 << 31) - 1


def prefix_hashes(tokens: list[int]) -> list[int]:
    """One 31-bit hash per position, chained over the whole prefix."""
    out: list[int] = []
    h = 0x12345
    for token in tokens:
        h = (h * 1_000_003 + token + 1) & ((1 << 61) - 1)
        out.append(h & MASK)
    return out


def expected_row(prefix_hash: int, layer: int, width: int) -> torch.Tensor:
    base = (prefix_hash * 31 + layer * 7_919) & MASK
    return (torch.arange(width, dtype=torch.int64) * 2_654_435_761 + base).remainder(MASK).to(torch.int32)


@dataclass
class Req:
    req_id: str
    tokens: list[int]
    num_prompt: int
    max_tokens: int
    arrival: int
    status: str = "waiting"  # waiting, loading, running, done
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    outputs: int = 0
    placeholder: int | None = None  # async: sampled, not yet appended
    aborted: bool = False
    external: int = 0
    blocks_replaced: bool = True
    controls: RequestControls = NO_CONTROLS  # what it asks of the cache

    def all_tokens(self) -> list[int]:
        return self.tokens + ([self.placeholder] if self.placeholder is not None else [])


class MiniEngine:
    def __init__(
        self,
        adapter: EngineAdapter,
        worker: WorkerAdapter,
        kv: list[torch.Tensor],
        *,
        num_blocks: int,
        token_budget: int = 64,
        async_scheduling: bool = False,
        key_lag_tokens: int = 0,
        worker_order: Callable[[WorkerAdapter, StepPlan, Callable[[], None]], None] | None = None,
    ) -> None:
        self.adapter = adapter
        self.worker = worker
        self.kv = kv
        self.block_size = adapter.config.tokens_per_block
        self.tokens_per_chunk = adapter.config.tokens_per_chunk
        self.width = kv[0].shape[-1]
        self.free_blocks = list(reversed(range(num_blocks)))
        self.token_budget = token_budget
        self.async_scheduling = async_scheduling
        self.key_lag_tokens = key_lag_tokens
        self.worker_order = worker_order or run_worker_in_order
        self.requests: dict[str, Req] = {}
        self.steps = 0
        self.checked_positions = 0
        self.loaded_tokens = 0
        self.preemptions = 0
        self._arrivals = 0
        self.key_prefix: dict[bytes, tuple[int, ...]] = {}  # chunk key -> its tokens

    # ------------------------------------------------------------------ requests
    def add_request(self, req_id: str, prompt: list[int], max_tokens: int,
                    controls: RequestControls = NO_CONTROLS) -> None:
        self._arrivals += 1
        self.requests[req_id] = Req(req_id, list(prompt), len(prompt), max_tokens, self._arrivals,
                                    controls=controls)

    def abort(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.status == "done":
            return
        req.aborted = True
        self._finish(req)

    def view(self, req: Req, final: bool = False) -> RequestView:
        known = req.tokens if final or not self.key_lag_tokens else req.tokens[: -self.key_lag_tokens]
        keys = chunk_keys(known, self.tokens_per_chunk)
        for position, key in enumerate(keys):
            if key not in self.key_prefix:
                self.key_prefix[key] = tuple(req.tokens[: (position + 1) * self.tokens_per_chunk])
        return RequestView(req.req_id, keys, req.num_prompt, len(req.tokens) + (req.placeholder is not None),
                           req.num_computed, controls=req.controls)

    def idle(self) -> bool:
        """No request left to run and nothing left for the adapter to do."""
        return all(r.status == "done" for r in self.requests.values()) and not self.adapter.has_pending_work()

    # ------------------------------------------------------------------ scheduling
    def _allocate(self, req: Req, num_tokens: int) -> list[int] | None:
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need > len(self.free_blocks):
            return None
        blocks = [self.free_blocks.pop() for _ in range(need)]
        req.block_ids.extend(blocks)
        return blocks

    def _free(self, req: Req) -> None:
        self.free_blocks.extend(reversed(req.block_ids))
        req.block_ids = []

    def _preempt_one(self, keep: Req, preempted: list[str], scheduled: dict[str, int]) -> bool:
        victim = max((r for r in self.requests.values()
                      if r.status == "running" and r is not keep and r.req_id not in scheduled),
                     key=lambda r: r.arrival, default=None)
        if victim is None:
            return False
        self._free(victim)
        victim.status = "waiting"
        victim.num_computed = 0
        victim.blocks_replaced = True
        preempted.append(victim.req_id)
        self.preemptions += 1
        return True

    def step(self) -> None:
        self.steps += 1
        preempted: list[str] = []
        new_blocks: dict[str, list[int]] = {}
        replaced: set[str] = set()
        scheduled: dict[str, int] = {}
        views: dict[str, RequestView] = {}
        budget = self.token_budget
        for req in sorted(self.requests.values(), key=lambda r: r.arrival):
            if req.status == "waiting":
                self._try_admit(req)
            if req.status != "running" or budget <= 0:
                continue
            total = len(req.all_tokens())
            num = min(total - req.num_computed, budget)
            if num <= 0:
                continue
            blocks = self._allocate(req, req.num_computed + num)
            while blocks is None and self._preempt_one(req, preempted, scheduled):
                blocks = self._allocate(req, req.num_computed + num)
            if blocks is None:
                continue
            budget -= num
            views[req.req_id] = self.view(req)
            scheduled[req.req_id] = num
            if req.blocks_replaced:
                replaced.add(req.req_id)
                new_blocks[req.req_id] = list(req.block_ids)
                req.blocks_replaced = False
            else:
                new_blocks[req.req_id] = blocks
        step = StepInput(views, scheduled, new_blocks, frozenset(replaced), tuple(preempted))
        plan = self.adapter.build_plan(step)
        self.worker_order(self.worker, plan, lambda: self._forward(scheduled))
        self._collect()
        self._advance(scheduled)

    def _try_admit(self, req: Req) -> None:
        view = self.view(req)
        external = self.adapter.lookup(view, 0)
        if external is None:
            return  # "not yet": a chunk is being promoted from disk
        if external > 0 and self._allocate(req, external) is not None:
            self.adapter.update_state_after_alloc(view, list(req.block_ids), external, 0)
            req.status = "loading"
            req.external = external
            return
        self.adapter.update_state_after_alloc(view, list(req.block_ids), 0, 0)
        req.status = "running"

    # ------------------------------------------------------------------ forward
    def _forward(self, scheduled: dict[str, int]) -> None:
        for req_id, num in scheduled.items():
            req = self.requests[req_id]
            self.check_request(req)
            hashes = prefix_hashes(req.all_tokens()[: req.num_computed + num])
            for position in range(req.num_computed, req.num_computed + num):
                block = req.block_ids[position // self.block_size]
                for layer, tensor in enumerate(self.kv):
                    tensor[block, position % self.block_size] = expected_row(hashes[position], layer, self.width)

    def check_request(self, req: Req) -> None:
        hashes = prefix_hashes(req.all_tokens()[: req.num_computed])
        for position in range(req.num_computed):
            block = req.block_ids[position // self.block_size]
            for layer, tensor in enumerate(self.kv):
                got = tensor[block, position % self.block_size]
                if not torch.equal(got, expected_row(hashes[position], layer, self.width)):
                    raise AssertionError(
                        f"step {self.steps}: request {req.req_id} position {position} layer {layer} "
                        f"holds wrong KV (block {block})"
                    )
            self.checked_positions += 1

    def _collect(self) -> None:
        report = self.worker.poll()
        self.adapter.complete(report)
        failed = set(report.failed_block_ids)
        for req_id in report.finished_loads:
            req = self.requests.get(req_id)
            if req is None or req.status != "loading":
                continue
            landed = req.external
            for index, block in enumerate(req.block_ids):
                if block in failed:
                    landed = min(landed, index * self.block_size)
                    break
            req.num_computed = landed
            self.loaded_tokens += landed
            req.status = "running"

    def _advance(self, scheduled: dict[str, int]) -> None:
        for req_id, num in scheduled.items():
            req = self.requests[req_id]
            req.num_computed += num
            if req.placeholder is not None:  # async: last step's token arrives now
                req.tokens.append(req.placeholder)
                req.placeholder = None
                req.outputs += 1
                if req.outputs >= req.max_tokens:
                    self._finish(req)
                    continue
            if req.num_computed < len(req.all_tokens()):
                continue  # still in prefill: no token sampled
            token = prefix_hashes(req.tokens)[-1] % 50_000
            if self.async_scheduling:
                req.placeholder = token
            else:
                req.tokens.append(token)
                req.outputs += 1
                if req.outputs >= req.max_tokens:
                    self._finish(req)

    def _finish(self, req: Req) -> None:
        req.placeholder = None  # async: the in-flight token is dropped
        req.num_computed = min(req.num_computed, len(req.tokens))
        self.adapter.request_finished(self.view(req, final=True), aborted=req.aborted)
        req.status = "done"
        self._free(req)

    def run(self, max_steps: int = 10_000) -> None:
        while not self.idle():
            if self.steps >= max_steps:
                raise AssertionError(f"not idle after {max_steps} steps")
            if all(r.status in ("done", "loading") for r in self.requests.values()):
                # Nothing to compute: block on the copies instead of spinning (a spinning
                # loop can starve the copy thread of the GIL).
                self.worker.wait_all()
            self.step()

    def expected_chunk(self, key: bytes) -> list[torch.Tensor]:
        """The KV a stored chunk must hold: per layer, [tokens_per_chunk, width] rows."""
        tokens = list(self.key_prefix[key])
        hashes = prefix_hashes(tokens)[-self.tokens_per_chunk :]
        return [torch.stack([expected_row(h, layer, self.width) for h in hashes]) for layer in range(len(self.kv))]


def run_worker_in_order(worker: WorkerAdapter, plan: StepPlan, forward: Callable[[], None]) -> None:
    """The model runner's order: flush, start, forward, submit the step's stores."""
    worker.handle_preemptions(plan)
    worker.start(plan)
    forward()
    worker.after_forward()


class LayoutKV:
    """A KV cache in one of vLLM's four layouts, for transfer tests and checks.

    Per layer a logical ``[B, H, N, C]`` tensor (block, head, token, channel) viewed over
    raw uint8 buffers filled with random bytes: ``LB*`` layer-outermost (one buffer, or one
    per layer with ``separate``), ``BL*`` block-outermost (one buffer, strided per-layer
    views); ``*NHC`` token-major pages, ``*HNC`` head-major pages. ``page_at`` and
    ``chunk`` give the reference bytes by offset arithmetic on the raw buffers, independent
    of tierkv's layout code. ``inner`` is ``(tokens, heads, channels)`` of one block.
    """

    def __init__(self, kind: str, layers: int, blocks: int, inner: tuple[int, int, int],
                 dtype: torch.dtype, separate: bool = False, device: str = "cpu") -> None:
        self.kind, self.layers, self.blocks, self.separate = kind, layers, blocks, separate
        nhc = kind.endswith("NHC")
        tokens, heads, dim = inner
        shape = (tokens, heads, dim) if nhc else (heads, tokens, dim)
        self.page = tokens * heads * dim * torch.empty((), dtype=dtype).element_size()
        count = blocks if separate else layers * blocks
        self.raws = [torch.randint(0, 256, (count * self.page,), dtype=torch.uint8, device=device)
                     for _ in range(layers if separate else 1)]
        typed = [raw.view(dtype) for raw in self.raws]
        if kind.startswith("LB"):
            views = [typed[layer].view(blocks, *shape) if separate
                     else typed[0].view(layers, blocks, *shape)[layer] for layer in range(layers)]
        else:
            views = [typed[0].view(blocks, layers, *shape)[:, layer] for layer in range(layers)]
        self.tensors = [v.permute(0, 2, 1, 3) if nhc else v for v in views]

    def page_at(self, layer: int, block: int) -> torch.Tensor:
        if self.separate:
            raw, index = self.raws[layer], block
        elif self.kind.startswith("LB"):
            raw, index = self.raws[0], layer * self.blocks + block
        else:
            raw, index = self.raws[0], block * self.layers + layer
        return raw[index * self.page : (index + 1) * self.page]

    def engine(self, blocks_per_chunk: int, num_slots: int, staging_chunks: float | None = None,
               pad: int = 0, **options: Any) -> Any:
        """The transfer engine of these tensors' device over a fresh zeroed slab (pinned for
        CUDA) whose slots are ``pad`` bytes longer than a chunk; ``staging_chunks`` sizes
        the CUDA engine's staging in chunks; ``options`` go to the engine."""
        from tierkv.tiers.cpu import CpuSlab
        from tierkv.engine.stack import make_transfer_engine
        from tierkv.transfer.layout import KVLayout

        layout = KVLayout.from_tensors(self.tensors)
        chunk_bytes = layout.chunk_bytes(blocks_per_chunk)
        pin = "always" if layout.device.type == "cuda" else "never"
        slab = CpuSlab(num_slots, chunk_bytes + pad, pin_memory=pin)
        slab.tensor.zero_()
        if staging_chunks is not None:
            options["staging_bytes"] = int(staging_chunks * chunk_bytes)
        return make_transfer_engine("auto", layout, slab, blocks_per_chunk, **options)

    def chunk(self, block_ids: list[int] | tuple[int, ...]) -> torch.Tensor:
        """The chunk's reference bytes in tierkv's slot layout, on the CPU."""
        if self.raws[0].is_cuda:
            torch.cuda.synchronize()
        pages = [self.page_at(layer, block) for layer in range(self.layers) for block in block_ids]
        return torch.cat(pages).cpu()
