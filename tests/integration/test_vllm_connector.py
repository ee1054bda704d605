"""tierkv's vLLM connector under vLLM's real Scheduler (0.33 in .venv, 0.34 in .venv-034), on CPU.

Every run goes through ``vllm_harness``: vLLM's own Scheduler (sync or async scheduling)
and connector factory, the worker role registered on KV views built with vLLM's
``allocate_kv_cache``, and a fake model runner that calls the worker connector in the
model runner's order and, before every layer of every step, checks every earlier KV slot
of every scheduled request against a value that depends only on the token prefix. A
wrong byte loaded from the CPU or the disk tier fails the run (KVMismatchError), and each
request's output tokens are compared with ``reference_generate``.

Hit counts are asserted where they are deterministic: with vLLM's GPU prefix cache off,
every reused token is an external hit, and a later turn of a chat must hit every full
chunk its previous turn computed (the chunk completed by the last decoded tokens too).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM connector tests need vllm installed")

from . import vllm_harness as harness_lib

from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from tierkv.config import DISK_OVERHEAD_BYTES
from tierkv.errors import ConfigError
from tierkv.integrations import vllm as tierkv_vllm
from tierkv.integrations import vllm_config, vllm_versions
from tierkv.integrations.vllm_keys import chunk_key, chunk_keys_from_block_hashes

HarnessConfig = harness_lib.HarnessConfig
MultiTurnWorkload = harness_lib.MultiTurnWorkload
RequestSpec = harness_lib.RequestSpec

TPC = 32  # tokens per chunk in these tests: 2 blocks of 16


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """The harness's KV checks are many small tensor ops; on a 2-core VM torch's intra-op
    threads make them 2-10x slower, so the module runs with one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=["v2", "v1"])
def model_runner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    return harness_lib.use_model_runner(str(request.param), monkeypatch)


def tierkv_config(**extra: Any) -> KVTransferConfig:
    # The harness's forward pass is simulated (nearly free): load_policy "cost" would rightly
    # decline most loads there, so these tests of exact hits load every hit.
    settings: dict[str, Any] = {"cpu_bytes": 8 << 20, "tokens_per_chunk": TPC,
                                "load_policy": "always"}
    settings.update(extra)
    return KVTransferConfig(
        kv_connector="TierKVConnector",
        kv_connector_module_path="tierkv.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=settings,
    )


class Run:
    """One harness with tierkv: records the external tokens vLLM accepted per request and
    checks the block index's invariants after every step."""

    def __init__(self, cfg: HarnessConfig, check: bool = True, **options: Any) -> None:
        self.cfg = cfg
        self.harness = harness_lib.build_harness(cfg, check=check, **options)
        self.engine = harness_lib.HarnessEngine(self.harness)
        self.connector: Any = self.harness.scheduler_connector
        self.side = self.connector._scheduler
        self.external: dict[str, int] = {}
        original = self.connector.update_state_after_alloc

        def spy(request: Any, blocks: Any, num_external_tokens: int) -> None:
            if num_external_tokens:
                self.external[request.request_id] = num_external_tokens
            original(request, blocks, num_external_tokens)

        self.connector.update_state_after_alloc = spy
        self.engine.on_step_end = lambda engine: self.side.index.check()

    def run(self, workload: harness_lib.Workload, max_steps: int = 3000) -> harness_lib.RunResult:
        result = self.engine.run(workload, max_steps=max_steps)
        self.assert_drained()
        return result

    def assert_drained(self) -> None:
        assert self.side.adapter.jobs_in_flight() == 0
        assert self.side.adapter.num_requests() == 0
        assert self.side.index.jobs_in_flight() == 0
        assert not self.connector.has_pending_push_work()

    def shutdown(self) -> None:
        worker = self.harness.worker_connector
        assert worker is not None
        worker.shutdown()
        self.harness.scheduler.shutdown()


def assert_clean(result: harness_lib.RunResult, vocab_size: int, skip: set[str] = frozenset()) -> None:
    bad = [req for req in result.mismatched_outputs(vocab_size) if req not in skip]
    assert bad == []
    assert result.num_checked_slots > 0


def expected_chat_hits(result: harness_lib.RunResult, user_turn_len: int) -> dict[str, int]:
    """Turn k+1's prompt is turn k's tokens plus new ones: every full chunk of turn k whose
    KV was computed (all but the last sampled token), and that leaves a token to compute."""
    expected = {}
    for req_id, spec in result.prompts.items():
        if req_id.endswith("-turn0"):
            continue
        previous = len(spec.prompt_token_ids) - user_turn_len
        chunks = min((previous - 1) // TPC, (len(spec.prompt_token_ids) - 1) // TPC)
        expected[req_id] = chunks * TPC
    return expected


CHAT = dict(num_conversations=3, num_turns=3, system_prompt_len=30, first_user_len=30,
            user_turn_len=26, max_tokens=8)


# (1) multi-turn chat ----------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chat_turns_hit_every_chunk_of_the_previous_turn(async_scheduling: bool) -> None:
    cfg = HarnessConfig(async_scheduling=async_scheduling, enable_prefix_caching=False,
                        num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config())
    run = Run(cfg)
    result = run.run(MultiTurnWorkload(**CHAT))
    assert_clean(result, cfg.vocab_size)

    expected = expected_chat_hits(result, CHAT["user_turn_len"])
    got = {req: run.external.get(req, 0) for req in expected}
    assert got == expected
    # Turn 0 ends at 60 + 8 tokens: its second chunk (tokens 32-63) was completed by the
    # decoded tokens, and turn 1 hits it too.
    assert all(got[f"conv{c}-turn1"] == 2 * TPC for c in range(3))
    assert all(got[f"conv{c}-turn2"] == 3 * TPC for c in range(3))
    stats = run.side.statistics()
    assert stats["hit_tokens_cpu"] == sum(expected.values()) and stats["hit_tokens_disk"] == 0
    assert stats["loads_failed"] == stats["stores_failed"] == 0
    # Each hit was in the CPU tier: a same-step load (sync_load_bytes), so no request
    # waited in WAITING_FOR_REMOTE_KVS for it (the exact KV checks saw it land in time).
    recved = {req for r in result.records if r.kv_connector_output
              for req in r.kv_connector_output.finished_recving or ()}
    assert not recved and stats["sync_loads"] == len(expected)
    # What crosses processes in vLLM's multiprocess executor is pickled.
    import pickle

    metas = [r.kv_connector_metadata for r in result.records]
    assert pickle.loads(pickle.dumps(metas)) == metas
    worker_metas = [r.kv_connector_output.kv_connector_worker_meta for r in result.records
                    if r.kv_connector_output and r.kv_connector_output.kv_connector_worker_meta]
    assert worker_metas and pickle.loads(pickle.dumps(worker_metas)) == worker_metas


@pytest.mark.parametrize("disk", [False, True], ids=["cpu", "cpu+disk"])
def test_chat_with_the_arc_eviction_policy(disk: bool, tmp_path: Path) -> None:
    # The extra-config key reaches the block index; a CPU tier of 6 chunks evicts under ARC
    # through the real Scheduler, the index's invariants hold after every step, and every
    # output token is right (no load delivered another chunk's KV).
    extra: dict[str, Any] = {"eviction_policy": "arc", "cpu_bytes": 6 * 4096}
    if disk:
        extra["disk_path"] = str(tmp_path)
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config(**extra))
    run = Run(cfg)
    assert run.side.index.eviction_policy == "arc" and run.side.geometry.num_slots == 6
    result = run.run(MultiTurnWorkload(**CHAT))
    assert_clean(result, cfg.vocab_size)
    stats = run.side.statistics()
    assert stats["cpu_evictions"] > 0 and stats["loads_failed"] == 0
    assert stats["hit_tokens_cpu"] + stats["hit_tokens_disk"] > 0
    run.shutdown()


def test_chat_with_vllm_prefix_cache_and_the_v1_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    harness_lib.use_model_runner("v1", monkeypatch)
    cfg = HarnessConfig(num_gpu_blocks=16, max_num_batched_tokens=48,
                        kv_transfer_config=tierkv_config())
    run = Run(cfg)
    result = run.run(MultiTurnWorkload(**{**CHAT, "num_conversations": 4}))
    assert_clean(result, cfg.vocab_size)
    assert not run.harness.scheduler.use_v2_model_runner
    # Local GPU hits and tierkv's together cover at least what tierkv alone would.
    first = {}
    for record in result.records:
        for req, start in record.computed_before.items():
            first.setdefault(req, start)
    for req, tokens in expected_chat_hits(result, CHAT["user_turn_len"]).items():
        assert first[req] >= tokens, req
    assert sum(run.external.values()) > 0


