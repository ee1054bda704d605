"""Drive the real vLLM 0.33.0 Scheduler on CPU with a fake model runner.

This is a test helper, not a test module. It builds vLLM's own objects (ModelConfig from a tiny
local Llama config, VllmConfig, KVCacheConfig, Scheduler or AsyncScheduler, connectors through
KVConnectorFactory) and replaces only the model: a fake forward pass writes a deterministic value
into every KV slot vLLM assigns, so any slot that later holds something else was loaded wrong.

Primitives and their contracts:
    HarnessConfig / build_harness(cfg)  the knobs and the wired objects (no downloads, no GPU).
    make_request(...)                   a vLLM Request hashed by vLLM's own block hasher.
    FakeModelRunner.execute_model(so)   calls the worker connector in the model runner's order
                                        (v1 or v2 runner, as the scheduler was built for), writes
                                        KV, samples one token per request that finished its
                                        prefill, returns a ModelRunnerOutput.
    check_kv(runner, so)                raises KVMismatchError if a slot below a scheduled
                                        request's num_computed_tokens holds a wrong value
                                        (sliding-window layers: only the window's slots).
    HarnessEngine                       the EngineCore loop: `step` (sync) or
                                        `step_with_batch_queue` (async scheduling).
    MultiTurnWorkload                   conversations whose later turns extend earlier ones.
    reference_generate(prompt, n)       the tokens any correct run must produce.
    HarnessCPUOffloadingSpec            vLLM's CPU offloading spec (real CPUOffloadingManager)
                                        with a CPU stand-in for its CUDA-only worker.
    RecordingConnector                  a connector loaded by kv_connector_module_path that
                                        records every call of both roles.

KV values: a token at position p has the fingerprint fp[p] = mix(fp[p-1], token[p]). Its KV for
(layer, head, element) is a hash of (fp[p], layer, head, element), written as raw bits through an
integer view of the cache, so comparisons are exact. The next token sampled after position p is
fp[p] % vocab_size. Both depend on the token prefix only, so two requests with the same prefix
expect the same KV and the same continuation.

Hybrid models (HarnessConfig.sliding_window / sliding_window_layers): vLLM groups the layers
(one KV cache group per attention type under the hybrid KV cache manager), the groups alias
each other's bytes, and the runner keeps one block table per group. A full-attention layer's
check covers every earlier position, a sliding-window layer's only start - w + 1 .. start - 1:
vLLM's SlidingWindowManager frees the blocks wholly below that and shows the null block (id 0)
there; the runner keeps the former ids, as vLLM's model runner does, and never writes block 0.
"""

from __future__ import annotations

