"""The cost model of cost-aware loads (tierkv.core.costs) and the adapter's use of it;
scripted, with a fake clock."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.profiles import thorough
from tierkv.core.costs import DECLINE_MARGIN, CostModel, CostPriors, DecayedLine
from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion, JobKind
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.engine.requests import RequestView, StepInput, WorkerReport
from tierkv.errors import ConfigError, UsageError


def test_a_decayed_line_learns_the_line_its_samples_lie_on() -> None:
    line = DecayedLine((10.0, 0.0), x_scale=8.0)  # a prior: flat 10 s
    assert line.line() == (10.0, 0.0)
    for _ in range(60):
        for x in (1.0, 4.0, 8.0):
            line.observe(x, 0.5 + 0.25 * x)  # the truth: 0.5 s + 0.25 s per unit
    intercept, slope = line.line()
    assert intercept == pytest.approx(0.5, abs=0.02) and slope == pytest.approx(0.25, abs=0.01)
    assert line.samples == 180


def test_samples_at_one_x_keep_most_of_the_prior_intercept_and_set_the_slope() -> None:
    """A tier is measured by the loads taken from it, often of one size: the first sample
    must move the estimate at once (a slow node), as a speed."""
    line = DecayedLine((0.005, 0.0005), x_scale=16.0)
    line.observe(4.0, 0.3)  # 4 chunks in 0.3 s: slow
    intercept, slope = line.line()
    assert intercept < 0.1 and slope > 0.04
    assert line.predict(4.0) == pytest.approx(0.3, rel=0.15)
    assert line.predict(9.0) > 0.45  # more chunks, more time
    falling = DecayedLine((1.0, 0.0), x_scale=10.0)
    for x, y in ((1.0, 5.0), (10.0, 1.0)) * 5:
        falling.observe(x, y)
    assert falling.line()[1] == 0.0  # never a negative slope


def measured(model: CostModel) -> CostModel:
    """``model`` after one measured step of 1024 tokens, on its priors' line: a decline
    weighs a measured load against a measured compute (CostModel.compute_measured)."""
    step, per_token = model.priors.compute_prior()
    model.observe_compute(1024, step + 1024 * per_token)
    return model


@thorough(60)
@given(st.lists(st.sampled_from(["cpu", "disk", "remote"]), min_size=1, max_size=12),
       st.floats(0.001, 1.0), st.floats(0.0, 0.1))
def test_the_best_prefix_is_the_cheapest_of_every_prefix(tiers: list[str], per_token_ms: float,
                                                          latency: float) -> None:
    priors = CostPriors(disk_load_seconds=latency, seconds_per_token=per_token_ms / 1000)
    model = measured(CostModel(priors))
    runs: list[tuple[str, int]] = []
    for tier in tiers:
        if runs and runs[-1][0] == tier:
            runs[-1] = (tier, runs[-1][1] + 1)
        else:
            runs.append((tier, 1))
    take, cost, whole = model.best_prefix(runs, 128)

    def cost_of(loaded: int) -> float:
        counts: dict[str, int] = {}
        for tier in tiers[:loaded]:
            counts[tier] = counts.get(tier, 0) + 1
        return model.load_seconds(counts) + model.compute_seconds((len(tiers) - loaded) * 128)

    every = [cost_of(loaded) for loaded in range(len(tiers) + 1)]
    assert whole == pytest.approx(every[-1])
    assert cost == pytest.approx(every[take])
    # The cheapest prefix, unless it saves at most DECLINE_MARGIN of the whole hit's load
    # and one engine step: then the whole hit.
    margin = DECLINE_MARGIN * whole + model.compute.line()[0]
    if min(every) + margin >= whole:
        assert take == len(tiers)
    else:
        assert every[take] == pytest.approx(min(every))


def test_a_decline_must_save_more_than_the_margin() -> None:
    """Near parity the estimates are within one step's noise: a loaded 2-core machine's
    restart hit (7 chunks of 128 tokens; the disk line measured from one cold 5-chunk load
    in a step of 20 ms) was estimated 24.2 ms against 23.0 ms of compute and declined.
    Within DECLINE_MARGIN of the load and one step it is loaded; a tier clearly slower is
    still declined."""
    model = CostModel(CostPriors(step_seconds=0.02, seconds_per_token=2.57e-5),
                      chunk_bytes=256 << 10)
    model.observe_load("disk", 5, 0.0204)
    for _ in range(7):
        model.observe_compute(1000, 0.02 + 1000 * 2.57e-5)
    load, compute = model.load_seconds({"disk": 7}), model.compute_seconds(7 * 128)
    assert compute < load < compute * 1.2  # recompute estimated faster, barely
    assert model.best_prefix([("disk", 7)], 128)[0] == 7
    model.observe_load("disk", 5, 0.2)  # 10x slower: recompute clearly wins
    assert model.best_prefix([("disk", 7)], 128)[0] == 0


def test_a_slow_tier_is_declined_a_fast_one_kept_a_head_taken_from_a_mixed_hit() -> None:
    model = measured(CostModel(CostPriors(seconds_per_token=0.0001)))  # 12.8 ms a chunk
    for _ in range(30):
        model.observe_load("remote", 4, 1.0)  # a throttled node: 1 s for 4 chunks
        model.observe_load("cpu", 4, 0.002)
    assert model.best_prefix([("remote", 4)], 128)[0] == 0
    assert model.best_prefix([("cpu", 4)], 128)[0] == 4
    assert model.best_prefix([("cpu", 2), ("remote", 2)], 128)[0] == 2
    with pytest.raises(ConfigError):
        CostModel(load_bias=0)


# -- the adapter ------------------------------------------------------------------------------

KEYS = [bytes([i]) * 32 for i in range(1, 9)]
MORE = [bytes([i]) * 32 for i in range(9, 13)]  # on disk too


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def adapter_with_chunks(policy: str, priors: CostPriors, clock: Clock,
                        disk_capacity: int = 16) -> EngineAdapter:
    """Chunks 0-3 in the CPU tier, 4-7 (and MORE) on disk only."""
    index = BlockIndex(num_slots=16, disk_capacity=disk_capacity, clock=clock)
    index.add_on_disk(KEYS[4:] + MORE)
    store = index.prepare_store(KEYS[:4])
    index.complete_store(Completion(store.job_id, JobKind.STORE, ok=True))
    config = AdapterConfig(tokens_per_block=16, blocks_per_chunk=2, load_policy=policy,
                           cost_priors=priors)
    adapter = EngineAdapter(index, config, clock)
    measured(adapter.costs)
    return adapter


def view(num_tokens: int = 8 * 32 + 1) -> RequestView:
    return RequestView("r", KEYS, num_tokens, num_tokens, 0)


def test_the_adapter_declines_the_slow_tail_of_a_hit_and_counts_it() -> None:
    clock = Clock()
    slow_disk = CostPriors(disk_load_seconds=1.0, seconds_per_token=0.0001)
    adapter = adapter_with_chunks("cost", slow_disk, clock)
    assert adapter.lookup(view(), 0) == 4 * 32  # the CPU head only
    assert adapter.stats.tier["disk"].declined_tokens == 4 * 32 and adapter.stats.tier["cpu"].declined_tokens == 0
    always = adapter_with_chunks("always", slow_disk, Clock())
    assert always.lookup(view(), 0) == 8 * 32 and always.stats.tier["disk"].declined_tokens == 0


def test_measured_loads_and_steps_teach_the_adapter() -> None:
    """A disk the priors think fast is measured slow: the next hit on it is declined."""
    clock = Clock()
    fast_disk = CostPriors(disk_load_seconds=0.001, disk_bytes_per_second=4e9,
                           seconds_per_token=0.0001)
    adapter = adapter_with_chunks("cost", fast_disk, clock)
    request = view()
    assert adapter.lookup(request, 0) == 8 * 32  # the priors: load everything
    adapter.update_state_after_alloc(request, list(range(16)), 8 * 32, 0)
    plan = adapter.build_plan(StepInput())
    [load] = plan.loads
    assert load.spec is not None
    clock.now += 5.0  # the disk took 5 s
    adapter.complete(WorkerReport(0, (Completion(load.spec.job_id, JobKind.LOAD, ok=True),)))
    assert adapter.stats.tier["disk"].load_seconds_measured == pytest.approx(5.0)
    assert 0 < adapter.stats.tier["disk"].load_seconds_estimated < 1.0
    for _ in range(20):  # the engine computes 1000 tokens in 0.1 s a step
        adapter.build_plan(StepInput(num_scheduled_tokens={"other": 1000}))
        clock.now += 0.1
    assert adapter.costs.loads["disk"].samples == 1
    other = RequestView("s", KEYS[:4] + MORE, 8 * 32 + 1, 8 * 32 + 1, 0)
    assert adapter.lookup(other, 0) == 4 * 32  # the CPU chunks; the disk ones are declined
    assert adapter.stats.tier["disk"].declined_tokens == 4 * 32


def test_a_declined_tier_is_probed_again_after_probe_seconds() -> None:
    """A slow node may recover, but only a load taken from it can tell: a tier declined for
    probe_seconds gets one load against the estimate."""
    clock = Clock()
    adapter = adapter_with_chunks("cost", CostPriors(disk_load_seconds=1.0,
                                                     seconds_per_token=0.0001), clock)
    assert adapter.lookup(view(), 0) == 4 * 32  # declined since now
    clock.now += 29.0
    assert adapter.lookup(view(), 0) == 4 * 32 and adapter.stats.load_probes == 0
    clock.now += 1.0
    assert adapter.lookup(view(), 0) == 8 * 32 and adapter.stats.load_probes == 1
    assert adapter.lookup(view(), 0) == 4 * 32  # declined again: the next probe in 30 s


def load_all(adapter: EngineAdapter, clock: Clock, request: RequestView, seconds: float) -> None:
    """Plan ``request``'s load and complete it ``seconds`` later."""
    adapter.update_state_after_alloc(request, list(range(16)), 8 * 32, 0)
    [load] = adapter.build_plan(StepInput()).loads
    assert load.spec is not None
    clock.now += seconds
    adapter.complete(WorkerReport(0, (Completion(load.spec.job_id, JobKind.LOAD, ok=True),)))
    adapter.request_finished(request)
    adapter.build_plan(StepInput())


