"""What :class:`~tierkv.engine.store.TierKVStore` takes from its caller, checked before
anything changes; a bad argument is a :class:`UsageError` naming what is wrong, a namespace
or ``model_path`` that does not fit the config a :class:`ConfigError`.

- :func:`check_keys`: a sequence of 32-byte ``bytes`` chunk keys.
- :func:`split_blocks`: block ids as one sequence per chunk (``blocks_per_chunk`` ids
  each) or one flat sequence, of ints (numpy integers, integer arrays and tensors too; never
  floats or bools) in ``[0, num_blocks)``, as one tuple per chunk.
- :func:`block_set`: every block id of ``block_ids`` (flat, per chunk, or None) as a set.
- :func:`job_ids`: what ``wait()`` takes: job ids ``store()``/``load()`` returned (None is
  skipped).
- :func:`build_namespace`: the store's namespace, what decides what its chunk bytes mean,
  from the KV layout, the model id, the tokens per block and the config
  (:func:`weights_fingerprint`: ``model_path`` and ``model_fingerprint``);
  :func:`check_namespace` refuses a namespace the caller gave that does not describe these
  tensors and this config (:class:`ConfigError` naming the field and both values).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierkv.checks import check_int, is_int
from tierkv.config import StoreConfig
from tierkv.core.jobs import JobId
from tierkv.errors import ConfigError, UsageError
from tierkv.keys import KEY_BYTES, Namespace
from tierkv.model_identity import is_mode, model_fingerprint
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.transfer.layout import KVLayout


def check_keys(keys: Sequence[bytes]) -> None:
    if isinstance(keys, (str, bytes, bytearray)) or not isinstance(keys, Sequence):
        raise UsageError(f"store: keys must be a sequence of {KEY_BYTES}-byte chunk keys "
                          f"(tierkv.chunk_keys), got {type(keys).__name__}")
    for key in keys:
        if type(key) is not bytes or len(key) != KEY_BYTES:
            raise UsageError(
                f"store: chunk key {key!r:.48} is not {KEY_BYTES} bytes (use "
                f"tierkv.chunk_keys, or bytes of a {KEY_BYTES}-byte hash)")


def block_rows(block_ids: Any) -> list[Any]:
    """``block_ids`` (a sequence, numpy array or tensor of ints, or of such rows) as a list."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.is_floating_point() or block_ids.is_complex() or block_ids.dtype == torch.bool:
            raise UsageError(f"store: block ids must be integers, got a {block_ids.dtype} tensor")
        return list(block_ids.tolist()) if block_ids.dim() else [int(block_ids)]
    if isinstance(block_ids, np.ndarray):
        if block_ids.dtype.kind not in "iu":
            raise UsageError(f"store: block ids must be integers, got a {block_ids.dtype} array")
        return list(block_ids.tolist()) if block_ids.ndim else [int(block_ids)]
    if isinstance(block_ids, (str, bytes, bytearray, Mapping)) or not isinstance(block_ids, Iterable):
        raise UsageError(f"store: block ids must be a sequence of ints (one flat sequence, or one "
                          f"per chunk), got {block_ids!r:.60}")
    return list(block_ids)


def block_id(block: Any) -> int:
    """One block id as an int: ints and numpy integers (never bools or floats)."""
    if isinstance(block, (bool, np.bool_)) or isinstance(block, (float, np.floating)):
        raise UsageError(f"store: block id {block!r} is not an int")
    try:
        return operator.index(block)
    except TypeError as exc:
        raise UsageError(f"store: block id {block!r:.40} is not an int") from exc


def _flat_or_rows(block_ids: Any) -> tuple[list[Any], bool]:
    rows = block_rows(block_ids)
    return rows, bool(rows) and not isinstance(rows[0], (int, np.integer, torch.Tensor))


def split_blocks(keys: Sequence[bytes], block_ids: Any, blocks_per_chunk: int,
                 num_blocks: int) -> list[tuple[int, ...]]:
    """``block_ids`` as one tuple of ``blocks_per_chunk`` ids per key (see the module
    docstring); more ids than the keys need are allowed (the tail is unused)."""
    bpc = blocks_per_chunk
    rows, nested = _flat_or_rows(block_ids)
    if nested:
        per_chunk = [tuple(block_id(b) for b in block_rows(chunk)) for chunk in rows]
    else:
        flat = [block_id(b) for b in rows]
        per_chunk = [tuple(flat[i : i + bpc]) for i in range(0, len(flat), bpc)]
    if len(per_chunk) < len(keys) or any(len(chunk) != bpc for chunk in per_chunk[: len(keys)]):
        raise UsageError(
            f"store: {len(keys)} chunk key(s) need {len(keys)} x {bpc} block ids "
            f"(blocks_per_chunk={bpc}), got {[len(c) for c in per_chunk]}"
        )
    for chunk in per_chunk[: len(keys)]:
        for block in chunk:
            if not 0 <= block < num_blocks:
                raise UsageError(f"store: block id {block} out of range [0, {num_blocks})")
    return per_chunk


def block_set(block_ids: Any) -> set[int]:
    """Every block id of ``block_ids`` (one flat sequence, or one per chunk) as a set."""
    rows, nested = _flat_or_rows(block_ids)
    if nested:
        return {block_id(b) for chunk in rows for b in block_rows(chunk)}
    return {block_id(b) for b in rows}


def job_ids(wanted: Iterable[JobId | None]) -> list[JobId]:
    """The job ids of ``wanted`` (None skipped); anything else is a UsageError."""
    if isinstance(wanted, (str, bytes)) or not isinstance(wanted, Iterable):
        raise UsageError(f"store: wait() takes a list of job ids, got {wanted!r:.60}")
    ids: list[JobId] = []
    for job_id in wanted:
        if job_id is None:
            continue
        if not (is_int(job_id) or isinstance(job_id, np.integer)) or job_id < 1:
            raise UsageError(f"store: wait() on {job_id!r:.40}, which is not a job id "
                              f"(store() and load() return them)")
        ids.append(JobId(int(job_id)))
    return ids


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