class _Tenants(harness_lib.Workload):
    """One prompt sent by tenant a, then by tenant b, then by tenant a again."""

    def __init__(self) -> None:
        self.prompt = [(31 * i) % 991 for i in range(100)]

    def initial_requests(self) -> list[RequestSpec]:
        return [RequestSpec("a1", self.prompt, 4, cache_salt="a")]

    def on_finished(self, request_id: str, all_token_ids: list[int]) -> list[RequestSpec]:
        follow = {"a1": RequestSpec("b1", self.prompt, 4, cache_salt="b"),
                  "b1": RequestSpec("a2", self.prompt, 4, cache_salt="a")}
        return [follow[request_id]] if request_id in follow else []


def test_cache_salts_keep_tenants_apart() -> None:
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config())
    run = Run(cfg)
    result = run.run(_Tenants())
    assert_clean(result, cfg.vocab_size)
    assert "b1" not in run.external  # another tenant's chunks are never offered
    assert run.external["a2"] == 3 * TPC


# (2) preemptions --------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preemptions_with_a_small_gpu_block_pool(model_runner: str, async_scheduling: bool) -> None:
    cfg = HarnessConfig(async_scheduling=async_scheduling, num_gpu_blocks=20,
                        max_num_batched_tokens=48, max_num_seqs=8,
                        kv_transfer_config=tierkv_config())
    run = Run(cfg)
    workload = MultiTurnWorkload(num_conversations=5, num_turns=2, max_tokens=20, first_user_len=40)
    result = run.run(workload)
    assert_clean(result, cfg.vocab_size)
    assert result.num_preemptions > 0
    assert sum(run.external.values()) > 0


# (3) restart over the same disk path -----------------------------------------------------------


class _Resend(harness_lib.Workload):
    """Each earlier request's full token sequence, plus a few new tokens."""

    def __init__(self, sequences: dict[str, list[int]]) -> None:
        self.sequences = sequences

    def initial_requests(self) -> list[RequestSpec]:
        return [RequestSpec(f"again-{req}", tokens + [7, 7, 7], max_tokens=4)
                for req, tokens in self.sequences.items()]


def _sequences(run: Run, result: harness_lib.RunResult) -> dict[str, list[int]]:
    return {req: list(spec.prompt_token_ids) + result.outputs[req] for req, spec in result.prompts.items()}


def resend_after_restart(first: Run, result: harness_lib.RunResult,
                         second: Run) -> tuple[dict[str, int], dict[str, int]]:
    """Every sequence of the first server's run sent again to the second one: each must hit
    every chunk the first computed (the last sampled token's KV was never written).
    Returns the expected hits and the second server's figures."""
    sequences = _sequences(first, result)
    again = second.run(_Resend(sequences))
    assert_clean(again, second.cfg.vocab_size)
    expected = {f"again-{req}": (len(tokens) - 1) // TPC * TPC for req, tokens in sequences.items()}
    assert second.external == expected
    stats = second.side.statistics()
    assert stats["hit_tokens_disk"] + stats["hit_tokens_cpu"] == sum(expected.values())
    return expected, stats


def test_restart_serves_hits_from_disk(tmp_path: Path) -> None:
    # Write-back (write-through is the connector's default): the shutdown flush writes
    # what was never spilled.
    transfer = tierkv_config(disk_path=str(tmp_path), disk_bytes=64 << 20, write_through=False)
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=transfer)
    first = Run(cfg)
    result = first.run(MultiTurnWorkload(**{**CHAT, "num_turns": 2}))
    assert_clean(result, cfg.vocab_size)
    stored = first.side.index.statistics()
    assert stored.spills_ok < stored.stores_planned  # most chunks were never spilled ...
    unspilled = len(first.harness.worker_connector._worker.unspilled_chunks())  # type: ignore[union-attr]
    assert unspilled > 0
    first.shutdown()  # ... the worker writes them at shutdown

    second = Run(cfg)  # a new scheduler and worker over the same disk path
    assert second.side.found_on_disk == stored.stores_planned - stored.stores_failed
    expected, stats = resend_after_restart(first, result, second)
    # Each distinct chunk came from disk once; a request sharing it with one that promoted
    # it first waited ("not yet") and then hit the CPU tier.
    distinct = {key for req in expected
                for key in chunk_keys_from_block_hashes(second.engine.requests[req].block_hashes, 2)[
                    : expected[req] // TPC]}
    assert stats["hit_tokens_disk"] == len(distinct) * TPC
    second.shutdown()


def test_shutdown_flush_never_writes_back_what_the_disk_cap_evicted(tmp_path: Path) -> None:
    # A disk of 6 chunks under a chat that stores more: the disk's LRU evicts the oldest,
    # which stay in the CPU tier. The workers' shutdown flush used to write those back (past
    # the cap, with the newest write sequence), so the next start kept the coldest chunks
    # and deleted the hottest: a restart served what the cap had evicted and missed what a
    # router was told the disk held. Now the disk after shutdown is what it held before.
    from tierkv.core.plans import DiskState

    small = 2 * 2 * 1024  # 2 blocks x 2 layers x 1 KiB pages: a 32-token chunk's bytes
    cap = 6 * (small + DISK_OVERHEAD_BYTES) + (256 << 10)  # + the index files (issue 41)
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config(disk_path=str(tmp_path), disk_bytes=cap))
    first = Run(cfg)
    first.run(MultiTurnWorkload(**CHAT))
    keys = {key for request in first.engine.requests.values()
            for key in chunk_keys_from_block_hashes(request.block_hashes, TPC // 16)}

    def held(run: Run, state: DiskState) -> set[bytes]:
        return {key for key in keys
                if (entry := run.side.index.entry(key)) is not None and entry.disk is state}

    on_disk, evicted = held(first, DiskState.ON_DISK), held(first, DiskState.EVICTED)
    assert len(on_disk) == first.side.index.disk_capacity and evicted
    first.shutdown()

    bigger = tierkv_config(disk_path=str(tmp_path), disk_bytes=64 << 20)
    second = Run(HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48,
                               max_num_batched_tokens=64, kv_transfer_config=bigger))
    assert held(second, DiskState.ON_DISK) == on_disk
    assert second.side.found_on_disk == len(on_disk)
    second.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_small_cpu_tier_spills_and_promotes_through_disk(tmp_path: Path, async_scheduling: bool) -> None:
    chunk_bytes = 2 * 2 * 1024 * 2  # 2 blocks x 2 layers x 1 KiB pages
    cfg = HarnessConfig(async_scheduling=async_scheduling, enable_prefix_caching=False,
                        num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config(cpu_bytes=6 * chunk_bytes,
                                                         disk_path=str(tmp_path)))
    run = Run(cfg)
    result = run.run(MultiTurnWorkload(**{**CHAT, "num_conversations": 4}))
    assert_clean(result, cfg.vocab_size)
    stats = run.side.statistics()
    assert stats["spills_ok"] > 0 and stats["cpu_evictions"] > 0
    # Every later turn still hits every chunk of its previous turn.
    expected = expected_chat_hits(result, CHAT["user_turn_len"])
    assert {req: run.external.get(req, 0) for req in expected} == expected
    # The first turns' chunks left the 6-slot CPU tier long ago: they come back from disk.
    sequences = {req: tokens for req, tokens in _sequences(run, result).items() if req.endswith("turn0")}
    again = run.run(_Resend(sequences))
    assert_clean(again, cfg.vocab_size)
    assert all(run.external[f"again-{req}"] == (len(tokens) - 1) // TPC * TPC
               for req, tokens in sequences.items())
    stats = run.side.statistics()
    assert stats["hit_tokens_disk"] > 0 and stats["loads_failed"] == 0
    run.shutdown()


# (4) aborts -------------------------------------------------------------------------------------


def test_aborts_mid_prefill_and_while_loading() -> None:
    # Asynchronous loads (a same-step load leaves nothing "while loading" to abort).
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=32,
                        kv_transfer_config=tierkv_config(sync_load_bytes=0))
    run = Run(cfg)
    engine = run.engine
    prompt = [(17 * i) % 997 for i in range(150)]
    state: dict[str, int] = {}

    def on_step_end(engine: harness_lib.HarnessEngine) -> None:
        run.side.index.check()
        long = engine.requests["long"]
        if "aborted_at" not in state and long.num_computed_tokens >= 96:
            state["aborted_at"] = long.num_computed_tokens
            engine.abort_request("long")  # mid-prefill: 150 tokens, 32 per step
            engine.add_request(RequestSpec("same", prompt, max_tokens=4))
        loader = engine.requests.get("same")
        if loader is not None and "loading" not in state and loader.status.name == "WAITING_FOR_REMOTE_KVS":
            state["loading"] = 1
            engine.abort_request("same")  # while its load is in flight
            engine.add_request(RequestSpec("third", prompt, max_tokens=4))

    engine.on_step_end = on_step_end
    result = run.run(harness_lib.StaticWorkload([RequestSpec("long", prompt, max_tokens=4)]))
    assert_clean(result, cfg.vocab_size, skip={"long", "same"})
    assert state["aborted_at"] == 96 and state["loading"] == 1
    # The aborted prefill stored every chunk it computed; both later requests hit them.
    assert run.external["same"] == run.external["third"] == 96
    assert len(result.outputs["third"]) == 4


# (5) KV layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLNHC", "BLHNC"])
def test_kv_layouts(layout: str) -> None:
    cfg = HarnessConfig(kv_cache_layout=layout, enable_prefix_caching=False, num_gpu_blocks=48,
                        max_num_batched_tokens=64, kv_transfer_config=tierkv_config())
    run = Run(cfg)
    result = run.run(MultiTurnWorkload(**{**CHAT, "num_conversations": 2, "num_turns": 2}))
    assert_clean(result, cfg.vocab_size)
    assert run.harness.layout.name == layout
    expected = expected_chat_hits(result, CHAT["user_turn_len"])
    assert {req: run.external.get(req, 0) for req in expected} == expected
    page_order = run.connector.geometry.page_order
    assert page_order == ("NHD" if "NH" in layout else "HND")


def test_namespace_follows_page_bytes_not_the_outer_layout() -> None:
    def namespace(layout: str) -> str:
        cfg = HarnessConfig(kv_cache_layout=layout, num_gpu_blocks=8, create_worker_connector=False,
                            kv_transfer_config=tierkv_config())
        return harness_lib.build_harness(cfg).scheduler_connector.namespace.fingerprint()  # type: ignore[union-attr]

    assert namespace("LBNHC") == namespace("BLNHC")  # same NHD page bytes
    assert namespace("LBHNC") == namespace("BLHNC")
    assert namespace("LBNHC") != namespace("LBHNC")


def test_kernel_block_split_views() -> None:
    cfg = HarnessConfig(kernel_block_size=8, enable_prefix_caching=False, num_gpu_blocks=48,
                        max_num_batched_tokens=64, kv_transfer_config=tierkv_config())
    run = Run(cfg)
    result = run.run(MultiTurnWorkload(**{**CHAT, "num_conversations": 2, "num_turns": 2}))
    assert_clean(result, cfg.vocab_size)
    assert sum(run.external.values()) > 0
    hnd = HarnessConfig(kernel_block_size=8, kv_cache_layout="LBHNC", num_gpu_blocks=8,
                        kv_transfer_config=tierkv_config())
    with pytest.raises(ConfigError, match="kernel blocks"):
        harness_lib.build_harness(hnd)


# configuration, versions, hashes ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"cpu_byte": 1 << 20}, r"\['cpu_byte'\] = 1048576: unknown key"),
        ({"cpu_bytes": -5}, r"\['cpu_bytes'\] = -5: must be an int >= 1"),
        ({"cpu_bytes": True}, r"\['cpu_bytes'\] = True"),
        ({"tokens_per_chunk": 40}, r"\['tokens_per_chunk'\] = 40: must be a multiple of vLLM's block size 16"),
        ({"cpu_bytes": 1000}, r"\['cpu_bytes'\] = 1000: holds no chunk"),
        ({"disk_sync_mode": "never"}, r"\['disk_sync_mode'\] = 'never': must be one of"),
        ({"spill_ahead_fraction": 2}, r"\['spill_ahead_fraction'\] = 2"),
        ({"offload_prompt_only": "yes"}, r"\['offload_prompt_only'\] = 'yes': must be true or false"),
        ({"eviction_policy": "mru"}, r"\['eviction_policy'\] = 'mru': must be one of \['arc', 'lru'\]"),
        ({"remote": {"push": "on_store"}}, r"\['remote'\] = .*needs remote_url"),
        ({"remote_url": "redis://h:1", "remote": {"url": "redis://x"}}, r"takes no url: set remote_url"),
        ({"remote_url": "redis://h:1", "remote": {"pushh": 1}}, r"unknown setting 'pushh'"),
        ({"remote_url": "redis://h:1", "remote": ["push"]}, r"must be a mapping"),
        ({"remote_url": "http://u:secret@h:1"}, r"remote.url must start with redis://.*\*\*\*@h:1"),
        ({"remote_url": "redis://h:1", "remote": {"push": "always"}}, r"remote.push must be one of"),
    ],
)
def test_config_errors_name_the_key_and_value(extra: dict[str, Any], match: str) -> None:
    cfg = HarnessConfig(num_gpu_blocks=8, kv_transfer_config=tierkv_config(**extra))
    with pytest.raises(ConfigError, match=match):
        harness_lib.build_harness(cfg)


