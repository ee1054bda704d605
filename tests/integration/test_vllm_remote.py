"""tierkv's shared remote tier under the real vLLM 0.33 Scheduler, on a real Redis Cluster.

Two engines (each its own vLLM Scheduler, tierkv scheduler side, worker side, CPU tier and
fake model runner from ``vllm_harness``) share the session's 3-master ``redis_cluster``:
engine A computes and pushes chunks, engine B, with empty local tiers, must load every one
of them from the cluster. The harness checks every earlier KV slot of every scheduled
request before every layer of every step (a wrong byte fails the run) and each request's
output is compared with ``reference_generate``. In ``[async]`` engine A is another Python
process (its own vLLM, its own block hasher), so the chunk keys and the namespace must be
stable across processes, as they are across hosts.

Another tenant (cache salt), model, KV layout or dtype never hits; a cluster nobody
answers (a refused port, or a server that accepts connections and never replies) never
fails a request or slows a step by more than the lookup deadline.

With vLLM's GPU prefix cache off, every reused token is an external hit, so hit counts
are exact. Prompt lengths are chosen so that what an engine stores (prompt + 3 computed
decode tokens) and what a lookup may load (whole chunks of prompt - 1 tokens) are the
same chunks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM connector tests need vllm installed")

from redis.cluster import RedisCluster as ClusterClient
from vllm.config import KVEventsConfig, KVTransferConfig
from vllm.distributed.kv_events import BlockStored

from tests.integration import vllm_harness as harness_lib
from tests.integration.test_vllm_connector import Run, expected_chat_hits
from tests.redis_cluster import HOST, RedisCluster, free_port
from tierkv.tiers.remote.format import parse_redis_key

HarnessConfig = harness_lib.HarnessConfig
RequestSpec = harness_lib.RequestSpec

TPC = 32  # tokens per chunk: 2 vLLM blocks of 16
MAX_TOKENS = 4
# (p + MAX_TOKENS - 1) // TPC == (p - 1) // TPC for each: the chunks A stores are the ones
# B may load (2 + 3 + 4 + 5 = 14 chunks).
PROMPT_LENGTHS = (70, 100, 129, 161)
REPO = Path(__file__).resolve().parents[2]
PREFIX = b"tierkv:"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """The harness's KV checks are many small tensor ops; one torch thread is faster on a
    2-core box (as in test_vllm_connector)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- engines ---------------------------------------------------------------------------------


def transfer_config(remote_url: str, **extra: Any) -> KVTransferConfig:
    # The remote lookup's deadline stays at its default (10 ms): a "not yet" answer makes
    # vLLM ask again next step, bounded by promotion_wait_seconds (5 s), far more than a
    # loopback cluster needs even on a slow CI box.
    settings: dict[str, Any] = {"cpu_bytes": 8 << 20, "tokens_per_chunk": TPC,
                                "remote_url": remote_url,
                                "load_policy": "always"}  # the harness's forward is simulated
    settings.update(extra)
    return KVTransferConfig(kv_connector="TierKVConnector",
                            kv_connector_module_path="tierkv.integrations.vllm",
                            kv_role="kv_both", kv_load_failure_policy="recompute",
                            kv_connector_extra_config=settings)


# remote.timeout_seconds of the tests that are not about a failing server: the default
# (0.5 s) is a production figure, which a loaded 2-core CI box can miss while connecting.
RELAXED = 5.0


def harness_config(remote_url: str, async_scheduling: bool = False, *,
                   remote_timeout: float = RELAXED, **overrides: Any) -> HarnessConfig:
    knobs: dict[str, Any] = dict(async_scheduling=async_scheduling, enable_prefix_caching=False,
                                 num_gpu_blocks=48, max_num_batched_tokens=64,
                                 kv_transfer_config=transfer_config(
                                     remote_url, remote={"timeout_seconds": remote_timeout}))
    knobs.update(overrides)
    return HarnessConfig(**knobs)


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(length)] for length in PROMPT_LENGTHS]


def specs(token_lists: list[list[int]], cache_salt: str | None = None,
          tag: str = "p") -> list[RequestSpec]:
    return [RequestSpec(f"{tag}{i}", tokens, MAX_TOKENS, cache_salt)
            for i, tokens in enumerate(token_lists)]


def loadable_tokens(spec: RequestSpec) -> int:
    """Tokens of the whole chunks a lookup may load (one token is always left to compute)."""
    return (len(spec.prompt_token_ids) - 1) // TPC * TPC


