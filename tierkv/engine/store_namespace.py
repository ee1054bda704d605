"""The namespace of a :class:`~tierkv.engine.store.TierKVStore`: what decides what its
chunk bytes mean.

- :func:`build_namespace` makes it from the KV layout, the model id, the tokens per block
  and the config (:func:`weights_fingerprint`: ``model_path`` and ``model_fingerprint``).
- :func:`check_namespace` refuses a namespace the caller gave that does not describe
  these tensors and this config (:class:`ConfigError` naming the field and both values).
"""

from __future__ import annotations

from pathlib import Path

from tierkv.checks import check_int
from tierkv.config import StoreConfig
from tierkv.errors import ConfigError, UsageError
from tierkv.keys import Namespace
from tierkv.model_identity import is_mode, model_fingerprint
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.transfer.layout import KVLayout

__all__ = ["build_namespace", "check_namespace", "weights_fingerprint"]


def content_cache_dir(disk_path: Path | str | None) -> Path | None:
    """Where ``model_fingerprint: content`` keeps its hashes: under the disk tier's root."""
    return None if disk_path is None else StoreLayout(disk_path).model_hashes_dir()


def weights_fingerprint(config: StoreConfig) -> str:
    """The model fingerprint of ``config``: computed from ``model_path`` (``auto`` or
    ``content``), or the operator's own name; ``""`` when neither says what the weights are."""
    mode = config.model_fingerprint
    if config.model_path is None:
        return "" if is_mode(mode) else f"name:{mode}"
    found = model_fingerprint(config.model_path, mode,
                              cache_dir=content_cache_dir(config.disk.path))
    if found is None:
        raise ConfigError(f"store: model_path={str(config.model_path)!r} cannot be read for "
                          f"the model fingerprint; give the model's directory or weight "
                          f"file, or model_path=None with model_fingerprint set to a name "
                          f"of the weights")
    return found


def build_namespace(
    layout: KVLayout, model_id: str, tokens_per_block: int, config: StoreConfig
) -> Namespace:
    """Everything that decides what this store's chunk bytes mean: the layout (dtype, page
    shapes and memory order), the layers' names in registration order, and how a chunk's
    tokens split into blocks. The layout describes one rank's tensors (the library does not
    know where heads are in them), so ranks of two TP sizes stay apart here; sharing across
    TP sizes is the vLLM connector's (docs/on-disk-format.md, "Parts")."""
    check_int("store: tokens_per_block", tokens_per_block, low=1)
    layout.check_tokens_per_block(tokens_per_block)  # keys must cover a block's tokens
    parts = config.tp_size  # the namespace's sizes are every part's (every rank's) together
    return Namespace(
        model_id=model_id,
        dtype=layout.dtype_name,
        kv_layout=layout.describe(),
        page_bytes=sum(layout.page_bytes) * parts,
        tokens_per_chunk=tokens_per_block * config.blocks_per_chunk,
        num_layers=layout.num_layers,
        layer_names=layout.layer_names,
        blocks_per_chunk=config.blocks_per_chunk,
        chunk_bytes=layout.chunk_bytes(config.blocks_per_chunk) * parts,
        model_fingerprint=weights_fingerprint(config),
    )


def check_namespace(namespace: Namespace, layout: KVLayout, config: StoreConfig) -> None:
    """A namespace given by the caller must describe these tensors and this config: what
    decides the bytes' meaning is not the caller's to choose (model id, TP size, hash
    scheme and extra are)."""
    if not isinstance(namespace, Namespace):
        raise UsageError(f"store: namespace must be a Namespace, got {namespace!r}")
    bpc = config.blocks_per_chunk
    if namespace.tokens_per_chunk % bpc:
        raise ConfigError(f"store: namespace tokens_per_chunk={namespace.tokens_per_chunk} "
                          f"is not a multiple of blocks_per_chunk={bpc}")
    own = build_namespace(layout, namespace.model_id, namespace.tokens_per_chunk // bpc, config)
    checked = ("dtype", "kv_layout", "page_bytes", "num_layers", "layer_names",
               "blocks_per_chunk", "chunk_bytes") + (("model_fingerprint",)
                                                     if own.model_fingerprint else ())
    for name in checked:
        if getattr(namespace, name) != getattr(own, name):
            raise ConfigError(
                f"store: the namespace says {name}={getattr(namespace, name)!r}, the KV "
                f"tensors and config give {getattr(own, name)!r}; build it with "
                f"tierkv.engine.store.build_namespace (and dataclasses.replace for model "
                f"id, hash scheme or extra)")
