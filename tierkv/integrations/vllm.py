"""tierkv as a vLLM KV connector (vLLM 0.32 to 0.34): GPU -> CPU slab -> disk -> remote, and back.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "TierKVConnector",
        "kv_connector_module_path": "tierkv.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_bytes": 34359738368, "disk_path": "/var/cache/tierkv"}}'

:class:`TierKVConnector` is one class for both of vLLM's roles. The scheduler role
(EngineCore process) maps vLLM's ``Request`` / ``SchedulerOutput`` onto tierkv's
:class:`~tierkv.engine.adapter.EngineAdapter` (:mod:`.vllm_scheduler`); the worker role
(one per GPU rank) runs the plans on the rank's KV tensors (:mod:`.vllm_worker`). What
goes between the roles, and in which of vLLM's fields, is :mod:`.vllm_messages`.

Importing this module is light (vLLM imports it while it builds ``VllmConfig``): no LMDB,
no CUDA, no threads; the worker role imports its transfer and disk code when it is built.
``docs/vllm.md`` has the settings, the key derivation, the guarantees and the limits.

tierkv's log lines under vLLM's logging setup: vLLM configures the ``vllm`` logger only (a
stream handler with time, process name and pid; ``VLLM_LOGGING_LEVEL``,
``--logging-config``), so ``tierkv.*`` had no handler: its INFO lines were dropped and its
warnings printed bare. :func:`follow_vllm_logging` hands tierkv's records to the handlers
the ``vllm`` logger has at the time of each record, at vLLM's level; it changes nothing
when the ``tierkv`` logger has handlers or a level of its own (an operator's logging
config that names it wins) or when vLLM configures no logging
(``VLLM_CONFIGURE_LOGGING=0``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import vllm
from tierkv.integrations.vllm_versions import check_vllm_version

check_vllm_version(getattr(vllm, "__version__", "unknown"))

from vllm.distributed.kv_events import (  # noqa: E402
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from tierkv.engine.store_inputs import content_cache_dir  # noqa: E402
from tierkv.errors import ConfigError, NamespaceMismatchError, UsageError  # noqa: E402
from tierkv.integrations.vllm_config import (  # noqa: E402
    ConnectorSettings,
    build_geometry,
    build_namespace,
    check_hash_stability,
    check_prefill_after_hits,
    data_parallel_index,
    engine_model_fingerprint,
    parse_settings,
)
from tierkv.integrations.vllm_messages import (  # noqa: E402
    TierKVConnectorStats,
    TierKVMetadata,
    TierKVWorkerMetadata,
)
from tierkv.integrations.vllm_scheduler import SchedulerSide  # noqa: E402
from tierkv.integrations.vllm_versions import UnsupportedVersionError  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from tierkv.integrations.vllm_worker import WorkerSide

log = logging.getLogger("tierkv.vllm")

__all__ = [
    "ConnectorSettings",
    "TierKVConnector",
    "TierKVConnectorStats",
    "TierKVMetadata",
    "TierKVWorkerMetadata",
    "UnsupportedVersionError",
    "follow_vllm_logging",
]

TIERKV = "tierkv"
VLLM = "vllm"


class _ToVllmHandlers(logging.Handler):
    """Emits each record through the ``vllm`` logger's handlers (each applies its level)."""

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger(VLLM).handlers
        if not handlers and record.levelno >= logging.WARNING and logging.lastResort is not None:
            logging.lastResort.handle(record)  # what Python prints with no handler at all
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def follow_vllm_logging() -> bool:
    """Route ``tierkv.*`` records to vLLM's handlers; True when it did (now or before)."""
    ours, theirs = logging.getLogger(TIERKV), logging.getLogger(VLLM)
    if any(isinstance(handler, _ToVllmHandlers) for handler in ours.handlers):
        return True
    if ours.handlers or ours.level != logging.NOTSET or not theirs.handlers:
        return False
    ours.addHandler(_ToVllmHandlers())
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False  # as vLLM's own logger: no second copy through the root logger
    return True


# KV events: the index's tiers as vLLM names media and localities (vllm.distributed.kv_events,
# vllm.v1.kv_offload.base.Locality): (medium, locality).
MEDIA = {"CPU": (MEDIUM_CPU, "LOCAL"), "DISK": (MEDIUM_STORAGE, "LOCAL"),
         "REMOTE": (MEDIUM_STORAGE, "REMOTE")}


