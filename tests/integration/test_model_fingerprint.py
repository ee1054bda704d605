"""The weights are part of the key (tierkv.model_identity): a checkpoint changed in place, a
config value that keeps every size, and a LoRA adapter saved over another under the same
name and path are misses after a restart over the same disk, never hits; unchanged, they
hit as before. Through the library API and through the vLLM connector under vLLM's real
Scheduler (the real-engine check is tests/engine/test_weights.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore
from tierkv.errors import ConfigError
from tierkv.keys import chunk_keys

# The rows of docs/on-disk-format.md's table ("What a namespace and a key bind") these
# tests flip, through the library API, the connector, and tests/engine/test_weights.py.
ROWS = ("weights", "config", "lora", "draft-model")

# ------------------------------------------------------------------ the library API
TOKENS_PER_BLOCK, BPC = 16, 2


def write_checkpoint(folder: Path, seed: int, rope_theta: float = 10000.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"rope_theta": rope_theta}))
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=generator)
    (folder / "model.safetensors").write_bytes(data.numpy().tobytes())
    return folder


def _store(root: Path, model: Path | None, mode: str = "auto") -> TierKVStore:
    kv = [torch.zeros((32, 2, TOKENS_PER_BLOCK, 2, 8), dtype=torch.float16) for _ in range(2)]
    config = StoreConfig(blocks_per_chunk=BPC, device="cpu", model_path=model,
                         model_fingerprint=mode,
                         cpu=CpuTierConfig(max_bytes=1 << 20, pin_memory="never"),
                         disk=DiskTierConfig(path=root, max_bytes=64 << 20))
    return TierKVStore(kv, model_id="fp-test", tokens_per_block=TOKENS_PER_BLOCK, config=config)


KEYS = chunk_keys(list(range(4 * TOKENS_PER_BLOCK * BPC)), TOKENS_PER_BLOCK * BPC)


def _write(root: Path, model: Path | None, mode: str = "auto") -> None:
    with _store(root, model, mode) as store:
        store.wait([store.store(KEYS, list(range(len(KEYS) * BPC)))])


def _hits(root: Path, model: Path | None, mode: str = "auto") -> int:
    with _store(root, model, mode) as store:
        return store.lookup(KEYS)


def test_library_weights_saved_over_the_old_ones_are_a_miss(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = write_checkpoint(tmp_path / "model", seed=0)
    _write(tmp_path / "kv", model)
    assert _hits(tmp_path / "kv", model) == len(KEYS)  # unchanged: every chunk hits
    write_checkpoint(model, seed=1)  # a fine-tune saved into the same directory
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        assert _hits(tmp_path / "kv", model) == 0
    warnings = [r.getMessage() for r in caplog.records if "0 chunks found" in r.getMessage()]
    assert len(warnings) == 1 and "model_fingerprint is 'auto:" in warnings[0]


def test_library_config_values_that_keep_every_size_are_a_miss(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model", seed=0)
    _write(tmp_path / "kv", model)
    write_checkpoint(model, seed=0, rope_theta=500000.0)  # RoPE base: same shapes, other KV
    assert _hits(tmp_path / "kv", model) == 0


def test_library_content_mode_follows_bytes_not_mtimes(tmp_path: Path) -> None:
    model = write_checkpoint(tmp_path / "model", seed=0)
    _write(tmp_path / "kv", model, "content")
    write_checkpoint(model, seed=0)  # the same bytes written again: new mtimes
    assert _hits(tmp_path / "kv", model, "content") == len(KEYS)
    assert (tmp_path / "kv" / "model-hashes").is_dir()  # the hashes' cache under disk.path
    write_checkpoint(model, seed=1)
    assert _hits(tmp_path / "kv", model, "content") == 0


def test_library_an_operators_name_of_the_weights(tmp_path: Path) -> None:
    _write(tmp_path / "kv", None, "registry:v1")
    assert _hits(tmp_path / "kv", None, "registry:v1") == len(KEYS)
    assert _hits(tmp_path / "kv", None, "registry:v2") == 0
    with _store(tmp_path / "other", None, "registry:v1") as store:
        assert store.namespace.model_fingerprint == "name:registry:v1"


def test_library_bad_model_settings_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_path='.*absent' cannot be read"):
        _store(tmp_path / "kv", tmp_path / "absent")
    with pytest.raises(ConfigError, match="model_fingerprint must be"):
        StoreConfig(model_fingerprint="")


# ------------------------------------------------------------------ the vLLM connector
vllm = pytest.importorskip("vllm", reason="the vLLM connector tests need vllm installed")

from tests.integration import vllm_harness as harness_lib  # noqa: E402
from tests.integration.test_vllm_connector import (CHAT, Run, assert_clean,  # noqa: E402
                                                   resend_after_restart, tierkv_config)
from tests.integration.vllm_harness import HarnessConfig, RequestSpec  # noqa: E402


def _config(disk: Path) -> HarnessConfig:
    return HarnessConfig(enable_prefix_caching=False, num_gpu_blocks=48,
                         max_num_batched_tokens=64,
                         kv_transfer_config=tierkv_config(disk_path=str(disk)))


def _first_run(cfg: HarnessConfig, model_dir: Path) -> tuple[Run, Any]:
    first = Run(cfg, model_dir=model_dir)
    result = first.run(harness_lib.MultiTurnWorkload(**{**CHAT, "num_turns": 1}))
    assert_clean(result, cfg.vocab_size)
    first.shutdown()
    return first, result


def _add_weights(model_dir: Path, seed: int) -> None:
    """The harness's model has a config only; give it weights (the fake forward ignores
    them, but the fingerprint reads them as the engine would)."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=generator)
    (model_dir / "model.safetensors").write_bytes(data.numpy().tobytes())