def test_a_spike_costs_a_fast_tier_a_few_requests_and_a_slow_tier_thins_its_probes() -> None:
    """One slow load (a spike) makes the disk look slow: its hits are declined for
    probe_requests requests, then a probe loads; beating its estimate 2x, it restarts the
    tier's line and the next hits load. A tier that stays slow is probed after 8, 16, 32
    declined requests."""
    clock = Clock()
    fast_disk = CostPriors(disk_load_seconds=0.001, disk_bytes_per_second=4e9,
                           seconds_per_token=0.0001)
    adapter = adapter_with_chunks("cost", fast_disk, clock, disk_capacity=1000)
    ids = iter(range(1000))
    on_disk = [adapter.index]

    def request() -> RequestView:
        """KEYS' CPU head and 4 chunks of its own on disk only (a load moves them to CPU)."""
        number = next(ids)
        tail = [number.to_bytes(2, "big") * 16 for number in range(4 * number + 100,
                                                                   4 * number + 104)]
        on_disk[0].add_on_disk(tail)
        return RequestView(f"r{number}", KEYS[:4] + tail, 8 * 32 + 1, 8 * 32 + 1, 0)

    first = request()
    assert adapter.lookup(first, 0) == 8 * 32
    load_all(adapter, clock, first, 5.0)  # a spike
    declined = [adapter.lookup(request(), 0) for _ in range(8)]
    assert declined == [4 * 32] * 8 and adapter.stats.load_probes == 0
    probe = request()
    assert adapter.lookup(probe, 0) == 8 * 32 and adapter.stats.load_probes == 1
    load_all(adapter, clock, probe, 0.002)
    assert adapter.stats.load_lines_restarted == 1
    assert adapter.lookup(request(), 0) == 8 * 32  # fast again, at once
    # A disk that stays slow: probes after 8, then 16, then 32 declined requests.
    slow = adapter_with_chunks("cost", fast_disk, clock, disk_capacity=1000)
    on_disk[0] = slow.index
    first = request()
    assert slow.lookup(first, 0) == 8 * 32
    load_all(slow, clock, first, 5.0)
    gaps = []
    for _ in range(3):
        gap = 0
        while True:
            looked = request()
            if slow.lookup(looked, 0) == 8 * 32:
                load_all(slow, clock, looked, 5.0)
                break
            gap += 1
        gaps.append(gap)
    assert gaps == [8, 16, 32] and slow.stats.load_lines_restarted == 0
    assert slow.stats.load_probes == 3


