"""The `tierkv` command line. Each command ends with one summary line and exits non-zero
on error. Subcommands import their modules lazily so `tierkv --help` stays fast."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from tierkv.errors import TierKVError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierkv", description="tiered KV-cache store tools")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    from tierkv import demo

    demo_parser = sub.add_parser("demo", help="multi-turn chat workload on CPU tensors")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(handler=demo.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.handler(args)
    except TierKVError as exc:
        print(f"tierkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    raise SystemExit(main())