def spec_kind(kv_cache_config: Any) -> str | None:
    """The kind of the (one) KV cache group's spec, as vLLM's KV events name it."""
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    return str(get_kv_cache_spec_kind(groups[0].kv_cache_spec).value) if groups else None


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    """tierkv's vLLM connector (both roles); see the module docstring. It supports vLLM's
    hybrid KV cache manager (``SupportsHMA``): a model's full-attention and sliding-window
    groups are stored together, a chunk holding every group's pages."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        follow_vllm_logging()  # vLLM configured this process's logging before building us
        check_vllm_version(getattr(vllm, "__version__", "unknown"))
        transfer = self._kv_transfer_config
        if transfer.kv_role != "kv_both":
            raise ConfigError(f"tierkv vLLM connector: kv_role={transfer.kv_role!r}; tierkv "
                              f"stores and loads, use kv_role='kv_both'")
        self.settings = parse_settings(transfer.kv_connector_extra_config)
        self.geometry = build_geometry(vllm_config, kv_cache_config, self.settings)
        check_prefill_after_hits(vllm_config, self.geometry, on_cpu=current_platform.is_cpu())
        check_hash_stability(vllm_config.cache_config.prefix_caching_hash_algo, self.settings)
        self.namespace = build_namespace(
            vllm_config, self.geometry, vllm.__version__,
            model_fingerprint=engine_model_fingerprint(
                vllm_config, self.settings.model_fingerprint,
                content_cache_dir(self.settings.disk_path)))
        self._fingerprint = self.namespace.fingerprint()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._checked_namespace = False
        self._events_enabled = False
        self._spec_kind: str | None = None
        self._failed_blocks: set[int] = set()
        self._failed_loads: set[str] = set()
        self._completions: list[Any] = []
        if role == KVConnectorRole.SCHEDULER:
            events = vllm_config.kv_events_config
            self._events_enabled = bool(events is not None and events.enable_kv_cache_events)
            self._spec_kind = spec_kind(kv_cache_config)
            if transfer.kv_load_failure_policy != "recompute":
                log.warning("tierkv: kv_load_failure_policy=%r ends a request with an error when "
                            "a chunk fails to load (e.g. a corrupt disk value); set it to "
                            "'recompute' to recompute those tokens instead",
                            transfer.kv_load_failure_policy)
            self._scheduler = SchedulerSide(
                self.settings, self.geometry, self.namespace,
                replica=data_parallel_index(vllm_config),
                record_events=self._events_enabled,
            )
        else:
            from tierkv.integrations.vllm_worker import WorkerSide

            rank = int(getattr(vllm_config.parallel_config, "rank", 0) or 0)
            self._worker = WorkerSide(
                self.settings, self.geometry, self.namespace,
                num_blocks=int(kv_cache_config.num_blocks), rank=rank,
                replica=data_parallel_index(vllm_config))

    # ================================================================ both roles
    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a store dropped by a preemption is a future miss

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierKVConnectorStats:
        return TierKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from tierkv.integrations.vllm_metrics import TierKVPromMetrics

        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # vLLM asks these of the class while it builds VllmConfig, before the model loads (the
    # first with CUDA graphs on, vLLM's default on GPUs; the second with sleep mode on): the
    # settings are checked there, so a typo in a key fails in seconds, not after loading.
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        parse_settings(extra_config)
        return False  # no layer-by-layer work inside the forward pass

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        parse_settings(getattr(kv_transfer_config, "kv_connector_extra_config", None))
        return True  # as vLLM's default: tierkv pins no KV cache memory

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        parse_settings(getattr(transfer, "kv_connector_extra_config", None))
        return None  # any layout docs/vllm.md lists

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ================================================================ worker role
    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise UsageError("tierkv vLLM connector: worker method called on the scheduler role")
        return self._worker

    def _plan_of(self, metadata: KVConnectorMetadata | None) -> Any:
        if not isinstance(metadata, TierKVMetadata):
            raise UsageError(f"tierkv vLLM connector: expected TierKVMetadata from the scheduler, "
                              f"got {type(metadata).__name__}")
        if not self._checked_namespace:
            if metadata.namespace != self._fingerprint:
                raise NamespaceMismatchError(
                    f"tierkv vLLM connector: the scheduler's namespace {metadata.namespace[:8]} "
                    f"differs from worker rank {self._worker_side().rank}'s {self._fingerprint[:8]} "
                    f"({self.namespace.describe()}); both processes must see the same model, "
                    f"cache config and PYTHONHASHSEED")
            self._checked_namespace = True
        return metadata.plan

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker_side().adapter().handle_preemptions(self._plan_of(kv_connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        # vLLM calls this before the forward only for synchronous loads (tierkv has none),
        # else after it. Either way is safe (docs/vllm.md, "When loads start"): loads fill
        # blocks no forward touches yet, stores are submitted by wait_for_save.
        self._worker_side().adapter().start(self._plan_of(self._get_connector_metadata()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        self._worker_side().adapter().after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        report = self._worker_side().adapter().poll()
        self._completions.extend(report.completions)
        if self.geometry.num_groups > 1:
            # vLLM cannot map block ids back to requests with several groups: a request
            # whose load lost a chunk is reported failed instead (it is recomputed).
            self._failed_loads.update(report.failed_loads)
        else:
            self._failed_blocks.update(report.failed_block_ids)
        return None, (set(report.finished_loads) or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        _, finished = self.get_finished(finished_req_ids)
        failed, self._failed_loads = self._failed_loads, set()
        return KVConnectorTransferResults(finished_recving=set(finished or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The step's completions, and that the step ran (every step: see
        TierKVWorkerMetadata.step_done)."""
        if self._worker is None:
            return None
        completions, self._completions = self._completions, []
        return TierKVWorkerMetadata(completions, step_done=True)

    # ================================================================ scheduler role
    def _scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise UsageError("tierkv vLLM connector: scheduler method called on the worker role")
        return self._scheduler

    def on_new_request(self, request: Any) -> None:
        self._scheduler_side().on_new_request(request)

    def may_load_async(self, request: Any) -> bool:
        # vLLM 0.34 (--max-num-inflight-kv-loads); earlier releases never call it.
        return self._scheduler_side().may_load_async(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[Any, int]:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        sources = self._scheduler_side().get_external_cache_hit_sources(request, num_external_tokens)
        return {CacheHitSource(name): tokens for name, tokens in sources.items()}

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_side().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # The blocks go back to vLLM now: tierkv fences instead of delaying frees (a job that
        # still reads a block handed out again is waited for before the next forward).
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        self._scheduler_side().request_finished(request, aborted)
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM calls this one (SupportsHMA), one block list per group: the scheduler side
        # knows each request's blocks already.
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool:
        # After a weight update (vLLM's /reset_prefix_cache): stop serving every chunk
        # stored before now, on every tier (SchedulerSide.reset_cache; docs/vllm.md).
        return self._scheduler_side().reset_cache(
            lambda request: request.status == RequestStatus.RUNNING)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM's KV events for chunks entering and leaving tierkv's tiers (``MEDIA``: CPU
        LOCAL, STORAGE LOCAL for the disk, STORAGE REMOTE for the remote tier), each chunk
        with its blocks' hashes, its token ids and vLLM's block size; at most
        ``EVENT_BATCH_CHUNKS`` chunks a step (a start's snapshot of the disk tier goes out
        over the first steps)."""
        if self._scheduler is None or not self._events_enabled:
            return []
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

        def convert(block_hash: bytes) -> Any:
            return maybe_convert_block_hash(BlockHash(block_hash))

        block_size = self.geometry.hash_block_size  # tokens per entry of block_hashes
        events: list[KVCacheEvent] = []
        for kind, medium, chunk in self._scheduler.take_events():
            hashes = [convert(block_hash) for block_hash in chunk.block_hashes]
            where, locality = MEDIA[medium]
            if kind == "stored":
                parent = chunk.parent_block_hash
                events.append(BlockStored(
                    block_hashes=hashes, parent_block_hash=None if parent is None
                    else convert(parent), token_ids=chunk.token_ids.tolist(),
                    block_size=block_size, lora_id=None, medium=where, lora_name=None,
                    group_idx=0, kv_cache_spec_kind=self._spec_kind, locality=locality))
            else:
                events.append(BlockRemoved(block_hashes=hashes, medium=where, group_idx=0,
                                           locality=locality))
        return events

    def get_kv_connector_stats(self) -> TierKVConnectorStats | None:
        if self._scheduler is not None:
            return self._scheduler.stats_since_last()
        data = self._worker_side().stats_since_last()
        return TierKVConnectorStats(data=data) if data else None
