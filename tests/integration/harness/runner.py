"""The fake model runner: vLLM's KV cache views, exact KV checks, and the worker connector's
call order around a fake forward (see ``vllm_harness``)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from collections.abc import Iterable, Iterator, Sequence
from copy import deepcopy
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.utils import (
    KVOutputAggregator,
    copy_kv_blocks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.worker.utils import allocate_kv_cache

from .config import HarnessConfig
from .runner_state import (
    NULL_BLOCK_ID,
    FakeAttentionMetadata,
    _reconcile,
    _RequestState,
    _ScheduledRequest,
)
from .values import (
    HarnessError,
    KVMismatch,
    KVMismatchError,
    KVValueGenerator,
    extend_fingerprints,
    sample_token,
)


class FakeModelRunner:
    """Allocates KV like vLLM's model runner and plays its connector protocol around a fake forward.

    Worker order per step. The v2 runner (worker/gpu/model_runner.py; the only one in vLLM
    0.34) is driven through vLLM's own wrapper, worker/gpu/kv_connector.py's
    ActiveKVConnector, as that runner calls it: update states (zero new blocks, CoW copies),
    pre_forward (handle_preemptions, bind_connector_metadata, start_load_kv if
    has_sync_kv_loads), the forward (per layer: wait_for_layer_load, check, write,
    save_kv_layer), finish_forward, post_forward (start_load_kv if not yet called,
    wait_for_save unless defer_kv_finalize, get_transfer_results, ...,
    clear_connector_metadata), finalize_step with defer_kv_finalize (a speculator's
    step); no_forward on an empty step. The v1 runner (gpu_model_runner.execute_model + the
    kv_connector_model_runner_mixin, vLLM 0.32/0.33) is played here: handle_preemptions,
    update states, bind_connector_metadata, start_load_kv if has_sync_kv_loads, forward,
    start_load_kv if not yet called, wait_for_save, get_transfer_results,
    get_block_ids_with_load_errors, get_kv_connector_stats,
    get_kv_connector_kv_cache_events, build_connector_worker_meta, clear_connector_metadata.
    """

    def __init__(
        self,
        cfg: HarnessConfig,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        layout: KVCacheLayout,
        connector: KVConnectorBase_V1 | None = None,
        scheduler: Scheduler | None = None,
        check: bool = True,
        rank: int = 0,
    ) -> None:
        self.cfg = cfg
        self.vllm_config = vllm_config
        self.kv_cache_config = deepcopy(kv_cache_config)  # the model runner deep-copies it too
        self.layout = layout
        self.connector = connector
        self.scheduler = scheduler  # only for a block-table cross-check
        self.check = check
        # Check a layer's earlier slots after writing this step's KV into it, as attention
        # reads them (the KV write precedes attention within a layer). A request admitted with
        # a local prefix hit on a block that another request of the same step is computing
        # (vLLM caches blocks at allocation) reads that block's KV from this very forward;
        # the default check-before-write flags it. Off by default.
        self.write_before_check = False
        # vLLM 0.34 has only the v2 runner (no VllmConfig.use_v2_model_runner).
        self.use_v2_model_runner = bool(getattr(vllm_config, "use_v2_model_runner", True))
        self.mrv2: Any = None  # vLLM's ActiveKVConnector around the connector (v2 runner)
        self.block_size = cfg.block_size
        self.kernel_block_size = cfg.kernel_block_size or cfg.block_size
        if cfg.block_size % self.kernel_block_size or (
            self.kernel_block_size != cfg.block_size and layout.is_block_outermost
        ):
            raise HarnessError(
                f"kernel_block_size {self.kernel_block_size} must divide block_size {cfg.block_size} "
                f"and the layout ({layout.name}) must not be block-outermost"
            )
        self.kernel_ratio = cfg.block_size // self.kernel_block_size
        groups = self.kv_cache_config.kv_cache_groups
        self.num_groups = len(groups)
        kernel_block_sizes = None if cfg.kernel_block_size is None else [cfg.kernel_block_size] * self.num_groups
        # Every layer's [B, H, N, C] view; layers at the same index of different groups view
        # the same bytes (groups alias from byte 0), as allocate_kv_cache gives them.
        self.kv_caches: dict[str, torch.Tensor] = allocate_kv_cache(
            self.kv_cache_config, torch.device("cpu"), layout, kernel_block_sizes
        )
        self.layer_names = list(cfg.layer_names)
        # The KV cache group of each layer (by layer index); which positions each layer's
        # attention reads (None: all earlier ones; w: the last w - 1 and itself).
        self.group_of_layer = [
            next(gid for gid, group in enumerate(groups) if name in group.layer_names) for name in self.layer_names
        ]
        self.layer_windows = [cfg.layer_window(index) for index in range(len(self.layer_names))]
        # Groups whose manager frees out-of-window blocks (their tables may show the null block).
        self.sliding_window_group_ids = {
            gid for gid, group in enumerate(groups) if isinstance(group.kv_cache_spec, SlidingWindowSpec)
        }
        first = self.kv_caches[self.layer_names[0]]
        num_kernel_blocks, num_heads, _, num_elements = first.shape  # logical [B, H, N, C]
        self.num_blocks = num_kernel_blocks // self.kernel_ratio
        if cfg.model_head_values and not cfg.mla:
            self.values = KVValueGenerator(len(self.layer_names), num_heads, num_elements,
                                           cfg.dtype, first_head=rank * num_heads)
        else:
            self.values = KVValueGenerator(len(self.layer_names), num_heads, num_elements,
                                           cfg.dtype, rank)
        self._bits = {name: self.kv_caches[name].view(self.values.bits_dtype) for name in self.layer_names}
        self.requests: dict[str, _RequestState] = {}
        self._fingerprint_cache: dict[str, tuple[list[int], list[int]]] = {}
        self.step_index = 0
        self.num_checked_slots = 0
        self._pending_mismatches: list[KVMismatch] = []
        self._aggregator: KVOutputAggregator | None = None
        if connector is not None and self.use_v2_model_runner:
            from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

            with self._as_worker_process():  # it registers the KV caches itself
                self.mrv2 = ActiveKVConnector(vllm_config, self.kv_caches)
        elif connector is not None:
            connector.register_kv_caches(self.kv_caches)
            connector.set_host_xfer_buffer_ops(copy_kv_blocks)

    def use_output_aggregator(self, scheduler_connector: KVConnectorBase_V1) -> None:
        self._aggregator = KVOutputAggregator.from_connector(scheduler_connector, world_size=1)

    # -- request state -------------------------------------------------------------------------

    def plan_step(self, so: SchedulerOutput) -> list[_ScheduledRequest]:
        """What each scheduled request looks like after this output; mutates nothing."""
        planned: list[_ScheduledRequest] = []
        for new in so.scheduled_new_reqs:
            tokens = new.prefill_token_ids if new.prefill_token_ids is not None else new.prompt_token_ids
            if tokens is None:
                raise HarnessError(f"request {new.req_id}: no token ids in NewRequestData")
            old = self.requests.get(new.req_id)
            planned.append(
                _ScheduledRequest(
                    request_id=new.req_id,
                    start=new.num_computed_tokens,
                    num_tokens=so.num_scheduled_tokens[new.req_id],
                    token_ids=_reconcile(new.req_id, old.token_ids if old else None, tokens, replace=True),
                    group_block_ids=self._group_tables(new.req_id, new.block_ids),
                    resumed_or_new=True,
                    num_prompt_tokens=len(new.prompt_token_ids or tokens),
                )
            )
        cached = so.scheduled_cached_reqs
        # vLLM 0.34 has neither field: a resumed request comes back in scheduled_new_reqs.
        resumed_ids = getattr(cached, "resumed_req_ids", None) or ()
        all_token_ids = getattr(cached, "all_token_ids", None) or {}
        for index, req_id in enumerate(cached.req_ids):
            resumed = req_id in resumed_ids
            old = self.requests.get(req_id)
            if old is None and not resumed:
                raise HarnessError(f"request {req_id}: cached but unknown to the runner")
            provided = all_token_ids.get(req_id)
            old_tokens = old.token_ids if old else None
            if provided is not None:
                tokens = _reconcile(req_id, old_tokens, provided, replace=resumed)
            elif old_tokens is not None:
                tokens = list(old_tokens)
            else:
                raise HarnessError(f"request {req_id}: resumed without all_token_ids")
            if old is not None and old.num_prompt_tokens and not resumed:
                # vLLM discarded sampled tokens (a same-step load that failed: the scheduler
                # rewound the request); its runner drops them too (num_output_tokens).
                del tokens[old.num_prompt_tokens + cached.num_output_tokens[index]:]
            new_block_ids = cached.new_block_ids[index]
            if resumed:  # the scheduler re-sends every group's whole table
                if new_block_ids is None:
                    raise HarnessError(f"request {req_id}: resumed without block ids")
                group_block_ids = self._group_tables(req_id, new_block_ids)
            else:
                assert old is not None
                appended = self._group_tables(req_id, new_block_ids) if new_block_ids is not None else None
                group_block_ids = tuple(
                    list(table) + (appended[gid] if appended is not None else [])
                    for gid, table in enumerate(old.group_block_ids)
                )
            planned.append(
                _ScheduledRequest(
                    request_id=req_id,
                    start=cached.num_computed_tokens[index],
                    num_tokens=so.num_scheduled_tokens[req_id],
                    token_ids=tokens,
                    group_block_ids=group_block_ids,
                    resumed_or_new=resumed,
                    num_prompt_tokens=old.num_prompt_tokens if old is not None else 0,
                )
            )
        for item in planned:
            end = item.start + item.num_tokens
            if end > len(item.token_ids):
                raise HarnessError(
                    f"request {item.request_id}: scheduled up to position {end} but the runner "
                    f"knows {len(item.token_ids)} tokens"
                )
            for gid, table in enumerate(item.group_block_ids):
                if end > len(table) * self.block_size:
                    raise HarnessError(
                        f"request {item.request_id}: {len(table)} blocks of group {gid} cannot hold {end} tokens"
                    )
                written = table[item.start // self.block_size : -(-end // self.block_size)] if item.num_tokens else []
                if NULL_BLOCK_ID in written:
                    raise HarnessError(
                        f"request {item.request_id}: positions {item.start}..{end - 1} of group {gid} "
                        f"map to the null block ({table})"
                    )
        return planned

    def _group_tables(self, request_id: str, block_ids: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
        if len(block_ids) != self.num_groups:
            raise HarnessError(
                f"request {request_id}: block ids for {len(block_ids)} groups, the cache has {self.num_groups}"
            )
        return tuple(list(ids) for ids in block_ids)

    def _commit(self, so: SchedulerOutput, planned: list[_ScheduledRequest]) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            self._fingerprint_cache.pop(req_id, None)
        for item in planned:
            self.requests[item.request_id] = _RequestState(
                list(item.token_ids), [list(table) for table in item.group_block_ids],
                item.num_prompt_tokens)
            if self.scheduler is not None:
                manager_tables = self.scheduler.kv_cache_manager.get_block_ids(item.request_id)
                for gid, (runner_ids, manager_ids) in enumerate(zip(item.group_block_ids, manager_tables)):
                    if self._tables_agree(gid, runner_ids, manager_ids):
                        continue
                    raise HarnessError(
                        f"request {item.request_id}: runner block table {runner_ids} of group {gid} != "
                        f"scheduler's {manager_ids}"
                    )

    def _tables_agree(self, group_id: int, runner_ids: Sequence[int], manager_ids: Sequence[int]) -> bool:
        """Equal, except where a sliding-window manager nulled a block it freed out of the
        window: the runner keeps the stale id there, as vLLM's model runner does."""
        if list(runner_ids) == list(manager_ids):
            return True
        if group_id not in self.sliding_window_group_ids or len(runner_ids) != len(manager_ids):
            return False
        return all(ours == theirs or theirs == NULL_BLOCK_ID for ours, theirs in zip(runner_ids, manager_ids))

    def fingerprints(self, request_id: str, token_ids: Sequence[int], upto: int) -> list[int]:
        """Prefix fingerprints of token_ids[:upto], cached per request while the prefix holds."""
        tokens, fingerprints = self._fingerprint_cache.get(request_id, ([], []))
        limit = min(len(fingerprints), upto)
        keep = limit
        if tokens[:limit] != list(token_ids[:limit]):
            keep = next(i for i in range(limit) if tokens[i] != token_ids[i])
        if keep < limit:  # the sequence changed at `keep` (a resumed request re-sent its tokens)
            tokens, fingerprints = tokens[:keep], fingerprints[:keep]
        if len(fingerprints) < upto:
            tokens = list(token_ids[:upto])
            extend_fingerprints(fingerprints, tokens)
        self._fingerprint_cache[request_id] = (tokens, fingerprints)
        return fingerprints

    # -- KV access ----------------------------------------------------------------------------

    def _slots(self, block_ids: Sequence[int], positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, offset) of each position in the [B, H, N, C] views (rows are kernel blocks)."""
        pos = torch.arange(positions.start, positions.stop, dtype=torch.int64)
        table = torch.tensor(block_ids, dtype=torch.int64)
        in_block = pos % self.block_size
        rows = table[pos // self.block_size] * self.kernel_ratio + in_block // self.kernel_block_size
        return rows, in_block % self.kernel_block_size

    def _rows(self, block_id: int) -> slice:
        return slice(block_id * self.kernel_ratio, (block_id + 1) * self.kernel_ratio)

    def read_bits(self, layer: str, block_ids: Sequence[int], positions: range) -> torch.Tensor:
        """Raw bits of the given positions of one layer, [P, H, C]."""
        blocks, offsets = self._slots(block_ids, positions)
        return self._bits[layer][blocks, :, offsets, :]

    def expected_bits(self, request_id: str, token_ids: Sequence[int], positions: range) -> torch.Tensor:
        """Expected raw bits for positions of a token sequence, [P, L, H, C]."""
        fingerprints = self.fingerprints(request_id, token_ids, positions.stop)
        return self.values.values(fingerprints[positions.start : positions.stop])

    def block_table(self, request_id: str, layer_index: int = 0) -> list[int]:
        """The runner's block table of a request for the KV cache group of a layer."""
        return self.requests[request_id].group_block_ids[self.group_of_layer[layer_index]]

    def window_start(self, layer_index: int, start: int) -> int:
        """The first earlier position a layer reads when computing from `start` on: 0 for
        full attention; for a window w, start - w + 1 (the token at p attends p - w + 1 .. p,
        and vLLM frees only blocks wholly below num_computed_tokens - w + 1)."""
        window = self.layer_windows[layer_index]
        return 0 if window is None else max(0, start - window + 1)

    def corrupt(self, request_id: str, position: int, layer_index: int = 0) -> int:
        """Flip one bit of a running request's KV slot (negative controls) in the block of
        the layer's group (for a freed out-of-window position: its former block). Returns
        the block."""
        block_id = self.block_table(request_id, layer_index)[position // self.block_size]
        if block_id == NULL_BLOCK_ID:
            raise HarnessError(f"request {request_id}: position {position} has no block (null) in that group")
        self.corrupt_block(block_id, position % self.block_size, layer_index)
        return block_id

    def corrupt_block(self, block_id: int, offset: int, layer_index: int = 0) -> None:
        """Flip one bit of slot `offset` of a block, e.g. a prefix-cached block nobody holds."""
        view = self._bits[self.layer_names[layer_index]]
        row = block_id * self.kernel_ratio + offset // self.kernel_block_size
        offset %= self.kernel_block_size
        view[row, 0, offset, 0] = view[row, 0, offset, 0] ^ 1

    def _check_layer(self, planned: Iterable[_ScheduledRequest], layer_index: int) -> list[KVMismatch]:
        """Every earlier slot the layer's attention reads (window_start .. start - 1) must hold
        its value. A read slot in the null block is wrong too (vLLM dropped KV in the window)."""
        layer = self.layer_names[layer_index]
        group = self.group_of_layer[layer_index]
        found: list[KVMismatch] = []
        for item in planned:
            positions = range(self.window_start(layer_index, item.start), item.start)
            if not positions:
                continue
            table = item.group_block_ids[group]
            got = self.read_bits(layer, table, positions)
            want = self.expected_bits(item.request_id, item.token_ids, positions)[:, layer_index]
            self.num_checked_slots += len(positions)
            wrong = (got != want).reshape(len(positions), -1).any(dim=1)
            if self.layer_windows[layer_index] is not None:  # only sliding-window tables hold nulls
                read = table[positions.start // self.block_size : -(-positions.stop // self.block_size)]
                if NULL_BLOCK_ID in read:
                    pos = torch.arange(positions.start, positions.stop, dtype=torch.int64)
                    wrong |= torch.tensor(table, dtype=torch.int64)[pos // self.block_size] == NULL_BLOCK_ID
            for index in wrong.nonzero().flatten().tolist():
                position = positions[index]
                found.append(KVMismatch(item.request_id, position, layer, table[position // self.block_size]))
        return found

    def _write_layer(self, planned: Iterable[_ScheduledRequest], layer_index: int) -> None:
        layer = self.layer_names[layer_index]
        group = self.group_of_layer[layer_index]
        for item in planned:
            positions = range(item.start, item.start + item.num_tokens)
            blocks, offsets = self._slots(item.group_block_ids[group], positions)
            want = self.expected_bits(item.request_id, item.token_ids, positions)
            self._bits[layer][blocks, :, offsets, :] = want[:, layer_index]

    def _apply_block_ops(self, so: SchedulerOutput) -> None:
        for block_id in so.new_block_ids_to_zero or ():
            for view in self._bits.values():
                view[self._rows(block_id)].zero_()
        for copy in so.kv_cache_block_copies or ():
            for view in self._bits.values():
                view[self._rows(copy.dst_block_id)].copy_(view[self._rows(copy.src_block_id)])

    # -- one step -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _as_worker_process(self) -> Iterator[None]:
        """Install the worker connector as the process's KV transfer group for the step."""
        previous = kv_transfer_state._KV_CONNECTOR_AGENT
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        try:
            yield
        finally:
            kv_transfer_state._KV_CONNECTOR_AGENT = previous

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; raises KVMismatchError after the step if a slot held wrong KV."""
        self.step_index += 1
        planned = self.plan_step(so)
        connector = self.connector
        meta = so.kv_connector_metadata
        if connector is not None and meta is None:
            raise HarnessError("the scheduler built no connector metadata")
        self._pending_mismatches = []
        with self._as_worker_process():
            if connector is not None and not self.use_v2_model_runner:
                assert meta is not None
                connector.handle_preemptions(meta)
            self._commit(so, planned)
            self._apply_block_ops(so)
            if so.total_num_scheduled_tokens == 0:
                output = self._no_forward(so)
            else:
                output = self._forward(so, planned)
        if self._aggregator is not None and output is not EMPTY_MODEL_RUNNER_OUTPUT:
            aggregated = self._aggregator.aggregate([output])
            assert aggregated is not None
            output = aggregated
        self._raise_unexplained_mismatches(output.kv_connector_output)
        return output

    def _pre_forward(self, so: SchedulerOutput) -> bool:
        """The v1 runner's connector calls before the forward; returns whether start_load_kv
        already ran."""
        connector = self.connector
        assert connector is not None and so.kv_connector_metadata is not None
        connector.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            connector.start_load_kv(get_forward_context())
            return True
        return False

    def _post_forward(self, so: SchedulerOutput, load_started: bool) -> KVConnectorOutput:
        connector = self.connector
        assert connector is not None
        if not load_started:
            connector.start_load_kv(get_forward_context())
        connector.wait_for_save()  # type: ignore[no-untyped-call]
        results = connector.get_transfer_results(so.finished_req_ids)
        output = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=results.failed_recving,
        )
        output.invalid_block_ids = connector.get_block_ids_with_load_errors()
        output.kv_connector_stats = connector.get_kv_connector_stats()
        output.kv_cache_events = connector.get_kv_connector_kv_cache_events()
        output.kv_connector_worker_meta = connector.build_connector_worker_meta()
        connector.clear_connector_metadata()
        return output

    def _no_forward(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.connector is None:
            return EMPTY_MODEL_RUNNER_OUTPUT
        if self.mrv2 is not None:
            output: ModelRunnerOutput = self.mrv2.no_forward(so)
            return output
        with set_forward_context(None, self.vllm_config):
            load_started = self._pre_forward(so)
            kv_output = self._post_forward(so, load_started)
        return ModelRunnerOutput.with_kv_conn_output_only(kv_output)

    def _forward(self, so: SchedulerOutput, planned: list[_ScheduledRequest]) -> ModelRunnerOutput:
        connector = self.connector
        slot_mappings = [
            torch.tensor(
                [
                    item.group_block_ids[gid][p // self.block_size] * self.block_size + p % self.block_size
                    for item in planned
                    for p in range(item.start, item.start + item.num_tokens)
                ],
                dtype=torch.int64,
            )
            for gid in range(self.num_groups)
        ]
        attn_metadata = {
            name: FakeAttentionMetadata(slot_mappings[self.group_of_layer[index]])
            for index, name in enumerate(self.layer_names)
        }
        kv_output: KVConnectorOutput | None = None
        load_started = False
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=so.total_num_scheduled_tokens):
            if self.mrv2 is not None:  # what the wrapper reads of the v2 runner's InputBatch
                self.mrv2.pre_forward(so, SimpleNamespace(
                    idx_mapping=torch.arange(len(planned), dtype=torch.int32),
                    req_ids=[item.request_id for item in planned],
                    num_tokens=so.total_num_scheduled_tokens))
            elif connector is not None:
                load_started = self._pre_forward(so)
            for layer_index, layer in enumerate(self.layer_names):
                hooks = connector is not None and connector.has_connector_metadata()
                if hooks:
                    assert connector is not None
                    connector.wait_for_layer_load(layer)
                if self.check and not self.write_before_check:
                    self._pending_mismatches.extend(self._check_layer(planned, layer_index))
                self._write_layer(planned, layer_index)
                if self.check and self.write_before_check:
                    self._pending_mismatches.extend(self._check_layer(planned, layer_index))
                if hooks:
                    assert connector is not None
                    connector.save_kv_layer(layer, self.kv_caches[layer], attn_metadata[layer])
            if connector is not None and self.mrv2 is None:
                kv_output = self._post_forward(so, load_started)
        if self.mrv2 is not None:  # outside the forward context, as the v2 runner calls it
            self.mrv2.finish_forward()
            defer = self.cfg.defer_kv_finalize
            kv_output = self.mrv2.post_forward(set(so.finished_req_ids), defer_finalize=defer)
            if defer:  # after the speculator's drafts
                self.mrv2.finalize_step()
        return self._sample(planned, kv_output)

    def _sample(self, planned: list[_ScheduledRequest], kv_output: KVConnectorOutput | None) -> ModelRunnerOutput:
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for item in planned:
            state = self.requests[item.request_id]
            end = item.start + item.num_tokens
            req_ids.append(item.request_id)
            if end < len(state.token_ids):
                sampled.append([])  # partial prefill (or a recompute): nothing sampled
                continue
            fingerprints = self.fingerprints(item.request_id, state.token_ids, end)
            token = sample_token(fingerprints[end - 1], self.cfg.vocab_size)
            state.token_ids.append(token)
            sampled.append([token])
        # vLLM 0.34 dropped req_id_to_index (the order of req_ids is the index).
        index = {"req_id_to_index": {req_id: i for i, req_id in enumerate(req_ids)}} \
            if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else {}
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_output, **index)

    def _raise_unexplained_mismatches(self, kv_output: KVConnectorOutput | None) -> None:
        mismatches = self._pending_mismatches
        self._pending_mismatches = []
        if not mismatches:
            return
        invalid = kv_output.invalid_block_ids if kv_output is not None else set()
        unexplained = [m for m in mismatches if not self._explained_by_load_error(m, invalid)]
        if unexplained:
            raise KVMismatchError(unexplained, self.step_index)

    def _explained_by_load_error(self, mismatch: KVMismatch, invalid: set[int]) -> bool:
        """A reported load error at or before the slot's block: vLLM recomputes from there."""
        if not invalid:
            return False
        state = self.requests.get(mismatch.request_id)
        if state is None:
            return False
        upto = mismatch.position // self.block_size + 1
        return any(block_id in invalid for table in state.group_block_ids for block_id in table[:upto])



def check_kv(runner: FakeModelRunner, so: SchedulerOutput) -> int:
    """Verify every slot below num_computed_tokens of every request scheduled in `so` (for a
    sliding-window layer, the slots in its window: FakeModelRunner.window_start).

    Call it where the model would read the KV: after the step's CoW copies and synchronous
    loads (FakeModelRunner.execute_model does this itself, per layer, right after
    wait_for_layer_load). Uses the runner's block tables as `so` updates them, without
    committing. Raises KVMismatchError; returns the number of (position, layer) slots checked.
    """
    planned = runner.plan_step(so)
    before = runner.num_checked_slots
    mismatches = [m for index in range(len(runner.layer_names)) for m in runner._check_layer(planned, index)]
    if mismatches:
        raise KVMismatchError(mismatches, runner.step_index)
    return runner.num_checked_slots - before