class Asker:
    """A remote tier's lookups: it holds ``keys`` and counts the questions."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys
        self.asked = 0

    def ask(self, keys: list[bytes]) -> dict[bytes, int]:
        """Each key's part count (1: held, 0: absent)."""
        self.asked += 1
        held = set(self.keys)
        return {key: int(key in held) for key in keys}


def test_a_remote_tier_no_hit_could_pay_for_is_not_asked_until_its_probe() -> None:
    """A slow remote node: once its hits are declined and no load could pay, lookups skip
    its round trip; past probe_seconds it is asked again, and its hit is the probe."""
    clock = Clock()
    remote_keys = [bytes([i]) * 32 for i in range(20, 28)]
    asker = Asker(remote_keys)
    index = BlockIndex(num_slots=16, disk_capacity=16, clock=clock)
    slow = CostPriors(remote_load_seconds=0.5, remote_bytes_per_second=1e6,
                      seconds_per_token=0.0001)
    config = AdapterConfig(tokens_per_block=16, blocks_per_chunk=2, load_policy="cost",
                           cost_priors=slow)
    adapter = EngineAdapter(index, config, clock, remote=asker)
    assert not adapter.costs.never_pays("remote", 32)  # compute not measured yet
    measured(adapter.costs)
    assert adapter.costs.never_pays("remote", 32)
    request = RequestView("r", remote_keys, 8 * 32 + 1, 8 * 32 + 1, 0)
    assert adapter.lookup(request, 0) == 0 and asker.asked == 1  # asked, then declined
    assert adapter.stats.tier["remote"].declined_tokens == 8 * 32
    clock.now += 10.0
    assert adapter.lookup(request, 0) == 0 and asker.asked == 1  # not asked
    assert adapter.stats.remote_lookups_skipped == 1
    clock.now += 20.0
    assert adapter.lookup(request, 0) == 8 * 32 and asker.asked == 2  # the probe
    assert adapter.stats.load_probes == 1
    # A fast remote tier is always asked.
    fast = EngineAdapter(BlockIndex(num_slots=16, disk_capacity=16, clock=clock),
                         AdapterConfig(tokens_per_block=16, blocks_per_chunk=2,
                                       load_policy="cost",
                                       cost_priors=CostPriors(seconds_per_token=0.0001)),
                         clock, remote=Asker(remote_keys))
    assert not fast.costs.never_pays("remote", 32)
    assert fast.lookup(request, 0) == 8 * 32 and fast.lookup(request, 0) == 8 * 32
    assert fast.stats.remote_lookups_skipped == 0