import contextlib
import json
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import (
    KVOutputAggregator,
    copy_kv_blocks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.attention.backends.utils import (
    _DEFAULT_LAYOUT_PREFERENCE,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

OFFLOADING_CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"

_MASK64 = (1 << 64) - 1
_MASK32 = (1 << 32) - 1
_FINGERPRINT_SEED = 0x243F6A8885A308D3


class HarnessError(RuntimeError):
    """The harness itself found vLLM's outputs inconsistent (not a KV mismatch)."""


@dataclass(frozen=True)
class KVMismatch:
    request_id: str
    position: int
    layer: str
    block_id: int


class KVMismatchError(AssertionError):
    """A KV slot that a scheduled request's attention reads (below its num_computed_tokens;
    for a sliding-window layer, within the window) holds a wrong value."""

    def __init__(self, mismatches: Sequence[KVMismatch], step: int) -> None:
        self.mismatches = list(mismatches)
        self.step = step
        first = self.mismatches[0]
        super().__init__(
            f"step {step}: {len(self.mismatches)} wrong KV slot(s); first: request "
            f"{first.request_id} position {first.position} layer {first.layer} "
            f"block {first.block_id}"
        )


# --------------------------------------------------------------------------------------------
# Deterministic tokens and KV values
# --------------------------------------------------------------------------------------------


def _mix64(value: int) -> int:
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def extend_fingerprints(fingerprints: list[int], token_ids: Sequence[int]) -> None:
    """Append the prefix fingerprints of token_ids[len(fingerprints):] in place."""
    previous = fingerprints[-1] if fingerprints else _FINGERPRINT_SEED
    for token in token_ids[len(fingerprints) :]:
        previous = _mix64(previous ^ _mix64(token + 0x9E3779B97F4A7C15))
        fingerprints.append(previous)


def sample_token(fingerprint: int, vocab_size: int) -> int:
    """The token the fake model samples after the prefix whose fingerprint is given."""
    return fingerprint % vocab_size


def reference_generate(prompt_token_ids: Sequence[int], max_tokens: int, vocab_size: int) -> list[int]:
    """The output tokens every correct run produces for this prompt (ignoring EOS)."""
    tokens = list(prompt_token_ids)
    fingerprints: list[int] = []
    outputs: list[int] = []
    for _ in range(max_tokens):
        extend_fingerprints(fingerprints, tokens)
        token = sample_token(fingerprints[-1], vocab_size)
        outputs.append(token)
        tokens.append(token)
    return outputs


def _mix32(values: torch.Tensor) -> torch.Tensor:
    # values: int64 in [0, 2**32); multipliers below 2**31 keep every product below 2**63.
    values = values ^ (values >> 16)
    values = (values * 0x7FEB352D) & _MASK32
    values = values ^ (values >> 15)
    values = (values * 0x346CA68B) & _MASK32
    return values ^ (values >> 16)


_BITS_DTYPE = {2: torch.int16, 4: torch.int32}


class KVValueGenerator:
    """Expected KV bits for positions, as a [P, L, H, C] tensor of the cache's integer twin."""

    def __init__(self, num_layers: int, num_heads: int, num_elements: int, dtype: torch.dtype,
                 rank: int = 0, first_head: int = 0) -> None:
        itemsize = torch.empty((), dtype=dtype).element_size()
        if itemsize not in _BITS_DTYPE:
            raise HarnessError(f"KV dtype {dtype} has {itemsize}-byte elements; use 2 or 4")
        self.bits_dtype = _BITS_DTYPE[itemsize]
        self._bits = 8 * itemsize
        layer = torch.arange(num_layers, dtype=torch.int64).view(-1, 1, 1)
        # first_head: the rank's heads by their index in the model (values then depend on
        # the head, not on the TP size: a chunk of one TP size checks exactly under another).
        head = torch.arange(first_head, first_head + num_heads, dtype=torch.int64).view(1, -1, 1)
        element = torch.arange(num_elements, dtype=torch.int64).view(1, 1, -1)
        # A tensor-parallel rank's heads get values of their own (rank 0: as without TP).
        salt = (layer * 0x10000 + head * 0x1000 + element + 1 + rank * 0x100000) * 0x01000193
        self._salt = _mix32(salt & _MASK32)  # [L, H, C]

    def values(self, fingerprints: Sequence[int]) -> torch.Tensor:
        low = torch.tensor([f & _MASK32 for f in fingerprints], dtype=torch.int64).view(-1, 1, 1, 1)
        high = torch.tensor([(f >> 32) & _MASK32 for f in fingerprints], dtype=torch.int64).view(-1, 1, 1, 1)
        mixed = _mix32(_mix32(high ^ self._salt) ^ low)  # [P, L, H, C], 32 random bits
        if self._bits == 16:
            # Clear bit 14 so float16/bfloat16 values are finite (no NaN/Inf payloads).
            mixed = mixed & 0xBFFF
            mixed = mixed - ((mixed >> 15) << 16)
        else:
            mixed = mixed & 0xBFFFFFFF
            mixed = mixed - ((mixed >> 31) << 32)
        return mixed.to(self.bits_dtype)


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HarnessConfig:
    """Knobs of one harness instance. Small pools force preemption, small budgets chunking."""

    block_size: int = 16
    num_gpu_blocks: int = 64
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 16
    max_model_len: int = 1024
    long_prefill_token_threshold: int = 0
    async_scheduling: bool = False
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    # None: resolve the way the engine core does (VLLM_KV_CACHE_LAYOUT, else the connector's
    # get_required_kvcache_layout, else the default preference, LBNHC). Or a KVCacheLayout name
    # (LBNHC, LBHNC, BLNHC, BLHNC, LHBNC, BHLNC) or a legacy alias (NHD = LBNHC, HND = LBHNC).
    kv_cache_layout: str | None = None
    kv_transfer_config: KVTransferConfig | None = None
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 8
    vocab_size: int = 1000
    dtype: torch.dtype = torch.float16
    # Attention-kernel block size when the backend splits each manager block (allocate_kv_cache's
    # kernel_block_sizes): layer views become [num_blocks * ratio, H, block_size / ratio, C].
    # vLLM never splits block-outermost layouts.
    kernel_block_size: int | None = None
    # Pass worker outputs through vLLM's KVOutputAggregator, as the multiprocess executor does.
    aggregate_kv_outputs: bool = True
    # Create the worker-role connector (a separate instance, as in the worker process).
    create_worker_connector: bool = True
    # Tensor-parallel ranks (each holds num_kv_heads / tp heads); tp_workers.ProcessRanks
    # runs each rank's worker role in a process of its own.
    tensor_parallel_size: int = 1
    # An MLA model (DeepSeek-style): one latent vector of head_size a token, the same on
    # every TP rank (MLAAttentionSpec, vLLM's [B, 1, N, C] views).
    mla: bool = False
    # KV values by the model's head index instead of salted by rank: rank r of TP t holds
    # heads [r * H / t, ...) with the values a TP = 1 engine has for them (cross-TP tests).
    model_head_values: bool = False
    # A hybrid model (Gemma/Mistral style): the layers named in sliding_window_layers attend
    # only the last sliding_window tokens (SlidingWindowSpec), the others everything
    # (FullAttentionSpec). vLLM's own grouping splits them into KV cache groups; with the
    # hybrid KV cache manager on (vLLM's default, unless the connector lacks SupportsHMA) the
    # sliding-window groups free their out-of-window blocks.
    sliding_window: int | None = None
    sliding_window_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.sliding_window is None) != (not self.sliding_window_layers):
            raise HarnessError("set sliding_window and sliding_window_layers together")
        if self.sliding_window is not None:
            if self.sliding_window < 1:
                raise HarnessError(f"sliding_window {self.sliding_window} must be positive")
            if any(not 0 <= index < self.num_layers for index in self.sliding_window_layers):
                raise HarnessError(f"sliding_window_layers {self.sliding_window_layers} outside 0..{self.num_layers - 1}")
            if self.mla:
                raise HarnessError("the harness has no sliding-window MLA layers")

    @property
    def layer_names(self) -> list[str]:
        return [f"model.layers.{index}.self_attn.attn" for index in range(self.num_layers)]

    @property
    def has_sliding_window(self) -> bool:
        return self.sliding_window is not None

    def layer_window(self, layer_index: int) -> int | None:
        """The tokens a layer's attention reads (None: all of them)."""
        return self.sliding_window if layer_index in self.sliding_window_layers else None


def write_tiny_llama(directory: Path, cfg: HarnessConfig) -> Path:
    """Write a Llama-architecture config.json (no weights, no tokenizer) and return the dir."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.num_kv_heads * cfg.head_size,
        "num_attention_heads": cfg.num_kv_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size,
        "num_hidden_layers": cfg.num_layers,
        "intermediate_size": 4 * cfg.num_kv_heads * cfg.head_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": max(cfg.max_model_len, 4096),
        "torch_dtype": str(cfg.dtype).removeprefix("torch."),
        "rms_norm_eps": 1e-5,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def build_vllm_config(cfg: HarnessConfig, model_dir: Path) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=cfg.max_model_len,
        dtype=cfg.dtype,
    )
    scheduler_config = SchedulerConfig(
        max_model_len=cfg.max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        enable_chunked_prefill=True,
        async_scheduling=cfg.async_scheduling,
    )
    cache_config = CacheConfig(
        block_size=cfg.block_size,
        enable_prefix_caching=cfg.enable_prefix_caching,
        prefix_caching_hash_algo=cfg.prefix_caching_hash_algo,  # type: ignore[arg-type]
    )
    with _platform_supports_hybrid_kv_cache(cfg.has_sliding_window):
        return VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(tensor_parallel_size=cfg.tensor_parallel_size),
            kv_transfer_config=deepcopy(cfg.kv_transfer_config),
        )


@contextlib.contextmanager
def _platform_supports_hybrid_kv_cache(enabled: bool) -> Iterator[None]:
    """Let VllmConfig's post-init see a platform with the hybrid KV cache manager (HMA).

    VllmConfig turns HMA off where current_platform.support_hybrid_kv_cache() is False. These
    tests run on vLLM's UnspecifiedPlatform (no GPU, not a CPU build of vLLM), which says
    False; every real platform (CUDA, ROCm, XPU, CPU) says True. Only that answer changes,
    only while the config is built: the rest of the decision stays vLLM's (a configured
    connector that does not subclass SupportsHMA still turns HMA off).
    """
    from vllm.platforms import current_platform

    if not enabled or current_platform.support_hybrid_kv_cache():
        yield
        return
    with mock.patch.object(current_platform, "support_hybrid_kv_cache", lambda: True):
        yield


def build_kv_cache_config(cfg: HarnessConfig, vllm_config: VllmConfig) -> tuple[KVCacheConfig, KVCacheLayout]:
    """The KV cache groups and tensors, laid out as the engine core would.

    Without sliding-window layers: one full-attention group over all layers, as always. With
    them: one spec per layer, grouped by vLLM itself (get_global_kv_cache_groups, the engine
    core's call: under HMA one group per attention type, e.g. (FA 0, 2) and (SW 1, 3); with
    HMA off the sliding-window specs are promoted to full attention, one group). Groups alias
    each other's bytes from byte 0 (get_kv_cache_config_from_groups).
    """
    spec_cls = MLAAttentionSpec if cfg.mla else FullAttentionSpec
    # One rank's heads; MLA's latent is one "head", replicated on every rank.
    num_kv_heads = 1 if cfg.mla else cfg.num_kv_heads // cfg.tensor_parallel_size
    spec = spec_cls(block_size=cfg.block_size, num_kv_heads=num_kv_heads, head_size=cfg.head_size, dtype=cfg.dtype)
    layer_specs: dict[str, KVCacheSpec] = {}
    for index, name in enumerate(cfg.layer_names):
        window = cfg.layer_window(index)
        layer_specs[name] = spec if window is None else SlidingWindowSpec(
            block_size=cfg.block_size,
            num_kv_heads=num_kv_heads,
            head_size=cfg.head_size,
            dtype=cfg.dtype,
            sliding_window=window,
        )
    cache_config = vllm_config.cache_config
    if cfg.kv_cache_layout is not None:
        # A pre-set layout wins in resolve_kv_cache_layout, as for "tests and standalone tools".
        cache_config.kv_cache_layout = KVCacheLayout[_layout_alias(cfg.kv_cache_layout)].name
    supported = [[layout.name for layout in _DEFAULT_LAYOUT_PREFERENCE]]
    layout = resolve_kv_cache_layout(vllm_config, supported, list(dict.fromkeys(layer_specs.values())))
    cache_config.num_gpu_blocks_override = cfg.num_gpu_blocks
    if cfg.has_sliding_window:
        groups = get_global_kv_cache_groups(vllm_config, [layer_specs])
    else:
        groups = [KVCacheGroupSpec(cfg.layer_names, spec)]
    bytes_per_block = max(
        sum(layer_specs[name].page_size_bytes for name in group.layer_names) for group in groups
    )
    kv_cache_config = get_kv_cache_config_from_groups(
        vllm_config, groups, available_memory=bytes_per_block * cfg.num_gpu_blocks
    )
    kv_cache_config.kv_cache_layout = layout.name
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return kv_cache_config, layout


def _layout_alias(name: str) -> str:
    return {"NHD": "LBNHC", "HND": "LBHNC"}.get(name, name)


def create_connector(
    vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
) -> KVConnectorBase_V1:
    """Build a connector through vLLM's own factory (kv_connector_module_path is honoured)."""
    connector = KVConnectorFactory.create_connector(vllm_config, role, kv_cache_config)
    assert isinstance(connector, KVConnectorBase_V1)
    return connector


