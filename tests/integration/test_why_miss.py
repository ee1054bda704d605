"""``tierkv why-miss`` over real stores (LMDB and slab files in temporary directories).

For every row of docs/on-disk-format.md's table "What a namespace and a key bind" (the
ids ``tests/unit/test_namespace_table.py`` reads, and every ``ROWS`` of the table's tests),
chunks of one prompt are stored under one value of the row's dimension (through the
warm-up's :class:`VllmTarget`, built from the same arguments ``tierkv why-miss`` parses,
or its namespace with the row's field changed where the warm-up cannot write it), and
``tierkv why-miss`` is asked with the other value: its verdict must name that dimension.
A row without a case here fails, naming the row.

Also: hits on disk (text through the warm-up's tokenizer), chunks never stored, a damaged
value (payload bytes flipped in the slab file), the prompt's input forms, and the LoRA and
multimodal block hashes checked against vLLM's own block hasher.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="why-miss reads the model's config with transformers")

from tests.unit.test_namespace_table import TESTS, named_ids, table_rows
from tierkv.cli import build_parser, main
from tierkv.config import DiskTierConfig
from tierkv.integrations.vllm_keys import chunk_keys_from_block_hashes, epoch_key
from tierkv.integrations.vllm_warmup import VllmTarget, vllm_block_hashes
from tierkv.keys import FORMAT_VERSION, Namespace, Part
from tierkv.tiers.disk.tier import DiskTier
from tierkv.tiny_models import build_model, save_char_tokenizer
from tierkv.warmup_hf import HfModel, build_target

TPC = 32
TOKENS = [random.Random(45).randrange(1, 4000) for _ in range(4 * TPC + 5)]  # 4 chunks
# The server: a tiny Llama (float32 weights) served in float16, 32-token chunks, vLLM 0.33.
BASE = ("--dtype", "float16", "--tokens-per-chunk", str(TPC), "--vllm-version", "0.33.0",
        "--disk-bytes", "64MiB")


@pytest.fixture(scope="module")
def built_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_char_tokenizer(build_model("llama", tmp_path_factory.mktemp("models")))


@pytest.fixture
def model(built_model: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model per test: a row may change its files."""
    return Path(shutil.copytree(built_model, tmp_path / "model"))


def target_of(model: Path, store: Path, *args: str) -> VllmTarget:
    """The server ``tierkv why-miss`` derives from these arguments (its own parser)."""
    parsed = build_parser(["why-miss"]).parse_args(
        ["why-miss", "--model", str(model), "--store", str(store), "--token-ids", "1",
         *BASE, *args])
    target, _, _ = build_target(parsed, HfModel(model, model, parsed.dtype, "cpu"))
    assert isinstance(target, VllmTarget)
    return target


def store_chunks(store: Path, namespace: Namespace, keys: list[bytes], parts: list[Part],
                 replica: int = 0) -> dict[bytes, bytes]:
    """Write each key's payload (random bytes) into every part's disk tier, as the
    connector's workers do; returns the payloads."""
    size = namespace.chunk_bytes // parts[0].count
    payloads = {key: os.urandom(size) for key in keys}
    for part in parts:
        with DiskTier(store, namespace, part, DiskTierConfig(path=store, max_bytes=64 << 20),
                      size, replica=replica) as tier:
            assert len(tier.put_many([(key, payloads[key]) for key in keys]).written) == len(keys)
    return payloads


