"""vLLM's own configs for the harness: HarnessConfig, a tiny local Llama, VllmConfig,
KVCacheConfig, connectors through vLLM's factory, and requests (see ``vllm_harness``)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import Any
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
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.utils import (
    _DEFAULT_LAYOUT_PREFERENCE,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request

from .values import HarnessError

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
    # vLLM 0.34's --max-num-inflight-kv-loads (None: not passed, as on 0.32/0.33): loads
    # that the connector's may_load_async admits start while the running batch is full.
    max_num_inflight_kv_loads: int | None = None
    # The v2 runner with a speculator: post_forward(defer_finalize=True) collects the
    # transfer results before wait_for_save, which finalize_step calls after the drafts.
    defer_kv_finalize: bool = False

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
        **({} if cfg.max_num_inflight_kv_loads is None
           else {"max_num_inflight_kv_loads": cfg.max_num_inflight_kv_loads}),
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
    lora_request: Any = None,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=block_hasher,
        lora_request=lora_request,
    )