def make_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    block_hasher: Callable[[Request], list[Any]],
    cache_salt: str | None = None,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=block_hasher,
    )


# --------------------------------------------------------------------------------------------
# The fake model runner
# --------------------------------------------------------------------------------------------


# vLLM's null block (BlockPool holds block 0 back): a sliding-window group's block table
# shows it for blocks outside the window. Nothing may write it.
NULL_BLOCK_ID = 0


@dataclass
class _RequestState:
    token_ids: list[int]
    # One block table per KV cache group, as the model runner's block tables. A
    # sliding-window group keeps the ids of blocks vLLM freed out of the window (stale).
    group_block_ids: list[list[int]]
    num_prompt_tokens: int = 0

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block table (the only one without sliding-window layers)."""
        return self.group_block_ids[0]


@dataclass(frozen=True)
class _ScheduledRequest:
    request_id: str
    start: int  # num_computed_tokens before this step
    num_tokens: int  # scheduled this step
    token_ids: list[int]
    group_block_ids: tuple[list[int], ...]  # per KV cache group
    resumed_or_new: bool
    num_prompt_tokens: int = 0

    @property
    def block_ids(self) -> list[int]:
        return self.group_block_ids[0]


@dataclass
class FakeAttentionMetadata(AttentionMetadata):
    """Stands in for a backend's metadata in forward_context and save_kv_layer."""

    slot_mapping: torch.Tensor


