#!/usr/bin/env python3
"""`make install-check`: what `make demo` would install, resolved by pip without installing
anything (``pip install --dry-run --ignore-installed --report``), checked for CUDA wheels.

It resolves the requirement files given (default: requirements/runtime.txt, the demo venv's
only one) with the options ``scripts/torch_cpu_index.sh`` gives that pip (PyTorch's CPU
index only where pip cannot find the CPU wheels already), as the Makefile does, and fails
when the resolution holds a CUDA wheel: an ``nvidia-*`` or ``cuda-*`` package, a Linux
torch without ``+cpu`` (PyPI's Linux torch is the CUDA build), or a triton that no file
pins (CUDA torch brings its own). Prints every package it would install, with its source.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT = ("requirements/runtime.txt",)


def pinned(files: Iterable[Path], name: str) -> set[str]:
    """The versions the requirement ``files`` pin ``name`` to."""
    pattern = re.compile(rf"^{re.escape(name)}==([^;#\s]+)", re.I)
    return {match[1] for path in files for line in path.read_text().splitlines()
            if (match := pattern.match(line.strip()))}


def problems(report: Mapping[str, Any], triton_pins: set[str], linux: bool = True) -> list[str]:
    """The CUDA wheels of a ``pip --report`` resolution, one line each."""
    found = []
    for item in report.get("install", []):
        meta = item["metadata"]
        name, version = meta["name"].lower(), meta["version"]
        if name.startswith(("nvidia-", "cuda-")):
            found.append(f"{name} {version}: a CUDA library")
        elif name == "torch" and linux and not version.endswith("+cpu"):
            found.append(f"torch {version}: not the CPU build (PyPI's Linux torch is CUDA's)")
        elif name == "triton" and version not in triton_pins:
            found.append(f"triton {version}: no requirement file pins it (CUDA torch's own)")
    return found


def resolve(pip: str, files: list[str]) -> dict[str, Any]:
    index = subprocess.run(["sh", str(REPO / "scripts" / "torch_cpu_index.sh"), pip],
                           capture_output=True, text=True, check=True, cwd=REPO).stdout.split()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        command = [pip, "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
                   str(out), *index, *(arg for name in files for arg in ("-r", name))]
        print("resolving:", " ".join(command), flush=True)
        subprocess.run(command, check=True, cwd=REPO)
        report: dict[str, Any] = json.loads(out.read_text())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=list(DEFAULT))
    parser.add_argument("--pip", default=str(Path(sys.executable).parent / "pip"),
                        help="the pip to resolve with (default: this Python's)")
    args = parser.parse_args(argv)
    report = resolve(args.pip, args.files)
    for item in report.get("install", []):
        meta = item["metadata"]
        print(f"  {meta['name']} {meta['version']}  {item['download_info']['url'][:80]}")
    found = problems(report, pinned((REPO / name for name in args.files), "triton"),
                     linux=sys.platform == "linux")
    for line in found:
        print(f"CUDA wheel: {line}")
    print(f"install-check: {len(report.get('install', []))} packages, "
          f"{len(found)} CUDA wheel(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
