"""Drive vLLM's real Scheduler (0.33 or 0.34) on CPU with a fake model runner.

This is a test helper, not a test module. It builds vLLM's own objects (ModelConfig from a tiny
local Llama config, VllmConfig, KVCacheConfig, Scheduler or AsyncScheduler, connectors through
KVConnectorFactory) and replaces only the model: a fake forward pass writes a deterministic value
into every KV slot vLLM assigns, so any slot that later holds something else was loaded wrong.

Primitives and their contracts:
    HarnessConfig / build_harness(cfg)  the knobs and the wired objects (no downloads, no GPU).
    make_request(...)                   a vLLM Request hashed by vLLM's own block hasher.
    FakeModelRunner.execute_model(so)   calls the worker connector in the model runner's order
                                        (v1 runner, or v2 through vLLM's own
                                        worker/gpu/kv_connector.py wrapper), writes
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

The parts live in tests/integration/harness/ (values, config, runner_state, runner, engine,
offloading, recording: see its __init__); this module re-exports them and wires them
(build_harness, run_workload). It keeps the wiring so that a test may monkeypatch
`build_vllm_config` here and have build_harness use it.
"""

from __future__ import annotations

import tempfile
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.structured_output import StructuredOutputManager

from .harness.config import (
    HarnessConfig,
    build_kv_cache_config,
    build_vllm_config,
    create_connector,
    make_request,
    write_tiny_llama,
)
from .harness.engine import (
    Harness,
    HarnessEngine,
    MultiTurnWorkload,
    RequestSpec,
    RunResult,
    StaticWorkload,
    StepRecord,
    Workload,
    assert_preempted_requests_came_back,
)
from .harness.offloading import (
    OFFLOADING_CONNECTOR_MODULE,
    HarnessCPUOffloadingSpec,
    StandInOffloadingWorker,
    StandInStats,
    offloading_transfer_config,
    stand_in_worker,
)
from .harness.recording import RecordingConnector, RecordingMetadata, recording_transfer_config
from .harness.runner import FakeModelRunner, check_kv
from .harness.runner_state import NULL_BLOCK_ID, FakeAttentionMetadata, _ScheduledRequest
from tierkv.integrations.vllm_versions import release_of

from .harness.values import (
    HarnessError,
    KVMismatch,
    KVMismatchError,
    KVValueGenerator,
    extend_fingerprints,
    reference_generate,
    sample_token,
)

__all__ = [
    "NULL_BLOCK_ID",
    "OFFLOADING_CONNECTOR_MODULE",
    "FakeAttentionMetadata",
    "FakeModelRunner",
    "Harness",
    "HarnessCPUOffloadingSpec",
    "HarnessConfig",
    "HarnessEngine",
    "HarnessError",
    "KVMismatch",
    "KVMismatchError",
    "KVValueGenerator",
    "MultiTurnWorkload",
    "RecordingConnector",
    "RecordingMetadata",
    "RequestSpec",
    "RunResult",
    "StandInOffloadingWorker",
    "StandInStats",
    "StaticWorkload",
    "StepRecord",
    "Workload",
    "_ScheduledRequest",
    "_default_model_dir",
    "assert_preempted_requests_came_back",
    "build_harness",
    "build_kv_cache_config",
    "build_vllm_config",
    "check_kv",
    "create_connector",
    "extend_fingerprints",
    "make_request",
    "offloading_transfer_config",
    "recording_transfer_config",
    "reference_generate",
    "run_workload",
    "sample_token",
    "stand_in_worker",
    "use_model_runner",
    "write_tiny_llama",
]

VLLM_RELEASE = release_of(vllm.__version__)  # the installed release's row of RELEASES


def use_model_runner(name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Build later VllmConfigs for vLLM's "v1" or "v2" model runner; skips "v1" on a
    release without it (vLLM 0.34: RELEASES' model_runner_v1)."""
    if name == "v1" and not VLLM_RELEASE.model_runner_v1:
        pytest.skip(f"vLLM {vllm.__version__} has no v1 model runner")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if name == "v2" else "0")
    return name


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


def run_workload(cfg: HarnessConfig, workload: Workload, max_steps: int = 2000, check: bool = True) -> tuple[Harness, RunResult]:
    harness = build_harness(cfg, check=check)
    engine = HarnessEngine(harness)
    return harness, engine.run(workload, max_steps=max_steps)