class FakeModelRunner:
    """Allocates KV like vLLM's model runner and plays its connector protocol around a fake forward.

    Worker order per step (v1 runner: gpu_model_runner.execute_model + the
    kv_connector_model_runner_mixin; v2 runner: worker/gpu/model_runner + worker/gpu/kv_connector):
        v1: handle_preemptions, update states (zero new blocks, CoW copies)
        v2: update states (zero new blocks, CoW copies), handle_preemptions
        then: bind_connector_metadata, start_load_kv if has_sync_kv_loads, forward (per layer:
        wait_for_layer_load, check, write, save_kv_layer), finish_forward (v2 only),
        start_load_kv if not yet called, wait_for_save, get_transfer_results (which calls
        get_finished unless overridden), get_block_ids_with_load_errors,
        get_kv_connector_stats, get_kv_connector_kv_cache_events, build_connector_worker_meta,
        clear_connector_metadata.
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
        self.use_v2_model_runner = vllm_config.use_v2_model_runner
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
        if connector is not None:
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
        for index, req_id in enumerate(cached.req_ids):
            resumed = req_id in cached.resumed_req_ids
            old = self.requests.get(req_id)
            if old is None and not resumed:
                raise HarnessError(f"request {req_id}: cached but unknown to the runner")
            provided = cached.all_token_ids.get(req_id)
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

    def _pre_forward(self, so: SchedulerOutput, load_kwargs: dict[str, Any]) -> bool:
        """Returns whether start_load_kv already ran."""
        connector = self.connector
        assert connector is not None and so.kv_connector_metadata is not None
        if self.use_v2_model_runner:
            connector.handle_preemptions(so.kv_connector_metadata)
        connector.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            connector.start_load_kv(get_forward_context(), **load_kwargs)
            return True
        return False

    def _post_forward(self, so: SchedulerOutput, load_started: bool, load_kwargs: dict[str, Any]) -> KVConnectorOutput:
        connector = self.connector
        assert connector is not None
        if not load_started:
            connector.start_load_kv(get_forward_context(), **load_kwargs)
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
        with set_forward_context(None, self.vllm_config):
            load_started = self._pre_forward(so, {})
            if self.use_v2_model_runner:
                self.connector.finish_forward()
            kv_output = self._post_forward(so, load_started, {})
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
        load_kwargs: dict[str, Any] = {}
        if self.use_v2_model_runner:
            load_kwargs = {
                "scheduler_output": so,
                "request_state_indices": torch.arange(len(planned), dtype=torch.int32),
                "request_ids": [item.request_id for item in planned],
                "num_tokens": so.total_num_scheduled_tokens,
            }
        kv_output: KVConnectorOutput | None = None
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=so.total_num_scheduled_tokens):
            load_started = self._pre_forward(so, load_kwargs) if connector is not None else False
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
            if connector is not None:
                if self.use_v2_model_runner:  # the v1 runner never calls finish_forward
                    connector.finish_forward()
                kv_output = self._post_forward(so, load_started, load_kwargs)
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
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: index for index, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=kv_output,
        )

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


def _reconcile(request_id: str, old: Sequence[int] | None, provided: Sequence[int], replace: bool) -> list[int]:
    """Token ids after the scheduler re-sent them; both sides must agree on their common prefix."""
    provided = list(provided)
    if old is None:
        return provided
    common = min(len(old), len(provided))
    if list(old[:common]) != provided[:common]:
        raise HarnessError(f"request {request_id}: runner and scheduler disagree on token ids")
    if replace or len(provided) >= len(old):
        return provided
    return list(old)


def assert_preempted_requests_came_back(result: RunResult, model_runner: str) -> None:
    """A preempted request comes back as a "resumed" cached request under the v1 model
    runner, as a new request under v2 (vLLM sends v2 the whole request again)."""
    resumed = [req for r in result.records for req in r.resumed_req_ids]
    admitted = [req for r in result.records for req in r.new_req_ids]
    if model_runner == "v1":
        assert resumed and len(admitted) == len(result.outputs)
    else:
        assert not resumed and len(admitted) > len(result.outputs)


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


# --------------------------------------------------------------------------------------------
# The harness and its engine loop
# --------------------------------------------------------------------------------------------


@dataclass
class Harness:
    cfg: HarnessConfig
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig
    layout: KVCacheLayout
    scheduler: Scheduler
    runner: FakeModelRunner
    worker_connector: KVConnectorBase_V1 | None
    block_hasher: Callable[[Request], list[Any]]

    @property
    def scheduler_connector(self) -> KVConnectorBase_V1 | None:
        return self.scheduler.connector


_MODEL_DIRS: dict[tuple[Any, ...], Path] = {}


def _default_model_dir(cfg: HarnessConfig) -> Path:
    key = (cfg.num_layers, cfg.num_kv_heads, cfg.head_size, cfg.vocab_size, cfg.dtype, cfg.max_model_len)
    if key not in _MODEL_DIRS:
        _MODEL_DIRS[key] = write_tiny_llama(Path(tempfile.mkdtemp(prefix="tierkv-tiny-llama-")), cfg)
    return _MODEL_DIRS[key]


def build_harness(cfg: HarnessConfig, model_dir: Path | None = None, check: bool = True) -> Harness:
    """Wire vLLM's config, KV cache config, scheduler (+ its connector) and a fake runner."""
    model_dir = write_tiny_llama(model_dir, cfg) if model_dir is not None else _default_model_dir(cfg)
    vllm_config = build_vllm_config(cfg, model_dir)
    kv_cache_config, layout = build_kv_cache_config(cfg, vllm_config)
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)  # as EngineCore.__init__ does before hashing any request
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
    )
    assert isinstance(scheduler, Scheduler)
    worker_connector = None
    if vllm_config.kv_transfer_config is not None and cfg.create_worker_connector:
        worker_connector = create_connector(vllm_config, KVConnectorRole.WORKER, deepcopy(kv_cache_config))
    runner = FakeModelRunner(
        cfg, vllm_config, kv_cache_config, layout, connector=worker_connector, scheduler=scheduler, check=check
    )
    if cfg.aggregate_kv_outputs and scheduler.connector is not None:
        runner.use_output_aggregator(scheduler.connector)
    block_hasher = get_request_block_hasher(hash_block_size, hash_fn, vllm_config.num_hash_lookahead_tokens)
    return Harness(cfg, vllm_config, kv_cache_config, layout, scheduler, runner, worker_connector, block_hasher)


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    cache_salt: str | None = None


