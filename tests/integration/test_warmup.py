"""Warm-up: HF forward -> chunks in the store -> hits in the real vLLM 0.33 Scheduler.

A tiny Llama with random weights and a character-level tokenizer is saved to a directory
(no downloads). ``tierkv warmup`` runs through ``tierkv.cli.main``; then vLLM's own
Scheduler with tierkv's connector over the same store (``vllm_harness``) gets the prompts
as new requests. Each must hit every full chunk, and the KV slots the worker loaded must
hold exactly the bytes of HF's K and V for those positions. Keys come from a hasher of our
own, cross-checked here against vLLM's ``get_request_block_hasher`` for every algorithm.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers", reason="warm-up needs transformers")
pytest.importorskip("vllm", reason="the warm-up's vLLM checks need vllm installed")

from . import vllm_harness as harness_lib

from vllm.config import KVTransferConfig
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

from tierkv.cli import main
from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore, build_namespace
from tierkv.integrations.vllm_keys import chunk_keys_from_block_hashes
from tierkv.keys import chunk_keys
from tierkv.tiers.disk.tier import list_namespaces
from tierkv.tiers.disk.tools import inspect_store, verify_store
from tierkv.transfer.layout import KVLayout
from tierkv.integrations.vllm_warmup import VllmTarget, vllm_block_hashes
from tierkv.tiny_models import ALPHABET, save_char_tokenizer
from tierkv.warmup import gather_chunks, warmup_tokens

TPC = 32  # tokens per chunk: 2 vLLM blocks of 16
SALT = "tenant-a"


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama (2 layers, 4 query heads over 2 KV heads of 8, float16) and a char tokenizer
    whose shapes match the harness's KV cache config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_hidden_layers=2, intermediate_size=64, vocab_size=1000,
                         max_position_embeddings=4096, dtype="float16")
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float16).save_pretrained(directory)
    return save_char_tokenizer(directory, ALPHABET)


def _tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(count)]


TEXT = ("the quick brown fox jumps over the lazy dog, " * 2)[:80]  # 80 characters = 80 tokens
SHARED = _tokens(1, 100)
PROMPTS: list[dict[str, Any]] = [
    {"text": TEXT},                                      # 2 full chunks (80 tokens)
    {"token_ids": SHARED},                               # 3 full chunks
    {"token_ids": SHARED[:64] + _tokens(2, 40)},         # shares 2 chunks, 1 new
    {"token_ids": _tokens(3, 70), "cache_salt": SALT},   # 2 full chunks, salted keys
]
NUM_CHUNKS = 2 + 3 + 1 + 2


def write_prompts(path: Path, prompts: list[dict[str, Any]] | list[str]) -> Path:
    path.write_text("".join((p if isinstance(p, str) else json.dumps(p)) + "\n" for p in prompts))
    return path


def warmup_args(model: Path, prompts: Path, store: Path, *extra: str) -> list[str]:
    # The harness's vLLM: a checkout with .venv-engine beside it would warm for that one.
    import vllm

    return ["warmup", "--model", str(model), "--prompts", str(prompts), "--store", str(store),
            "--tokens-per-chunk", str(TPC), "--disk-bytes", "64MiB", "--device", "cpu",
            "--no-progress", "--vllm-version", vllm.__version__, *extra]


def tierkv_transfer_config(store: Path) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="TierKVConnector", kv_connector_module_path="tierkv.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"cpu_bytes": 8 << 20, "tokens_per_chunk": TPC,
                                   "disk_path": str(store), "disk_bytes": 64 << 20,
                                   "load_policy": "always"})  # a simulated forward


def token_ids_of(model: Path, prompt: dict[str, Any]) -> list[int]:
    if "token_ids" in prompt:
        return list(prompt["token_ids"])
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model)(prompt["text"])["input_ids"])


def reference_kv(model_dir: Path, sequences: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence, HF's K and V ``[L, H, S, D]`` over its full chunks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16).eval()
    out = []
    with torch.inference_mode():
        for tokens in sequences:
            full = len(tokens) // TPC * TPC
            cache = model.base_model(input_ids=torch.tensor([tokens[:full]]), use_cache=True).past_key_values
            out.append((torch.stack([layer.keys[0] for layer in cache.layers]),
                        torch.stack([layer.values[0] for layer in cache.layers])))
    return out


# ------------------------------------------------------------------------------ keys
@pytest.mark.parametrize("algorithm,seed", [("sha256", None), ("sha256_cbor", None), ("sha256", "0"),
                                            ("xxhash", "1234"), ("xxhash_cbor", "7")])
def test_block_hashes_and_keys_match_vllm(algorithm: str, seed: str | None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = _tokens(4, 83)
    hash_fn = get_hash_fn_by_name(algorithm)
    try:
        if seed is None:
            monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        else:
            monkeypatch.setenv("PYTHONHASHSEED", seed)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(16, hash_fn)
        for salt in (None, SALT):
            request = harness_lib.make_request("r", tokens, 1, hasher, cache_salt=salt)
            ours = vllm_block_hashes(tokens, 16, algorithm, seed, salt)
            assert ours == list(request.block_hashes) and len(ours) == 5
            target = VllmTarget("m", 2, 2, 8, tokens_per_chunk=TPC, hash_algo=algorithm, hash_seed=seed)
            assert target.chunk_keys(tokens, salt) == chunk_keys_from_block_hashes(request.block_hashes, 2)
    finally:
        monkeypatch.undo()
        init_none_hash(get_hash_fn_by_name("sha256"))


@pytest.mark.parametrize("layout,algorithm,seed", [("LBNHC", "sha256", None), ("BLHNC", "sha256_cbor", "3")])
def test_namespace_equals_the_connectors(layout: str, algorithm: str, seed: str | None, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if seed is not None:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    model_dir = harness_lib.write_tiny_llama(tmp_path / "model", harness_lib.HarnessConfig())
    cfg = harness_lib.HarnessConfig(kv_cache_layout=layout, prefix_caching_hash_algo=algorithm,
                                    num_gpu_blocks=8, create_worker_connector=False,
                                    kv_transfer_config=tierkv_transfer_config(tmp_path / "store"))
    connector: Any = harness_lib.build_harness(cfg, model_dir=model_dir).scheduler_connector
    target = VllmTarget(str(model_dir), 2, 2, 8, tokens_per_chunk=TPC, kv_cache_layout=layout,
                        hash_algo=algorithm, hash_seed=seed, disk_bytes=64 << 20)
    assert target.namespace() == connector.namespace
    assert target.geometry().chunk_bytes == connector.geometry.chunk_bytes
    assert target.disk_capacity == connector.geometry.disk_capacity
    connector.shutdown()
    init_none_hash(get_hash_fn_by_name("sha256"))


def test_tensor_parallel_ranks_get_their_heads() -> None:
    """Part p's pages are a TP-1 engine's pages over the KV heads of part p: contiguous
    runs; with fewer heads than ranks, one part per head (ranks holding a head share it)."""
    keys = [torch.randn(4, 2 * TPC, 8).half() for _ in range(2)]
    values = [torch.randn(4, 2 * TPC, 8).half() for _ in range(2)]
    for layout in ("LBNHC", "LBHNC"):
        split = VllmTarget("m", 2, 4, 8, tokens_per_chunk=TPC, kv_cache_layout=layout,
                           tensor_parallel_size=2).pack(keys, values)
        single = VllmTarget("m", 2, 2, 8, tokens_per_chunk=TPC, kv_cache_layout=layout)
        for rank, heads in enumerate((slice(0, 2), slice(2, 4))):
            want = single.pack([k[heads] for k in keys], [v[heads] for v in values])[0]
            assert torch.equal(split[rank], want) and split[rank].shape == (2, single.chunk_bytes)
        replicated = VllmTarget("m", 2, 4, 8, tokens_per_chunk=TPC, kv_cache_layout=layout,
                                tensor_parallel_size=8).pack(keys, values)
        one_head = VllmTarget("m", 2, 1, 8, tokens_per_chunk=TPC, kv_cache_layout=layout)
        assert len(replicated) == 4
        for part in range(4):
            head = slice(part, part + 1)
            assert torch.equal(replicated[part], one_head.pack([k[head] for k in keys],
                                                               [v[head] for v in values])[0])


# ------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC"])
def test_warmed_prompts_hit_in_vllm_with_hf_bytes(layout: str, tiny_model: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    store = tmp_path / "store"
    assert main(warmup_args(model_dir, prompts, store, "--kv-cache-layout", layout, "--verify")) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith(f"warmed {NUM_CHUNKS} chunks (")
    assert "verified 8 chunks: clean" in out
    # A rerun resumes: every chunk is present, nothing is computed or written.
    assert main(warmup_args(model_dir, prompts, store, "--kv-cache-layout", layout)) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("warmed 0 chunks (0 B) in ") and f"({NUM_CHUNKS + 2} already present" in last
    (warmed,) = list_namespaces(store)

    sequences = [token_ids_of(model_dir, prompt) for prompt in PROMPTS]
    expected_kv = reference_kv(model_dir, sequences)
    cfg = harness_lib.HarnessConfig(enable_prefix_caching=False, kv_cache_layout=layout, num_gpu_blocks=48,
                                    max_num_batched_tokens=64, kv_transfer_config=tierkv_transfer_config(store))
    # vLLM serves the directory the warm-up read, config included (the harness would write
    # a config of its own there: another model, whose fingerprint differs).
    monkeypatch.setattr(harness_lib, "write_tiny_llama", lambda directory, _: directory)
    harness = harness_lib.build_harness(cfg, model_dir=model_dir, check=False)
    connector: Any = harness.scheduler_connector
    assert connector.namespace.fingerprint() == warmed.fingerprint
    assert connector.namespace.model_fingerprint.startswith("auto:")
    assert connector._scheduler.found_on_disk == NUM_CHUNKS

    external: dict[str, int] = {}
    loaded: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    original = connector.update_state_after_alloc

    def spy(request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens:
            external[request.request_id] = num_external_tokens
        original(request, blocks, num_external_tokens)

    def capture(engine: harness_lib.HarnessEngine, so: Any) -> None:
        record = engine.records[-1]
        for req_id, start in record.computed_before.items():
            if start and req_id in external and req_id not in loaded:  # its load landed
                block_ids = engine.runner.requests[req_id].block_ids
                positions = torch.arange(start)
                blocks = torch.tensor(block_ids)[positions // 16]
                slots = [engine.runner.kv_caches[name][blocks, :, positions % 16, :] for name in cfg.layer_names]
                loaded[req_id] = [(s[..., :8].transpose(0, 1), s[..., 8:].transpose(0, 1)) for s in slots]

    connector.update_state_after_alloc = spy
    engine = harness_lib.HarnessEngine(harness)
    engine.after_execute = capture
    specs = [harness_lib.RequestSpec(f"p{index}", tokens, max_tokens=2,
                                     cache_salt=PROMPTS[index].get("cache_salt"))
             for index, tokens in enumerate(sequences)]
    engine.run(harness_lib.StaticWorkload(specs))
    # Every full chunk is an external hit (vLLM leaves the last token to compute).
    assert external == {f"p{i}": (len(tokens) - 1) // TPC * TPC for i, tokens in enumerate(sequences)}
    stats = connector._scheduler.statistics()  # each warmed chunk came from disk once
    assert stats["hit_tokens_disk"] == NUM_CHUNKS * TPC
    assert stats["hit_tokens_disk"] + stats["hit_tokens_cpu"] == sum(external.values())
    # The worker loaded exactly HF's K and V bytes, chunk by chunk. A chunk shared by two
    # prompts was written from the first prompt's forward (p2's first chunks are p1's).
    source = {0: 0, 1: 1, 2: 1, 3: 3}
    for index in range(len(sequences)):
        got = loaded[f"p{index}"]
        for layer, (keys, values) in enumerate(got):
            upto = keys.shape[1]
            for chunk in range(upto // TPC):
                ref = source[index] if chunk < 2 else index
                want_k, want_v = expected_kv[ref][0][layer], expected_kv[ref][1][layer]
                span = slice(chunk * TPC, (chunk + 1) * TPC)
                assert torch.equal(keys[:, span].view(torch.int16), want_k[:, span].view(torch.int16))
                assert torch.equal(values[:, span].view(torch.int16), want_v[:, span].view(torch.int16))
    harness.worker_connector.shutdown()  # type: ignore[union-attr]
    harness.scheduler.shutdown()


# ------------------------------------------------------------------------------ custom engines
def test_the_warmup_writes_for_the_engine_venvs_vllm_and_a_server_of_another_says_what_to_do(
        tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Regression: a warm-up from `make demo`'s venv (vLLM 0.33) keyed its chunks for 0.33,
    the CPU server of .venv-engine (0.32) never hit them, and neither said which vLLM each
    used nor what to run instead."""
    import logging
    import re

    import vllm

    engine_vllm = tmp_path / ".venv-engine" / "lib" / "python3.11" / "site-packages" / "vllm"
    engine_vllm.mkdir(parents=True)
    (engine_vllm / "_version.py").write_text("__version__ = version = '0.32.0'\n")
    monkeypatch.chdir(tmp_path)  # the engine venv beside the working directory
    model_dir = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[1:2])
    store = tmp_path / "store"
    args = warmup_args(model_dir, prompts, store)
    at = args.index("--vllm-version")
    del args[at:at + 2]  # the default
    assert main(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"writing namespace [0-9a-f]{8} for vLLM 0\.32 \(0\.32\.0, from the "
                     r"engine venv \S*\.venv-engine", out), out
    (warmed,) = list_namespaces(store)
    assert warmed.description["extra"] == "vllm-0.32" and warmed.fingerprint[:8] in out
    # A server of this venv's vLLM over that store names the differing dimension and the fix.
    cfg = harness_lib.HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48,
                                    max_num_batched_tokens=64,
                                    kv_transfer_config=tierkv_transfer_config(store))
    monkeypatch.setattr(harness_lib, "write_tiny_llama", lambda directory, _: directory)
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        harness = harness_lib.build_harness(cfg, model_dir=model_dir, check=False)
    from tierkv.integrations.vllm_versions import chunks_minor

    minor = chunks_minor(vllm.__version__)  # 0.34 keeps 0.33's chunks (RELEASES' chunks_of)
    line = next(r.getMessage() for r in caplog.records if "0 chunks found" in r.getMessage())
    assert (f"extra is 'vllm-0.32' there, 'vllm-{minor}' here (the vLLM minor version: vLLM "
            f"{minor} never reads chunks written for vLLM 0.32; warm up for the serving vLLM "
            f"with `tierkv warmup --vllm-version <its version>`") in line, line
    harness.worker_connector.shutdown()  # type: ignore[union-attr]
    harness.scheduler.shutdown()


