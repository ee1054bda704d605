"""The weights are part of the key, on a real engine: a checkpoint saved over the old one
in the same directory, or a LoRA adapter saved over another under the same name and path,
gets none of the old KV after a restart over the same disk, and the engine's tokens are
those of vLLM alone with the new weights (tierkv.model_identity)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.engine.conftest import References
from tests.engine.engines import Engine, Output, assert_distinct, compare, prompt


def test_a_checkpoint_saved_over_the_old_one_gets_none_of_its_kv(
        models: dict[str, Path], reference: References, logprob_tolerance: float,
        tmp_path: Path) -> None:
    from tierkv.tiny_models import build_model

    tokens = [prompt(1024, seed=40 + index) for index in range(3)]
    model = tmp_path / "model"
    shutil.copytree(models["llama"], model)
    settings = {"cpu_bytes": 64 << 20, "disk_path": str(tmp_path / "kv")}
    with Engine(model, tierkv=settings) as engine:
        engine.generate(tokens)
        engine.settle()
    tuned = build_model("llama", tmp_path / "tuned", seed=1)  # a fine-tune: same config
    shutil.copyfile(tuned / "model.safetensors", model / "model.safetensors")
    with Engine(tuned) as alone:
        expected = alone.generate(tokens)
    old = reference("llama", tokens)
    for new, was in zip(expected, old):  # old KV would give other tokens: the check can see it
        assert_distinct(new, was, logprob_tolerance, "the two checkpoints")
    with Engine(model, tierkv=settings) as engine:
        assert engine.connector._scheduler_side().found_on_disk == 0
        outputs = engine.generate(tokens)
        assert [output.num_cached_tokens for output in outputs] == [0, 0, 0]
        figures = engine.figures()
        assert figures["hit_tokens_disk"] == figures["hit_tokens_cpu"] == 0
        for output, ref in zip(outputs, expected):
            compare(output, ref, logprob_tolerance, "new weights after a restart")


def write_adapter(folder: Path, seed: int, hidden: int = 256, q_out: int = 256,
                  v_out: int = 128, layers: int = 4, rank: int = 8) -> Path:
    """A PEFT LoRA adapter of rank ``rank`` on q_proj and v_proj of the tiny llama, with
    random A and B (B is not zero, so the adapter changes the KV)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "tiny-llama"}))
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for layer in range(layers):
        for name, out in (("q_proj", q_out), ("v_proj", v_out)):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.3
            tensors[f"{stem}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.3
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


LORA_ARGS = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1}


def generate_with(engine: Engine, prompts: list[list[int]], lora: Any) -> list[Output]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, detokenize=False,
                            ignore_eos=True)
    outputs = engine.llm.generate([TokensPrompt(prompt_token_ids=list(tokens))
                                   for tokens in prompts], params, use_tqdm=False,
                                  lora_request=lora)
    return [Output.of(output) for output in outputs]


def test_a_lora_adapter_saved_over_another_gets_none_of_its_kv(
        models: dict[str, Path], logprob_tolerance: float, tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    tokens = [prompt(700, seed=50)]
    adapter = write_adapter(tmp_path / "adapter", seed=0)
    lora = LoRARequest("tenant", 1, str(adapter))
    settings = {"cpu_bytes": 64 << 20, "disk_path": str(tmp_path / "kv")}
    with Engine(models["llama"], tierkv=settings, **LORA_ARGS) as engine:
        first = generate_with(engine, tokens, lora)
        engine.settle()
    with Engine(models["llama"], tierkv=settings, **LORA_ARGS) as engine:  # unchanged: hits
        hit = generate_with(engine, tokens, lora)
        assert hit[0].num_cached_tokens > 0
        compare(hit[0], first[0], logprob_tolerance, "the same adapter after a restart")
    write_adapter(adapter, seed=1)  # another adapter saved under the same name and path
    with Engine(models["llama"], **LORA_ARGS) as alone:
        expected = generate_with(alone, tokens, LoRARequest("tenant", 1, str(adapter)))
    assert_distinct(expected[0], first[0], logprob_tolerance, "the two adapters")
    with Engine(models["llama"], tierkv=settings, **LORA_ARGS) as engine:
        outputs = generate_with(engine, tokens, LoRARequest("tenant", 1, str(adapter)))
        assert outputs[0].num_cached_tokens == 0
        assert engine.figures()["hit_tokens_disk"] == 0
        compare(outputs[0], expected[0], logprob_tolerance, "the new adapter after a restart")
