"""Without an extra, tierkv still runs, and using the part the extra installs fails with a
tierkv error that names it (``pip install 'tierkv-cache[remote]'``), not a bare
ModuleNotFoundError. Each case runs in a fresh interpreter where the extra's modules are
made unimportable (``sys.modules[name] = None``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRELUDE = "import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"


def run(blocked: tuple[str, ...], code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PRELUDE.format(blocked=blocked) + code],
                          capture_output=True, text=True, timeout=120)


def test_without_the_remote_extra(tmp_path: Path) -> None:
    code = f"""
from tierkv.cli import main
store = {str(tmp_path / "store")!r}
assert main(["demo", "--dir", store, "--conversations", "1", "--turns", "1", "--layers", "1"]) == 0
assert main(["inspect", store]) == 0  # a disk store: no redis needed
assert main(["inspect", "redis://127.0.0.1:1"]) == 2
import torch
from tierkv import StoreConfig, TierKVStore
from tierkv.config import RemoteTierConfig
from tierkv.errors import MissingExtraError
try:
    TierKVStore([torch.zeros(4, 2, 16, 2, 8)], model_id="m", config=StoreConfig(
        blocks_per_chunk=2, device="cpu", remote=RemoteTierConfig(url="redis://127.0.0.1:1")))
except MissingExtraError as exc:
    print("refused:", exc)
"""
    done = run(("redis", "hiredis"), code)
    assert done.returncode == 0, done.stderr[-2000:]
    # Installed from this checkout (make test: pip install -e .): no release of
    # tierkv-cache need exist for the hint to work.
    assert "needs the 'remote' extra (module 'redis' is not installed): pip install " \
           f"'{ROOT}[remote]' (or its modules: pip install redis hiredis)" in done.stderr
    assert "refused: the remote tier (StoreConfig.remote, vLLM's remote_url) needs the " \
           "'remote' extra" in done.stdout
    assert "Traceback" not in done.stderr


def test_without_the_warmup_extra(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"token_ids": [1, 2, 3]}\n')
    code = f"""
from tierkv.cli import main
raise SystemExit(main(["warmup", "--model", {str(tmp_path)!r}, "--prompts", {str(prompts)!r},
                       "--store", {str(tmp_path / "store")!r}]))
"""
    done = run(("transformers",), code)
    assert done.returncode == 2, (done.stdout[-1000:], done.stderr[-2000:])
    assert "tierkv warmup needs the 'warmup' extra (module 'transformers' is not installed)" \
        in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("command", [["--help"], ["demo", "--help"], ["--version"]])
def test_the_cli_starts_without_any_extra(command: list[str]) -> None:
    blocked = ("redis", "hiredis", "transformers", "aiofiles", "tqdm", "vllm")
    done = run(blocked, f"from tierkv.cli import main\nmain({command!r})")
    assert done.returncode == 0, done.stderr[-2000:]