def test_a_request_may_ask_for_its_own_load_policy() -> None:
    """RequestView.load_policy overrides the adapter's for that request: "always" loads the
    hit a cost engine declines (and is measured), "cost" declines in an always engine, and
    "recompute" loads nothing and asks no tier (the same engine's counterfactual)."""
    slow = CostPriors(disk_load_seconds=1.0, remote_load_seconds=1.0, seconds_per_token=0.0001)
    cost = adapter_with_chunks("cost", slow, Clock())

    def asking(policy: str | None) -> RequestView:
        return RequestView("r", KEYS, 8 * 32 + 1, 8 * 32 + 1, 0, load_policy=policy)

    assert cost.lookup(asking(None), 0) == 4 * 32  # the engine's policy: disk declined
    assert cost.lookup(asking("always"), 0) == 8 * 32
    assert cost.stats.tier["disk"].declined_tokens == 4 * 32  # the "always" request declined nothing
    always = adapter_with_chunks("always", slow, Clock())
    assert always.lookup(asking(None), 0) == 8 * 32
    assert always.lookup(asking("cost"), 0) == 4 * 32
    assert always.stats.tier["disk"].declined_tokens == 4 * 32
    # An "always" load is estimated, and measured when it completes.
    clock = Clock()
    measured = adapter_with_chunks("cost", slow, clock)
    request = asking("always")
    assert measured.lookup(request, 0) == 8 * 32
    measured.update_state_after_alloc(request, list(range(16)), 8 * 32, 0)
    [load] = measured.build_plan(StepInput()).loads
    assert load.spec is not None
    clock.now += 2.0
    measured.complete(WorkerReport(0, (Completion(load.spec.job_id, JobKind.LOAD, ok=True),)))
    assert measured.stats.tier["disk"].load_seconds_measured == pytest.approx(2.0)
    assert measured.costs.loads["disk"].samples == 1
    # "recompute": no hit, no tier asked, even with every chunk in the CPU tier.
    remote_keys = [bytes([i]) * 32 for i in range(20, 28)]
    asker = Asker(remote_keys)
    index = BlockIndex(num_slots=16, disk_capacity=16, clock=clock)
    adapter = EngineAdapter(index, AdapterConfig(tokens_per_block=16, blocks_per_chunk=2),
                            clock, remote=asker)
    on_remote = RequestView("r", remote_keys, 8 * 32 + 1, 8 * 32 + 1, 0, load_policy="recompute")
    assert adapter.lookup(on_remote, 0) == 0 and asker.asked == 0
    assert adapter.stats.lookups_recompute == 1 and adapter.stats.hit_tokens == 0
    assert cost.lookup(asking("recompute"), 0) == 0
    with pytest.raises(UsageError, match="load_policy 'fast'.*'recompute'"):
        cost.lookup(asking("fast"), 0)