def test_defaults_with_only_cpu_bytes_and_disk_path(tmp_path: Path) -> None:
    settings = vllm_config.parse_settings({"cpu_bytes": 1 << 24, "disk_path": str(tmp_path)})
    assert settings.tokens_per_chunk is None and settings.disk_bytes == 64 << 30
    transfer = KVTransferConfig(kv_connector="TierKVConnector",
                                kv_connector_module_path="tierkv.integrations.vllm", kv_role="kv_both",
                                kv_connector_extra_config={"cpu_bytes": 1 << 24, "disk_path": str(tmp_path)})
    harness = harness_lib.build_harness(HarnessConfig(num_gpu_blocks=64, kv_transfer_config=transfer))
    geometry = harness.scheduler_connector.geometry  # type: ignore[union-attr]
    assert geometry.tokens_per_chunk == 128 and geometry.blocks_per_chunk == 8
    assert geometry.chunk_bytes == 1024 * 2 * 8  # page bytes x layers x blocks per chunk
    assert geometry.num_slots == (1 << 24) // geometry.chunk_bytes
    assert harness.worker_connector._worker.slab.num_slots == geometry.num_slots  # type: ignore[union-attr]
    harness.worker_connector.shutdown()  # type: ignore[union-attr]


def test_kv_role_must_be_kv_both() -> None:
    transfer = tierkv_config()
    transfer.kv_role = "kv_producer"
    with pytest.raises(ConfigError, match="kv_role='kv_producer'"):
        harness_lib.build_harness(HarnessConfig(num_gpu_blocks=8, kv_transfer_config=transfer))


@pytest.mark.parametrize("name", ["pipeline_parallel_size", "decode_context_parallel_size",
                                  "prefill_context_parallel_size"])
def test_other_parallel_layouts_are_refused_with_why_and_what_instead(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    build = harness_lib.build_vllm_config

    def parallel(cfg: HarnessConfig, model_dir: Path) -> Any:
        config = build(cfg, model_dir)
        object.__setattr__(config.parallel_config, name, 2)
        return config

    monkeypatch.setattr(harness_lib, "build_vllm_config", parallel)
    why = "holds only its own layers" if name.startswith("pipeline") else "different tokens"
    with pytest.raises(ConfigError, match=f"{name}=2 is not supported: .*{why}.*"
                                          f"--tensor-parallel-size"):
        vllm_config.world_size_of(harness_lib.build_vllm_config(
            HarnessConfig(num_gpu_blocks=8), harness_lib._default_model_dir(HarnessConfig())))


def test_full_attention_and_sliding_window_groups_make_one_chunk_of_every_groups_pages() -> None:
    """A hybrid model (issue 15, point 1): its groups are stored together, a chunk holding
    each layer region's page of every group's blocks; a chunk fits the smallest window."""
    import torch
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16,
                               sliding_window=72)
    cfg = HarnessConfig(num_gpu_blocks=8)
    config = harness_lib.build_vllm_config(cfg, harness_lib._default_model_dir(cfg))
    hybrid = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["a", "c"], full),
                                              KVCacheGroupSpec(["b", "d"], window)])
    geometry = vllm_config.build_geometry(config, hybrid, vllm_config.parse_settings({}))
    assert geometry.layer_names == ("a", "c") and geometry.num_groups == 2
    assert geometry.tokens_per_chunk == 64  # 256 by default; the window holds 72 tokens
    assert geometry.pages_per_chunk == 8 and geometry.chunk_bytes == 2 * 8 * full.page_size_bytes
    assert geometry.released_blocks(71) == 0 and geometry.released_blocks(87) == 1
    namespace = vllm_config.build_namespace(config, geometry, "0.33.0")
    assert namespace.kv_layout.endswith(" groups=[full:2, sliding_window=72:2]")
    assert namespace.layer_names == ("a", "c", "b", "d")
    # The group's kinds are part of the namespace: another window is another namespace.
    other = SimpleNamespace(kv_cache_groups=[hybrid.kv_cache_groups[0], KVCacheGroupSpec(
        ["b", "d"], SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=8,
                                      dtype=torch.float16, sliding_window=80))])
    assert vllm_config.build_namespace(config, vllm_config.build_geometry(
        config, other, vllm_config.parse_settings({})), "0.33.0").fingerprint() \
        != namespace.fingerprint()
    with pytest.raises(ConfigError, match=r"tokens_per_chunk.*at most 64 with a sliding window of 72"):
        vllm_config.build_geometry(config, hybrid, vllm_config.parse_settings({"tokens_per_chunk": 128}))
    only_window = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec(["a"], window)])
    assert vllm_config.build_geometry(config, only_window,
                                      vllm_config.parse_settings({})).sliding_windows == (71,)


