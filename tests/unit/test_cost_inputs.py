"""What the cost model (tierkv.core.costs) takes in: only real timing samples, counted when
dropped, and priors checked as settings (issue 41, items 3 and 4)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.profiles import thorough
from tierkv.core.costs import CostModel, CostPriors, DecayedLine
from tierkv.core.stats import TIERS
from tierkv.core.index import BlockIndex
from tierkv.core.jobs import Completion, JobKind
from tierkv.engine.adapter import EngineAdapter
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.engine.requests import RequestView, StepInput, WorkerReport
from tierkv.errors import ConfigError

# -- timing samples ---------------------------------------------------------------------------

RUNS = ([("disk", 8)], [("cpu", 2), ("disk", 3), ("remote", 4)], [("remote", 1)])


def lines(model: CostModel) -> list[tuple[float, float]]:
    return [model.compute.line(), *(model.loads[tier].line() for tier in TIERS)]


def decisions(model: CostModel) -> list[object]:
    """What the model decides: the prefix of a few hits, and which tiers never pay."""
    return [*(model.best_prefix(runs, 128) for runs in RUNS),
            *(model.never_pays(tier, 128) for tier in TIERS), model.compute_measured(128)]


def test_an_infinite_or_overflowing_step_leaves_the_compute_line_as_it_was() -> None:
    """The issue's repro: observe_compute(1024, inf), or a token count whose square
    overflows a float, turned the compute line to NaN, and load_policy "cost" then
    declined nearly every hit, silently. They are dropped and counted; the lines and the
    decisions stay a model's that never saw them."""
    clean, model = CostModel(), CostModel()
    for each in (clean, model):
        each.observe_compute(1024, 0.005 + 1024 * 25e-6)
        each.observe_load("disk", 4, 0.01)
    bad = [model.observe_compute(1024, math.inf),
           model.observe_compute(10 ** 200, 0.03),  # its square overflows a float
           model.observe_compute(1 << 33, 0.03),  # beyond MAX_SAMPLE_COUNT
           model.observe_load("remote", 4, math.inf),  # a tier's first load: as it comes
           model.observe_load("disk", 10 ** 200, 0.01),
           model.observe_load("cpu", 2, -math.inf)]
    assert all(math.isfinite(value) for line in lines(model) for value in line)
    assert lines(model) == lines(clean) and decisions(model) == decisions(clean)
    assert model.best_prefix([("disk", 8)], 128)[0] == 8
    assert bad == [False] * 6 and model.counts.cost_samples_dropped == 6


def test_the_adapter_counts_a_dropped_step_and_keeps_loading_its_hits() -> None:
    """Through the engine adapter (a custom engine reports its own steps): the bad samples
    reach its statistics, and the disk hits after them are loaded, not declined."""
    index = BlockIndex(num_slots=16, disk_capacity=64, clock=lambda: 0.0)
    keys = [bytes([i]) * 32 for i in range(1, 33)]
    index.add_on_disk(keys)
    adapter = EngineAdapter(index, AdapterConfig(tokens_per_block=16, blocks_per_chunk=16,
                                                 load_policy="cost"), lambda: 0.0)
    adapter.observe_compute(1024, 0.005 + 1024 * 25e-6)  # measured on the priors' line
    adapter.observe_compute(1024, math.inf)
    adapter.observe_compute(10 ** 200, 0.03)
    # 4 chunks of 256 tokens: 9 ms to load from disk against 26 ms to compute.
    tokens = 4 * 256 + 1
    loaded = [adapter.lookup(RequestView(f"r{n}", keys[n:n + 4], tokens, tokens, 0), 0)
              for n in range(0, 32, 4)]
    assert loaded == [4 * 256] * 8 and adapter.stats.tier["disk"].declined_tokens == 0
    assert adapter.stats.cost_samples_dropped == 2


def test_a_taken_load_whose_time_is_no_sample_is_neither_learned_nor_summed() -> None:
    """A same-step load's copy reports an infinite time (a broken clock): the CPU line and
    the estimated/measured sums stay as they were, and it is counted."""
    def clock() -> float:
        return 0.0

    index = BlockIndex(num_slots=16, disk_capacity=16, clock=clock)
    keys = [bytes([i]) * 32 for i in range(1, 5)]
    store = index.prepare_store(keys)
    index.complete_store(Completion(store.job_id, JobKind.STORE, ok=True))
    adapter = EngineAdapter(index, AdapterConfig(tokens_per_block=16, blocks_per_chunk=2,
                                                 load_policy="cost", sync_load_chunks=8),
                            clock)
    request = RequestView("r", keys, 4 * 32 + 1, 4 * 32 + 1, 0)
    assert adapter.lookup(request, 0) == 4 * 32 and adapter.sync_load("r")
    adapter.update_state_after_alloc(request, list(range(8)), 4 * 32, 0)
    [load] = adapter.build_plan(StepInput()).loads
    assert load.spec is not None
    adapter.complete(WorkerReport(0, (Completion(load.spec.job_id, JobKind.LOAD, ok=True,
                                                 seconds=math.inf),)))
    assert adapter.stats.sync_loads == 1
    assert adapter.costs.loads["cpu"].line() == CostModel().loads["cpu"].line()
    assert adapter.costs.loads["cpu"].samples == 0
    assert adapter.stats.tier["cpu"].load_seconds_measured == 0.0
    assert adapter.stats.tier["cpu"].load_seconds_estimated == 0.0
    assert adapter.stats.cost_samples_dropped == 1


