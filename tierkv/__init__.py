"""tierkv: a multi-tier KV-cache block store for LLM inference engines.

GPU -> pinned CPU tier (ARC eviction by default, ``cpu.eviction_policy``) -> disk tier
(slab files under an LMDB index) -> remote tier (Redis / Valkey), and back. Start with
:class:`tierkv.engine.store.TierKVStore` (also exported here, imported lazily so that
``import tierkv.core`` stays free of torch and lmdb).

The distribution is ``tierkv-cache``; an unrelated PyPI project named ``tierkv`` installs
the same import name. Importing this package refuses to run when that project's
installation claims these files too (its files overwrite ours, or ours its): see
:func:`check_installation` and README.md, "Install".
"""

from __future__ import annotations

import importlib
import os
from typing import Any

__version__ = "0.1.0"
# The name to pip-install (pyproject.toml); the import name stays ``tierkv``.
DISTRIBUTION = "tierkv-cache"

__all__ = ["TierKVStore", "StoreConfig", "Namespace", "chunk_keys", "__version__",
           "DISTRIBUTION"]

_HOMES = {"TierKVStore": "tierkv.engine.store", "StoreConfig": "tierkv.config",
          "Namespace": "tierkv.keys", "chunk_keys": "tierkv.keys"}
_METADATA_SUFFIXES = (".dist-info", ".egg-info")


def _project(stem: str) -> str:
    """The normalized project name of a metadata directory's stem (``tierkv_cache-0.1.0``)."""
    return stem.split("-", 1)[0].lower().replace("_", "-").replace(".", "-")


def _foreign_owners(package_dir: str) -> list[str]:
    """Distributions other than ours whose metadata beside ``package_dir`` claim its files:
    ``name version`` of each. One directory listing when there are none (the common case:
    no other ``tierkv-*`` metadata there); their file lists are read only when there are."""
    site = os.path.dirname(package_dir)
    try:
        names = os.listdir(site)
    except OSError:
        return []
    found = [name for name in names if name.endswith(_METADATA_SUFFIXES)
             and _project(name.rsplit(".", 1)[0]) == "tierkv"]
    if not found:
        return []
    from importlib.metadata import PathDistribution
    from pathlib import Path

    owners: list[str] = []
    package = os.path.basename(package_dir)
    for name in found:
        dist = PathDistribution(Path(site) / name)
        files = dist.files or []
        top_level = (dist.read_text("top_level.txt") or "").split()
        if package in top_level or any(f.parts[:1] == (package,) for f in files):
            owners.append(f"{dist.metadata['Name'] or name} {dist.version or '?'}")
    return owners


def check_installation(package_dir: str | None = None) -> None:
    """Raise :class:`~tierkv.errors.ForeignInstallError` when another distribution's
    metadata claims the files of this package (``package_dir``: where it was imported from)."""
    package_dir = package_dir or os.path.dirname(os.path.abspath(__file__))
    owners = _foreign_owners(package_dir)
    if owners:
        from tierkv.errors import ForeignInstallError

        raise ForeignInstallError(
            f"tierkv: {package_dir} is also installed by {', '.join(owners)}, another project "
            f"with the import name 'tierkv' (tierkv's distribution is {DISTRIBUTION}); their "
            f"files overwrite each other, so this package may be a mix of both. Run: pip "
            f"uninstall -y tierkv {DISTRIBUTION}, then pip install {DISTRIBUTION} (or use "
            f"separate virtual environments)")


check_installation()


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
