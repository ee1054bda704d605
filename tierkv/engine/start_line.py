"""The one INFO line a store logs when it opens, the library's
(:class:`~tierkv.engine.store.TierKVStore`) and each rank of the vLLM connector alike: its
tiers with their sizes in binary units, the disk cap, tokens per chunk and the namespace's
short id (the first 8 hex digits of :meth:`Namespace.fingerprint`, as ``tierkv inspect``
and the warm-up show it). A remote URL is shown without its password."""

from __future__ import annotations

from tierkv.config import StoreConfig, safe_url
from tierkv.keys import Namespace
from tierkv.units import format_bytes

__all__ = ["short_id", "start_line"]


def short_id(namespace: Namespace) -> str:
    """The namespace's short id: the first 8 hex digits of its fingerprint."""
    return namespace.fingerprint()[:8]


def start_line(who: str, config: StoreConfig, namespace: Namespace, *, num_slots: int,
               chunk_bytes: int) -> str:
    """``who`` (``"store"``, ``"rank 0"``) opened with ``num_slots`` CPU slots of
    ``chunk_bytes`` over ``config``'s tiers, for chunks of ``namespace``."""
    tiers = [f"CPU {format_bytes(num_slots * chunk_bytes)} ({num_slots} chunks)"]
    disk = config.disk
    if disk.path is not None:
        tiers.append(f"disk at {disk.path} capped at {format_bytes(disk.max_bytes)}")
    else:
        tiers.append("no disk tier")
    if config.remote is not None:
        tiers.append(f"remote {safe_url(config.remote.url)}")
    return (f"tierkv: {who} open, namespace {short_id(namespace)}: {', '.join(tiers)}; "
            f"{namespace.tokens_per_chunk} tokens a chunk of {format_bytes(chunk_bytes)}")