@dataclass
class StepRecord:
    index: int
    num_scheduled_tokens: dict[str, int]
    new_req_ids: list[str]
    resumed_req_ids: set[str]
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    has_sync_kv_loads: bool
    kv_connector_metadata: KVConnectorMetadata | None
    # num_computed_tokens of each scheduled request before the step (its first new position)
    computed_before: dict[str, int] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass
class RunResult:
    prompts: dict[str, RequestSpec]
    outputs: dict[str, list[int]]
    records: list[StepRecord]
    num_steps: int
    num_checked_slots: int
    seconds: float

    @property
    def num_preemptions(self) -> int:
        return sum(len(record.preempted_req_ids) for record in self.records)

    @property
    def max_batch_tokens(self) -> int:
        return max((sum(r.num_scheduled_tokens.values()) for r in self.records), default=0)

    def mismatched_outputs(self, vocab_size: int) -> list[str]:
        """Request ids whose outputs differ from reference_generate."""
        return [
            req_id
            for req_id, spec in self.prompts.items()
            if self.outputs.get(req_id) != reference_generate(spec.prompt_token_ids, spec.max_tokens, vocab_size)
        ]


class Workload:
    """Requests to start with, and follow-ups to add when a request finishes."""

    def initial_requests(self) -> list[RequestSpec]:
        raise NotImplementedError

    def on_finished(self, request_id: str, all_token_ids: list[int]) -> list[RequestSpec]:
        return []