def test_other_kv_cache_specs_and_mixed_page_shapes_are_refused_at_start() -> None:
    """What docs/vllm.md lists as not supported fails at start, saying what to do instead."""
    import torch
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec,
                                            KVCacheGroupSpec, MLAAttentionSpec)

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    cfg = HarnessConfig(num_gpu_blocks=8)
    config = harness_lib.build_vllm_config(cfg, harness_lib._default_model_dir(cfg))
    settings = vllm_config.parse_settings({})
    local = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=8,
                                      dtype=torch.float16, attention_chunk_size=64)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=32, dtype=torch.float16)
    wider = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=4, dtype=torch.float16)
    for groups, message in [
        ([full, local], "KV cache spec ChunkedLocalAttentionSpec .* is not supported"),
        ([full, mla], "KV cache spec MLAAttentionSpec .* is not supported"),
        ([local], "KV cache spec ChunkedLocalAttentionSpec .* is not supported"),
        ([full, wider], "the KV cache groups differ in num_kv_heads"),
    ]:
        kv = SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"l{i}"], spec)
                                              for i, spec in enumerate(groups)])
        with pytest.raises(ConfigError, match=message) as raised:
            vllm_config.build_geometry(config, kv, settings)
        assert "--disable-hybrid-kv-cache-manager" in str(raised.value)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_mla_model_hits_every_chunk_of_the_previous_turn(async_scheduling: bool,
                                                            tmp_path: Path) -> None:
    """MLA (issue 15, point 2): vLLM views the latent cache as [B, 1, N, C] pages with no K/V
    halves; tierkv stores them under a namespace of their own, and serves them from the CPU
    tier and, after a restart, from disk (exact KV of every slot checked before each step)."""
    cfg = HarnessConfig(async_scheduling=async_scheduling, enable_prefix_caching=False,
                        num_gpu_blocks=48, max_num_batched_tokens=64, head_size=24, mla=True,
                        kv_transfer_config=tierkv_config(disk_path=str(tmp_path)))
    run = Run(cfg)
    assert run.connector.geometry.attention == "mla"
    assert run.connector.namespace.kv_layout.startswith("vllm-mla-page ")
    assert run.connector.geometry.page_bytes == 16 * 24 * 2  # one latent vector a token
    result = run.run(MultiTurnWorkload(**CHAT))
    assert_clean(result, cfg.vocab_size)
    expected = expected_chat_hits(result, CHAT["user_turn_len"])
    assert run.side.statistics()["hit_tokens_cpu"] == sum(expected.values()) > 0
    run.shutdown()
    again = Run(cfg)
    assert again.side.found_on_disk > 0
    assert_clean(again.run(MultiTurnWorkload(**{**CHAT, "num_turns": 1})), cfg.vocab_size)
    assert again.side.statistics()["hit_tokens_disk"] > 0
    again.shutdown()
    # A full-attention model of the same page size is another namespace: no MLA chunk for it.
    other = Run(HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48,
                              max_num_batched_tokens=64, num_kv_heads=3, head_size=4,
                              kv_transfer_config=tierkv_config(disk_path=str(tmp_path))))
    assert other.connector.geometry.page_bytes == 16 * 24 * 2 and other.side.found_on_disk == 0
    other.shutdown()


