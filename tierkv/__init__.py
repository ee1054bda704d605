"""tierkv: a multi-tier KV-cache block store for LLM inference engines.

GPU -> pinned CPU LRU tier -> LMDB disk tier, and back. Start with
:class:`tierkv.engine.store.TierKVStore` (also exported here, imported lazily so that
``import tierkv.core`` stays free of torch and lmdb).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["TierKVStore", "StoreConfig", "Namespace", "chunk_keys", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "TierKVStore":
        from tierkv.engine.store import TierKVStore

        return TierKVStore
    if name == "StoreConfig":
        from tierkv.config import StoreConfig

        return StoreConfig
    if name in ("Namespace", "chunk_keys"):
        from tierkv import keys

        return getattr(keys, name)
    raise AttributeError(f"module 'tierkv' has no attribute {name!r}")
