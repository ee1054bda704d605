"""Tiny random-weight language models, built locally from configs (no download), that a
real vLLM engine runs on CPU: for ``tests/engine/``, ``scripts/bench_ttft.py`` and
``make demo-vllm``.

- :data:`MODELS` name -> :class:`TinyModel` (its Hugging Face config, and what it shows).
- :func:`build_model` writes ``config.json`` and ``model.safetensors`` into a directory
  (once: an existing build of the same spec is kept) and returns the directory.
- :func:`save_char_tokenizer` writes a character-level tokenizer (one token per character
  of an alphabet, ``[UNK]`` = 0) beside a model, for prompts given as text.

The weights are random, so the tokens mean nothing; what matters is that greedy outputs
depend on every prompt token (``initializer_range`` is large enough that changing one early
token changes the output), so an engine that loaded wrong KV gives other tokens. Needs torch
and transformers (the ``warmup`` extra); vLLM is not imported.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierkv.extras import needs

VOCAB_SIZE = 4096
MAX_POSITIONS = 4096


@dataclass(frozen=True)
class TinyModel:
    """One model: its transformers config class and settings."""

    name: str
    config_class: str  # a class of transformers, e.g. "LlamaConfig"
    model_class: str  # e.g. "LlamaForCausalLM"
    settings: dict[str, Any] = field(default_factory=dict)
    what: str = ""

    def fingerprint(self) -> str:
        spec = json.dumps([self.config_class, self.model_class, self.settings], sort_keys=True)
        return hashlib.sha256(spec.encode()).hexdigest()[:12]


_COMMON = {"vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_POSITIONS,
           "initializer_range": 0.3, "tie_word_embeddings": False}

MODELS: dict[str, TinyModel] = {
    "llama": TinyModel(
        "llama", "LlamaConfig", "LlamaForCausalLM",
        {**_COMMON, "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "num_key_value_heads": 2},
        "full attention, 4 layers, 2 KV heads of 64"),
    "qwen2": TinyModel(
        "qwen2", "Qwen2Config", "Qwen2ForCausalLM",
        {**_COMMON, "num_hidden_layers": 3, "hidden_size": 192, "intermediate_size": 384,
         "num_attention_heads": 6, "num_key_value_heads": 3},
        "full attention, 3 layers, 3 KV heads of 32, QKV bias"),
    "gemma3": TinyModel(
        "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
        {**_COMMON, "num_hidden_layers": 4, "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 2},
        "hybrid: 2 sliding-window layers (128 tokens) and 2 full-attention layers"),
    # vLLM's CPU MLA kernels compile for a 576-wide latent only (kv_lora_rank 512 + rope 64).
    "deepseek_v2": TinyModel(
        "deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
        {**_COMMON, "num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
         "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 512,
         "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32,
         "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "first_k_dense_replace": 2, "moe_intermediate_size": 128},
        "MLA (DeepSeek-V2 attention), 2 dense layers"),
}


def build_model(name: str, root: str | Path, *, seed: int = 0) -> Path:
    """Write model ``name`` (of :data:`MODELS`) under ``root/<name>-<fingerprint>`` and
    return that directory; a complete earlier build there is reused."""
    spec = MODELS[name]
    folder = Path(root) / f"{name}-{spec.fingerprint()}-s{seed}"
    done = folder / ".complete"
    if done.exists():
        return folder
    with needs("warmup", "building a tiny model"):
        import torch
        import transformers
    config = getattr(transformers, spec.config_class)(**spec.settings)
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_class)(config).to(torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    done.write_text(spec.fingerprint())
    return folder


ALPHABET = "abcdefghijklmnopqrstuvwxyz .,"


def save_char_tokenizer(directory: str | Path, alphabet: str = ALPHABET) -> Path:
    """Save a tokenizer that maps each character of ``alphabet`` to one token id (its
    position + 1; anything else to ``[UNK]``, 0) into ``directory``; returns it."""
    with needs("warmup", "building a tiny tokenizer"):
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{char: index + 1 for index, char in enumerate(alphabet)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast: Any = PreTrainedTokenizerFast  # untyped
    fast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(directory)
    return Path(directory)


__all__ = ["ALPHABET", "MODELS", "TinyModel", "build_model", "save_char_tokenizer"]