def test_vllm_unchanged_weights_hit_after_a_restart(tmp_path: Path) -> None:
    cfg, model_dir = _config(tmp_path / "kv"), tmp_path / "model"
    harness_lib.write_tiny_llama(model_dir, cfg)
    _add_weights(model_dir, seed=0)
    first, result = _first_run(cfg, model_dir)
    second = Run(cfg, model_dir=model_dir)
    assert second.side.namespace.model_fingerprint == first.side.namespace.model_fingerprint
    assert second.side.found_on_disk > 0
    resend_after_restart(first, result, second)
    second.shutdown()


def test_vllm_weights_saved_over_the_old_ones_are_a_miss(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg, model_dir = _config(tmp_path / "kv"), tmp_path / "model"
    harness_lib.write_tiny_llama(model_dir, cfg)
    _add_weights(model_dir, seed=0)
    first, result = _first_run(cfg, model_dir)
    _add_weights(model_dir, seed=1)
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        second = Run(cfg, model_dir=model_dir)
    assert second.side.found_on_disk == 0
    warnings = [r.getMessage() for r in caplog.records if "0 chunks found" in r.getMessage()]
    assert len(warnings) == 1 and "model_fingerprint is 'auto:" in warnings[0]
    _assert_misses(first, result, second)


def test_vllm_config_values_that_keep_every_size_are_a_miss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, model_dir = _config(tmp_path / "kv"), tmp_path / "model"
    first, result = _first_run(cfg, model_dir)
    write = harness_lib.write_tiny_llama

    def with_rope(directory: Path, config: HarnessConfig) -> Path:
        folder = write(directory, config)
        values = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**values, "rope_theta": 500000.0}))
        return folder

    monkeypatch.setattr(harness_lib, "write_tiny_llama", with_rope)
    second = Run(cfg, model_dir=model_dir)
    assert second.side.found_on_disk == 0
    _assert_misses(first, result, second)


def test_vllm_hf_overrides_are_part_of_the_fingerprint(tmp_path: Path) -> None:
    from tierkv.integrations.vllm_config import engine_model_fingerprint

    cfg = _config(tmp_path / "kv")
    vllm_config = harness_lib.build_vllm_config(cfg, harness_lib.write_tiny_llama(
        tmp_path / "model", cfg))
    plain = engine_model_fingerprint(vllm_config)
    vllm_config.model_config.hf_overrides = {"rope_theta": 500000.0}
    assert engine_model_fingerprint(vllm_config) == plain + "+overrides:" + \
        engine_model_fingerprint(vllm_config).split("+overrides:")[1]
    assert "+overrides:" not in plain
    assert engine_model_fingerprint(vllm_config, "registry:v3").startswith("name:registry:v3")


