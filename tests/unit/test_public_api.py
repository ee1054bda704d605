"""The public API is pinned: ``tierkv.__all__`` changes only with this test (and the docs
that promise it), and each name is importable from ``tierkv`` as the object its home module
defines. (Every module's own ``__all__``: tests/integration/test_packaging.py, which imports
the vLLM integration.)"""

from __future__ import annotations

import importlib

import tierkv

PUBLIC = ["DISTRIBUTION", "Namespace", "StoreConfig", "TierKVStore", "__version__",
          "chunk_keys"]
HOMES = {"TierKVStore": "tierkv.engine.store", "StoreConfig": "tierkv.config",
         "Namespace": "tierkv.keys", "chunk_keys": "tierkv.keys"}


def test_the_top_level_api_is_pinned() -> None:
    assert sorted(tierkv.__all__) == PUBLIC
    for name in tierkv.__all__:
        assert getattr(tierkv, name) is not None, name
    for name, home in HOMES.items():
        assert getattr(tierkv, name) is getattr(importlib.import_module(home), name), name
    assert isinstance(tierkv.__version__, str) and tierkv.__version__