def why_miss(model: Path, store: Path, *args: str, prompt: tuple[str, ...] | None = None,
             capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    """``tierkv why-miss --json``: (exit code, its document)."""
    given = prompt or ("--token-ids", json.dumps(TOKENS))
    code = main(["why-miss", "--model", str(model), "--store", str(store), *given, *BASE, *args,
                 "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def why_miss_lines(model: Path, store: Path, *args: str,
                   capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = main(["why-miss", "--model", str(model), "--store", str(store), "--token-ids",
                 ",".join(map(str, TOKENS)), *BASE, *args])
    return code, capsys.readouterr().out.splitlines()


# ------------------------------------------------------------------------------ the table
Edit = Callable[[Namespace], dict[str, Any]]


def _flip_weights(model: Path) -> None:
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # one weight's bits, the file's size unchanged
    weights.write_bytes(bytes(data))


def _edit_config(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    config["rope_theta"] = 5000.0
    (model / "config.json").write_text(json.dumps(config))


def _lora(model: Path) -> None:
    adapter = model.parent / "adapter-a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (adapter / "adapter_model.safetensors").write_bytes(os.urandom(4096))


@dataclass(frozen=True)
class Case:
    """How a row's chunks are written (``writer`` arguments, a ``namespace`` edit, the
    ``parts`` and ``replica`` written, an ``epoch``), how why-miss is asked (``reader``
    arguments; ``change`` the model's files after writing), and what it must answer: the
    ``verdict`` of every chunk from ``first`` on, naming ``names`` (one of them)."""

    names: tuple[str, ...]
    verdict: str = "other-namespace"
    writer: tuple[str, ...] = ()
    reader: tuple[str, ...] = ()
    namespace: Edit | None = None
    parts: tuple[Part, ...] | None = None
    replica: int = 0
    epoch: bool = False
    change: Callable[[Path], None] | None = None
    first: int = 0  # chunks before it hit


def _groups(window: int) -> Edit:
    return lambda ns: {"kv_layout": ns.kv_layout + f" groups=[full(2 layers), sliding"
                                                   f"(window={window}, 2 layers)]"}


CASES: dict[str, Case] = {
    "weights": Case(("model_fingerprint",), change=_flip_weights),
    "config": Case(("model_fingerprint",), change=_edit_config),
    "draft-model": Case(("draft",), namespace=lambda ns: {
        "model_fingerprint": ns.model_fingerprint + "+draft:auto:" + "d" * 32}),
    "model-id": Case(("model_id",), namespace=lambda ns: {"model_id": "another/model"}),
    "revision": Case(("model_id",), writer=("--revision", "rev-a")),
    "dtype": Case(("dtype",), writer=("--dtype", "bfloat16")),
    "kv-cache-dtype": Case(("dtype",), namespace=lambda ns: {"dtype": "float16/fp8"}),
    "quantization": Case(("extra",), namespace=lambda ns: {"extra": ns.extra + "/quant:fp8"}),
    "layout": Case(("kv_layout",), writer=("--kv-cache-layout", "LBHNC")),
    "block-size": Case(("kv_layout",), writer=("--block-size", "32")),
    "chunk-size": Case(("tokens_per_chunk",), writer=("--tokens-per-chunk", str(2 * TPC))),
    "layers": Case(("num_layers",), namespace=lambda ns: {
        "num_layers": ns.num_layers + 1,
        "layer_names": (*ns.layer_names, f"model.layers.{ns.num_layers}.self_attn.attn")}),
    "layer-order": Case(("layer_names",), namespace=lambda ns: {
        "layer_names": tuple(reversed(ns.layer_names))}),
    "kv-heads": Case(("num_kv_heads",), namespace=lambda ns: {
        "num_kv_heads": 4, "kv_layout": ns.kv_layout.replace("H=2", "H=4")}),
    "head-size": Case(("kv_layout",), namespace=lambda ns: {
        "kv_layout": ns.kv_layout.replace("C=256B", "C=512B"), "page_bytes": 2 * ns.page_bytes,
        "chunk_bytes": 2 * ns.chunk_bytes}),
    "hash-algorithm": Case(("hash_scheme",), writer=("--hash-algo", "sha256_cbor")),
    # Only a fingerprint of PYTHONHASHSEED is recorded: those keys cannot be derived here.
    "hash-seed": Case(("hash_scheme",), "not-stored", writer=("--hash-algo", "xxhash",
                                                             "--hash-seed", "1"),
                      reader=("--hash-algo", "xxhash", "--hash-seed", "2")),
    "hash-block-size": Case(("hash_scheme",), writer=("--hash-block-size", "8")),
    "tp-part": Case(("part",), "partial", writer=("--tensor-parallel-size", "2"),
                    parts=(Part(0, 2),)),
    "dp-index": Case(("data_parallel_index",), "other-dp", replica=1),
    "pp": Case(("pipeline_parallel_size",), "refused", reader=("--pipeline-parallel-size", "2")),
    "mla": Case(("rank_layout",), namespace=lambda ns: {
        "rank_layout": "mla", "kv_layout": ns.kv_layout.replace("vllm-page", "vllm-mla-page")}),
    "kv-groups": Case(("kv_layout",), namespace=_groups(TPC)),
    "sliding-window": Case(("kv_layout",), namespace=_groups(2 * TPC)),
    "lora": Case(("lora",), "other-key", change=_lora, reader=("--lora", "adapter-a=ADAPTER")),
    # An image over tokens 40..47: the chunk of tokens 0..31 is the same chunk.
    "multimodal": Case(("multimodal",), "other-key", reader=("--mm", "img-a:40:8"), first=1),
    "cache-salt": Case(("cache_salt",), "other-key", reader=("--salt", "tenant-a")),
    "format-version": Case(("format_version",), namespace=lambda ns: {
        "format_version": FORMAT_VERSION + 1}),
    "vllm-minor": Case(("extra",), writer=("--vllm-version", "0.32.0")),
    # Keys of a cache epoch (after reset_prefix_cache) are random and never persisted: the
    # store cannot tell them from keys never stored, and why-miss says so.
    "epoch": Case(("epoch",), "not-stored", epoch=True),
}


def all_rows() -> list[str]:
    """The docs table's rows and every row a table test flips."""
    return sorted(set(table_rows()).union(*(named_ids(path) for path in TESTS)))


def test_every_case_is_a_row_of_the_table() -> None:
    assert sorted(set(CASES) - set(all_rows())) == []


@pytest.mark.parametrize("row", all_rows())
def test_why_miss_names_the_dimension_of_every_row(row: str, model: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    case = CASES.get(row)
    if case is None:
        pytest.fail(f"row {row!r} of the namespace table has no why-miss case: add one to "
                    f"CASES, and teach tierkv why-miss to explain it")
    store = tmp_path / "kv"
    writer = target_of(model, store, *case.writer)
    namespace = writer.namespace()
    if case.namespace is not None:
        namespace = dataclasses.replace(namespace, **case.namespace(namespace))
    keys = writer.chunk_keys(TOKENS)
    if case.epoch:
        epoch = os.urandom(16)
        keys = [epoch_key(key, epoch) for key in keys]
    store_chunks(store, namespace, keys, list(case.parts or writer.parts()), case.replica)
    if case.change is not None:
        case.change(model)
    reader = [arg.replace("ADAPTER", str(model.parent / "adapter-a")) for arg in case.reader]
    code, report = why_miss(model, store, *reader, capsys=capsys)
    chunks = report["chunks"]
    assert code == 1 and len(chunks) == len(TOKENS) // TPC
    assert [chunk["verdict"] for chunk in chunks[: case.first]] == ["hit-disk"] * case.first
    for chunk in chunks[case.first:]:
        assert chunk["verdict"] == case.verdict, (row, chunk)
        assert case.names[0] in chunk["detail"], (row, chunk)  # in words, on its line
        assert case.epoch or case.names[0] in chunk["dimensions"], (row, chunk)


# ------------------------------------------------------------------------------ hits, misses
def test_text_through_the_warmups_tokenizer_hits_on_disk(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoTokenizer

    text = ("the quick brown fox jumps over the lazy dog, " * 3)[:100]
    ids = list(AutoTokenizer.from_pretrained(model)(text)["input_ids"])
    store = tmp_path / "kv"
    target = target_of(model, store)
    keys = target.chunk_keys(ids)
    assert len(keys) == 3
    store_chunks(store, target.namespace(), keys, target.parts())
    code, report = why_miss(model, store, prompt=("--text", text), capsys=capsys)
    assert code == 0 and [c["verdict"] for c in report["chunks"]] == ["hit-disk"] * 3
    assert report["served_chunks"] == 3 and report["chunks"][0]["key"] == keys[0].hex()
    code, report = why_miss(model, store, prompt=("--prompt", json.dumps({"text": text})),
                            capsys=capsys)
    assert code == 0 and report["served_chunks"] == 3


def test_never_stored_and_a_hit_after_a_miss(model: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "kv"
    target = target_of(model, store)
    keys = target.chunk_keys(TOKENS)
    store_chunks(store, target.namespace(), [keys[0], keys[2]], target.parts())
    code, lines = why_miss_lines(model, store, capsys=capsys)
    assert code == 1
    verdicts = [line.split(": ")[1] for line in lines if line.startswith("chunk ")]
    assert verdicts == ["hit-disk", "not-stored", "hit-disk", "not-stored"]
    assert "never stored, or evicted" in lines[1] and lines[1].startswith("chunk 1 tokens [32, 64)")
    assert lines[-1].startswith("why-miss: 4 chunk(s) of 133 tokens") and \
        "loads the first 1 (32 tokens)" in lines[-1] and "CPU tier" in lines[-1]
    empty = tmp_path / "empty"
    empty.mkdir()
    code, report = why_miss(model, empty, capsys=capsys)
    assert code == 1 and {c["verdict"] for c in report["chunks"]} == {"not-stored"}
    assert "is not in" in report["notes"][0]


def test_a_damaged_value_is_named_and_verify_agrees(model: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "kv"
    target = target_of(model, store)
    keys = target.chunk_keys(TOKENS)
    payloads = store_chunks(store, target.namespace(), keys, target.parts())
    payload = payloads[keys[1]]
    flipped = 0
    for slab in store.glob("ns-*/part-0of1/shard-*/slab-*"):
        data = bytearray(slab.read_bytes())
        at = data.find(payload[:4096])
        if at >= 0:
            data[at + 1000] ^= 0x5A  # a payload byte, in the slab file
            slab.write_bytes(bytes(data))
            flipped += 1
    assert flipped == 1
    code, report = why_miss(model, store, capsys=capsys)
    assert code == 1
    assert [c["verdict"] for c in report["chunks"]] == ["hit-disk", "damaged", "hit-disk",
                                                        "hit-disk"]
    assert "checksum" in report["chunks"][1]["detail"] and report["served_chunks"] == 1
    assert main(["verify", str(store), "--no-progress"]) == 1  # the same value, found bad
    assert keys[1].hex() in capsys.readouterr().out


def test_token_ids_as_a_list_a_comma_list_or_a_prompt_line(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "kv"
    target = target_of(model, store)
    keys = target.chunk_keys(TOKENS, "tenant-b")
    store_chunks(store, target.namespace(), keys, target.parts())
    line = json.dumps({"token_ids": TOKENS, "cache_salt": "tenant-b"})
    assert why_miss(model, store, prompt=("--prompt", line), capsys=capsys)[1]["served_chunks"] == 4
    for given in (("--token-ids", json.dumps(TOKENS)), ("--token-ids", ",".join(map(str, TOKENS)))):
        code, report = why_miss(model, store, "--salt", "tenant-b", prompt=given, capsys=capsys)
        assert code == 0 and report["served_chunks"] == 4
    assert main(["why-miss", "--model", str(model), "--store", str(store), "--token-ids", "1,x",
                 *BASE]) == 2
    assert "--token-ids" in capsys.readouterr().err


# ------------------------------------------------------------------------------ vLLM's hashes
@pytest.fixture
def vllm_hasher() -> Iterator[Any]:
    pytest.importorskip("vllm", reason="the check against vLLM's block hasher needs vllm")
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(get_hash_fn_by_name("sha256"))
    yield kv_cache_utils.get_request_block_hasher(16, get_hash_fn_by_name("sha256"))


def test_lora_and_multimodal_block_hashes_are_vllms(vllm_hasher: Any) -> None:
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    tokens = TOKENS[:96]
    images = [("img-a", 20, 8), ("img-b", 40, 30)]
    features = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                      mm_hash=ident, mm_position=PlaceholderRange(offset, length))
                for ident, offset, length in images]
    for lora, salt in ((None, None), (("adapter-a", "/adapters/a"), None),
                       (("adapter-a", "/adapters/a"), "tenant-a")):
        request = Request(request_id="r", prompt_token_ids=tokens,
                          sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                          mm_features=features, cache_salt=salt, block_hasher=vllm_hasher,
                          lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None)
        ours = vllm_block_hashes(tokens, 16, cache_salt=salt, lora=lora, multimodal=images)
        assert [bytes(block) for block in request.block_hashes] == ours
    plain = chunk_keys_from_block_hashes(vllm_block_hashes(tokens, 16), 2)
    imaged = chunk_keys_from_block_hashes(vllm_block_hashes(tokens, 16, multimodal=images), 2)
    assert plain[0] != imaged[0] and plain[2] != imaged[2]


# ------------------------------------------------------------------------------ remote tier
def test_the_remote_tier_where_the_disk_misses(model: Path, tmp_path: Path, redis_cluster: Any,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Chunk 0 on disk; 1 on the remote tier; 2 there, its value flipped; 3 on the remote
    tier under a namespace no disk record describes (another model id)."""
    from redis.cluster import RedisCluster as ClusterClient

    from tierkv.config import RemoteTierConfig
    from tierkv.tiers.remote.format import redis_key
    from tierkv.tiers.remote.tier import RemoteTier

    redis_cluster.flushall()
    store = tmp_path / "kv"
    target = target_of(model, store)
    namespace, keys = target.namespace(), target.chunk_keys(TOKENS)
    store_chunks(store, namespace, keys[:1], target.parts())
    config = RemoteTierConfig(url=redis_cluster.url, timeout_seconds=5.0)
    other = dataclasses.replace(namespace, model_id="another/model")
    for where, chunk_keys in ((namespace, keys[1:3]), (other, keys[3:])):
        with RemoteTier(config, where.fingerprint(), Part(0, 1), where.chunk_bytes) as tier:
            tier.put_many([(key, os.urandom(where.chunk_bytes)) for key in chunk_keys])
    raw = ClusterClient.from_url(redis_cluster.url)
    name = redis_key(b"tierkv:", namespace.fingerprint(), Part(0, 1), keys[2])
    value = bytearray(raw.get(name))
    value[-10] ^= 0x5A
    raw.set(name, bytes(value))
    raw.close()
    code, report = why_miss(model, store, "--remote", redis_cluster.url, capsys=capsys)
    chunks = report["chunks"]
    assert code == 1 and [c["verdict"] for c in chunks] == ["hit-disk", "hit-remote", "damaged",
                                                            "other-namespace"]
    assert "remote tier" in chunks[2]["detail"] and chunks[3]["dimensions"] == ["namespace"]
    assert other.fingerprint()[:8] in chunks[3]["detail"] and report["served_chunks"] == 2
    code, report = why_miss(model, store, capsys=capsys)  # without --remote: disk only
    assert [c["verdict"] for c in report["chunks"]] == ["hit-disk"] + ["not-stored"] * 3