def test_version_check(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm_versions.check_vllm_version("0.33.0")
    vllm_versions.check_vllm_version("0.33.7rc1")
    vllm_versions.check_vllm_version("0.32.0")
    vllm_versions.check_vllm_version("0.34.0")
    for version in ("0.31.1", "0.35.0", "1.0.0", "dev"):
        with pytest.raises(vllm_versions.UnsupportedVersionError,
                           match=r"targets vLLM 0\.32\.x, 0\.33\.x and 0\.34\.x"):
            vllm_versions.check_vllm_version(version)
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    with pytest.raises(tierkv_vllm.UnsupportedVersionError, match="vLLM 0.35.0 is not supported"):
        harness_lib.build_harness(HarnessConfig(num_gpu_blocks=8, kv_transfer_config=tierkv_config()))


def test_unstable_hashes_refuse_a_disk_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("xxhash")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with_disk = tierkv_config(disk_path=str(tmp_path))
    cfg = HarnessConfig(num_gpu_blocks=8, prefix_caching_hash_algo="xxhash", kv_transfer_config=with_disk)
    with pytest.raises(ConfigError, match="without PYTHONHASHSEED.*Set PYTHONHASHSEED"):
        harness_lib.build_harness(cfg)
    # Nor a remote tier: another engine's hashes would never match.
    with pytest.raises(ConfigError, match="remote tier could never be hit.*remove remote_url"):
        harness_lib.build_harness(HarnessConfig(
            num_gpu_blocks=8, prefix_caching_hash_algo="xxhash",
            kv_transfer_config=tierkv_config(remote_url="redis://127.0.0.1:1")))
    # Without a disk tier nothing outlives the process: allowed.
    harness_lib.build_harness(HarnessConfig(num_gpu_blocks=8, prefix_caching_hash_algo="xxhash",
                                            create_worker_connector=False,
                                            kv_transfer_config=tierkv_config()))
    # A fixed seed makes xxhash stable, and the seed is part of the namespace.
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    harness = harness_lib.build_harness(
        HarnessConfig(num_gpu_blocks=8, prefix_caching_hash_algo="xxhash", create_worker_connector=False,
                      kv_transfer_config=with_disk))
    scheme = harness.scheduler_connector.namespace.hash_scheme  # type: ignore[union-attr]
    assert scheme.startswith("vllm-xxhash/seed:") and "unset" not in scheme


def test_hash_seed_changes_the_namespace() -> None:
    cfg = HarnessConfig(num_gpu_blocks=8, create_worker_connector=False, kv_transfer_config=tierkv_config())
    connector: Any = harness_lib.build_harness(cfg).scheduler_connector
    unset = vllm_config.build_namespace(connector._vllm_config, connector.geometry, "0.33.0", {})
    seeded = vllm_config.build_namespace(connector._vllm_config, connector.geometry, "0.33.0",
                                         {"PYTHONHASHSEED": "0"})
    assert unset.fingerprint() != seeded.fingerprint()
    assert "seed:unset" in unset.hash_scheme and "seed:unset" not in seeded.hash_scheme


def test_import_is_light() -> None:
    code = (
        "import sys, torch\n"
        "import tierkv.integrations.vllm as m\n"
        "assert 'lmdb' not in sys.modules, 'lmdb imported'\n"
        "assert 'tierkv.integrations.vllm_worker' not in sys.modules\n"
        "assert 'tierkv.engine.disk_start' not in sys.modules\n"
        "assert 'tierkv.transfer.cuda' not in sys.modules\n"
        "assert not torch.cuda.is_initialized()\n"
        "print(m.TierKVConnector.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("TierKVConnector")


def test_one_capacity_formula_for_the_connector_and_the_library_store(tmp_path: Path) -> None:
    import torch

    from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig, disk_chunk_capacity
    from tierkv.engine.store import TierKVStore

    kv = [torch.zeros((8, 4, 64), dtype=torch.uint8)]
    disk_bytes = 37 * (2 * 256 + DISK_OVERHEAD_BYTES) + 5
    config = StoreConfig(blocks_per_chunk=2, cpu=CpuTierConfig(max_bytes=4096, pin_memory="never"),
                         disk=DiskTierConfig(path=tmp_path, max_bytes=disk_bytes), device="cpu")
    with TierKVStore(kv, model_id="m", tokens_per_block=4, config=config) as store:
        budget = store._share.budgets[0]
        assert budget.unit_bytes == 512 + DISK_OVERHEAD_BYTES
        # all it may take (issue 41: it takes room a step at a time, and the cap counts its
        # index files): the formula over the cap less those files
        whole = budget.plan(0, 10**6)
        assert whole == disk_chunk_capacity(disk_bytes - budget.fixed_bytes, 512) > 0
    assert disk_chunk_capacity(disk_bytes, 512) == 37
    assert disk_chunk_capacity(disk_bytes, 512, ranks=2) == 18


# keys, events, stats ---------------------------------------------------------------------------


def test_keys_derive_from_the_last_block_hash_of_each_chunk() -> None:
    harness = harness_lib.build_harness(HarnessConfig(num_gpu_blocks=8, kv_transfer_config=tierkv_config(),
                                                      create_worker_connector=False))
    request = harness_lib.make_request("r", list(range(100)), 4, harness.block_hasher)
    keys = chunk_keys_from_block_hashes(request.block_hashes, TPC // 16)
    assert len(request.block_hashes) == 6 and len(keys) == 3
    assert keys[1] == chunk_key(request.block_hashes[3])
    import hashlib

    assert keys[0] == hashlib.sha256(b"tierkv/vllm/chunk-key/v1\x00" + bytes(4) + request.block_hashes[1]).digest()
    salted = harness_lib.make_request("s", list(range(100)), 4, harness.block_hasher, cache_salt="tenant")
    assert chunk_keys_from_block_hashes(salted.block_hashes, 2)[0] != keys[0]


@pytest.mark.parametrize(("disk", "write_through"), [(False, True), (True, True), (True, False)],
                         ids=["cpu", "cpu+disk", "cpu+disk-write-back"])
def test_kv_events_and_stats(disk: bool, write_through: bool, monkeypatch: pytest.MonkeyPatch,
                             tmp_path: Path) -> None:
    build = harness_lib.build_vllm_config

    def with_events(cfg: HarnessConfig, model_dir: Path) -> Any:
        config = build(cfg, model_dir)
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        return config

    monkeypatch.setattr(harness_lib, "build_vllm_config", with_events)
    # With a disk: a CPU tier of 6 chunks, so chunks leave it (and stay on disk).
    extra = {"disk_path": str(tmp_path), "write_through": write_through,
             "cpu_bytes": 6 * 4096} if disk else {}
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config(**extra))
    run = Run(cfg)
    run.side.stats_interval = 0.0  # report on every step
    if disk:  # each step's spills land before the next, as on an idle machine: under load
        # they came late, CPU chunks were still dirty when room was needed, and stores were
        # refused instead of evicting (make test under vLLM 0.34 saw no eviction once)
        worker, check = run.harness.worker_connector._worker.worker, run.engine.on_step_end  # type: ignore[union-attr]

        def settled(engine: harness_lib.HarnessEngine) -> None:
            check(engine)
            worker.executor.wait(worker.executor.in_flight_ids())

        run.engine.on_step_end = settled
    events: list[Any] = []
    take = run.connector.take_events
    run.connector.take_events = lambda: events.extend(take()) or []
    stats: list[Any] = []
    get_stats = run.connector.get_kv_connector_stats
    run.connector.get_kv_connector_stats = lambda: (stats.append(get_stats()) or stats[-1])
    result = run.run(MultiTurnWorkload(**{**CHAT, "num_turns": 2}))
    assert_clean(result, cfg.vocab_size)
    events.extend(run.connector.take_events())  # what the last step's completions changed

    stored = [event for event in events if isinstance(event, BlockStored)]
    counts = run.side.statistics()
    on_cpu = [event for event in stored if event.medium == "CPU"]
    assert len(on_cpu) == counts["stores_planned"]
    on_disk = [event for event in stored if event.medium == "STORAGE"]
    assert len(on_disk) == (counts["spills_ok"] if disk else 0)
    assert not disk or on_disk
    assert all(event.group_idx == 0 and event.kv_cache_spec_kind == "full_attention"
               for event in stored)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    # Each event is one chunk: its blocks' hashes, the hash before it, its tokens.
    chunks = {}
    for req_id, request in run.engine.requests.items():
        hashes = [maybe_convert_block_hash(h) for h in request.block_hashes]
        tokens = list(result.prompts[req_id].prompt_token_ids) + result.outputs[req_id]
        for index in range(len(hashes) // 2):
            chunks[tuple(hashes[2 * index:2 * index + 2])] = (
                hashes[2 * index - 1] if index else None, tokens[index * TPC:(index + 1) * TPC])
    for event in stored:
        assert event.block_size == cfg.block_size and len(event.block_hashes) == 2
        parent, tokens = chunks[tuple(event.block_hashes)]
        assert event.parent_block_hash == parent and event.token_ids == tokens
    # Per tier, a chunk is removed only after it was stored, and stored again only after.
    held: set[tuple[str, tuple[Any, ...]]] = set()
    for event in events:
        entry = (event.medium, tuple(event.block_hashes))
        if isinstance(event, BlockStored):
            assert entry not in held
            held.add(entry)
        else:
            assert isinstance(event, BlockRemoved) and entry in held
            held.remove(entry)
    removed = [event for event in events if isinstance(event, BlockRemoved)]
    assert not disk or {event.medium for event in removed} == {"CPU"}  # evicted, kept on disk
    assert not disk or len(removed) == counts["cpu_evictions"] > 0

    scheduler_stats = [s for s in stats if s is not None]
    assert scheduler_stats and isinstance(scheduler_stats[0], tierkv_vllm.TierKVConnectorStats)
    total = scheduler_stats[0]
    for item in scheduler_stats[1:]:
        total = total.aggregate(item)
    rebuilt = tierkv_vllm.TierKVConnector.build_kv_connector_stats(total.to_dict())
    assert rebuilt.reduce() == total.reduce() and not rebuilt.is_empty()
    worker_stats = run.harness.worker_connector.get_kv_connector_stats()  # type: ignore[union-attr]
    assert worker_stats is None or isinstance(worker_stats, tierkv_vllm.TierKVConnectorStats)
    run.shutdown()  # closes the disk tier
    if not disk:
        return
    # A restart sends what the disk holds as STORAGE events, as the first run sent them
    # (hashes, parent, tokens), at most EVENT_BATCH_CHUNKS a step, and keeps stepping
    # (has_pending_push_work) until they are out: the chunks the first run's events put
    # on disk, and under write-back those its workers' shutdown flush wrote.
    known = {tuple(event.block_hashes): event for event in stored}
    on_disk_now = {hashes for medium, hashes in held if medium == "STORAGE"}
    second = Run(cfg)
    assert second.side.found_on_disk > len(on_disk_now) if not write_through else \
        second.side.found_on_disk == len(on_disk_now) > 2
    assert second.connector.has_pending_push_work()
    take_side = second.side.take_events
    second.side.take_events = lambda: take_side(max_chunks=2)  # type: ignore[method-assign]
    batches = [list(second.connector.take_events())
               for _ in range((second.side.found_on_disk + 1) // 2 + 1)]
    assert all(len(batch) <= 2 for batch in batches) and not batches[-1]
    assert not second.connector.has_pending_push_work()
    snapshot = [event for batch in batches for event in batch]
    assert len(snapshot) == second.side.found_on_disk
    assert on_disk_now <= {tuple(event.block_hashes) for event in snapshot}
    for event in snapshot:
        assert isinstance(event, BlockStored) and event.medium == "STORAGE"
        assert event.locality == "LOCAL"
        before = known[tuple(event.block_hashes)]
        assert (event.parent_block_hash, event.token_ids, event.block_size) == (
            before.parent_block_hash, before.token_ids, before.block_size)
    second.shutdown()


# failures and tensor parallelism -----------------------------------------------------------------


def run_with_a_chunk_missing_on_disk(cfg: HarnessConfig) -> tuple[Run, harness_lib.RunResult]:
    """One chat turn, a restart, the second chunk of conv1-turn0 deleted from disk (the
    index still lists it: its read misses), and every turn sent again."""
    first = Run(cfg)
    result = first.run(MultiTurnWorkload(**{**CHAT, "num_turns": 1}))
    first.shutdown()

    second = Run(cfg)
    sequences = _sequences(first, result)
    victim = harness_lib.make_request("x", sequences["conv1-turn0"], 1, second.harness.block_hasher)
    lost = chunk_keys_from_block_hashes(victim.block_hashes, 2)[1]
    disk = second.harness.worker_connector._worker.disk  # type: ignore[union-attr]
    assert disk.delete_many([lost]) == 1
    again = second.run(_Resend(sequences))
    assert_clean(again, cfg.vocab_size)  # the lost chunk's tokens were recomputed
    return second, again


def test_a_chunk_missing_on_disk_is_recomputed(tmp_path: Path) -> None:
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config(disk_path=str(tmp_path)))
    second, again = run_with_a_chunk_missing_on_disk(cfg)
    invalid = set().union(*(r.kv_connector_output.invalid_block_ids for r in again.records
                            if r.kv_connector_output))
    assert len(invalid) == 2  # the two GPU blocks of the missing chunk
    stats = second.side.statistics()
    assert stats["loads_failed"] == 1 and stats["hit_tokens_disk"] == 6 * TPC
    assert stats["disk_missing"] == 1  # forgotten by the index; recomputed and stored again
    second.shutdown()


def test_a_second_worker_on_the_same_disk_environment_is_refused(tmp_path: Path) -> None:
    cfg = HarnessConfig(num_gpu_blocks=8, kv_transfer_config=tierkv_config(disk_path=str(tmp_path)))
    first = harness_lib.build_harness(cfg)
    with pytest.raises(ConfigError, match="in use by another tierkv worker"):
        harness_lib.build_harness(cfg)
    first.worker_connector.shutdown()  # type: ignore[union-attr]
    harness_lib.build_harness(cfg).worker_connector.shutdown()  # type: ignore[union-attr]


def test_a_follower_rank_reads_the_writers_environment_once_it_exists(tmp_path: Path) -> None:
    """MLA under TP: a rank that loads rank 0's copy opens rank 0's environment read-only,
    waits (bounded) for rank 0 to create it, and says which path when it never appears."""
    from tierkv.config import DiskTierConfig, StoreConfig
    from tierkv.keys import SINGLE_PART, Namespace
    from tierkv.tiers.disk.opener import open_disk
    from tierkv.tiers.disk.tier import DiskTier

    namespace = Namespace(model_id="m", dtype="float16", kv_layout="x", page_bytes=64,
                          tokens_per_chunk=16)
    config = StoreConfig(disk=DiskTierConfig(path=tmp_path, max_bytes=1 << 20), rank=0)
    with pytest.raises(ConfigError, match=r"part-0of1 \(the environment of part 0of1, which "
                                          r"another rank writes\) could not be read within 0 s"):
        open_disk(config.disk, namespace, SINGLE_PART, "follower", payload_bytes=64,
                  wait_seconds=0.1)
    # The follower is another process (as rank 1 is): it starts first, the writer then
    # creates the environment and stores a chunk, and the follower reads it.
    code = f'''
import sys
import time
from pathlib import Path
from tierkv.config import DiskTierConfig, StoreConfig
from tierkv.tiers.disk.opener import open_disk
from tierkv.keys import SINGLE_PART, Namespace
from tierkv.tiers.base import ReadStatus
namespace = Namespace(model_id="m", dtype="float16", kv_layout="x", page_bytes=64,
                      tokens_per_chunk=16)
config = StoreConfig(disk=DiskTierConfig(path=Path({str(tmp_path)!r}), max_bytes=1 << 20), rank=0)
print("waiting", flush=True)
tier = open_disk(config.disk, namespace, SINGLE_PART, "follower", payload_bytes=64, wait_seconds=60)
out = bytearray(64)
for _ in range(600):
    if tier.read_into(b"k" * 32, memoryview(out)) is ReadStatus.OK:
        break
    __import__("time").sleep(0.05)
print(tier.read_only, out == bytes(range(64)))
'''
    follower = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    assert follower.stdout is not None
    assert follower.stdout.readline() == "waiting\n"  # started before the environment exists
    with DiskTier(tmp_path, namespace, 0, config.disk, 64) as writer:
        writer.put_many([(b"k" * 32, bytes(range(64)))])
        out, err = follower.communicate(timeout=120)
    assert follower.returncode == 0, err[-2000:]
    assert out.split() == ["True", "True"]  # read-only, and the writer's bytes


def test_rebuild_keeps_chunks_every_part_holds(tmp_path: Path) -> None:
    from tierkv.config import DiskTierConfig
    from tierkv.engine.disk_start import rebuild_keys
    from tierkv.tiers.disk.opener import close_disk, open_disk
    from tierkv.keys import Namespace, Part
    from tierkv.tiers.disk.tier import DiskTier

    namespace = Namespace(model_id="m", dtype="float16", kv_layout="x", page_bytes=64,
                          tokens_per_chunk=32)
    config = DiskTierConfig(path=tmp_path, max_bytes=1 << 24)
    keys = [bytes([i]) * 32 for i in range(6)]
    payload = b"\x01" * 128
    for part, held in ((Part(0, 2), keys), (Part(1, 2), keys[:2] + keys[3:])):  # 1of2 lacks keys[2]
        tier = open_disk(config, namespace, part, "scan", payload_bytes=len(payload))
        for key in held:  # one txn each: keys[0] is the oldest
            tier.put_many([(key, payload)])
        close_disk(tier)
    kept, deleted, elsewhere = rebuild_keys(namespace, 2, config, len(payload),
                                            capacity=4)
    assert kept == keys[1:2] + keys[3:]  # oldest first; keys[0] trimmed (capacity), keys[2] partial
    assert deleted == 2 and elsewhere == {}
    tier = open_disk(config, namespace, Part(0, 2), "scan", payload_bytes=len(payload))
    assert sorted(record.key for record in tier.scan()) == sorted(kept)
    close_disk(tier)

    # A TP = 1 engine's part (one value of both halves' bytes) and a TP = 4 engine's that
    # lost a part (a crash between parts): the first is usable, loaded as 1 part; the
    # second is not; neither is deleted (another engine's).
    others = [bytes([100 + i]) * 32 for i in range(3)]
    with DiskTier(tmp_path, namespace, Part(0, 1), config, 2 * len(payload)) as whole:
        whole.put_many([(key, payload * 2) for key in others[:2] + keys[3:4]])
    for index in range(3):  # part 3of4 never written
        with DiskTier(tmp_path, namespace, Part(index, 4), config, len(payload) // 2) as quarter:
            quarter.put_many([(others[2], payload[:64])])
    kept, deleted, elsewhere = rebuild_keys(namespace, 2, config, len(payload),
                                            capacity=100, counts=(2, 1, 4))
    assert deleted == 0 and elsewhere == {others[0]: 1, others[1]: 1}  # keys[3]: our own
    assert set(kept) == set(keys[1:2] + keys[3:]) | set(others[:2])
    with DiskTier(tmp_path, namespace, Part(0, 1), config, 2 * len(payload)) as whole:
        assert len(list(whole.scan())) == 3


def test_a_job_completes_once_every_tp_rank_reported_it() -> None:
    from types import SimpleNamespace

    from tierkv.integrations.vllm_config import ConnectorSettings
    from tierkv.integrations.vllm_geometry import Geometry
    from tierkv.integrations.vllm_scheduler import SchedulerSide
    from tierkv.keys import Namespace

    geometry = Geometry(layer_names=("a", "b"), block_size=16, hash_block_size=16, blocks_per_chunk=2,
                        page_bytes=1024, num_heads=2, content_bytes=32, dtype="float16", layout="LBNHC",
                        page_order="NHD", world_size=2, num_slots=8, disk_capacity=0)
    namespace = Namespace(model_id="m", dtype="float16", kv_layout="x", page_bytes=2048,
                          tokens_per_chunk=32)
    side = SchedulerSide(ConnectorSettings(), geometry, namespace)
    request = SimpleNamespace(request_id="r", block_hashes=[bytes([i]) * 32 for i in range(4)],
                              num_prompt_tokens=70, num_tokens=70, num_computed_tokens=0)
    side.on_new_request(request)
    new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5],))
    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
    so = SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                         num_scheduled_tokens={"r": 64}, preempted_req_ids=set())
    plan = side.build_meta(so).plan
    (store,) = plan.stores
    assert [chunk.block_ids for chunk in store.chunks] == [(1, 2), (3, 4)]
    done = tierkv_vllm.TierKVWorkerMetadata([tierkv_vllm_completion(store.job_id)])
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=done))  # rank 0
    assert side.adapter.jobs_in_flight() == 1 and side.has_pending_push_work()
    both = done.aggregate(tierkv_vllm.TierKVWorkerMetadata([]))  # a step where rank 1 had nothing
    assert isinstance(both, tierkv_vllm.TierKVWorkerMetadata) and len(both.completions) == 1
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=both))  # rank 1
    assert side.adapter.jobs_in_flight() == 0
    assert side.index.lookup(side.adapter.records["r"].engine.keys).num_hits == 2


