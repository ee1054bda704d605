"""The Python examples in README.md and docs/ run as written (docs stay true)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/engine-adapter.md"]


def examples() -> list[tuple[str, str]]:
    found = []
    for name in DOCS:
        text = (ROOT / name).read_text()
        for number, code in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            found.append((f"{name}#{number}", code))
    return found


@pytest.mark.parametrize("name, code", examples(), ids=[n for n, _ in examples()])
def test_example_runs(name: str, code: str, tmp_path: Path) -> None:
    code = code.replace("/tmp/tierkv-example", str(tmp_path / "store"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{name} failed:\n{result.stderr[-2000:]}"
