"""A connector that records the protocol, loaded through kv_connector_module_path (see
``vllm_harness``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

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