def test_a_declined_remote_tier_is_still_asked_for_a_request_that_loads_always() -> None:
    """The skip of a declined remote tier's lookups is the cost policy's: a request that
    asks for "always" still gets the remote hit (and its load measures the node again)."""
    clock = Clock()
    remote_keys = [bytes([i]) * 32 for i in range(20, 28)]
    asker = Asker(remote_keys)
    slow = CostPriors(remote_load_seconds=0.5, remote_bytes_per_second=1e6,
                      seconds_per_token=0.0001)
    adapter = EngineAdapter(BlockIndex(num_slots=16, disk_capacity=16, clock=clock),
                            AdapterConfig(tokens_per_block=16, blocks_per_chunk=2,
                                          load_policy="cost", cost_priors=slow),
                            clock, remote=asker)
    measured(adapter.costs)
    request = RequestView("r", remote_keys, 8 * 32 + 1, 8 * 32 + 1, 0)
    assert adapter.lookup(request, 0) == 0 and asker.asked == 1  # declined from now on
    assert adapter.lookup(request, 0) == 0 and adapter.stats.remote_lookups_skipped == 1
    clock.now += 1.0
    loads = RequestView("a", remote_keys, 8 * 32 + 1, 8 * 32 + 1, 0, load_policy="always")
    assert adapter.lookup(loads, 0) == 8 * 32  # the index's remote marks, or the node
    assert adapter.stats.remote_lookups_skipped == 1
    # A load was taken from the node: the next cost lookup looks (and declines) again.
    assert adapter.lookup(request, 0) == 0 and adapter.stats.remote_lookups_skipped == 1
    assert adapter.stats.tier["remote"].declined_tokens == 3 * 8 * 32  # every cost lookup declined


