"""vLLM's block hashes are the same in every supported minor that shares chunks.

A chunk's key derives from vLLM's block hashes (docs/vllm.md, "Chunk keys"), and a
namespace keeps the minor whose chunks it holds (RELEASES' ``chunks_of``): vLLM 0.34
writes and serves 0.33's chunks. That is right only while 0.34 hashes the same tokens
and settings to the same bytes as 0.33 did. The values below were recorded under vLLM
0.33.0 (PYTHONHASHSEED unset); `make test` runs this file under 0.33 (.venv) and 0.34
(.venv-034), so a minor that hashes otherwise fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vllm installed")

import vllm
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from tierkv.integrations.vllm_config import build_namespace
from tierkv.integrations.vllm_versions import RELEASES, chunks_minor, vllm_minor

from . import vllm_harness as harness_lib
from .test_vllm_connector import CHAT, TPC, Run, _Resend, assert_clean, tierkv_config

ROOT = Path(__file__).resolve().parents[2]
# The venv `make test` builds for the other minor that shares chunks (Makefile).
OTHER_VENV = {"0.33": ROOT / ".venv-034", "0.34": ROOT / ".venv"}
# The first server, in the other venv: a two-turn chat written to disk_path; prints the
# token sequences it computed and the chunks it stored.
FIRST_SERVER = """
import json, sys
from pathlib import Path
from tests.integration import vllm_harness as harness_lib
from tests.integration.test_vllm_connector import CHAT, Run, assert_clean
from tests.integration.test_vllm_block_hashes import restart_config
import vllm
run = Run(restart_config(sys.argv[1]), model_dir=Path(sys.argv[2]))
result = run.run(harness_lib.MultiTurnWorkload(**{**CHAT, "num_turns": 2}))
assert_clean(result, run.cfg.vocab_size)
stored = run.side.index.statistics()
run.shutdown()
print(json.dumps({"vllm": vllm.__version__, "stored": stored.stores_planned - stored.stores_failed,
                  "sequences": {req: list(spec.prompt_token_ids) + result.outputs[req]
                                for req, spec in result.prompts.items()}}))
"""

# The last block hash of a 70-token prompt (tokens 7..76, 16-token blocks: 4 hashes, each
# chained to the one before), by hash algorithm and extra keys, under vLLM 0.33.0.
RECORDED_UNDER_033 = {
    ("sha256", "plain"): "6e2e7cb604da9c2bb20b5e5b3f06f2f28e56795cb45ed9d044e43ef067d3aa2a",
    ("sha256", "salt"): "faf49677d402a020dc2a85da09bf6f53ac408c2ed39dfc20a34d1a935bbc28a0",
    ("sha256", "lora"): "ab32728ff1b601d37d2a614718df221f043f5600e12806873a688a987b6b9ae4",
    ("sha256_cbor", "plain"): "2ac6fb04ac4838cf6724755ba747ac5f1a29ae091bf4c0ddefc890cd122b0fb6",
    ("sha256_cbor", "salt"): "d5dfeeeaef50774ba18c6f53f9dcdd193904f1e0e1bc9b4cd228620f54b3811a",
    ("sha256_cbor", "lora"): "c8deae4676653d7d45b636e85e9ca0bd327e4d9397b676a915d30e3a04979c95",
}


@pytest.mark.parametrize(("algo", "extra"), sorted(RECORDED_UNDER_033))
def test_block_hashes_equal_the_ones_recorded_under_033(algo: str, extra: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert chunks_minor(vllm.__version__) == "0.33", "this vLLM does not share 0.33's chunks"
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)  # as EngineCore does, reading PYTHONHASHSEED
    request = Request(
        request_id="r", prompt_token_ids=list(range(7, 77)),
        sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
        cache_salt="s1" if extra == "salt" else None,
        lora_request=LoRARequest("ad", 1, "/tmp/ad") if extra == "lora" else None,
        block_hasher=get_request_block_hasher(16, hash_fn, 0))
    assert len(request.block_hashes) == 4
    assert bytes(request.block_hashes[-1]).hex() == RECORDED_UNDER_033[(algo, extra)]


def test_033_and_034_share_a_namespace_032_does_not(tmp_path: Path) -> None:
    """The namespace of an engine under 0.34 is the one 0.33 gives (their chunks are
    shared); 0.32 keeps its own. Everything but the version is this engine's."""
    assert RELEASES["0.34"].chunks_of == "0.33" and RELEASES["0.32"].chunks_of == "0.32"
    cfg = harness_lib.HarnessConfig(num_gpu_blocks=8,
                                    kv_transfer_config=tierkv_config(disk_path=str(tmp_path)))
    run = Run(cfg)
    connector = run.connector
    own = connector.namespace.fingerprint()
    fingerprint = {version: build_namespace(
        run.harness.vllm_config, connector.geometry, version,
        model_fingerprint=connector.namespace.model_fingerprint).fingerprint()
        for version in ("0.32.0", "0.33.0", "0.33.4", "0.34.0", "0.34.1+cu129")}
    assert own == fingerprint[f"{vllm_minor(vllm.__version__)}.0"]
    assert fingerprint["0.33.0"] == fingerprint["0.33.4"] == fingerprint["0.34.0"] \
        == fingerprint["0.34.1+cu129"] != fingerprint["0.32.0"]
    run.shutdown()


def restart_config(disk_path: str) -> harness_lib.HarnessConfig:
    return harness_lib.HarnessConfig(
        enable_prefix_caching=False, num_gpu_blocks=48, max_num_batched_tokens=64,
        kv_transfer_config=tierkv_config(disk_path=disk_path, disk_bytes=64 << 20))


def test_a_server_upgraded_between_033_and_034_restarts_warm(tmp_path: Path) -> None:
    """The first server runs under the other minor (its venv, in a process of its own), the
    second here over the same disk path: it finds every chunk and serves each sequence's
    chunks from disk, with exact KV."""
    minor = vllm_minor(vllm.__version__)
    python = OTHER_VENV[minor] / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{python.parent.parent.name} is not built (make test builds it)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    disk, model = tmp_path / "disk", tmp_path / "model"  # one model path: the namespace keeps it
    done = subprocess.run([str(python), "-c", FIRST_SERVER, str(disk), str(model)], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout.strip().splitlines()[-1])
    assert vllm_minor(first["vllm"]) != minor and first["stored"] > 0
    second = Run(restart_config(str(disk)), model_dir=model)
    assert second.side.found_on_disk == first["stored"]
    again = second.run(_Resend(first["sequences"]))
    assert_clean(again, second.cfg.vocab_size)
    expected = {f"again-{req}": (len(tokens) - 1) // TPC * TPC
                for req, tokens in first["sequences"].items()}
    assert second.external == expected
    stats = second.side.statistics()
    assert stats["hit_tokens_disk"] > 0
    assert stats["hit_tokens_disk"] + stats["hit_tokens_cpu"] == sum(expected.values())
    second.shutdown()
