"""docs/on-disk-format.md's table of what a namespace and a key bind is a contract: every
row has a test that flips that dimension and must see a miss. This holds the table to the
tests, without importing them (they need vLLM): each row's id is a test id of the library
or the vLLM table test, and every id those tests flip is a row."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = [ROOT / "tests" / "integration" / name for name in (
    "test_namespace_table_library.py", "test_namespace_table_vllm.py",
    "test_model_fingerprint.py")]


def table_rows() -> list[str]:
    text = (ROOT / "docs" / "on-disk-format.md").read_text()
    section = text.split("## What a namespace and a key bind", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z0-9-]+)` \|", section, flags=re.MULTILINE)


def named_ids(path: Path) -> set[str]:
    """The row ids a table test flips: its ROWS (a dict or a sequence of ids)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "ROWS" for target in node.targets):
            value = node.value
            items = value.keys if isinstance(value, ast.Dict) else getattr(value, "elts", [])
            return {item.value for item in items
                    if isinstance(item, ast.Constant) and isinstance(item.value, str)}
    raise AssertionError(f"{path.name} names no ROWS")


def test_every_row_of_the_table_has_a_test_and_every_test_a_row() -> None:
    rows = table_rows()
    assert len(rows) >= 25 and len(set(rows)) == len(rows)
    tested = set().union(*(named_ids(path) for path in TESTS))
    assert sorted(set(rows) - tested) == []  # a row no test flips
    assert sorted(tested - set(rows)) == []  # a test of a row the table lacks