def test_a_request_asked_again_counts_once_toward_the_probe() -> None:
    """vLLM asks again about a request that heard "not yet" (here: its next chunk is being
    stored); a skipped remote tier counts the request once, when it is answered, so a
    waiting request does not bring the probe forward."""
    clock = Clock()
    remote_keys = [bytes([i]) * 32 for i in range(20, 28)]
    slow = CostPriors(remote_load_seconds=0.5, remote_bytes_per_second=1e6,
                      seconds_per_token=0.0001)
    index = BlockIndex(num_slots=16, disk_capacity=16, clock=clock)
    adapter = EngineAdapter(index, AdapterConfig(tokens_per_block=16, blocks_per_chunk=2,
                                                 load_policy="cost", cost_priors=slow,
                                                 wait_for_stores=True),
                            clock, remote=Asker(remote_keys))
    measured(adapter.costs)
    assert adapter.lookup(RequestView("r", remote_keys, 8 * 32 + 1, 8 * 32 + 1, 0), 0) == 0
    local = [bytes([i]) * 32 for i in range(40, 48)]
    index.prepare_store(local[:1])  # chunk 0 is being stored: "not yet" for a while
    waiting = RequestView("w", local, 8 * 32 + 1, 8 * 32 + 1, 0)
    for _ in range(20):
        assert adapter.lookup(waiting, 0) is None
    assert adapter.stats.waits_on_stores == 20 and adapter.stats.remote_lookups_skipped == 0
    clock.now += 10.0  # promotion_wait_seconds passed: answered
    assert adapter.lookup(waiting, 0) == 0
    assert adapter.stats.remote_lookups_skipped == 1 and adapter.stats.load_probes == 0


def test_one_spike_moves_a_tier_line_a_bounded_step_and_a_slowdown_compounds() -> None:
    """After a tier's first load, a load far slower than the line's estimate teaches it
    SPIKE_FACTOR times the estimate: a 10x spike does not make a fast disk look slower than
    computing, a disk that stays 100x slower is learned within a few loads. The first load
    (the priors are a guess) is learned as it comes: a slow node is declined at once."""
    model = measured(CostModel(CostPriors(disk_load_seconds=0.005, disk_bytes_per_second=2e9,
                                          seconds_per_token=0.0001), chunk_bytes=2 << 20))
    for _ in range(3):
        model.observe_load("disk", 4, 0.01)
    estimate = model.load_seconds({"disk": 4})
    model.observe_load("disk", 4, 10 * estimate)  # a spike
    assert model.load_seconds({"disk": 4}) < 2 * estimate
    assert model.best_prefix([("disk", 4)], 128)[0] == 4  # still loaded: 51 ms of compute
    for _ in range(3):  # a lasting 100x slowdown
        model.observe_load("disk", 4, 100 * estimate)
    assert model.best_prefix([("disk", 4)], 128)[0] == 0
    slow = measured(CostModel(CostPriors(seconds_per_token=0.0001), chunk_bytes=2 << 20))
    slow.observe_load("remote", 4, 3.0)  # the first load: as it comes
    assert slow.best_prefix([("remote", 4)], 128)[0] == 0
    assert slow.loads["remote"].predict(4) > 1.0