class Engine(Run):
    """One engine: the harness's vLLM Scheduler with tierkv's scheduler side, its worker
    side and fake runner (:class:`Run`: the external tokens vLLM accepted per request, the
    block index checked after every step), and each step's wall time."""

    def __init__(self, cfg: HarnessConfig, model_dir: Path) -> None:
        super().__init__(cfg, model_dir=model_dir)
        self.step_seconds: list[float] = []
        step = self.engine.step

        def timed_step() -> list[str]:
            started = time.perf_counter()
            try:
                return step()
            finally:
                self.step_seconds.append(time.perf_counter() - started)

        self.engine.step = timed_step  # type: ignore[method-assign]

    @property
    def fingerprint(self) -> str:
        return str(self.side.fingerprint)

    def pusher(self) -> Any:
        worker = self.harness.worker_connector._worker  # type: ignore[union-attr]
        return worker._stack.executor.pusher

    def stats(self) -> dict[str, int]:
        return dict(self.side.statistics())

    def shutdown(self) -> None:
        """The worker drains its jobs and flushes its push queue; then the scheduler side."""
        self.harness.worker_connector.shutdown()  # type: ignore[union-attr]
        self.harness.scheduler.shutdown()


def assert_served(result: harness_lib.RunResult, vocab_size: int) -> None:
    """Every request finished with the reference output, on exactly checked KV, and no
    load failed (vLLM was never told to recompute a block)."""
    assert result.mismatched_outputs(vocab_size) == []
    assert all(len(result.outputs[req]) == spec.max_tokens for req, spec in result.prompts.items())
    assert result.num_checked_slots > 0
    invalid = [r.kv_connector_output.invalid_block_ids for r in result.records
               if r.kv_connector_output and r.kv_connector_output.invalid_block_ids]
    assert invalid == []


def run_writer(args: dict[str, Any]) -> dict[str, Any]:
    """Engine A: run the prompts, shut down (which flushes the pushes), and say what it
    stored. Runs in this process or, through ``python -c``, in another one."""
    cfg = harness_config(args["url"], args["async"])
    engine = Engine(cfg, Path(args["model_dir"]))
    result = engine.run(harness_lib.StaticWorkload(specs(args["prompts"], args["salt"], "a")))
    stats = engine.stats()
    pusher = engine.pusher()
    engine.shutdown()
    pushed = pusher.statistics()
    return {"bad_outputs": result.mismatched_outputs(cfg.vocab_size),
            "checked_slots": result.num_checked_slots,
            "finished": sorted(engine.engine.finished),
            "external": engine.external,
            "fingerprint": engine.fingerprint,
            "stores_planned": stats["stores_planned"], "stores_failed": stats["stores_failed"],
            "loads_remote": stats["loads_remote"],
            "queued": pushed.pushes_queued, "pushed": pushed.pushes_pushed,
            "dropped": pushed.pushes_dropped, "failed": pushed.pushes_failed}


_CHILD = ("import json, sys, torch\n"
          "torch.set_num_threads(1)\n"
          "from tests.integration.test_vllm_remote import run_writer\n"
          "summary = run_writer(json.loads(sys.argv[1]))\n"
          "print('TIERKV-RESULT ' + json.dumps(summary), flush=True)\n")


def run_writer_in_another_process(args: dict[str, Any]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], cwd=REPO,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("TIERKV-RESULT "))
    return dict(json.loads(line.removeprefix("TIERKV-RESULT ")))


def cluster_chunks(url: str) -> Counter[tuple[str, str]]:
    """Values on the cluster per (namespace fingerprint, part ``<p>of<P>``): a SCAN of the
    ``tierkv:`` prefix on every primary."""
    client = ClusterClient.from_url(url)
    counts: Counter[tuple[str, str]] = Counter()
    try:
        for node in client.get_primaries():
            for name in client.scan_iter(match=PREFIX + b"*", count=1000, target_nodes=node):
                parsed = parse_redis_key(PREFIX, name)
                assert parsed is not None, name
                counts[(parsed[0], parsed[1].name)] += 1
    finally:
        client.close()
    return counts


