"""The `tierkv` command line. Each command ends with one summary line and exits non-zero
on error. `tierkv --version` imports nothing else (it works before torch is installed)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tierkv.errors import TierKVError


def _version() -> str:
    from tierkv import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierkv", description="tiered KV-cache store tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    parser.add_argument("--version", action="version", version=f"tierkv {_version()}",
                        help="print tierkv's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    from tierkv import demo, remote_ping, tools, tools_rm, warmup_hf

    demo_parser = sub.add_parser("demo", help="multi-turn chat workload on CPU tensors")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=demo.run)
    warmup_parser = sub.add_parser(
        "warmup", help="compute KV for a prompts file with a HF model and write it into a store",
        description="Compute KV for every prompt of a JSONL file with a HF transformers model and "
                    "write it into the store's disk tier, keyed and laid out as tierkv's vLLM "
                    "connector stores it. Resumable; see docs/warmup.md.")
    warmup_hf.add_arguments(warmup_parser)
    warmup_parser.set_defaults(handler=warmup_hf.run)
    inspect_parser = sub.add_parser("inspect", help="namespaces, chunks, bytes of a store (read-only)")
    tools.add_inspect_arguments(inspect_parser)
    inspect_parser.set_defaults(handler=tools.run_inspect)
    verify_parser = sub.add_parser(
        "verify", help="checksum every chunk of a store; exit 0 clean, 1 bad found, 2 error")
    tools.add_verify_arguments(verify_parser)
    verify_parser.set_defaults(handler=tools.run_verify)
    rm_parser = sub.add_parser(
        "rm", help="delete one namespace of a store; exit 0 deleted (or --dry-run), 1 not "
                   "deleted (no --yes), 2 refused",
        description="Delete the namespace whose fingerprint starts with --namespace PREFIX "
                    "(exactly one must): its ns-<fingerprint> directory with every rank, shard "
                    "and moved-aside leftover, or its keys in a redis:// store. Refused while a "
                    "running engine claims it. Without --yes it only prints what it would "
                    "delete; see docs/warmup.md.")
    tools_rm.add_rm_arguments(rm_parser)
    rm_parser.set_defaults(handler=tools_rm.run_rm)
    ping_parser = sub.add_parser(
        "ping", help="a remote store's nodes, slots, latency, password, chunks and eviction "
                     "policy; exit 0 ready, 1 problems found, 2 cannot connect",
        description="Connect to a redis:// or rediss:// remote tier as an engine would and "
                    "report every node (latency, slots, memory, maxmemory-policy), the slots "
                    "covered, whether the password was accepted, and this prefix's chunks; "
                    "see docs/remote.md.")
    remote_ping.add_arguments(ping_parser)
    ping_parser.set_defaults(handler=remote_ping.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == ["--version"]:  # before the subcommands' modules (torch, lmdb) are imported
        print(f"tierkv {_version()}")
        return 0
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args))
    except TierKVError as exc:
        print(f"tierkv {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
