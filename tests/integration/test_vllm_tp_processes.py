"""TP = 2 with each rank's worker role in a process of its own (issue 15, point 3), under the
real vLLM 0.33 Scheduler: the metadata crosses a process boundary pickled, the ranks'
completions are merged by vLLM's KVOutputAggregator, and every rank checks the exact KV of
every earlier slot of its own heads before each step (tp_workers.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from . import vllm_harness as harness_lib
from .test_vllm_connector import CHAT, TPC, HarnessConfig, MultiTurnWorkload, assert_clean, \
    expected_chat_hits, tierkv_config
from .tp_workers import ProcessRanks


class TPRun:
    """The scheduler here, each rank's worker in its own process."""

    def __init__(self, cfg: HarnessConfig) -> None:
        self.cfg = cfg
        self.harness = harness_lib.build_harness(cfg)
        self.ranks = ProcessRanks(self.harness, harness_lib._default_model_dir(cfg))
        self.harness.runner = self.ranks  # type: ignore[assignment]
        self.engine = harness_lib.HarnessEngine(self.harness)
        self.side: Any = self.harness.scheduler_connector._scheduler  # type: ignore[union-attr]
        self.engine.on_step_end = lambda engine: self.side.index.check()

    def run(self, workload: harness_lib.Workload) -> harness_lib.RunResult:
        result = self.engine.run(workload, max_steps=3000)
        assert self.side.adapter.jobs_in_flight() == 0 and self.side.adapter.num_requests() == 0
        return result

    def shutdown(self) -> None:
        self.ranks.shutdown()
        self.harness.scheduler.shutdown()


