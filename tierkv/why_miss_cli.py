"""``tierkv why-miss``: its arguments (the warm-up's settings of the server, a prompt and
its key inputs) and its lines; :mod:`tierkv.why_miss` finds the verdicts.

One line per chunk (index, token range, key, verdict, detail), notes, and a summary line;
``--json`` prints one JSON document instead. Exit codes: 0 every chunk hits (on disk, or on
the remote tier of ``--remote``), 1 at least one does not, 2 error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tierkv.config import RemoteTierConfig, safe_url
from tierkv.errors import ConfigError, TierKVError
from tierkv.model_identity import model_fingerprint
from tierkv.tools import add_remote_arguments
from tierkv.warmup_hf import (DESCRIBE_OPTIONS, HfModel, Prompt, add_target_arguments,
                              build_target, parse_line)
from tierkv.why_miss import KeyInputs, explain

PROMPT_WHERE = {"prompt": "--prompt", "token_ids": "--token-ids", "text": "--text"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", type=Path, required=True,
        help="local HF model directory (the one vLLM serves): its config.json and tokenizer")
    add("--store", type=Path, required=True, help="store root: the connector's disk_path")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="JSON",
                        help='one line of a warm-up prompts file: {"text": ...} or '
                             '{"token_ids": [...]}, with "cache_salt" and '
                             '"add_special_tokens" if it has them')
    prompt.add_argument("--token-ids", metavar="IDS",
                        help="the prompt's token ids: a JSON list or comma-separated")
    prompt.add_argument("--text", help="the prompt's text, tokenized as the warm-up does "
                                       "(--tokenizer, default --model)")
    add_target_arguments(parser)
    add("--salt", help="the request's cache_salt (vLLM's; overrides the --prompt's)")
    add("--lora", metavar="NAME=PATH",
        help="the request's LoRA adapter: vLLM's lora_name and lora_path (its files are "
             "fingerprinted as the connector does)")
    add("--mm", action="append", default=[], metavar="IDENTIFIER:OFFSET:LENGTH",
        help="a multimodal input: vLLM's mm hash (identifier) and its placeholder's first "
             "token and length (repeat for several)")
    add("--data-parallel-index", type=int, default=0,
        help="the engine's data-parallel index (default: %(default)s)")
    add("--pipeline-parallel-size", type=int, default=1,
        help="vLLM's --pipeline-parallel-size (default: %(default)s)")
    add("--remote", metavar="URL",
        help="the connector's remote tier (redis:// or rediss://): looked up where the disk "
             "tier misses")
    add_remote_arguments(parser)
    add("--json", action="store_true", help="print one JSON document instead of the lines")


def _token_ids(text: str) -> list[int]:
    try:
        value = json.loads(text) if text.strip().startswith("[") else \
            [int(part) for part in text.replace(",", " ").split()]
    except ValueError as exc:
        raise ConfigError(f"why-miss: --token-ids {text[:40]!r}: not a JSON list or "
                          f"comma-separated integers ({exc})") from exc
    return [int(token) for token in value]


def _inputs(args: argparse.Namespace, salt: str | None) -> KeyInputs:
    lora, adapter = None, ""
    if args.lora:
        name, sep, path = str(args.lora).partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"why-miss: --lora {args.lora!r}: expected NAME=PATH")
        found = model_fingerprint(path, "auto")
        if found is None:
            raise ConfigError(f"why-miss: --lora {args.lora!r}: the adapter at {path} cannot be "
                              f"fingerprinted, and the connector never serves a request of "
                              f"such an adapter from its tiers")
        lora, adapter = (name, path), found
    images = []
    for text in args.mm:
        ident, *numbers = str(text).rsplit(":", 2)
        if len(numbers) != 2 or not ident or not all(n.isdigit() for n in numbers):
            raise ConfigError(f"why-miss: --mm {text!r}: expected IDENTIFIER:OFFSET:LENGTH")
        images.append((ident, int(numbers[0]), int(numbers[1])))
    return KeyInputs(salt, lora, adapter, tuple(images))


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except TierKVError as exc:  # the CLI prefixes "tierkv why-miss: error: " itself
        text = str(exc)
        for prefix in ("warmup: ", "why-miss: "):
            if text.startswith(prefix):
                raise type(exc)(text.removeprefix(prefix)) from exc
        raise


def _run(args: argparse.Namespace) -> int:
    model = HfModel(args.model, args.tokenizer or args.model, args.dtype, "cpu")
    if args.prompt is not None:
        prompt = parse_line("--prompt", 1, str(args.prompt).encode(), model.vocab_size)
        if prompt is None:
            raise ConfigError("why-miss: --prompt is empty")
    else:
        ids = None if args.token_ids is None else _token_ids(args.token_ids)
        prompt = Prompt(1, args.text, ids, None, True)
    where = next(PROMPT_WHERE[name] for name in PROMPT_WHERE if getattr(args, name) is not None)
    token_ids = model.tokenize(prompt, where)
    inputs = _inputs(args, args.salt or prompt.cache_salt)
    target, _, _ = build_target(args, model)
    remote = None if args.remote is None else RemoteTierConfig(
        url=str(args.remote), key_prefix=args.key_prefix, timeout_seconds=args.timeout)
    report = explain(args.store, target, token_ids, inputs,
                     data_parallel_index=args.data_parallel_index,
                     pipeline_parallel_size=args.pipeline_parallel_size, hints=DESCRIBE_OPTIONS,
                     remote=remote)
    code = 0 if report.chunks and report.served() == len(report.chunks) else 1
    if args.json:
        print(json.dumps(report.as_json()))
        return code
    for chunk in report.chunks:
        print(chunk.line())
    if remote is not None:
        print(f"note: the remote tier {safe_url(remote.url)} (prefix {remote.key_prefix!r}) "
              f"was looked up where the disk tier misses")
    for note in report.notes:
        print(f"note: {note}")
    if not report.chunks:
        print(f"note: the prompt's {len(token_ids)} tokens hold no full chunk of "
              f"{target.chunk_tokens} tokens (--tokens-per-chunk): nothing is stored for it")
    print(report.summary())
    return code