def test_warmup_tokens_for_a_custom_engine(tmp_path: Path) -> None:
    """Warm a library store through a caller's KV producer; TierKVStore then loads it."""
    blocks_per_chunk, block = 2, 16
    config = StoreConfig(blocks_per_chunk=blocks_per_chunk, cpu=CpuTierConfig(max_bytes=1 << 20),
                         disk=DiskTierConfig(path=tmp_path, max_bytes=64 << 20), device="cpu")
    shape = (2, block, 8)  # the engine's page: [H, N, D]

    def page(token: int, position: int) -> torch.Tensor:  # KV of one token (any function of the prefix)
        return torch.full((2, 8), float(token % 97 + position % 5), dtype=torch.float16)

    scratch = [torch.zeros((16, *shape), dtype=torch.float16) for _ in range(2)]
    scratch_layout = KVLayout.from_tensors(scratch)

    def producer(prefix: list[int]) -> torch.Tensor:
        for position, token in enumerate(prefix):  # "prefill" into the scratch blocks 0..n-1
            for layer in scratch:
                layer[position // block, :, position % block] = page(token, position)
        num_chunks = len(prefix) // (block * blocks_per_chunk)
        ids = [[c * blocks_per_chunk + j for j in range(blocks_per_chunk)] for c in range(num_chunks)]
        return gather_chunks(scratch_layout, blocks_per_chunk, ids)

    sequences = [_tokens(10, 75), _tokens(10, 64) + _tokens(11, 40), _tokens(12, 20)]
    namespace = build_namespace(scratch_layout, "my-engine", block, config)
    chunk_bytes = scratch_layout.chunk_bytes(blocks_per_chunk)
    report = warmup_tokens(tmp_path, namespace, sequences, producer, chunk_bytes=chunk_bytes)
    assert (report.chunks_written, report.chunks_present, report.prompts_short) == (3, 2, 1)
    again = warmup_tokens(tmp_path, namespace, iter(sequences), producer, chunk_bytes=chunk_bytes)
    assert (again.chunks_written, again.chunks_present) == (0, 5)
    assert again.summary().startswith("warmed 0 chunks (0 B) in ")

    kv = [torch.zeros((32, *shape), dtype=torch.float16) for _ in range(2)]
    with TierKVStore(kv, model_id="my-engine", tokens_per_block=block, config=config) as store:
        assert store.namespace == namespace
        tokens = sequences[1]
        keys = chunk_keys(tokens, store.tokens_per_chunk)
        assert store.lookup(keys) == 3
        block_ids = [[20 + 2 * c, 21 + 2 * c] for c in range(3)]
        handle = store.load(keys, block_ids)
        store.wait([handle.job_id])
        assert handle.num_from_disk == 3
        for position in range(96):
            block_id = block_ids[position // 32][(position % 32) // block]
            for layer in kv:
                assert torch.equal(layer[block_id, :, position % block], page(tokens[position], position))


# ------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def warm_store(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("warm")
    prompts = write_prompts(base / "prompts.jsonl", PROMPTS[1:2])
    assert main(warmup_args(tiny_model, prompts, base / "store")) == 0
    return base / "store"


def _chunks(store: Path) -> dict[str, int]:
    return {report.fingerprint: sum(rank.chunks for rank in report.ranks) for report in inspect_store(store)}


ok = json.dumps({"token_ids": SHARED})
BAD_INPUTS = {
    "malformed-json": ([ok, ok, '{"token_ids": [1, 2,'], (), ["line 3", "not valid JSON"]),
    "empty-file": ([], (), ["holds no prompts"]),
    "blank-lines": (["", "  "], (), ["holds no prompts"]),
    "no-text-or-ids": ([ok, json.dumps({"prompt": "hi"})], (), ["line 2", '"text" or "token_ids"']),
    "token-out-of-vocab": ([json.dumps({"token_ids": [1, 5000]})], (), ["line 1", "token id 5000", "[0, 1000)"]),
    "all-short": ([json.dumps({"token_ids": [1, 2, 3]}), json.dumps({"text": "abc"})], (),
                  ["nothing to warm", "shorter than one chunk of 32 tokens", "--tokens-per-chunk"]),
    "wrong-model-dir": ([ok], ("--model", "/nonexistent/model"), ["--model /nonexistent/model", "config.json"]),
    "other-namespace": ([ok], ("--tokens-per-chunk", "48"),
                        ["holds namespace", "tokens_per_chunk is 32 there, 48 here", "--tokens-per-chunk",
                         "--allow-new-namespace"]),
    # A hub id vLLM serves is named by its snapshot's commit, which this hub cache lacks.
    "other-model-id": ([ok], ("--model-id", "org/other"), ["hub model 'org/other'", "--model-id",
                                                           "snapshots/<commit>"]),
    "unstable-hash": ([ok], ("--hash-algo", "xxhash", "--hash-seed", "unset"), ["--hash-seed", "PYTHONHASHSEED"]),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_names_the_line_or_setting_and_leaves_the_store(
        case: str, tiny_model: Path, warm_store: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    lines, options, messages = BAD_INPUTS[case]
    store = Path(shutil.copytree(warm_store, tmp_path / "store"))
    before = _chunks(store)
    prompts = write_prompts(tmp_path / "prompts.jsonl", lines)
    args = warmup_args(tiny_model, prompts, store)
    for option, value in zip(options[::2], options[1::2]):
        if option in args:
            args[args.index(option) + 1] = value
        else:
            args += [option, value]
    assert main(args) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after any warnings
    assert err.startswith("tierkv warmup: error: ")
    for message in messages:
        assert message in err
    assert _chunks(store) == before
    assert verify_store(store).clean


def test_short_prompts_are_skipped_with_a_warning(tiny_model: Path, warm_store: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    store = Path(shutil.copytree(warm_store, tmp_path / "store"))
    prompts = write_prompts(tmp_path / "prompts.jsonl", [json.dumps({"token_ids": [5] * 7}), "", ok])
    assert main(warmup_args(tiny_model, prompts, store)) == 0
    captured = capsys.readouterr()
    assert "line 1: 7 tokens, shorter than one chunk of 32 tokens" in captured.err
    assert captured.out.splitlines()[-1].startswith("warmed 0 chunks (0 B) in ")
    assert "(3 already present, 1 prompt(s) shorter than a chunk)" in captured.out
    # A new namespace beside the old one, when asked for.
    assert main(warmup_args(tiny_model, prompts, store, "--allow-new-namespace", "--dtype", "bfloat16")) == 0
    assert sorted(_chunks(store).values()) == [3, 3]


def test_store_full_stops_with_exit_1(tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[1:3])
    args = warmup_args(tiny_model, prompts, tmp_path / "store")
    args[args.index("--disk-bytes") + 1] = str(2 * (4096 + 8192))  # room for 2 chunks
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "stopped: the store reached its capacity of 2 chunks; raise --disk-bytes" in captured.err
    assert captured.out.splitlines()[-1].startswith("warmed 2 chunks (8.00 KiB)")
    assert verify_store(tmp_path / "store").clean


def test_a_store_held_by_a_running_worker_is_refused(tiny_model: Path, warm_store: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import fcntl
    import os

    from tierkv.tiers.disk.files import OWNER_FILE

    store = Path(shutil.copytree(warm_store, tmp_path / "store"))
    (namespace,) = list_namespaces(store)
    fd = os.open(namespace.path / "part-0of1" / "shard-0" / OWNER_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a connector worker holds it
    try:
        prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[2:3])  # one chunk to write
        assert main(warmup_args(tiny_model, prompts, store)) == 2
        assert "in use by a running tierkv worker" in capsys.readouterr().err
        assert _chunks(store) == {namespace.fingerprint: 3}
    finally:
        os.close(fd)
    assert main(warmup_args(tiny_model, prompts, store)) == 0  # released: it writes
    assert _chunks(store) == {namespace.fingerprint: 4}


def test_the_writer_fills_each_write_transaction(tmp_path: Path) -> None:
    # 3 chunks of 12 KiB per 32 KiB batch (not a multiple): the writer once queued until the
    # bytes reached the batch (3 chunks) and then wrote them as 2 + 1, so 6 chunks took
    # 4 transactions; put_in_batches' own split (2 per txn) gives 3.
    from tierkv.keys import Namespace
    from tierkv.warmup import ChunkWriter

    chunk = 12 << 10
    namespace = Namespace(model_id="txns", dtype="float16", kv_layout="NHD", page_bytes=chunk,
                          tokens_per_chunk=16)
    config = DiskTierConfig(write_batch_bytes=32 << 10)
    with ChunkWriter(tmp_path / "kv", namespace, chunk, disk_config=config) as writer:
        [tier] = writer.tiers
        batches: list[int] = []
        put_many = tier.put_many
        tier.put_many = lambda items, deletes=(): (  # type: ignore[method-assign]
            batches.append(len(items)) or put_many(items, deletes))
        for index in range(6):
            assert writer.add(bytes([index + 1]) * 32, [bytes([index]) * chunk])
        writer.flush()
        assert batches == [2, 2, 2] and tier.statistics().puts == 6