def test_a_fit_that_comes_out_non_finite_keeps_the_line_before_it() -> None:
    """A decay so small that the prior's penalties vanish under rounding leaves the normal
    equations singular (a ZeroDivisionError before): the line stays the prior."""
    line = DecayedLine((0.005, 0.001), x_scale=16.0, decay=1e-320)
    line.observe(4.0, 0.1)
    assert line.line() == (0.005, 0.001)
    assert line.samples == 1
    assert line.predict(4.0) == pytest.approx(0.009)


GOOD = st.tuples(st.sampled_from(["compute", *TIERS]), st.integers(1, 1 << 32),
                 st.floats(0.0, 3600.0))
BAD_COUNTS = st.one_of(st.integers(max_value=0), st.integers(min_value=(1 << 32) + 1),
                       st.just(10 ** 200), st.just(True), st.floats(allow_nan=True),
                       st.none(), st.text(max_size=3))
BAD_SECONDS = st.one_of(st.floats(max_value=-1e-300), st.floats(min_value=3600.0,
                                                                exclude_min=True),
                        st.just(math.nan), st.just(math.inf), st.just(-math.inf),
                        st.just(True), st.none(), st.text(max_size=3))
BAD = st.one_of(
    st.tuples(st.sampled_from(["compute", *TIERS]), BAD_COUNTS, st.floats(0.0, 3600.0)),
    st.tuples(st.sampled_from(["compute", *TIERS]), st.integers(1, 1 << 32), BAD_SECONDS),
    st.tuples(st.sampled_from(["compute", *TIERS]), BAD_COUNTS, BAD_SECONDS))


def observe(model: CostModel, sample: tuple[str, Any, Any]) -> object:
    """Teach ``model`` the sample; what it returned (whether it took it)."""
    what, count, seconds = sample
    if what == "compute":
        return model.observe_compute(count, seconds)
    return model.observe_load(what, count, seconds)


@thorough(200)
@given(st.lists(st.tuples(st.booleans(), GOOD, BAD), max_size=40))
def test_no_sequence_of_samples_leaves_a_line_non_finite_or_moves_a_decision(
        steps: list[tuple[bool, tuple[str, Any, Any], tuple[str, Any, Any]]]) -> None:
    """Good samples (counts in [1, 2^32], seconds in [0, 3600]) mixed with bad ones
    (infinite, NaN, negative, over the bounds, huge ints, wrong types): the model that saw
    them all has finite lines, the lines and decisions of one that saw only the good, and
    counted each bad one."""
    clean, model = CostModel(), CostModel()
    taken: list[object] = []
    for is_good, good, bad in steps:
        if is_good:
            clean_took = observe(clean, good)
            taken.append((observe(model, good), clean_took))
        else:
            taken.append(observe(model, bad))
    assert all(math.isfinite(value) for line in lines(model) for value in line)
    assert lines(model) == lines(clean)
    assert decisions(model) == decisions(clean)
    assert taken == [(True, True) if is_good else False for is_good, _, _ in steps]
    bad_seen = sum(1 for is_good, _, _ in steps if not is_good)
    assert model.counts.cost_samples_dropped == bad_seen


# -- cost_priors ------------------------------------------------------------------------------

PRIORS = [f.name for f in fields(CostPriors)]
RATES = [name for name in PRIORS if name.endswith("_bytes_per_second")]
BAD_PRIORS = [-1.0, math.nan, math.inf, -math.inf, 1e300, "fast", None, True]


@pytest.mark.parametrize("bad", BAD_PRIORS, ids=repr)
@pytest.mark.parametrize("name", PRIORS)
def test_a_bad_prior_is_a_config_error_that_names_it(name: str, bad: object) -> None:
    """A NaN latency was accepted (and declined every hit on its tier), a str or None met
    the model as a raw TypeError: each is refused when the priors are made, naming the
    setting, the value and what it takes."""
    with pytest.raises(ConfigError) as info:
        CostPriors(**{name: bad})
    message = str(info.value)
    assert message.startswith(f"cost_priors.{name} must be a number within [")
    assert message.endswith(f", got {bad!r}")


@pytest.mark.parametrize("name", RATES)
def test_a_zero_rate_is_a_config_error_not_a_division_by_zero(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"cost_priors\.{name} must be a number within "
                                          rf"\[1, 1e\+15\], got 0"):
        CostPriors(**{name: 0})
    CostPriors(**{name: 1})  # 1 byte a second: slow, but a rate


@pytest.mark.parametrize("name", [name for name in PRIORS if name not in RATES])
def test_a_prior_of_zero_seconds_is_one(name: str) -> None:
    """A fixed cost or a token's compute of 0 seconds is an assumption, not an error."""
    model = CostModel(CostPriors(**{name: 0}))
    assert all(math.isfinite(value) for line in lines(model) for value in line)


@pytest.mark.parametrize("bad", [{"disk_bytes_per_second": 1e9}, "fast", None, 1.0],
                         ids=repr)
def test_cost_priors_that_are_no_cost_priors_are_a_config_error(bad: object) -> None:
    """A dict (a JSON config's priors) met the model as a raw AttributeError."""
    with pytest.raises(ConfigError, match=r"adapter\.cost_priors must be a CostPriors"):
        AdapterConfig(16, 2, cost_priors=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"cost_priors must be a CostPriors"):
        CostModel(bad)  # type: ignore[arg-type]
