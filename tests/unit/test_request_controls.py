"""Per-request controls (tierkv.core.controls) as a request's kv_transfer_params give them,
what the engine adapter's lookup and plans do with them, and load_policy "module:Class"
(the LoadPolicy protocol and its example, tierkv.engine.example_load_policy)."""

from __future__ import annotations

import pytest

from tierkv.core.controls import NO_CONTROLS, RequestControls, request_controls
from tierkv.core.costs import CostModel
from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion, JobKind
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.engine.example_load_policy import LocalFirst
from tierkv.engine.requests import RequestView, StepInput, WorkerReport
from tierkv.errors import ConfigError
from tierkv.keys import chunk_keys

TPC = 8  # 4 tokens a block, 2 blocks a chunk
EXAMPLE = "tierkv.engine.example_load_policy:LocalFirst"


def test_kv_transfer_params_give_each_control() -> None:
    assert request_controls(None) is NO_CONTROLS
    assert request_controls({"do_remote_prefill": True}) is NO_CONTROLS
    assert request_controls({"tierkv": {"load_policy": "cost"}}) is NO_CONTROLS
    got = request_controls({"tierkv": {"skip_load": True, "skip_store": True,
                                       "load_deadline_ms": 25}})
    assert got == RequestControls(True, True, None, 25)
    assert got.deadline_seconds(None) == 0.025
    assert NO_CONTROLS.deadline_seconds(40) == 0.04 and NO_CONTROLS.deadline_seconds(None) is None
    # vLLM's kv_load_tiers matchers: medium cpu | storage, locality local | remote.
    tiers: list[tuple[list[object], set[str]]] = [
        ([], set()),
        ([{"medium": "cpu"}], {"cpu"}),
        ([{"medium": "STORAGE"}], {"disk", "remote"}),
        ([{"locality": "local"}], {"cpu", "disk"}),
        ([{"medium": "storage", "locality": "remote"}], {"remote"}),
        ([{}], {"cpu", "disk", "remote"}),
        (["disk", {"locality": "remote"}], {"disk", "remote"}),
    ]
    for raw, expected in tiers:
        assert request_controls({"kv_load_tiers": raw}).load_tiers == expected, raw


@pytest.mark.parametrize("params, named", [
    ({"kv_load_tiers": "cpu"}, "kv_load_tiers must be a list"),
    ({"kv_load_tiers": [{"medium": "gpu"}]}, "{'medium': 'gpu'}"),
    ({"kv_load_tiers": [{"locality": "moon"}]}, "\"locality\": one of ['local', 'remote']"),
    ({"kv_load_tiers": ["ssd"]}, "tier names ['cpu', 'disk', 'remote']"),
    ({"kv_load_tiers": [{"medium": "cpu", "speed": 1}]}, "kv_load_tiers"),
    ({"tierkv": {"skip_load": "yes"}}, "tierkv.skip_load must be true or false"),
    ({"tierkv": {"skip_store": 1}}, "tierkv.skip_store must be true or false"),
    ({"tierkv": {"load_deadline_ms": -1}}, "load_deadline_ms must be a number of milliseconds"),
    ({"tierkv": {"load_deadline_ms": "50"}}, "load_deadline_ms must be a number"),
    ({"tierkv": {"load_deadline_ms": float("nan")}}, "load_deadline_ms must be a number"),
    ({"tierkv": {"skip_loads": True}}, "unknown control(s) ['skip_loads']"),
    ({"tierkv": "skip_load"}, "kv_transfer_params tierkv must be a mapping"),
])
def test_a_value_not_understood_names_the_parameter(params: dict[str, object],
                                                     named: str) -> None:
    with pytest.raises(ConfigError) as raised:
        request_controls(params)
    assert named in str(raised.value)


def adapter(**settings: object) -> EngineAdapter:
    return EngineAdapter(BlockIndex(5, 16), AdapterConfig(4, 2, **settings))  # type: ignore[arg-type]


def store(engine: EngineAdapter, keys: list[bytes], spill: bool = False) -> None:
    """``keys`` stored in the CPU tier as the index's jobs complete (``spill``: and written
    to disk, so clean: the next stores may evict them)."""
    index = engine.index
    plan = index.prepare_store(keys)
    assert plan.job_id is not None and len(plan.chunks) == len(keys)
    index.complete(Completion(plan.job_id, JobKind.STORE, ok=True))
    if spill:
        spills = index.take_spills(flush=True)
        assert spills is not None
        index.complete(Completion(spills.job_id, JobKind.SPILL, ok=True))


def stored(engine: EngineAdapter, tokens: list[int], on_disk: int = 0) -> list[bytes]:
    """The chunks of ``tokens`` in the index (5 CPU slots): READY in the CPU tier, the first
    ``on_disk`` of them on disk only (written back, then evicted by other chunks)."""
    keys = chunk_keys(tokens, TPC)
    if on_disk:
        store(engine, keys[:on_disk], spill=True)
        store(engine, chunk_keys([999] * 5 * TPC, TPC), spill=True)  # evicts them
    store(engine, keys[on_disk:])
    return keys
def view(tokens: list[int], controls: RequestControls = NO_CONTROLS,
         req_id: str = "r") -> RequestView:
    keys = chunk_keys(tokens, TPC)
    return RequestView(req_id, keys, len(tokens), len(tokens), 0, controls=controls)


