"""The namespace dimensions table (docs/on-disk-format.md; issue 40, point 3), row by row,
through tierkv's vLLM connector under vLLM's real Scheduler (``vllm_harness``).

Each row flips one dimension between a writer and a reader over one ``disk_path``: the
first engine runs a tiny workload and shuts down (its chunks on disk); the second starts
with that one dimension changed and must find nothing of the first's namespace
(``found_on_disk == 0``) and, sent the same token sequences again, serve none of them
(tierkv's hit tokens and vLLM's external tokens both 0). The same test then starts a third
engine with the writer's settings: it finds every chunk and hits every one (the control:
the flip, not the workload, made the miss, and the flipped reader destroyed nothing).

The model directory's config.json is written once per test by the writer and read
unchanged by every reader (``keep_the_first_config``), so a row flips its dimension alone:
not also the config file the engine reads.

Rows whose dimension lives in the chunk keys, not the namespace (cache salt, multimodal
inputs, the cache epoch), find the writer's chunks on disk by design and must still hit
none. Rows that the real Scheduler cannot flip on this machine are tested at the narrowest
real level, and their docstrings say why. ``ROWS`` lists the row ids (the pytest ids), for
a test that holds the docs table to them.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM connector tests need vllm installed")

from . import vllm_harness as harness_lib
from .test_namespace_table_library import row_ids
from .test_vllm_connector import (TPC, Run, _Resend, _sequences, assert_clean, one_torch_thread,
                                  tierkv_config)

import vllm
from vllm.config import VllmConfig

from tests.reliability import support
from tierkv.config import DiskTierConfig
from tierkv.errors import ConfigError, NamespaceMismatchError
from tierkv.integrations import vllm_config
from tierkv.integrations.vllm_keys import chunk_keys_from_block_hashes
from tierkv.keys import FORMAT_VERSION, Namespace, Part
from tierkv.tiers.disk.format import CHECKSUM_MISMATCH, binding_of, check_value
from tierkv.tiers.disk.tier import DiskTier

__all__ = ["one_torch_thread"]  # the autouse fixture: the KV checks run on one torch thread

HarnessConfig = harness_lib.HarnessConfig
RequestSpec = harness_lib.RequestSpec

ROWS = ("model-id", "revision", "dtype", "kv-cache-dtype", "quantization", "layout",
        "block-size", "chunk-size", "layers", "kv-heads", "head-size", "hash-algorithm",
        "hash-seed", "hash-block-size", "tp-part", "dp-index", "pp", "mla", "kv-groups",
        "sliding-window", "multimodal", "cache-salt", "format-version", "vllm-minor", "epoch")

# Two conversations of one 60-token prompt and 8 output tokens: two 32-token chunks each.
WORKLOAD: dict[str, Any] = dict(num_conversations=2, num_turns=1, system_prompt_len=30,
                                first_user_len=30, max_tokens=8)
HYBRID: dict[str, Any] = dict(num_layers=4, sliding_window=TPC, sliding_window_layers=(1, 3))
Edit = Callable[[VllmConfig], None]


@pytest.fixture(autouse=True)
def keep_the_first_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model directory keeps the config.json its first engine wrote: the readers of a row
    see the writer's model files, whatever their HarnessConfig says."""
    write = harness_lib.write_tiny_llama

    def keep(directory: Path, cfg: HarnessConfig) -> Path:
        return directory if (directory / "config.json").exists() else write(directory, cfg)

    monkeypatch.setattr(harness_lib, "write_tiny_llama", keep)


def engine(disk: Path, settings: dict[str, Any] | None = None, **options: Any) -> HarnessConfig:
    knobs: dict[str, Any] = {"enable_prefix_caching": False, "num_gpu_blocks": 96,
                             "max_num_batched_tokens": 64, **options}
    return HarnessConfig(kv_transfer_config=tierkv_config(
        disk_path=str(disk), disk_bytes=16 << 20, **(settings or {})), **knobs)


@contextmanager
def edited(monkeypatch: pytest.MonkeyPatch, edit: Edit | None) -> Iterator[None]:
    """vLLM's config as the harness builds it, then ``edit``-ed (while the block lasts)."""
    if edit is None:
        yield
        return
    build = harness_lib.build_vllm_config

    def build_and_edit(cfg: HarnessConfig, model_dir: Path) -> VllmConfig:
        config = build(cfg, model_dir)
        edit(config)
        return config

    with monkeypatch.context() as patch:
        patch.setattr(harness_lib, "build_vllm_config", build_and_edit)
        yield