def test_vllm_a_speculative_drafters_weights_are_part_of_the_fingerprint(
        tmp_path: Path) -> None:
    """A drafter's attention layers are stored with the chunk (its KV, its weights): the
    harness cannot run a drafter, so this flips the draft model the namespace reads on
    the real VllmConfig."""
    from types import SimpleNamespace

    from tierkv.integrations.vllm_config import engine_model_fingerprint

    cfg = _config(tmp_path / "kv")
    vllm_config = harness_lib.build_vllm_config(cfg, harness_lib.write_tiny_llama(
        tmp_path / "model", cfg))
    plain = engine_model_fingerprint(vllm_config)
    draft = write_checkpoint(tmp_path / "draft", seed=0)
    vllm_config.speculative_config = SimpleNamespace(
        draft_model_config=SimpleNamespace(model=str(draft), revision=None))
    one = engine_model_fingerprint(vllm_config)
    write_checkpoint(draft, seed=1)  # another drafter saved over it
    other = engine_model_fingerprint(vllm_config)
    assert "+draft:auto:" in one and len({plain, one, other}) == 3


def _assert_misses(first: Run, result: Any, second: Run) -> None:
    """Every sequence of the first run sent again: no external token, no tierkv hit."""
    from tests.integration.test_vllm_connector import _Resend, _sequences

    again = second.run(_Resend(_sequences(first, result)))
    assert_clean(again, second.cfg.vocab_size)
    assert second.external == {}
    stats = second.side.statistics()
    assert stats["hit_tokens_disk"] == stats["hit_tokens_cpu"] == 0
    second.shutdown()


def _adapter(folder: Path, seed: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (256 << 10,), dtype=torch.uint8, generator=generator)
    (folder / "adapter_model.safetensors").write_bytes(data.numpy().tobytes())
    return folder


def _lora_run(cfg: HarnessConfig, model_dir: Path, lora: Any, prompt: list[int]) -> Run:
    run = Run(cfg, model_dir=model_dir)
    result = run.run(harness_lib.StaticWorkload([RequestSpec("r", prompt, 4,
                                                             lora_request=lora)]))
    assert_clean(result, cfg.vocab_size)
    return run


def test_vllm_a_lora_adapter_saved_over_another_under_its_name_is_a_miss(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    cfg, model_dir = _config(tmp_path / "kv"), tmp_path / "model"
    harness_lib.write_tiny_llama(model_dir, cfg)
    adapter = _adapter(tmp_path / "adapter", seed=0)
    lora = LoRARequest("tenant-a", 1, str(adapter))
    prompt = list(range(3, 3 + 4 * 32 + 5))
    _lora_run(cfg, model_dir, lora, prompt).shutdown()
    again = _lora_run(cfg, model_dir, lora, prompt)  # unchanged: its chunks hit
    assert again.external == {"r": 4 * 32}
    again.shutdown()
    _adapter(adapter, seed=1)  # another adapter saved under the same name and path
    changed = _lora_run(cfg, model_dir, lora, prompt)
    assert changed.external == {}
    assert changed.side.statistics()["hit_tokens_disk"] == 0
    changed.shutdown()
    plain = _lora_run(cfg, model_dir, None, prompt)  # the base model never gets LoRA KV
    assert plain.external == {}
    plain.shutdown()


def test_vllm_a_lora_adapter_that_cannot_be_read_is_never_served(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.lora.request import LoRARequest

    cfg, model_dir = _config(tmp_path / "kv"), tmp_path / "model"
    harness_lib.write_tiny_llama(model_dir, cfg)
    lora = LoRARequest("tenant-b", 2, str(tmp_path / "not-here"))
    prompt = list(range(5, 5 + 4 * 32 + 5))
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        _lora_run(cfg, model_dir, lora, prompt).shutdown()
        again = _lora_run(cfg, model_dir, lora, prompt)
    assert again.external == {}
    assert again.side.statistics()["hit_tokens_disk"] == 0
    side = again.side
    request = again.engine.requests["r"]
    assert side.adapter_of(request) != side.adapter_of(request)  # fresh for each request
    assert any("cannot be fingerprinted" in r.getMessage() for r in caplog.records)
    again.shutdown()