class MultiTurnWorkload(Workload):
    """Conversations sharing a system prompt; turn k+1 = turn k's prompt + its output + new tokens."""

    def __init__(
        self,
        *,
        num_conversations: int = 4,
        num_turns: int = 3,
        system_prompt_len: int = 40,
        first_user_len: int = 30,
        user_turn_len: int = 20,
        max_tokens: int = 8,
        vocab_size: int = 1000,
        seed: int = 0,
        cache_salts: Sequence[str | None] | None = None,
    ) -> None:
        self.num_conversations = num_conversations
        self.num_turns = num_turns
        self.max_tokens = max_tokens
        self.user_turn_len = user_turn_len
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)
        self._system = self._tokens(system_prompt_len)
        self._first = [self._tokens(first_user_len) for _ in range(num_conversations)]
        self._salts = list(cache_salts) if cache_salts is not None else [None] * num_conversations

    def _tokens(self, count: int) -> list[int]:
        return [self._rng.randrange(self.vocab_size) for _ in range(count)]

    @staticmethod
    def request_id(conversation: int, turn: int) -> str:
        return f"conv{conversation}-turn{turn}"

    def initial_requests(self) -> list[RequestSpec]:
        return [
            RequestSpec(self.request_id(c, 0), self._system + self._first[c], self.max_tokens, self._salts[c])
            for c in range(self.num_conversations)
        ]

    def on_finished(self, request_id: str, all_token_ids: list[int]) -> list[RequestSpec]:
        conversation_text, turn_text = request_id.split("-")
        conversation, turn = int(conversation_text[4:]), int(turn_text[4:])
        if turn + 1 >= self.num_turns:
            return []
        prompt = list(all_token_ids) + self._tokens(self.user_turn_len)
        return [RequestSpec(self.request_id(conversation, turn + 1), prompt, self.max_tokens, self._salts[conversation])]


class StaticWorkload(Workload):
    def __init__(self, requests: Sequence[RequestSpec]) -> None:
        self._requests = list(requests)

    def initial_requests(self) -> list[RequestSpec]:
        return list(self._requests)