# -- 1. two engines, one cluster ---------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_two_engines_share_one_cluster(redis_cluster: RedisCluster, tmp_path: Path,
                                       async_scheduling: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    redis_cluster.flushall()
    model_dir = tmp_path / "tiny-llama"
    tokens = prompts(seed=1)
    args = {"url": redis_cluster.url, "async": async_scheduling, "model_dir": str(model_dir),
            "prompts": tokens, "salt": None}
    # async: engine A is another process (the spec's "two schedulers with their workers"
    # as two vLLM engines would be); sync: both engines in this process.
    writer = run_writer_in_another_process(args) if async_scheduling else run_writer(args)
    expected_chunks = sum((length + MAX_TOKENS - 1) // TPC for length in PROMPT_LENGTHS)
    assert writer["bad_outputs"] == [] and writer["checked_slots"] > 0
    assert writer["finished"] == [f"a{i}" for i in range(len(tokens))]
    assert writer["external"] == {} and writer["loads_remote"] == 0  # the cluster was empty
    assert writer["stores_planned"] == expected_chunks and writer["stores_failed"] == 0
    # Every stored chunk was pushed (the shutdown flushed the queue), none dropped or failed.
    assert writer["queued"] == writer["pushed"] == expected_chunks
    assert writer["dropped"] == writer["failed"] == 0
    on_cluster = cluster_chunks(redis_cluster.url)
    assert on_cluster == {(writer["fingerprint"], "0of1"): expected_chunks}  # TP 1: one part

    cfg = harness_config(redis_cluster.url, async_scheduling)
    build = harness_lib.build_vllm_config

    def with_events(cfg: HarnessConfig, model_dir: Path) -> Any:
        config = build(cfg, model_dir)
        config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        return config

    monkeypatch.setattr(harness_lib, "build_vllm_config", with_events)  # B's KV events on
    reader = Engine(cfg, model_dir)  # empty CPU tier, no disk
    assert reader.fingerprint == writer["fingerprint"]
    events: list[Any] = []
    take = reader.connector.take_events
    reader.connector.take_events = lambda: events.extend(take()) or []  # type: ignore[method-assign]
    workload = specs(tokens, tag="b")
    result = reader.run(harness_lib.StaticWorkload(workload))
    # B learned of every chunk on the remote tier from its lookups: a STORAGE REMOTE event
    # each, before the CPU events of their loads.
    remote = [event for event in events if event.locality == "REMOTE"]
    assert len(remote) == expected_chunks
    assert all(isinstance(event, BlockStored) and event.medium == "STORAGE" for event in remote)
    assert len({tuple(event.block_hashes) for event in remote}) == expected_chunks
    assert_served(result, cfg.vocab_size)
    # Every full chunk A stored is a remote hit in B, and nothing else is.
    ranks = {rank for _, rank in on_cluster}
    stored = sum(on_cluster.values()) // len(ranks)  # chunks = values / ranks
    assert reader.external == {spec.request_id: loadable_tokens(spec) for spec in workload}
    stats = reader.stats()
    assert stats["loads_remote"] == stored == expected_chunks
    assert stats["hit_tokens_remote"] == stored * TPC
    assert stats["loads_cpu"] == stats["loads_disk"] == 0
    assert stats["hit_tokens_cpu"] == stats["hit_tokens_disk"] == 0
    assert stats["remote_missing"] == stats["remote_corrupt"] == stats["remote_failed"] == 0
    assert stats["loads_failed"] == stats["stores_failed"] == 0
    assert stats["remote_lookup_requests"] > 0 and stats["remote_lookup_errors"] == 0
    # vLLM heard "not yet" while the lookup was in flight, a bounded number of times.
    assert stats["remote_not_yet"] < 200
    lookups = reader.side.remote.statistics()
    assert lookups.lookup_keys_found == expected_chunks and lookups.lookup_errors == 0
    pusher = reader.pusher()
    reader.shutdown()
    # B loaded everything and computed no new full chunk: it pushed nothing, and the
    # cluster holds exactly A's values still.
    assert pusher.statistics().pushes_queued == 0
    assert cluster_chunks(redis_cluster.url) == on_cluster


# -- 2. namespaces and tenants never mix ----------------------------------------------------------


def test_another_model_or_salt_gets_no_remote_hits(redis_cluster: RedisCluster, tmp_path: Path) -> None:
    redis_cluster.flushall()
    url = redis_cluster.url
    model_dir = tmp_path / "tiny-llama"
    tokens = prompts(seed=2)[:2]  # 70 and 100 tokens: 2 + 3 chunks
    expected_chunks = 5
    writer = run_writer({"url": url, "async": False, "model_dir": str(model_dir),
                         "prompts": tokens, "salt": "tenant-a"})
    assert writer["bad_outputs"] == [] and writer["pushed"] == expected_chunks
    assert cluster_chunks(url) == {(writer["fingerprint"], "0of1"): expected_chunks}

    variants: dict[str, tuple[dict[str, Any], Path, str]] = {
        "another tenant": ({}, model_dir, "tenant-b"),
        "another model": ({}, tmp_path / "another-tiny-llama", "tenant-a"),
        "another layout": ({"kv_cache_layout": "LBHNC"}, model_dir, "tenant-a"),
        "another dtype": ({"dtype": torch.bfloat16}, model_dir, "tenant-a"),
    }
    fingerprints = {}
    for name, (overrides, directory, salt) in variants.items():
        cfg = harness_config(url, **overrides)
        engine = Engine(cfg, directory)
        result = engine.run(harness_lib.StaticWorkload(specs(tokens, salt, "n")))
        assert_served(result, cfg.vocab_size)
        stats = engine.stats()
        lookups = engine.side.remote.statistics()
        assert engine.external == {}, name  # nothing offered to vLLM
        assert stats["loads_remote"] == stats["hit_tokens_remote"] == 0, name
        assert stats["remote_missing"] == stats["remote_corrupt"] == 0, name
        # It asked the cluster (so the zero is an answer, not silence) and found nothing.
        assert lookups.lookup_keys_asked >= expected_chunks and lookups.lookup_keys_found == 0, \
            name
        assert lookups.lookup_errors == 0, name
        pusher = engine.pusher()
        engine.shutdown()
        assert pusher.statistics().pushes_pushed == expected_chunks, name  # its own chunks
        fingerprints[name] = engine.fingerprint

    # The tenant shares A's namespace (its keys differ); the others each have their own.
    assert fingerprints["another tenant"] == writer["fingerprint"]
    others = [fingerprints[name] for name in ("another model", "another layout", "another dtype")]
    assert len({writer["fingerprint"], *others}) == 4
    assert cluster_chunks(url) == {(writer["fingerprint"], "0of1"): 2 * expected_chunks,
                                   **{(fp, "0of1"): expected_chunks for fp in others}}

    # The positive control: A's settings and tenant still hit every chunk A stored.
    cfg = harness_config(url)
    again = Engine(cfg, model_dir)
    workload = specs(tokens, "tenant-a", "c")
    result = again.run(harness_lib.StaticWorkload(workload))
    assert_served(result, cfg.vocab_size)
    assert again.external == {spec.request_id: loadable_tokens(spec) for spec in workload}
    stats = again.stats()
    assert stats["loads_remote"] == expected_chunks and stats["remote_missing"] == 0
    again.shutdown()


# -- 3. a dead cluster ---------------------------------------------------------------------------


class SilentServer:
    """A TCP server on loopback that accepts connections and never answers (a hung
    Redis): every call waits for the client's socket timeout."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind((HOST, 0))
        self.listener.listen(128)
        self.listener.settimeout(0.05)
        self.port = int(self.listener.getsockname()[1])
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self.accepted.append(conn)

    def __enter__(self) -> SilentServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.listener.close()
        for conn in self.accepted:
            conn.close()


@pytest.mark.parametrize("server", ["refused", "silent"])
def test_a_dead_cluster_never_fails_a_request(redis_cluster: RedisCluster, tmp_path: Path,
                                              server: str, caplog: pytest.LogCaptureFixture) -> None:
    redis_cluster.flushall()
    caplog.set_level(logging.WARNING, logger="tierkv")
    chat = dict(num_conversations=3, num_turns=2, system_prompt_len=30, first_user_len=30,
                user_turn_len=26, max_tokens=8)
    with contextlib.ExitStack() as stack:
        silent = stack.enter_context(SilentServer()) if server == "silent" else None
        port = silent.port if silent is not None else free_port()  # "refused": nothing listens
        cfg = harness_config(f"redis://{HOST}:{port}", remote_timeout=0.5)  # the default
        engine = Engine(cfg, tmp_path / "tiny-llama")
        started = time.perf_counter()
        result = engine.run(harness_lib.MultiTurnWorkload(**chat))
        run_seconds = time.perf_counter() - started
        assert_served(result, cfg.vocab_size)
        stats = engine.stats()
        # The local CPU tier still serves every later turn.
        expected = expected_chat_hits(result, chat["user_turn_len"])
        assert {req: engine.external.get(req, 0) for req in expected} == expected
        assert stats["hit_tokens_cpu"] == sum(expected.values()) > 0
        assert stats["loads_remote"] == stats["hit_tokens_remote"] == 0
        assert stats["remote_missing"] == stats["remote_failed"] == stats["loads_failed"] == 0
        # The lookups were tried and failed (absent, counted), never raised into vLLM.
        assert stats["remote_lookup_errors"] > 0
        # The lookups' calls failed with their cause, counted (a refused connection opens
        # the breaker at once: the later lookups were skipped without the network).
        cause = "timeout" if silent is not None else "connection_refused"
        assert stats[f"remote_calls_{cause}"] >= 1
        if silent is None:
            assert stats["remote_calls_connection_refused"] == 1
            assert stats["remote_calls_skipped"] > 0
        # No step waited on the network: the lookup deadline is 10 ms and the socket
        # timeout (0.5 s) is paid on tierkv's threads. 2 s is loose for a slow CI box.
        assert max(engine.step_seconds) < 2.0, sorted(engine.step_seconds)[-5:]
        pusher = engine.pusher()
        started = time.perf_counter()
        engine.shutdown()
        shutdown_seconds = time.perf_counter() - started
        pushes = pusher.statistics()
        # Every stored chunk was offered to the push queue and failed quietly.
        assert pushes.pushes_queued == stats["stores_planned"] - stats["stores_failed"] > 0
        assert pushes.pushes_pushed == 0
        assert pushes.pushes_failed + pushes.pushes_dropped + pushes.pushes_abandoned == \
            pushes.pushes_queued
        assert shutdown_seconds < 10.0, shutdown_seconds
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], [record.getMessage() for record in errors]
    print(f"{server}: run {run_seconds:.2f} s over {len(engine.step_seconds)} steps, max step "
          f"{max(engine.step_seconds) * 1000:.1f} ms, shutdown {shutdown_seconds:.2f} s, "
          f"not yet {stats['remote_not_yet']}, lookup errors {stats['remote_lookup_errors']}, "
          f"pushes {pushes}")


# -- 4. the remote tier's capacity gauges --------------------------------------------------------


def test_the_connector_reports_the_cluster_s_memory(redis_cluster: RedisCluster,
                                                   tmp_path: Path) -> None:
    """The scheduler side's lookup thread polls the cluster's INFO memory; the connector's
    stats carry it as the remote usage gauges, which vLLM's metrics show as tier="remote"
    (none before the first payload: a gauge not known is no sample, not 0)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from tests.integration.test_remote_usage import clients, memory_sums
    from tierkv.integrations.vllm_metrics import TierKVPromMetrics

    redis_cluster.flushall()
    cfg = harness_config(redis_cluster.url)
    engine = Engine(cfg, tmp_path / "tiny-llama")
    measure = clients(redis_cluster.ports)
    try:
        remote = engine.side.remote
        assert remote is not None and remote.usage.wait_polls(1, 60.0)
        engine.run(harness_lib.StaticWorkload(specs(prompts()[:1])))  # stats to report
        assert engine.pusher().flush(60.0)  # the pushes landed: the servers' memory settled
        remote.usage.poll(remote.tier)  # a fresh connection's first INFO counts less
        used, maximum = memory_sums(measure)
        stats = engine.connector.get_kv_connector_stats()
        assert stats is not None
        chunk = remote.stored_chunk_bytes
        tokens = (maximum // chunk * TPC, used // chunk * TPC)
        assert maximum == 3 * 256 << 20  # the fixture's maxmemory, 3 masters
        assert (stats.data["remote_capacity_bytes"], stats.data["remote_used_bytes"]) == \
            (maximum, used)
        assert (stats.data["remote_capacity_tokens"], stats.data["remote_used_tokens"]) == tokens
        registry = CollectorRegistry()
        types: dict[type, Any] = {cls: functools.partial(cls, registry=registry)
                                  for cls in (Gauge, Counter, Histogram)}
        vllm = SimpleNamespace(kv_transfer_config=cfg.kv_transfer_config)
        prom = TierKVPromMetrics(vllm, types, ["model_name", "engine"], {0: ["tiny", "0"]})

        def remote_gauges() -> dict[str, float]:
            return {sample.name: sample.value for family in text_string_to_metric_families(
                generate_latest(registry).decode()) for sample in family.samples
                if sample.labels.get("tier") == "remote"
                and sample.name.startswith(("tierkv:usage", "tierkv:capacity"))}

        assert remote_gauges() == {}
        prom.observe(stats.data, 0)
        assert remote_gauges() == {"tierkv:capacity_bytes": maximum, "tierkv:usage_bytes": used,
                                   "tierkv:capacity_tokens": tokens[0],
                                   "tierkv:usage_tokens": tokens[1]}
    finally:
        for client in measure:
            client.close()
        engine.shutdown()