@dataclass
class Written:
    """What the writer left on disk, and the token sequences to send again."""

    sequences: dict[str, list[int]]
    chunks: int
    keys: list[bytes]  # of every chunk computed
    namespace: Namespace  # the writer's

    @property
    def fingerprint(self) -> str:
        return self.namespace.fingerprint()

    @property
    def expected_hits(self) -> int:  # every chunk the writer computed (not the last token's)
        return sum((len(tokens) - 1) // TPC * TPC for tokens in self.sequences.values())


@dataclass
class Seen:
    """What a reader found at start and served when the sequences came again."""

    found_on_disk: int
    hit_tokens: int  # tierkv's, from the CPU and the disk tier
    external_tokens: int  # vLLM's: what it accepted from the connector


def write(cfg: HarnessConfig, model_dir: Path, salt: str | None = None) -> Written:
    run = Run(cfg, model_dir=model_dir)
    workload = harness_lib.MultiTurnWorkload(**WORKLOAD, cache_salts=[salt] * 2)
    result = run.run(workload)
    assert_clean(result, cfg.vocab_size)
    stored = run.side.index.statistics()
    run.shutdown()
    chunks = stored.stores_planned - stored.stores_failed
    assert chunks > 0
    sequences = _sequences(run, result)
    keys = [key for req, tokens in sequences.items() for key in chunk_keys_from_block_hashes(
        run.engine.requests[req].block_hashes, TPC // 16)[: (len(tokens) - 1) // TPC]]
    return Written(sequences, chunks, keys, run.side.namespace)


class _Again(_Resend):
    """The writer's sequences again (plus a few tokens), under ``salt``, as ``<name>-...``."""

    def __init__(self, sequences: dict[str, list[int]], salt: str | None, name: str) -> None:
        super().__init__(sequences)
        self.salt, self.name = salt, name

    def initial_requests(self) -> list[RequestSpec]:
        return [RequestSpec(f"{self.name}-{spec.request_id}", spec.prompt_token_ids,
                            spec.max_tokens, self.salt) for spec in super().initial_requests()]


def send_again(run: Run, written: Written, salt: str | None = None,
               name: str = "read") -> tuple[int, int]:
    """(tierkv's hit tokens, vLLM's external tokens) of the writer's sequences sent again."""
    before = run.side.statistics()
    again = run.run(_Again(written.sequences, salt, name))
    assert_clean(again, run.cfg.vocab_size)  # every KV slot and output exact, hit or not
    after = run.side.statistics()
    hits = sum(after[tier] - before[tier] for tier in ("hit_tokens_disk", "hit_tokens_cpu"))
    return hits, sum(tokens for req, tokens in run.external.items() if req.startswith(name))


def read(cfg: HarnessConfig, model_dir: Path, written: Written, salt: str | None = None,
         check: Callable[[Run], None] | None = None) -> Seen:
    run = Run(cfg, model_dir=model_dir)
    if check is not None:
        check(run)
    found = run.side.found_on_disk
    hits, external = send_again(run, written, salt)
    run.shutdown()
    return Seen(found, hits, external)


def assert_miss(seen: Seen, found_on_disk: int = 0) -> None:
    assert seen == Seen(found_on_disk, 0, 0)


def assert_control(seen: Seen, written: Written, found_on_disk: int | None = None) -> None:
    """The writer's settings again: every chunk found (``found_on_disk``: the writer's and
    the readers' in its namespace), every one served."""
    hits = written.expected_hits
    found = written.chunks if found_on_disk is None else found_on_disk
    assert seen == Seen(found, hits, hits) and hits > 0 and len(written.keys) == written.chunks


# ------------------------------------------------------------------------------ the table


def _revision(name: str) -> Edit:
    def edit(config: VllmConfig) -> None:
        config.model_config.revision = name
    return edit


def _cache_dtype(config: VllmConfig) -> None:
    config.cache_config.cache_dtype = "fp8"


def _quantization(config: VllmConfig) -> None:
    config.model_config.quantization = "fp8"


def _data_parallel_index(config: VllmConfig) -> None:
    object.__setattr__(config.parallel_config, "data_parallel_index", 1)


@dataclass(frozen=True)
class Side:
    """One engine of a row: HarnessConfig ``options``, connector ``settings``, an ``edit``
    of vLLM's config as built, and ``env`` and ``patch`` (``(module, name, value)``) that
    hold while it runs."""

    options: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    edit: Edit | None = None
    env: dict[str, str] = field(default_factory=dict)
    patch: tuple[Any, str, Any] | None = None


@dataclass(frozen=True)
class Row:
    """The writer, and the reader (its options on top of the writer's)."""

    reader: Side
    writer: Side = Side()
    other_model_dir: bool = False


@contextmanager
def running_as(monkeypatch: pytest.MonkeyPatch, side: Side) -> Iterator[None]:
    with edited(monkeypatch, side.edit), monkeypatch.context() as patch:
        for name, value in side.env.items():
            patch.setenv(name, value)
        if side.patch is not None:
            patch.setattr(*side.patch)
        yield


TABLE: dict[str, Row] = {
    # Another directory, byte-identical config.json: another model id.
    "model-id": Row(Side(), other_model_dir=True),
    # model_config.revision (a local directory has none to resolve; the connector reads it).
    "revision": Row(Side(edit=_revision("rev-b")), Side(edit=_revision("rev-a"))),
    "dtype": Row(Side({"dtype": torch.bfloat16})),  # same page bytes, other numbers
    # cache_config.cache_dtype, the value the namespace reads: the harness runs on vLLM's
    # platform-less CPU path, which allocates no fp8 KV cache, so the pages stay float16
    # here and only the setting flips (a real fp8 cache changes the pages' dtype too).
    "kv-cache-dtype": Row(Side(edit=_cache_dtype)),
    # model_config.quantization, the value the namespace reads (the harness loads no
    # weights, so no quantized checkpoint can be built).
    "quantization": Row(Side(edit=_quantization)),
    "layout": Row(Side({"kv_cache_layout": "LBHNC"})),  # HND pages; the writer's are NHD
    # 32-token blocks, one a chunk: the same 32 tokens per chunk in another block split.
    "block-size": Row(Side({"block_size": 32})),
    "chunk-size": Row(Side(settings={"tokens_per_chunk": 2 * TPC})),
    "layers": Row(Side({"num_layers": 3})),
    "kv-heads": Row(Side({"num_kv_heads": 4})),
    "head-size": Row(Side({"head_size": 16})),
    "hash-algorithm": Row(Side({"prefix_caching_hash_algo": "sha256_cbor"})),
    # xxhash is stable only under a fixed PYTHONHASHSEED; another seed, other block hashes.
    "hash-seed": Row(Side(env={"PYTHONHASHSEED": "2"}),
                     Side({"prefix_caching_hash_algo": "xxhash"}, env={"PYTHONHASHSEED": "1"})),
    # Data-parallel engine 1 keeps its own part directories (part-0of1-dp1).
    "dp-index": Row(Side(edit=_data_parallel_index)),
    # One latent a token (MLA) against full attention of the same page bytes:
    # 16 tokens x 1 head x (K + V) x 16 x 2 bytes = 16 tokens x 32 x 2 bytes.
    "mla": Row(Side({"head_size": 32, "mla": True}), Side({"num_kv_heads": 1, "head_size": 16})),
    # Full attention over 4 layers against 2 full + 2 sliding-window layers (two groups).
    "kv-groups": Row(Side(HYBRID), Side({"num_layers": 4})),
    "sliding-window": Row(Side({"sliding_window": 2 * TPC}), Side(HYBRID)),
    "format-version": Row(Side(patch=(vllm_config, "FORMAT_VERSION", FORMAT_VERSION + 1))),
    # Both supported minors: a chunk keyed under 0.33's block hashing is not 0.32's.
    "vllm-minor": Row(Side(patch=(vllm, "__version__", "0.32.0"))),
}


@pytest.mark.parametrize("row", list(TABLE), ids=list(TABLE))
def test_a_flipped_dimension_finds_and_serves_nothing(row: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    spec = TABLE[row]
    model_dir, disk = tmp_path / "model", tmp_path / "kv"
    writer = engine(disk, spec.writer.settings, **spec.writer.options)
    with running_as(monkeypatch, spec.writer):
        written = write(writer, model_dir)
    reader_dir = model_dir
    if spec.other_model_dir:
        reader_dir = tmp_path / "model-copy"
        shutil.copytree(model_dir, reader_dir)
    reader = engine(disk, {**spec.writer.settings, **spec.reader.settings},
                    **{**spec.writer.options, **spec.reader.options})
    with running_as(monkeypatch, spec.reader):
        assert_miss(read(reader, reader_dir, written))
    with running_as(monkeypatch, spec.writer):
        assert_control(read(writer, model_dir, written), written)


# ------------------------------------------------------------------ rows of their own


def _hash_per_8_tokens(config: VllmConfig) -> None:
    config.cache_config.prefix_match_unit = 8


def hashes_per(tokens: int) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        assert run.connector.geometry.hash_block_size == tokens
    return check


@pytest.mark.parametrize("row", ["hash-block-size"])
def test_another_hash_block_size_finds_and_serves_nothing(row: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A hybrid model's block hashes cover ``prefix_match_unit`` tokens (8 here, the GCD of
    the groups' 16-token blocks otherwise). The harness resolves the hash block size as
    vLLM's EngineCore does and writes it into the KV cache config, where the connector
    reads it."""
    build = harness_lib.build_kv_cache_config

    def resolved(cfg: HarnessConfig, config: VllmConfig) -> Any:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        kv_cache_config, layout = build(cfg, config)
        _, kv_cache_config.hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
        return kv_cache_config, layout

    monkeypatch.setattr(harness_lib, "build_kv_cache_config", resolved)
    model_dir, disk = tmp_path / "model", tmp_path / "kv"
    cfg = engine(disk, **HYBRID)
    written = write(cfg, model_dir)
    with edited(monkeypatch, _hash_per_8_tokens):
        assert_miss(read(cfg, model_dir, written, check=hashes_per(8)))
    assert_control(read(cfg, model_dir, written, check=hashes_per(16)), written)


def _pipeline_parallel(config: VllmConfig) -> None:
    object.__setattr__(config.parallel_config, "pipeline_parallel_size", 2)


@pytest.mark.parametrize("row", ["pp"])
def test_pipeline_parallelism_is_refused_at_start(row: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline stage holds only its own layers' KV: an engine with
    pipeline_parallel_size > 1 never starts with tierkv, so it can serve nothing (see
    test_other_parallel_layouts_are_refused_with_why_and_what_instead for the message)."""
    model_dir, cfg = tmp_path / "model", engine(tmp_path / "kv")
    written = write(cfg, model_dir)
    with edited(monkeypatch, _pipeline_parallel), \
            pytest.raises(ConfigError, match="pipeline_parallel_size=2 is not supported"):
        Run(cfg, model_dir=model_dir)
    assert_control(read(cfg, model_dir, written), written)


@pytest.mark.parametrize("row", ["tp-part"])
def test_a_value_read_as_another_part_is_never_served(row: str, tmp_path: Path) -> None:
    """Parts are shared by design: a chunk written at TP 2 is read whole at TP 1, and cut
    per head at TP 2 from TP 1's, each rank getting exactly its heads' bytes (checked slot
    by slot in test_vllm_tp_processes.py: test_another_tp_size_loads_every_chunk_from_disk_exactly,
    and test_a_chunk_missing_one_part_is_a_miss_never_partial_bytes). What must never be
    served is a value read as a part it is not. Every value the connector wrote (part 0 of
    1) verifies under its own part and fails the checksum under parts 0 and 1 of 2; its
    directory copied to where part 0 of 2 lives is refused whole."""
    model_dir, disk = tmp_path / "model", tmp_path / "kv"
    cfg = engine(disk)
    written = write(cfg, model_dir)
    assert_control(read(cfg, model_dir, written), written)
    (ns_dir,) = disk.glob("ns-*")
    payload_bytes = written.namespace.chunk_bytes  # one part of 1: the whole chunk
    assert payload_bytes == 2 * 2 * 1024  # 2 blocks x 2 layers x 1 KiB pages
    out = memoryview(bytearray(payload_bytes))
    with support.raw_env(ns_dir / "part-0of1") as (txn, chunks, _):
        values = [bytes(txn.get(key, db=chunks)) for key in written.keys]
    for key, value in zip(written.keys, values):
        assert check_value(binding_of(written.fingerprint, Part(0, 1)), key, value,
                           payload_bytes, out) is None
        for other in (Part(0, 2), Part(1, 2)):
            assert check_value(binding_of(written.fingerprint, other), key, value,
                               payload_bytes, out) == CHECKSUM_MISMATCH
    shutil.copytree(ns_dir / "part-0of1", ns_dir / "part-0of2")
    disk_config = DiskTierConfig(path=disk, max_bytes=16 << 20)
    with pytest.raises(NamespaceMismatchError, match="part '0of1'.*expected .*part 0of2"):
        DiskTier(disk, written.namespace, Part(0, 2), disk_config, payload_bytes // 2,
                 read_only=True)


def test_a_misplaced_part_directory_of_another_tp_size_is_a_miss(tmp_path: Path) -> None:
    """The one part a TP 1 engine wrote, moved where parts 0 and 1 of a TP 2 writer would
    be: a TP 1 engine (which reads other TP sizes' parts) must start, find nothing and
    serve nothing (it did not start until misplaced parts were skipped like damaged ones:
    issue 41, item 2)."""
    model_dir, disk = tmp_path / "model", tmp_path / "kv"
    cfg = engine(disk)
    written = write(cfg, model_dir)
    (ns_dir,) = disk.glob("ns-*")
    shutil.copytree(ns_dir / "part-0of1", ns_dir / "part-1of2")
    (ns_dir / "part-0of1").rename(ns_dir / "part-0of2")
    assert_miss(read(cfg, model_dir, written))


@pytest.mark.parametrize("row", ["cache-salt"])
def test_another_cache_salt_serves_nothing(row: str, tmp_path: Path) -> None:
    """vLLM hashes a request's cache_salt into its first block hash, so a tenant's chunks
    are in the same namespace (found on disk) under keys no other salt reaches."""
    model_dir, cfg = tmp_path / "model", engine(tmp_path / "kv")
    written = write(cfg, model_dir, salt="tenant-a")
    chunks = written.chunks
    assert_miss(read(cfg, model_dir, written, salt="tenant-b"), found_on_disk=chunks)
    assert_miss(read(cfg, model_dir, written), found_on_disk=2 * chunks)  # nor without one
    # The readers stored theirs (same namespace, other keys): 3 tenants' chunks are there.
    assert_control(read(cfg, model_dir, written, salt="tenant-a"), written, 3 * chunks)


@pytest.mark.parametrize("row", ["epoch"])
def test_after_a_cache_reset_nothing_stored_before_is_served(row: str, tmp_path: Path) -> None:
    """reset_cache (vLLM's /reset_prefix_cache, after a weight update) moves the keys to a
    new epoch: the same sequences hit before it (CPU and disk) and miss after it. More in
    test_vllm_reset.py."""
    model_dir, cfg = tmp_path / "model", engine(tmp_path / "kv")
    written = write(cfg, model_dir)
    run = Run(cfg, model_dir=model_dir)
    assert run.side.found_on_disk == written.chunks
    hits = written.expected_hits
    assert send_again(run, written, name="before") == (hits, hits) and hits > 0
    assert run.engine.scheduler.reset_prefix_cache(reset_connector=True) is True
    assert send_again(run, written, name="after") == (0, 0)
    run.shutdown()


def _with_image(request_id: str, tokens: list[int], identifier: str | None,
                block_hasher: Any) -> Any:
    """A vLLM Request whose tokens 40..47 are an image's placeholder (``identifier``: its
    hash), hashed by vLLM's own block hasher."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    features = None if identifier is None else [MultiModalFeatureSpec(
        data=None, modality="image", identifier=identifier, mm_hash=identifier,
        mm_position=PlaceholderRange(offset=40, length=8))]
    return Request(request_id=request_id, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                   mm_features=features, block_hasher=block_hasher)


@pytest.mark.parametrize("row", ["multimodal"])
def test_other_multimodal_inputs_serve_nothing_past_them(row: str, tmp_path: Path) -> None:
    """vLLM puts each image's hash into the block hashes of the blocks its placeholder
    covers (extra keys), and tierkv's keys derive from those hashes. The harness's model
    is text-only (its Scheduler budgets no encoder, so an image request would never be
    scheduled): the request goes to the real connector's lookup over the writer's disk,
    the call vLLM's Scheduler makes for a waiting request. The same tokens with an image
    hit only the chunk before the image; another image's keys differ from that point."""
    model_dir, cfg = tmp_path / "model", engine(tmp_path / "kv")
    written = write(cfg, model_dir)
    run = Run(cfg, model_dir=model_dir)
    assert run.side.found_on_disk == written.chunks  # one namespace: the keys decide
    tokens = next(iter(written.sequences.values()))[:2 * TPC + 1]
    plain, image_a, image_b = (_with_image(name, tokens, identifier, run.harness.block_hasher)
                               for name, identifier in (("plain", None), ("a", "img-a"),
                                                        ("b", "img-b")))
    keys = [chunk_keys_from_block_hashes(request.block_hashes, TPC // 16)
            for request in (plain, image_a, image_b)]
    assert keys[0][0] == keys[1][0] == keys[2][0]  # tokens 0..31: before the image
    assert len({chunk[1] for chunk in keys}) == 3  # tokens 32..63 hold it: three keys
    offered = {}
    for request in (plain, image_a, image_b):
        offered[request.request_id], _ = run.connector.get_num_new_matched_tokens(request, 0)
        run.connector.request_finished(request, [])
    assert offered == {"plain": 2 * TPC, "a": TPC, "b": TPC}
    run.assert_drained()
    run.shutdown()


def test_the_rows_are_the_tests_ids() -> None:
    assert sorted(row_ids(globals())) == sorted(ROWS)
