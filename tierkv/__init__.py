"""tierkv: a multi-tier KV-cache block store for LLM inference engines.

GPU -> pinned CPU LRU tier -> LMDB disk tier, and back. Start with
:class:`tierkv.engine.store.TierKVStore` (also exported here, imported lazily so that
``import tierkv.core`` stays free of torch and lmdb).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
# The name to pip-install (pyproject.toml); the import name stays ``tierkv``.
DISTRIBUTION = "tierkv-cache"

__all__ = ["TierKVStore", "StoreConfig", "Namespace", "chunk_keys", "__version__",
           "DISTRIBUTION"]

_HOMES = {"TierKVStore": "tierkv.engine.store", "StoreConfig": "tierkv.config",
          "Namespace": "tierkv.keys", "chunk_keys": "tierkv.keys"}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