def test_the_adapter_loads_only_from_the_tiers_a_request_allows() -> None:
    engine = adapter()
    tokens = list(range(5 * TPC))
    stored(engine, tokens, on_disk=2)  # chunks 0-1 on disk only, 2-4 in the CPU tier
    assert engine.lookup(view(tokens), 0) == 4 * TPC  # one token is left to compute
    only = {("cpu",): 0, ("disk",): 2 * TPC, ("cpu", "disk"): 4 * TPC, (): 0, ("remote",): 0}
    for tiers, tokens_hit in only.items():
        asked = RequestControls(load_tiers=frozenset(tiers))
        assert engine.lookup(view(tokens, asked), 0) == tokens_hit, tiers
    assert engine.lookup(view(tokens, RequestControls(skip_load=True)), 0) == 0


def test_skip_store_stores_none_of_the_requests_chunks() -> None:
    engine = adapter()
    for req_id, controls, stores in (("skip", RequestControls(skip_store=True), 0),
                                     ("kept", NO_CONTROLS, 3)):
        tokens = [ord(req_id[0])] * (3 * TPC + 1)
        request = view(tokens, controls, req_id)
        assert engine.lookup(request, 0) == 0
        engine.update_state_after_alloc(request, list(range(7)), 0, 0)
        plan = engine.build_plan(StepInput({req_id: request}, {req_id: len(tokens)},
                                           {req_id: list(range(7))}, frozenset({req_id})))
        finished = RequestView(req_id, request.chunk_keys, len(tokens), len(tokens) + 1,
                               len(tokens), controls=controls)
        engine.request_finished(finished)
        last = engine.build_plan(StepInput())
        assert sum(len(spec.keys) for spec in (*plan.stores, *last.stores)) == stores, req_id


def test_a_load_carries_the_requests_deadline_or_the_engines() -> None:
    tokens = list(range(3 * TPC))
    for default, asked, expected in ((None, None, None), (40.0, None, 0.04),
                                     (40.0, 5.0, 0.005), (None, 0.0, 0.0)):
        engine = adapter(load_deadline_ms=default)
        stored(engine, tokens)
        request = view(tokens, RequestControls(load_deadline_ms=asked))
        hit = engine.lookup(request, 0)
        assert hit == 2 * TPC
        engine.update_state_after_alloc(request, list(range(6)), hit, 0)
        [load] = engine.build_plan(StepInput()).loads
        assert load.deadline_seconds == expected
    with pytest.raises(ConfigError, match="adapter.load_deadline_ms must be a number >= 0"):
        AdapterConfig(4, 2, load_deadline_ms=-1.0)


def costs_where_remote_is_slow() -> CostModel:
    """A cost model that measured a fast compute and a remote tier far slower than it."""
    model = CostModel()
    for _ in range(8):
        model.observe_compute(1024, 0.001 + 1024 * 1e-6)
        model.observe_load("remote", 4, 2.0)
    return model


def test_the_example_policy_loads_the_local_head_and_what_the_model_says_pays() -> None:
    policy = LocalFirst()
    slow, fresh = costs_where_remote_is_slow(), CostModel()
    runs = [("cpu", 2), ("disk", 1), ("remote", 3)]
    assert slow.best_prefix(runs, 128, 128)[0] < 3  # the model alone declines local chunks too
    assert policy.choose(runs, 128, 128, slow) == 3  # the local head, not the slow remote tail
    assert policy.choose(runs, 128, 128, fresh) == 6  # nothing measured: load everything
    assert policy.choose([("remote", 4)], 128, 128, slow) == 0


def test_an_engine_runs_its_own_policy() -> None:
    engine = adapter(load_policy=EXAMPLE)
    assert isinstance(engine.policy.custom, LocalFirst)
    tokens = list(range(5 * TPC))
    stored(engine, tokens, on_disk=1)
    assert engine.lookup(view(tokens), 0) == 4 * TPC  # LocalFirst: every local chunk

    class Fails:
        def choose(self, *args: object) -> int:
            raise RuntimeError("the operator's bug")

    engine.policy.custom = Fails()  # a policy that raises: the cost model decides
    assert engine.lookup(view(tokens), 0) == 4 * TPC
    assert engine.policy.custom_failures == 1


@pytest.mark.parametrize("path, named", [
    ("tierkv.no_such_module:Policy", "cannot import Policy from tierkv.no_such_module"),
    ("tierkv.engine.example_load_policy:Missing", "cannot import Missing"),
    ("tierkv.engine.adapter_config:AdapterConfig", "AdapterConfig has no choose("),
    ("fast", "adapter.load_policy must be one of ['always', 'cost'] or 'module:Class'"),
    ("tierkv.engine:", "adapter.load_policy must be one of"),
])
def test_a_policy_that_cannot_be_used_names_the_setting(path: str, named: str) -> None:
    with pytest.raises(ConfigError) as raised:
        adapter(load_policy=path)
    assert named in str(raised.value)
    assert "load_policy" in str(raised.value)


def test_a_request_asking_again_while_its_load_runs_hits_nothing() -> None:
    """vLLM asks again for a request whose load was cut at its deadline (every block
    failed): its chunks are still being read, and waiting for them is what the deadline
    ruled out, so it hits nothing until that load completes."""
    engine = adapter(load_deadline_ms=1.0)
    tokens = list(range(3 * TPC))
    stored(engine, tokens)
    request = view(tokens)
    assert engine.lookup(request, 0) == 2 * TPC
    engine.update_state_after_alloc(request, list(range(6)), 2 * TPC, 0)
    [load] = engine.build_plan(StepInput()).loads
    assert load.spec is not None
    assert engine.lookup(request, 0) == 0
    engine.complete(WorkerReport(0, (Completion(load.spec.job_id, JobKind.LOAD, ok=True),)))
    assert engine.lookup(request, 0) == 2 * TPC
