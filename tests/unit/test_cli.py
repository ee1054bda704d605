"""The command line's own options."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tierkv
from tierkv.cli import main


def test_version_prints_the_packaged_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tierkv {tierkv.__version__}"
    with pytest.raises(SystemExit) as done:  # with other options too, through argparse
        main(["-v", "--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"tierkv {tierkv.__version__}"
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1) == tierkv.__version__  # type: ignore[union-attr]


def test_every_option_of_every_command_has_help_text() -> None:
    import argparse

    from tierkv.cli import build_parser

    missing: list[str] = []

    def walk(parser: argparse.ArgumentParser, name: str) -> None:
        for action in parser._actions:  # noqa: SLF001 - argparse has no public walk
            if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
                for command, sub in action.choices.items():
                    walk(sub, f"{name} {command}")
            elif not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "tierkv")
    assert missing == []


def test_rm_needs_a_namespace_and_verify_takes_no_progress(capsys: pytest.CaptureFixture[str]) -> None:
    from tierkv.cli import build_parser

    with pytest.raises(SystemExit) as done:
        main(["rm", "/var/cache/tierkv"])  # never "every namespace"
    assert done.value.code == 2
    assert "the following arguments are required: --namespace" in capsys.readouterr().err
    args = build_parser().parse_args(["rm", "/s", "--namespace", "5c1d", "--dry-run"])
    assert (args.namespace, args.dry_run, args.yes) == ("5c1d", True, False)
    args = build_parser().parse_args(["verify", "/s", "--no-progress"])
    assert args.no_progress and not build_parser().parse_args(["verify", "/s"]).no_progress