def test_a_request_lives_on_the_adapter_record_and_its_id_is_refused_until_released() -> None:
    """The connector keeps what it needs of a request on the adapter's record (no table of
    its own); an id that comes back while the finished request's store is in flight is
    refused as vLLM names it, before anything changes, and taken once the record is gone."""
    from types import SimpleNamespace

    from tierkv.errors import UsageError
    from tierkv.integrations.vllm_config import ConnectorSettings, Geometry
    from tierkv.integrations.vllm_scheduler import SchedulerSide
    from tierkv.keys import Namespace

    geometry = Geometry(layer_names=("a",), block_size=16, hash_block_size=16, blocks_per_chunk=2,
                        page_bytes=1024, num_heads=2, content_bytes=32, dtype="float16", layout="LBNHC",
                        page_order="NHD", world_size=1, num_slots=8, disk_capacity=0)
    namespace = Namespace(model_id="m", dtype="float16", kv_layout="x", page_bytes=1024,
                          tokens_per_chunk=32)
    side = SchedulerSide(ConnectorSettings(), geometry, namespace)

    def request() -> SimpleNamespace:
        return SimpleNamespace(request_id="r", block_hashes=[bytes([i]) * 32 for i in range(4)],
                               num_prompt_tokens=70, num_tokens=70, num_computed_tokens=0)

    def step(scheduled: dict[str, int], new: list[Any]) -> Any:
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
        return side.build_meta(SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached,
                                               num_scheduled_tokens=scheduled, preempted_req_ids=set()))

    first = request()
    side.on_new_request(first)
    assert side.get_num_new_matched_tokens(first, 16) == (0, False)
    record = side.adapter.records["r"]
    assert record.engine.request is first and record.engine.local_hit == 16
    (store,) = step({"r": 64}, [SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4, 5],))]).plan.stores
    first.num_computed_tokens = 64
    side.request_finished(first, aborted=True)
    assert side.adapter.records["r"] is record and record.engine is None  # its store is in flight
    tables = [value for value in vars(side).values() if isinstance(value, (dict, set))]
    assert not any("r" in table for table in tables)  # nothing of the request outside its record
    again = request()
    with pytest.raises(UsageError, match="'r'.*unique"):
        side.on_new_request(again)
    assert side.adapter.records["r"] is record and record.engine is None  # nothing changed
    done = tierkv_vllm.TierKVWorkerMetadata([tierkv_vllm_completion(store.job_id)])
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=done))
    step({}, [])
    assert not side.adapter.has_request("r")  # released: the id is free again
    side.on_new_request(again)
    assert side.adapter.records["r"].engine.request is again


