"""The `tierkv` command line. Each command ends with one summary line and exits non-zero
on error.

- Commands are one row each of :data:`COMMANDS` (the module that adds their arguments and
  runs them); a command's module is imported only when that command runs, so
  ``tierkv --help`` and ``tierkv --version`` import nothing heavy (no torch, no lmdb).
- ``-v`` / ``--verbose`` works before or after the command.
- One handler for every command: a tierkv error prints one line
  (``tierkv inspect: error: ...``) and exits 2; a reader that closes the pipe
  (``tierkv inspect --json | head``) ends the command quietly (exit 0); Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tierkv.errors import TierKVError


def _version() -> str:
    from tierkv import __version__

    return __version__


@dataclass(frozen=True)
class Command:
    """One subcommand: ``module.add(parser)`` adds its arguments, ``module.run(args)`` runs it."""

    module: str
    add: str
    run: str
    help: str
    description: str | None = None


COMMANDS: dict[str, Command] = {
    "demo": Command("tierkv.demo", "add_arguments", "run",
                    "multi-turn chat workload on CPU tensors"),
    "warmup": Command(
        "tierkv.warmup_hf", "add_arguments", "run",
        "compute KV for a prompts file with a HF model and write it into a store",
        "Compute KV for every prompt of a JSONL file with a HF transformers model and write "
        "it into the store's disk tier, keyed and laid out as tierkv's vLLM connector stores "
        "it. Resumable; see docs/warmup.md."),
    "inspect": Command("tierkv.tools", "add_inspect_arguments", "run_inspect",
                       "namespaces, chunks, bytes of a store (read-only)"),
    "verify": Command("tierkv.tools", "add_verify_arguments", "run_verify",
                      "checksum every chunk of a store; exit 0 clean, 1 bad found, 2 error"),
    "rm": Command(
        "tierkv.tools", "add_rm_arguments", "run_rm",
        "delete one namespace of a store; exit 0 deleted (or --dry-run), 1 not deleted (no "
        "--yes), 2 refused",
        "Delete the namespace whose fingerprint starts with --namespace PREFIX (exactly one "
        "must): its ns-<fingerprint> directory with every rank, shard and moved-aside "
        "leftover, or its keys in a redis:// store. Refused while a running engine claims "
        "it. Without --yes it only prints what it would delete; see docs/warmup.md."),
    "why-miss": Command(
        "tierkv.why_miss_cli", "add_arguments", "run",
        "for each chunk of one prompt: where it hits, or why it misses; exit 0 all hit, 1 "
        "some miss, 2 error",
        "Given the server's settings (those of tierkv warmup) and a prompt (token ids, or "
        "text through the warm-up's tokenizer), say for each chunk whether the disk tier "
        "holds it, or why not: never stored or evicted, another namespace (naming the "
        "settings that differ), another cache_salt, LoRA adapter or multimodal input, "
        "another data-parallel engine's or a partial chunk, a damaged value. Read-only; see "
        "docs/warmup.md."),
    "ping": Command(
        "tierkv.tools", "add_ping_arguments", "run_ping",
        "a remote store's nodes, slots, latency, password, chunks and eviction policy; exit 0 "
        "ready, 1 problems found, 2 cannot connect",
        "Connect to a redis:// or rediss:// remote tier as an engine would and report every "
        "node (latency, slots, memory, maxmemory-policy), the slots covered, whether the "
        "password was accepted, and this prefix's chunks; see docs/remote.md."),
}


def _verbose_option() -> argparse.ArgumentParser:
    """``-v`` for the top level and every command; a command's copy never resets a ``-v``
    given before it (its default is no value at all)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log at INFO level (before or after the command)")
    return parent


def _chosen(argv: Sequence[str]) -> str | None:
    """The command ``argv`` runs (its first word that names one), before parsing."""
    return next((word for word in argv if word in COMMANDS), None)


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the arguments of ``commands`` only (default: every command's) are added,
    so their modules are imported only then."""
    verbose = _verbose_option()
    parser = argparse.ArgumentParser(prog="tierkv", description="tiered KV-cache store tools",
                                     parents=[verbose])
    parser.add_argument("--version", action="version", version=f"tierkv {_version()}",
                        help="print tierkv's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = COMMANDS if commands is None else commands
    for name, command in COMMANDS.items():
        command_parser = sub.add_parser(name, help=command.help, parents=[verbose],
                                        description=command.description or command.help)
        if name in wanted:
            module = importlib.import_module(command.module)
            getattr(module, command.add)(command_parser)
    return parser


def _quiet_stdout() -> None:
    """After a broken pipe: send what is still buffered to /dev/null, so that flushing it at
    exit raises nothing either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stdout without a file (tests)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # before the subcommands' modules (torch, lmdb) are imported
        print(f"tierkv {_version()}")
        return 0
    name = _chosen(argv)
    command = name or "tierkv"
    try:
        args = build_parser([name] if name else []).parse_args(argv)
        logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False)
                            else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
        run = getattr(importlib.import_module(COMMANDS[args.command].module),
                      COMMANDS[args.command].run)
        code = int(run(args))
        sys.stdout.flush()  # a closed pipe shows here, inside the handler
        return code
    except TierKVError as exc:
        message = " ".join(str(exc).split())
        print(f"tierkv {command}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        _quiet_stdout()
        return 0
    except KeyboardInterrupt:
        print(f"tierkv {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
