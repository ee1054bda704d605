"""The command line's own options."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import tierkv
from tierkv.cli import main


def test_version_prints_the_packaged_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
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