def test_a_block_vllm_hands_to_one_group_ahead_of_the_other_is_fenced_at_once() -> None:
    """Two KV cache groups: vLLM's new blocks of a step may fill one group's table ahead of
    the other's. A block a finished request's store still reads, handed to one group,
    is written by this very step's forward pass: that store must be flushed now, not when
    the other group catches up (the connector used to pass on only the positions every
    group held)."""
    from types import SimpleNamespace

    from tierkv.integrations.vllm_config import ConnectorSettings
    from tierkv.integrations.vllm_geometry import Geometry
    from tierkv.integrations.vllm_geometry import KVGroup
    from tierkv.integrations.vllm_scheduler import SchedulerSide
    from tierkv.keys import Namespace

    geometry = Geometry(layer_names=("a",), block_size=16, hash_block_size=16, blocks_per_chunk=2,
                        page_bytes=1024, num_heads=2, content_bytes=32, dtype="float16", layout="LBNHC",
                        page_order="NHD", world_size=1, num_slots=8, disk_capacity=0,
                        groups=(KVGroup("full", ("a",)), KVGroup("full", ("b",))))
    namespace = Namespace(model_id="m", dtype="float16", kv_layout="x", page_bytes=1024,
                          tokens_per_chunk=32)
    side = SchedulerSide(ConnectorSettings(), geometry, namespace)

    def request(req_id: str, blocks: int) -> SimpleNamespace:
        return SimpleNamespace(request_id=req_id, num_prompt_tokens=16 * blocks + 8,
                               block_hashes=[bytes([ord(req_id), i]) * 16 for i in range(blocks)],
                               num_tokens=16 * blocks + 8, num_computed_tokens=0)

    def step(new: list[SimpleNamespace], cached: dict[str, Any], tokens: dict[str, int]) -> Any:
        so = SimpleNamespace(
            scheduled_new_reqs=new, num_scheduled_tokens=tokens, preempted_req_ids=set(),
            scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached),
                                                  new_block_ids=list(cached.values()),
                                                  resumed_req_ids=set()))
        return side.build_meta(so).plan

    done, running = request("d", 2), request("r", 2)
    side.on_new_request(done)
    side.on_new_request(running)
    plan = step([SimpleNamespace(req_id="d", block_ids=([1, 2], [11, 12])),
                 SimpleNamespace(req_id="r", block_ids=([3], [13]))], {}, {"d": 32, "r": 16})
    (store,) = plan.stores  # d's first chunk: in flight, reading blocks 1, 2, 11 and 12
    assert [chunk.block_ids for chunk in store.chunks] == [(1, 2, 11, 12)]
    done.num_computed_tokens, running.num_computed_tokens = 32, 16
    side.request_finished(done, aborted=False)  # its blocks go back to vLLM at once
    # Block 1 goes to r's group 0; its group 1 gets no block this step.
    plan = step([], {"r": ([1], [])}, {"r": 16})
    assert store.job_id in plan.jobs_to_flush
    assert plan.stores == ()  # r's chunk 0 lacks group 1's second page
    running.num_computed_tokens = 32
    plan = step([], {"r": ([], [14])}, {"r": 1})
    (store,) = plan.stores
    assert [chunk.block_ids for chunk in store.chunks] == [(3, 1, 13, 14)]


def test_keys_follow_rewritten_block_hashes() -> None:
    """A streaming-input session drops its last sampled token and vLLM rewrites the hashes
    from that block on: keys derived from the old hashes must not be reused."""
    from types import SimpleNamespace

    from tierkv.integrations.vllm_config import ConnectorSettings
    from tierkv.integrations.vllm_geometry import Geometry
    from tierkv.integrations.vllm_scheduler import SchedulerSide
    from tierkv.keys import Namespace

    geometry = Geometry(layer_names=("a",), block_size=16, hash_block_size=16, blocks_per_chunk=2,
                        page_bytes=1024, num_heads=2, content_bytes=32, dtype="float16", layout="LBNHC",
                        page_order="NHD", world_size=1, num_slots=4, disk_capacity=0)
    namespace = Namespace(model_id="m", dtype="float16", kv_layout="x", page_bytes=1024, tokens_per_chunk=32)
    side = SchedulerSide(ConnectorSettings(), geometry, namespace)
    hashes = [bytes([i]) * 32 for i in range(4)]
    request = SimpleNamespace(request_id="s", block_hashes=hashes, num_prompt_tokens=64, num_tokens=64,
                              num_computed_tokens=0)
    side.on_new_request(request)
    view = side._view(side.adapter.records["s"].engine)
    assert list(view.chunk_keys) == [chunk_key(hashes[1]), chunk_key(hashes[3])]
    del hashes[3:]
    hashes.append(b"\xee" * 32)  # same length, new last hash
    assert list(side._view(side.adapter.records["s"].engine).chunk_keys) == [chunk_key(hashes[1]), chunk_key(b"\xee" * 32)]
    assert list(view.chunk_keys)[1] == chunk_key(b"\xee" * 32)  # edited in place: the adapter sees it
    del hashes[1:]
    assert side._view(side.adapter.records["s"].engine).chunk_keys == []


def tierkv_vllm_completion(job_id: Any) -> Any:  # a store job's
    from tierkv.core.jobs import Completion, JobKind

    return Completion(job_id, JobKind.STORE, ok=True, num_bytes=4096)


# randomized runs ---------------------------------------------------------------------------------


def random_settings(rng: Any, tokens_per_chunk: int, chunk_bytes: int, disk_path: Path) -> dict[str, Any]:
    """tierkv's extra config for a randomized run: CPU bytes for 1-24 chunks, some prompt-only
    and write-through runs, a disk tier of 4-40 chunks in most."""
    extra: dict[str, Any] = {"tokens_per_chunk": tokens_per_chunk,
                             "cpu_bytes": rng.randint(1, 24) * chunk_bytes,
                             "offload_prompt_only": rng.random() < 0.2,
                             "write_through": rng.random() < 0.3}
    if rng.random() < 0.6:
        extra["disk_path"] = str(disk_path)
        extra["disk_bytes"] = rng.randint(4, 40) * (chunk_bytes + DISK_OVERHEAD_BYTES)
    return extra


def random_engine_knobs(rng: Any) -> dict[str, Any]:
    """The harness knobs a randomized run draws besides the model and the pool (under vLLM
    0.34 also --max-num-inflight-kv-loads: loads that start while the batch is full)."""
    knobs = dict(async_scheduling=rng.random() < 0.5, enable_prefix_caching=rng.random() < 0.5,
                 kv_cache_layout=rng.choice(["LBNHC", "LBHNC", "BLNHC", "BLHNC"]),
                 max_num_batched_tokens=rng.choice([32, 48, 64]), max_num_seqs=rng.choice([4, 8]))
    if harness_lib.VLLM_RELEASE.inflight_kv_loads:  # no new draw: each seed's workload stays
        knobs["max_num_inflight_kv_loads"] = {32: None, 48: 1, 64: 4}[knobs["max_num_batched_tokens"]]
    return knobs