def resend(run: TPRun, result: harness_lib.RunResult,
           which: Callable[[str], bool] = lambda req: True) -> tuple[dict[str, int], int]:
    """Each of ``result``'s sequences (those ``which`` picks) sent to ``run`` with one more
    token; checks the outputs and returns the figures and the tokens of every chunk the
    first engine computed (the last sampled token was never written)."""
    sequences = {req: list(spec.prompt_token_ids) + result.outputs[req]
                 for req, spec in result.prompts.items() if which(req)}
    again = run.run(harness_lib.StaticWorkload(
        [harness_lib.RequestSpec(f"again-{req}", tokens + [7], max_tokens=2)
         for req, tokens in sequences.items()]))
    assert_clean(again, run.cfg.vocab_size)
    return run.side.statistics(), sum((len(t) - 1) // TPC * TPC for t in sequences.values())


def tp_config(**options: Any) -> HarnessConfig:
    extra = options.pop("extra", {})
    settings: dict[str, Any] = {"enable_prefix_caching": False, "num_gpu_blocks": 48,
                                "max_num_batched_tokens": 64, "tensor_parallel_size": 2,
                                **options}
    return HarnessConfig(kv_transfer_config=tierkv_config(**extra),
                         create_worker_connector=False, aggregate_kv_outputs=False, **settings)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_rank_processes_serve_every_chunk_of_the_previous_turn(async_scheduling: bool) -> None:
    run = TPRun(tp_config(async_scheduling=async_scheduling))
    assert run.side.geometry.world_size == 2
    assert len(set(run.ranks.pids)) == 2 and os.getpid() not in run.ranks.pids
    result = run.run(MultiTurnWorkload(**CHAT))
    assert_clean(result, run.cfg.vocab_size)
    assert run.ranks.num_checked_slots > 0  # both ranks checked their slots every step
    expected = expected_chat_hits(result, CHAT["user_turn_len"])
    stats = run.side.statistics()
    assert stats["hit_tokens_cpu"] == sum(expected.values()) > 0
    assert stats["loads_failed"] == stats["stores_failed"] == 0
    run.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_rank_processes_with_preemption_and_a_restart_from_disk(async_scheduling: bool,
                                                                     tmp_path: Path) -> None:
    # A small GPU pool preempts; the second server starts on what both ranks wrote to disk.
    cfg = tp_config(async_scheduling=async_scheduling, num_gpu_blocks=20,
                    extra={"disk_path": str(tmp_path)})
    workload = {**CHAT, "num_conversations": 4}
    first = TPRun(cfg)
    result = first.run(MultiTurnWorkload(**workload))
    assert_clean(result, cfg.vocab_size)
    assert result.num_preemptions > 0
    first.shutdown()  # each rank flushes its CPU tier to its own environment
    assert sorted(path.name for path in next(tmp_path.glob("ns-*")).glob("part-*")) == \
        ["part-0of2", "part-1of2"]

    second = TPRun(cfg)
    assert second.side.found_on_disk > 0  # chunks every rank holds
    again = second.run(MultiTurnWorkload(**{**workload, "num_turns": 1}))
    assert_clean(again, cfg.vocab_size)
    stats = second.side.statistics()
    assert stats["hit_tokens_disk"] >= TPC * workload["num_conversations"]  # each first turn
    assert stats["loads_failed"] == 0
    second.shutdown()


def test_a_ranks_values_are_its_own() -> None:
    """The harness's KV values differ per rank, so a chunk loaded into another rank's slots
    fails the exact check (what makes the tests above able to fail)."""
    import torch

    zero = harness_lib.KVValueGenerator(2, 1, 8, torch.float16, rank=0).values([7, 8])
    one = harness_lib.KVValueGenerator(2, 1, 8, torch.float16, rank=1).values([7, 8])
    assert not torch.equal(zero, one)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mla_under_tp_keeps_one_disk_copy_that_every_rank_loads(async_scheduling: bool,
                                                               tmp_path: Path) -> None:
    """MLA ranks hold identical KV (issue 15, point 2): rank 0 writes one copy per chunk, and
    rank 1 loads it (exact checks of both ranks' slots). A full-attention model with pages of
    the same size keeps one copy per rank: the bytes saved are measured against it."""
    from tierkv.tiers.disk.tools import inspect_store

    workload = {**CHAT, "num_conversations": 4}

    def stored(root: Path, **options: Any) -> tuple[int, int, list[str], int]:
        cfg = tp_config(async_scheduling=async_scheduling, num_gpu_blocks=20,
                        extra={"disk_path": str(root)}, **options)
        run = TPRun(cfg)
        result = run.run(MultiTurnWorkload(**workload))
        assert_clean(result, cfg.vocab_size)
        assert result.num_preemptions > 0
        on_disk = run.side.index.statistics().on_disk
        run.shutdown()
        (report,) = inspect_store(root)
        ranks = [rank.path.name for rank in report.ranks]
        return (sum(rank.chunks for rank in report.ranks),
                sum(rank.payload_bytes for rank in report.ranks), ranks,
                on_disk + run.ranks.flushed)

    mla_values, mla_bytes, mla_ranks, mla_chunks = stored(tmp_path / "mla", mla=True,
                                                          head_size=16)
    full_values, full_bytes, full_ranks, full_chunks = stored(tmp_path / "full", num_kv_heads=2,
                                                              head_size=8)
    assert mla_ranks == ["part-0of1"] and full_ranks == ["part-0of2", "part-1of2"]
    assert mla_values == mla_chunks > 0  # one value per chunk
    assert full_values == 2 * full_chunks  # one per chunk and rank
    # Pages of the same size (MLA 1 x 16 latent; 1 head of K and V of 8 on each rank).
    assert mla_bytes * 2 == full_bytes * mla_chunks // full_chunks

    # A restart: both ranks load the one copy (rank 1 from rank 0's environment).
    cfg = tp_config(async_scheduling=async_scheduling, num_gpu_blocks=20, mla=True,
                    head_size=16, extra={"disk_path": str(tmp_path / "mla")})
    again = TPRun(cfg)
    assert again.side.found_on_disk == mla_values
    result = again.run(MultiTurnWorkload(**{**workload, "num_turns": 1}))
    assert_clean(result, cfg.vocab_size)
    counts = again.side.statistics()
    assert counts["hit_tokens_disk"] >= TPC * workload["num_conversations"]
    assert counts["loads_failed"] == 0
    again.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_hybrid_model_on_two_rank_processes(async_scheduling: bool, tmp_path: Path) -> None:
    """Full-attention and sliding-window groups (HMA on) with TP = 2 in two processes: each
    rank stores every group's pages of its own heads, and a restart loads them."""
    cfg = tp_config(async_scheduling=async_scheduling, num_layers=4, sliding_window=32,
                    sliding_window_layers=(1, 3), num_gpu_blocks=96,
                    extra={"disk_path": str(tmp_path)})
    first = TPRun(cfg)
    assert first.side.geometry.num_groups == 2 and first.side.geometry.world_size == 2
    result = first.run(MultiTurnWorkload(**CHAT))
    assert_clean(result, cfg.vocab_size)
    expected = expected_chat_hits(result, CHAT["user_turn_len"])
    assert first.side.statistics()["hit_tokens_cpu"] == sum(expected.values()) > 0
    first.shutdown()

    second = TPRun(cfg)
    stats, computed = resend(second, result, lambda req: req.endswith("turn2"))
    assert stats["hit_tokens_disk"] == computed and stats["loads_failed"] == 0
    second.shutdown()


def test_mla_under_tp_keeps_one_remote_copy_that_every_rank_loads(redis_cluster: Any) -> None:
    """MLA with TP = 2 on the remote tier: rank 0 pushes one value per chunk (rank 1 pushes
    nothing), and a second engine's two ranks both load it from the cluster."""
    from .test_vllm_remote import cluster_chunks

    redis_cluster.flushall()
    cfg = tp_config(mla=True, head_size=16, extra={"remote_url": redis_cluster.url})
    first = TPRun(cfg)
    result = first.run(MultiTurnWorkload(**{**CHAT, "num_turns": 1}))
    assert_clean(result, cfg.vocab_size)
    stored = first.side.index.statistics().stores_planned
    first.shutdown()  # each rank flushes its push queue
    on_cluster = cluster_chunks(redis_cluster.url)
    assert on_cluster == {(first.side.fingerprint, "0of1"): stored} and stored > 0

    second = TPRun(cfg)  # another engine: an empty CPU tier, the same cluster
    stats, computed = resend(second, result)
    assert stats["hit_tokens_remote"] == computed > 0 and stats["loads_failed"] == 0
    second.shutdown()


# -- across TP sizes: one namespace, parts read whole and re-sliced ----------------------------
CROSS_HEADS = 4  # TP 2: two heads a rank, so a rank copies a range of heads out of a part


def cross_config(tp: int, layout: str, **extra: Any) -> HarnessConfig:
    return tp_config(tensor_parallel_size=tp, num_kv_heads=CROSS_HEADS, kv_cache_layout=layout,
                     model_head_values=True, extra=extra)


def store_then_load(writer_tp: int, reader_tp: int, layout: str,
                    **extra: Any) -> tuple[dict[str, int], int, str, str]:
    """A TP = ``writer_tp`` engine computes and stores a chat's first turn; a TP =
    ``reader_tp`` engine (ranks in their own processes, an empty CPU tier) is sent the same
    sequences: each rank checks the exact KV of every head it holds in every slot before
    each step, against the values the model's heads have whatever the TP size (so a chunk
    with one head's bytes wrong, missing or another head's fails). Returns the reader's
    figures, the tokens the writer computed in full chunks, and both namespaces."""
    writer = TPRun(cross_config(writer_tp, layout, **extra))
    result = writer.run(MultiTurnWorkload(**{**CHAT, "num_turns": 1}))
    assert_clean(result, writer.cfg.vocab_size)
    writer.shutdown()  # flushes every part to disk, or the push queues to the cluster
    reader = TPRun(cross_config(reader_tp, layout, **extra))
    assert reader.side.geometry.num_parts == reader_tp != writer.side.geometry.num_parts
    stats, computed = resend(reader, result)
    assert reader.ranks.num_checked_slots > 0
    reader.shutdown()
    return stats, computed, writer.side.fingerprint, reader.side.fingerprint


@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"], ids=["NHD", "HND"])
@pytest.mark.parametrize("writer_tp,reader_tp", [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_another_tp_size_loads_every_chunk_from_disk_exactly(
        writer_tp: int, reader_tp: int, layout: str, tmp_path: Path) -> None:
    stats, computed, written_as, read_as = store_then_load(writer_tp, reader_tp, layout,
                                                           disk_path=str(tmp_path))
    assert written_as == read_as  # one namespace for both TP sizes
    parts = sorted(path.name for path in next(tmp_path.glob("ns-*")).glob("part-*"))
    assert parts == sorted({f"part-{p}of{writer_tp}" for p in range(writer_tp)}
                           | {f"part-{p}of{reader_tp}" for p in range(reader_tp)})
    fraction = stats["hit_tokens_disk"] / computed
    print(f"disk, TP {writer_tp} -> TP {reader_tp} ({layout}): hit fraction {fraction:.3f} "
          f"({stats['hit_tokens_disk']} of {computed} tokens)")
    assert fraction == 1.0 and stats["loads_failed"] == 0 and stats["corrupt"] == 0


@pytest.mark.parametrize("writer_tp,reader_tp", [(1, 2), (2, 1)], ids=["tp1-to-tp2", "tp2-to-tp1"])
def test_another_tp_size_loads_every_chunk_from_the_cluster_exactly(
        writer_tp: int, reader_tp: int, redis_cluster: Any) -> None:
    from .test_vllm_remote import cluster_chunks

    redis_cluster.flushall()
    stats, computed, written_as, read_as = store_then_load(
        writer_tp, reader_tp, "LBNHC", remote_url=redis_cluster.url)
    assert written_as == read_as
    on_cluster = cluster_chunks(redis_cluster.url)
    assert {part for _, part in on_cluster} >= {f"{p}of{writer_tp}" for p in range(writer_tp)}
    fraction = stats["hit_tokens_remote"] / computed
    print(f"remote, TP {writer_tp} -> TP {reader_tp}: hit fraction {fraction:.3f} "
          f"({stats['hit_tokens_remote']} of {computed} tokens)")
    assert fraction == 1.0 and stats["loads_failed"] == 0


def test_a_chunk_missing_one_part_is_a_miss_never_partial_bytes(tmp_path: Path) -> None:
    """A crash between parts: a TP = 2 engine wrote both parts, then part 1's chunks are
    lost. A TP = 1 engine finds no chunk whole under 2 parts: nothing hits, nothing of part
    0 reaches a slot (the ranks' exact checks would fail), and part 0's values stay (they
    are another engine's)."""
    import shutil

    writer = TPRun(cross_config(2, "LBNHC", disk_path=str(tmp_path)))
    result = writer.run(MultiTurnWorkload(**{**CHAT, "num_turns": 1}))
    assert_clean(result, writer.cfg.vocab_size)
    writer.shutdown()
    ns_dir = next(tmp_path.glob("ns-*"))
    shutil.rmtree(ns_dir / "part-1of2")
    reader = TPRun(cross_config(1, "LBNHC", disk_path=str(tmp_path)))
    assert reader.side.found_on_disk == 0
    stats, computed = resend(reader, result)
    assert computed > 0 and stats["hit_tokens_disk"] == 0 and stats["loads_failed"] == 0
    reader.shutdown()
    assert (ns_dir / "part-0of2").is_dir()