class HarnessEngine:
    """EngineCore's loop over the real scheduler and the fake runner (vllm/v1/engine/core.py).

    Sync scheduling follows EngineCore.step: schedule, execute, update_from_output. Async
    scheduling follows step_with_batch_queue with a queue of max_concurrent_batches (2): step N+1
    is scheduled and executed before update_from_output(N). The runner executes a step as soon
    as it is scheduled, as the GPU would.
    """

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.scheduler = harness.scheduler
        self.runner = harness.runner
        self.requests: dict[str, Request] = {}
        self.specs: dict[str, RequestSpec] = {}
        self.outputs: dict[str, list[int]] = {}
        self.records: list[StepRecord] = []
        self.finished: list[str] = []
        # Called right after the runner executed a step (before update_from_output).
        self.after_execute: Callable[[HarnessEngine, SchedulerOutput], None] | None = None
        # Called by run() after each step and its follow-up requests (between steps).
        self.on_step_end: Callable[[HarnessEngine], None] | None = None
        self._batch_queue: deque[tuple[ModelRunnerOutput, SchedulerOutput]] = deque()
        self._queue_size = harness.vllm_config.max_concurrent_batches

    def add_request(self, spec: RequestSpec) -> Request:
        request = make_request(
            spec.request_id, spec.prompt_token_ids, spec.max_tokens, self.harness.block_hasher, spec.cache_salt
        )
        self.requests[spec.request_id] = request
        self.specs[spec.request_id] = spec
        self.outputs[spec.request_id] = []
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def _schedule_and_execute(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        so = self.scheduler.schedule()
        record = StepRecord(
            index=len(self.records) + 1,
            num_scheduled_tokens=dict(so.num_scheduled_tokens),
            new_req_ids=[new.req_id for new in so.scheduled_new_reqs],
            resumed_req_ids=set(so.scheduled_cached_reqs.resumed_req_ids),
            preempted_req_ids=set(so.preempted_req_ids or ()),
            finished_req_ids=set(so.finished_req_ids),
            has_sync_kv_loads=so.has_sync_kv_loads,
            kv_connector_metadata=so.kv_connector_metadata,
            computed_before={new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs},
        )
        cached = so.scheduled_cached_reqs
        record.computed_before.update(zip(cached.req_ids, cached.num_computed_tokens))
        self.records.append(record)
        output = self.runner.execute_model(so)
        record.kv_connector_output = output.kv_connector_output
        if self.after_execute is not None:
            self.after_execute(self, so)
        return so, output

    def _update(self, so: SchedulerOutput, output: ModelRunnerOutput) -> list[str]:
        finished: list[str] = []
        for engine_outputs in self.scheduler.update_from_output(so, output).values():
            for item in engine_outputs.outputs:
                self.outputs[item.request_id].extend(item.new_token_ids)
                if item.finish_reason is not None:
                    finished.append(item.request_id)
        self.finished.extend(finished)
        return finished

    def step(self) -> list[str]:
        """One engine step; returns the ids of requests that finished in it."""
        if self._queue_size <= 1:
            if not self.scheduler.has_requests():
                return []
            so, output = self._schedule_and_execute()
            return self._update(so, output)
        return self._step_with_batch_queue()

    def _step_with_batch_queue(self) -> list[str]:
        queue = self._batch_queue
        if self.scheduler.has_requests():
            so, output = self._schedule_and_execute()
            executed = so.total_num_scheduled_tokens > 0
            queue.appendleft((output, so))
            if len(queue) < self._queue_size and (executed or self.scheduler.has_requests()):
                return []
        elif not queue:
            return []
        output, so = queue.pop()
        return self._update(so, output)

    def busy(self) -> bool:
        return self.scheduler.has_requests() or bool(self._batch_queue)

    def run(self, workload: Workload, max_steps: int = 2000) -> RunResult:
        started = time.perf_counter()
        for spec in workload.initial_requests():
            self.add_request(spec)
        steps = 0
        while self.busy():
            steps += 1
            if steps > max_steps:
                raise HarnessError(f"no quiescence after {max_steps} steps ({len(self.scheduler.requests)} left)")
            for request_id in self.step():
                request = self.requests[request_id]
                for spec in workload.on_finished(request_id, list(request.all_token_ids)):
                    self.add_request(spec)
            if self.on_step_end is not None:
                self.on_step_end(self)
        return RunResult(
            prompts=dict(self.specs),
            outputs=dict(self.outputs),
            records=list(self.records),
            num_steps=steps,
            num_checked_slots=self.runner.num_checked_slots,
            seconds=time.perf_counter() - started,
        )


def run_workload(cfg: HarnessConfig, workload: Workload, max_steps: int = 2000, check: bool = True) -> tuple[Harness, RunResult]:
    harness = build_harness(cfg, check=check)
    engine = HarnessEngine(harness)
    return harness, engine.run(workload, max_steps=max_steps)


# --------------------------------------------------------------------------------------------
# vLLM's OffloadingConnector with a CPU stand-in for its CUDA-only worker
# --------------------------------------------------------------------------------------------


@dataclass
class StandInStats:
    stores: int = 0
    loads: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    waits: int = 0


class StandInOffloadingWorker(OffloadingWorker):
    """A CPU OffloadingWorker. copy=True moves bytes (at submit, in order); copy=False only
    reports success, so loaded blocks keep stale bytes (check_kv must catch that).
    Completion is reported at the next get_finished, like an event that was polled."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int, blocks_per_chunk: int, copy: bool) -> None:
        self._gpu = [tensor.tensor for tensor in kv_caches.tensors]
        self._page = [tensor.page_size_bytes for tensor in kv_caches.tensors]
        self._refs = kv_caches.group_data_refs
        self._blocks_per_chunk = blocks_per_chunk
        self._copy = copy
        self._cpu = [
            torch.zeros(num_chunks, blocks_per_chunk * page, dtype=torch.int8) if copy else torch.empty(0)
            for page in self._page
        ]
        self._finished: list[TransferResult] = []
        self.stats = StandInStats()

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, CPULoadStoreSpec)
        size = self._transfer(src_spec, dst_spec, to_cpu=True)
        self.stats.stores += 1
        self.stats.bytes_stored += size
        self._finished.append(TransferResult(job_id, True, size, 0.0))
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        assert isinstance(src_spec, CPULoadStoreSpec)
        size = self._transfer(dst_spec, src_spec, to_cpu=False)
        self.stats.loads += 1
        self.stats.bytes_loaded += size
        self._finished.append(TransferResult(job_id, True, size, 0.0))
        return True

    def _transfer(self, gpu_spec: GPULoadStoreSpec, cpu_spec: CPULoadStoreSpec, to_cpu: bool) -> int:
        # Same addressing as vLLM's CPUOffloadingWorker: per group, block_indices[g] is the
        # logical index of the group's first GPU block; the chunk side skips that many
        # sub-blocks modulo blocks_per_chunk.
        per_chunk = self._blocks_per_chunk
        gpu_ids = gpu_spec.block_ids.tolist()
        chunk_ids = cpu_spec.block_ids.tolist()
        gpu_offset = chunk_offset = num_bytes = 0
        for group, (group_size, block_index) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices)):
            if group_size == 0:
                continue
            skip = block_index % per_chunk
            num_chunks = -(-(group_size + skip) // per_chunk)
            group_gpu = gpu_ids[gpu_offset : gpu_offset + group_size]
            group_chunks = chunk_ids[chunk_offset : chunk_offset + num_chunks]
            for index, gpu_block in enumerate(group_gpu):
                logical = skip + index
                chunk, sub_block = group_chunks[logical // per_chunk], logical % per_chunk
                for ref in self._refs[group]:
                    page = self._page[ref.tensor_idx]
                    size = ref.page_size_bytes
                    num_bytes += size
                    if not self._copy:
                        continue
                    gpu_row = self._gpu[ref.tensor_idx][gpu_block, :size]
                    cpu_row = self._cpu[ref.tensor_idx][chunk, sub_block * page : sub_block * page + size]
                    if to_cpu:
                        cpu_row.copy_(gpu_row)
                    else:
                        gpu_row.copy_(cpu_row)
            gpu_offset += group_size
            chunk_offset += num_chunks
        return num_bytes

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        self.stats.waits += 1  # transfers already ran at submit


class HarnessCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPUOffloadingSpec (real CPUOffloadingManager on the scheduler side) whose worker is
    a StandInOffloadingWorker, because CPUOffloadingSpec.get_worker requires CUDA or XPU.
    Selected by kv_connector_extra_config spec_name/spec_module_path; 'stand_in_copy' picks
    the copying or the non-copying worker."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self._stand_in: StandInOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._stand_in is None:
            self._stand_in = StandInOffloadingWorker(
                kv_caches,
                num_chunks=self.num_chunks,
                blocks_per_chunk=self.blocks_per_chunk,
                copy=bool(self.extra_config.get("stand_in_copy", True)),
            )
        return self._stand_in


def offloading_transfer_config(
    cpu_bytes_to_use: int = 8 << 20, copy: bool = True, **extra: Any
) -> KVTransferConfig:
    """vLLM's OffloadingConnector, loaded through kv_connector_module_path, with the CPU stand-in."""
    return KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_connector_module_path=OFFLOADING_CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={
            "cpu_bytes_to_use": cpu_bytes_to_use,
            "spec_name": HarnessCPUOffloadingSpec.__name__,
            "spec_module_path": HarnessCPUOffloadingSpec.__module__,
            "stand_in_copy": copy,
            **extra,
        },
    )