def test_an_engine_that_reports_its_steps_ends_is_timed_by_them_not_by_idle_gaps() -> None:
    """Timed from plan to plan, a step followed by a second of idle engine (the next request
    arrives late) looks 100x slower. An engine that reports each step's end (the vLLM
    connector does) is timed from each plan to that end; plans made before the previous
    step ended (asynchronous scheduling) pair in order."""
    clock = Clock()
    gaps = EngineAdapter(BlockIndex(num_slots=4, disk_capacity=4, clock=clock),
                         AdapterConfig(tokens_per_block=16, blocks_per_chunk=2), clock)
    ends = EngineAdapter(BlockIndex(num_slots=4, disk_capacity=4, clock=clock),
                         AdapterConfig(tokens_per_block=16, blocks_per_chunk=2), clock)
    for _ in range(10):  # 1000-token steps of 10 ms, each followed by 1 s idle
        for adapter in (gaps, ends):
            adapter.build_plan(StepInput(num_scheduled_tokens={"r": 1000}))
        clock.now += 0.01
        ends.step_finished()
        clock.now += 1.0
    assert gaps.costs.compute.predict(1000) > 0.5  # the idle second counted as compute
    assert ends.costs.compute.predict(1000) == pytest.approx(0.01, rel=0.2)
    # Asynchronous scheduling: the next step is planned before this one ends, and starts
    # when it does.
    paired = EngineAdapter(BlockIndex(num_slots=4, disk_capacity=4, clock=clock),
                           AdapterConfig(tokens_per_block=16, blocks_per_chunk=2), clock)
    paired.step_finished()  # nothing planned yet: ignored
    for _ in range(10):
        paired.build_plan(StepInput(num_scheduled_tokens={"r": 1000}))
        clock.now += 0.001
        paired.build_plan(StepInput(num_scheduled_tokens={"r": 1}))
        clock.now += 0.01
        paired.step_finished()  # the 1000-token step: 11 ms from its plan
        clock.now += 0.002
        paired.step_finished()  # the 1-token step: 2 ms from the end of the one before
        clock.now += 1.0
    assert paired.costs.compute.predict(1000) == pytest.approx(0.011, rel=0.2)
    assert paired.costs.compute.predict(1) == pytest.approx(0.002, rel=0.5)


def test_never_pays_needs_every_chunk_slower_than_its_compute() -> None:
    priors = CostPriors(remote_load_seconds=0.001, remote_bytes_per_second=1e9,
                        seconds_per_token=0.0001, step_seconds=0.0)
    model = measured(CostModel(priors, chunk_bytes=2 << 20))
    assert not model.never_pays("remote", 32)  # 2 ms a chunk against 3.2 ms of compute
    assert model.never_pays("remote", 16)  # 2 ms (counted 1.9 ms) against 1.6 ms
    assert not measured(CostModel(priors, chunk_bytes=2 << 20, load_bias=0.5)).never_pays(
        "remote", 16)
    # The margin: a one-chunk load (3.1 ms) within a step (5 ms) of its compute is taken,
    # one that costs more than that (12.1 ms) is not.
    stepping = measured(CostModel(dataclasses.replace(priors, step_seconds=0.005),
                                  chunk_bytes=2 << 20))
    assert not stepping.never_pays("remote", 4)
    assert stepping.best_prefix([("remote", 1)], 4)[0] == 1
    slower = CostModel(dataclasses.replace(priors, step_seconds=0.005, remote_load_seconds=0.01),
                       chunk_bytes=2 << 20)
    assert not slower.never_pays("remote", 4)  # compute not measured yet: loads are taken
    assert slower.best_prefix([("remote", 9)], 4)[0] == 9
    measured(slower)
    assert slower.never_pays("remote", 4)
    assert all(slower.best_prefix([("remote", n)], 4)[0] == 0 for n in range(1, 50))

