"""``scripts/bench_serve.py``'s checks on figures made by hand: each invariant the serving
benchmark holds (no failed request, cached tokens equal vLLM's counters, vLLM's external
hits equal tierkv's per-tier hits, a warm phase moved tierkv's counters, greedy tokens equal
vLLM alone's, a flat RSS) is reported when it breaks, and only then. Its workloads are
the same for the same seed and reuse what they claim to."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_serve  # noqa: E402
from serve_load import Sizes, workload  # noqa: E402

ZERO = {key: 0.0 for key in bench_serve.COUNTERS}


def run(arm: str, tokens: list[int], *, cached: int = 128, error: str = "",
        rss_growth: float = 0.0, **counters: float) -> dict[str, Any]:
    reply = {"session": 0, "turn": 0, "ttft": 0.05, "tokens": tokens, "cached": cached,
             "error": error}
    summary = bench_serve.summary([], 1.0) | {"errors": int(bool(error)),
                                              "cached_tokens": cached, "requests": 1}
    return {"workload": "chat", "arm": arm, "round": 0, "concurrency": 4,
            "main_concurrency": 4, "rss_start_mib": 100.0, "rss_end_mib": 100.0 + rss_growth,
            "phases": [{"phase": "run", "seconds": 1.0, "summary": summary, "replies": [reply],
                        "counters": ZERO | {"vllm_cached": float(cached)} | counters}]}


def good() -> list[dict[str, Any]]:
    return [run("vllm", [1, 2]),
            run("tierkv", [1, 2], hit_cpu=128.0, vllm_external_hits=128.0)]


def test_agreeing_runs_pass() -> None:
    failures, tally = bench_serve.checks(good(), slack_mib=64)
    assert failures == []
    assert tally == {"greedy_compared": 1, "greedy_differed": 0, "notes": []}


def test_each_broken_invariant_is_reported() -> None:
    cases = {
        "request(s) failed": run("tierkv", [1, 2], error="HTTP 500", hit_cpu=128.0,
                                 vllm_external_hits=128.0),
        "vLLM's counter": run("tierkv", [1, 2], hit_cpu=128.0, vllm_external_hits=128.0,
                              vllm_cached=0.0),
        "external hit tokens": run("tierkv", [1, 2], hit_cpu=128.0, vllm_external_hits=256.0),
        "moved no tierkv counter": run("tierkv", [1, 2]),
        "differ from vLLM alone": run("tierkv", [1, 3], hit_cpu=128.0,
                                      vllm_external_hits=128.0),
        "RSS grew": run("tierkv", [1, 2], rss_growth=65.0, hit_cpu=128.0,
                        vllm_external_hits=128.0),
    }
    for words, bad in cases.items():
        failures, _ = bench_serve.checks([good()[0], bad], slack_mib=64)
        assert len(failures) == 1 and words in failures[0], (words, failures)


def test_workloads_repeat_and_reuse_as_claimed() -> None:
    sizes = Sizes(sessions=3, turns=2, system_prompts=2, system_tokens=8, user_tokens=4,
                  reply_tokens=2, context_tokens=16, tool_tokens=2, agentic_turns=2,
                  documents=2, document_tokens=8, unique_tokens=8)
    for name in ("chat", "agentic", "pressure", "unique", "restart"):
        assert workload(name, sizes, seed=1) == workload(name, sizes, seed=1)
        assert workload(name, sizes, seed=1) != workload(name, sizes, seed=2)
    first, second = workload("chat", sizes)  # waves: every session's turn 0, then 1
    assert first[0][0].prompt[:8] == first[2][0].prompt[:8]  # a shared system prompt
    assert second[0][0].prompt[:len(first[0][0].prompt)] == first[0][0].prompt  # history
    store, reread = workload("pressure", sizes)
    assert [s[0].prompt[:8] for s in store] == [s[0].prompt[:8] for s in reread]
    restart = workload("restart", sizes)
    assert [t.phase for wave in restart for s in wave for t in s] == ["cold"] * 6 + \
        ["replay"] * 6
    assert [t.prompt for wave in restart[:2] for s in wave for t in s] == \
        [t.prompt for wave in restart[2:] for s in wave for t in s]
    unique = workload("unique", sizes)[0]
    assert len({s[0].prompt for s in unique}) == 3


def test_a_preempted_reload_is_a_note_not_a_failure() -> None:
    # vLLM counts a request's external hits once; tierkv counts each load of it, and a
    # preempted request loads again.
    reloaded = run("tierkv", [1, 2], hit_cpu=256.0, vllm_external_hits=128.0, preemptions=1.0)
    failures, tally = bench_serve.checks([good()[0], reloaded], slack_mib=64)
    assert failures == [] and len(tally["notes"]) == 1
    fewer = run("tierkv", [1, 2], hit_cpu=64.0, vllm_external_hits=128.0, preemptions=1.0)
    failures, _ = bench_serve.checks([good()[0], fewer], slack_mib=64)
    assert len(failures) == 1 and "external hit tokens" in failures[0]



def test_fewer_tierkv_hits_than_vllm_counted_fail_even_with_roomless_loads() -> None:
    # Seen with write_through off (docs/benchmarks/serving.md): not explained, so not excused.
    fewer = run("tierkv", [1, 2], hit_disk=128.0, vllm_external_hits=256.0, no_room_loads=1.0)
    failures, tally = bench_serve.checks([good()[0], fewer], slack_mib=64)
    assert len(failures) == 1 and "1 roomless chunk load(s)" in failures[0]
    assert tally["notes"] == []