def stand_in_worker(harness: Harness) -> StandInOffloadingWorker:
    """The stand-in behind the worker-role OffloadingConnector of a harness."""
    connector: Any = harness.worker_connector
    worker = connector.connector_worker.worker
    assert isinstance(worker, StandInOffloadingWorker)
    return worker


# --------------------------------------------------------------------------------------------
# A connector that records the protocol
# --------------------------------------------------------------------------------------------


@dataclass
class RecordingMetadata(KVConnectorMetadata):
    step: int
    num_scheduled_tokens: dict[str, int]


class RecordingConnector(KVConnectorBase_V1):
    """Loaded with kv_connector_module_path=<this module>. Records (role, method) calls of both
    role instances in CALLS; matches nothing, loads nothing, frees blocks at once."""

    CALLS: ClassVar[list[tuple[str, str]]] = []

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._step = 0
        self._record("__init__")

    def _record(self, method: str) -> None:
        self.CALLS.append((self.role.name.lower(), method))

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._record("register_kv_caches")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._record("handle_preemptions")

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._record("bind_connector_metadata")
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._record("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self._record("save_kv_layer")

    def finish_forward(self) -> None:
        self._record("finish_forward")

    def wait_for_save(self) -> None:
        self._record("wait_for_save")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._record("get_finished")
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._record("get_block_ids_with_load_errors")
        return set()

    def build_connector_worker_meta(self) -> None:
        self._record("build_connector_worker_meta")
        return None

    def clear_connector_metadata(self) -> None:
        self._record("clear_connector_metadata")
        super().clear_connector_metadata()

    # scheduler side
    def on_new_request(self, request: Request) -> None:
        self._record("on_new_request")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._record("get_num_new_matched_tokens")
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        self._record("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        self._record("build_connector_meta")
        return RecordingMetadata(self._step, dict(scheduler_output.num_scheduled_tokens))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._record("update_connector_output")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._record("request_finished")
        return False, None

    def take_events(self) -> Iterable[Any]:
        self._record("take_events")
        return ()


def recording_transfer_config() -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=RecordingConnector.__name__,
        kv_connector_module_path=RecordingConnector.__module__,
        kv_role="kv_both",
    )