def run_random_chat(run: Run, rng: Any, seed: int) -> dict[str, int]:
    """A random multi-turn chat with some aborts, the block index checked after every step;
    every request not aborted gets the reference output on exactly checked KV. Returns the
    scheduler side's figures (the run is shut down)."""
    run.harness.runner.write_before_check = True  # same-step prefix hits on a shared system prompt
    workload = MultiTurnWorkload(num_conversations=rng.randint(3, 5), num_turns=3,
                                 system_prompt_len=rng.randint(10, 40), first_user_len=rng.randint(10, 40),
                                 user_turn_len=rng.randint(5, 30), max_tokens=rng.randint(4, 16), seed=seed)
    aborted: set[str] = set()
    abort_rate = rng.choice([0.0, 0.0, 0.05])

    def maybe_abort(engine: harness_lib.HarnessEngine) -> None:
        run.side.index.check()
        live = [req for req, request in engine.requests.items() if not request.is_finished()]
        if live and rng.random() < abort_rate:
            victim = rng.choice(live)
            aborted.add(victim)
            engine.abort_request(victim)

    run.engine.on_step_end = maybe_abort
    result = run.run(workload)
    assert_clean(result, run.cfg.vocab_size, skip=aborted)
    stats = run.side.statistics()
    run.shutdown()
    return stats


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("TIERKV_RANDOM_SEEDS", "16"))))
def test_random_configurations_keep_every_kv_slot_right(seed: int, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import random

    rng = random.Random(seed)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", rng.choice(["0", "1"]))
    tokens_per_chunk = rng.choice([16, 32, 48])
    extra = random_settings(rng, tokens_per_chunk, tokens_per_chunk // 16 * 2 * 1024, tmp_path)
    knobs = random_engine_knobs(rng)
    cfg = HarnessConfig(num_gpu_blocks=rng.randint(14, 40), kv_transfer_config=tierkv_config(**extra),
                        **knobs)
    assert run_random_chat(Run(cfg), rng, seed)["loads_failed"] == 0


def test_block_index_touch_refreshes_recency() -> None:
    from tierkv.core.index import BlockIndex
    from tierkv.core.jobs import Completion, JobKind

    index = BlockIndex(num_slots=3)
    keys = [bytes([i]) * 32 for i in range(4)]
    plan = index.prepare_store(keys[:3])
    index.complete_store(Completion(plan.job_id, JobKind.STORE, ok=True))  # LRU order: 0, 1, 2
    index.touch([keys[0], b"absent" * 6])  # 0 is now the most recent
    index.prepare_store(keys[3:])  # evicts the least recent: 1
    assert [index.contains(key) for key in keys] == [True, False, True, True]
    index.check()


def test_sizes_as_vllm_writes_them_and_its_cpu_bytes_to_use_key() -> None:
    from tierkv.integrations.vllm_config import parse_settings

    settings = parse_settings({"cpu_bytes": "32GiB", "disk_bytes": "64G"})
    assert (settings.cpu_bytes, settings.disk_bytes) == (32 << 30, 64 << 30)
    assert parse_settings({"cpu_bytes": "500MB"}).cpu_bytes == 500 * 10**6
    assert parse_settings({"cpu_bytes_to_use": 8 << 30}).cpu_bytes == 8 << 30
    assert parse_settings({"cpu_bytes_to_use": "8G"}).cpu_bytes == 8 << 30
    for bad, match in (({"cpu_bytes": "32 parsecs"}, r"\['cpu_bytes'\] = '32 parsecs': must be"),
                       ({"cpu_bytes": "0GiB"}, r"must be an int >= 1"),
                       ({"cpu_bytes_to_use": 1, "cpu_bytes": 1}, r"another name of cpu_bytes")):
        with pytest.raises(ConfigError, match=match):
            parse_settings(bad)


def test_nan_is_refused_naming_the_key() -> None:
    """NaN compares false with every bound, so the connector's own checks let it through:
    promotion_wait_seconds=NaN reached the adapter, whose lookups then never waited on a
    promotion, and load_bias=NaN failed later as the adapter's, not naming the key. The
    checks the connector now shares with the library refuse it as the key's value."""
    for key in ("promotion_wait_seconds", "load_bias", "spill_ahead_fraction"):
        with pytest.raises(ConfigError, match=rf"\['{key}'\] = nan: must be a number"):
            vllm_config.parse_settings({key: float("nan")})


def test_the_connector_keys_are_the_library_settings_they_translate_to() -> None:
    """Each key derived from a library setting takes what that setting takes (its kind,
    bounds, choices) and has its default, unless the connector says otherwise."""
    from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
    from tierkv.engine.adapter_config import AdapterConfig
    from tierkv.settings import declared

    classes = {cls.__name__: cls for cls in (CpuTierConfig, DiskTierConfig, StoreConfig,
                                             AdapterConfig)}
    own_defaults = {"write_through": True, "load_policy": "cost"}  # docs/vllm.md says why
    derived = {name: spec for name, spec in declared(vllm_config.ConnectorSettings).items()
               if spec.source}
    assert set(derived) >= {"cpu_bytes", "disk_bytes", "disk_sync_mode", "load_bias",
                            "promotion_wait_seconds", "eviction_policy", "device"}
    for name, spec in derived.items():
        cls_name, source = spec.source.split(".")
        mine = declared(classes[cls_name])[source]
        assert (spec.kind, spec.low, spec.high, spec.above, spec.choices, spec.unit) == \
            (mine.kind, mine.low, mine.high, mine.above, mine.choices, mine.unit), name
        assert getattr(vllm_config.ConnectorSettings, name) == \
            own_defaults.get(name, getattr(classes[cls_name], source)), name


def test_a_restart_under_other_settings_warns_which_differ(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config(disk_path=str(tmp_path)))
    first = Run(cfg)
    assert_clean(first.run(MultiTurnWorkload(**{**CHAT, "num_turns": 1})), cfg.vocab_size)
    first.shutdown()
    other = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48,
                          max_num_batched_tokens=64, kv_transfer_config=tierkv_config(
                              disk_path=str(tmp_path), tokens_per_chunk=2 * TPC))
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        second = Run(other)
    assert second.side.found_on_disk == 0
    warnings = [r.getMessage() for r in caplog.records if "0 chunks found" in r.getMessage()]
    assert len(warnings) == 1 and "tokens_per_chunk is 32 there, 64 here" in warnings[0]
    second.shutdown()


def test_the_last_steps_figures_are_reported_before_the_engine_goes_idle() -> None:
    """Figures are reported at most once per stats_interval while tierkv has work in flight,
    and at once when it has none: vLLM calls for them only while it steps, so a burst's
    last figures would wait for the next request (an idle server's /metrics stayed behind).
    The clock stands still here: only the first payload and the idle ones are due."""
    cfg = HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
                        kv_transfer_config=tierkv_config())
    run = Run(cfg)
    run.side._clock = lambda: 1000.0  # a frozen clock: the interval never elapses
    payloads: list[Any] = []
    get_stats = run.connector.get_kv_connector_stats
    run.connector.get_kv_connector_stats = lambda: (payloads.append(get_stats()) or payloads[-1])
    result = run.run(MultiTurnWorkload(**{**CHAT, "num_turns": 2}))
    assert_clean(result, cfg.vocab_size)
    assert not run.side.has_pending_push_work()
    reported = sum(payload.data.get("hit_tokens_cpu", 0) for payload in payloads if payload)
    assert reported == run.side.statistics()["hit_tokens_cpu"] > 0
    run.shutdown()


def test_one_disk_cap_for_every_namespace_under_the_disk_path(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server whose settings changed (here tokens_per_chunk, as a vLLM upgrade or a TP
    change would) starts a new namespace under the same disk_path. disk_bytes is one cap
    for all of them: the old namespace, which no engine claims, gives its room first (the
    path is full), with a warning that names it. Before, each namespace had a cap of its own
    and the old ones stayed forever (the path held both: 2x the cap)."""
    from tierkv.config import DISK_OVERHEAD_BYTES
    from tierkv.tiers.disk.budget import survey

    disk = tmp_path / "kv"
    small = 2 * 2 * 1024  # 2 blocks x 2 layers x 1 KiB pages: a 32-token chunk's bytes
    # the cap counts each namespace's index files too (about 200 KiB here; issue 41)
    cap = 16 * (small + DISK_OVERHEAD_BYTES) + (256 << 10)
    first = Run(HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48,
                              max_num_batched_tokens=64,
                              kv_transfer_config=tierkv_config(disk_path=str(disk), disk_bytes=cap)))
    first.run(MultiTurnWorkload(**CHAT))
    old = first.side.fingerprint
    assert first.side.index.statistics().on_disk > 8  # it filled more than half the cap
    first.shutdown()
    second = Run(HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48,
                               max_num_batched_tokens=64,
                               kv_transfer_config=tierkv_config(
                                   disk_path=str(disk), disk_bytes=cap, tokens_per_chunk=64)))
    assert second.side.fingerprint != old
    # the path is full (the first engine filled it, and the cap counts the second's index
    # files): the old namespace goes at start, named in a warning (issue 41: only then)
    assert any(f"deleted namespace {old[:8]}" in record.getMessage()
               and "no engine claimed it" in record.getMessage() for record in caplog.records)
    result = second.run(MultiTurnWorkload(**{**CHAT, "num_conversations": 6}))
    assert_clean(result, second.cfg.vocab_size)
    held = second.side.index.statistics().on_disk * (2 * small + DISK_OVERHEAD_BYTES)
    others = sum(holding.used for holding in survey(disk, (second.side.fingerprint, "part-0of1")))
    assert held + others <= cap
    assert not (disk / f"ns-{old}").exists()  # the old namespace gave its room
    assert held > (cap - (256 << 10)) // 2  # ... to the new one (beside its index files)
    second.shutdown()
