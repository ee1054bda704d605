"""The directory layout of a disk tier's store root (``disk.path``): the one place that
spells and parses its names (``docs/on-disk-format.md``, "Layout").

::

    <root>/ns-<fingerprint>/                 one namespace (namespace.json inside)
            part-<p>of<P>[-dp<d>]/           one part of its chunks (data-parallel engine d > 0)
                shard-<s>/                   one shard's environment: data.mdb, slab-0.kv
            rank-<r>/[shard-<s>/]            an older format's rank (never read; rm deletes it)
            kv-events[-dp<d>]/               the vLLM scheduler's KV-event blocks (LMDB)
    <root>/model-hashes/                     model_fingerprint "content": weights' hashes

Primitives and contracts:

- :class:`StoreLayout` ``(root)`` names the directories of a root:
  :meth:`~StoreLayout.namespace_dir`, :meth:`~StoreLayout.part_dir`,
  :meth:`~StoreLayout.shard_dir`, and lists them: :meth:`~StoreLayout.namespace_dirs`
  (every ``ns-*`` entry, sorted; the caller judges whether to trust it).
- Its static methods parse and list below a namespace or a part directory wherever it lies:
  :meth:`~StoreLayout.fingerprint_of`, :meth:`~StoreLayout.part_dir_name` /
  :meth:`~StoreLayout.parse_part_dir` (``None`` for any other name),
  :meth:`~StoreLayout.old_rank_of`, :meth:`~StoreLayout.is_part_dir` (a part's, or an older
  format's rank's), :meth:`~StoreLayout.shard_of_dir`, :meth:`~StoreLayout.shard_dirs`,
  :meth:`~StoreLayout.data_files` and :meth:`~StoreLayout.moved_aside` (what
  ``files.move_aside`` left of a part or of its shards: ``<name>.<why>-<time>``).
- Pure path arithmetic and directory listings: it opens no file and follows no judgement of
  trust (:mod:`tierkv.tiers.disk.files` does that).
"""

from __future__ import annotations

from pathlib import Path

from tierkv.keys import Part, parse_part

_NAMESPACE = "ns-"
_PART = "part-"
_OLD_RANK = "rank-"
_SHARD = "shard-"
_REPLICA = "-dp"
_MODEL_HASHES = "model-hashes"
_EVENT_BLOCKS = "kv-events"


class StoreLayout:
    """The directories under one store root; see the module docstring."""

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    # -- the directories of a root ---------------------------------------------------------
    def namespace_dir(self, fingerprint: str) -> Path:
        return self.root / self.namespace_name(fingerprint)

    def part_dir(self, fingerprint: str, part: Part, replica: int = 0) -> Path:
        return self.namespace_dir(fingerprint) / self.part_dir_name(part, replica)

    def shard_dir(self, fingerprint: str, part: Part, shard: int, replica: int = 0) -> Path:
        return self.part_dir(fingerprint, part, replica) / self.shard_name(shard)

    def event_blocks_dir(self, fingerprint: str, replica: int = 0) -> Path:
        """Where a vLLM scheduler keeps its chunks' KV-event blocks (hashes and tokens)."""
        suffix = f"{_REPLICA}{replica}" if replica else ""
        return self.namespace_dir(fingerprint) / f"{_EVENT_BLOCKS}{suffix}"

    def model_hashes_dir(self) -> Path:
        """Where ``model_fingerprint: content`` caches whole-content hashes of weights."""
        return self.root / _MODEL_HASHES

    def namespace_dirs(self) -> list[Path]:
        """Every ``ns-*`` entry of the root, sorted (not judged: links and files included)."""
        return sorted(self.root.glob(f"{_NAMESPACE}*"))

    # -- names, wherever they lie ----------------------------------------------------------
    @staticmethod
    def namespace_name(fingerprint: str) -> str:
        return f"{_NAMESPACE}{fingerprint}"

    @staticmethod
    def is_namespace_name(name: str) -> bool:
        return name.startswith(_NAMESPACE)

    @staticmethod
    def fingerprint_of(ns_dir: Path) -> str:
        """The fingerprint a namespace directory's name carries."""
        return ns_dir.name.removeprefix(_NAMESPACE)

    @staticmethod
    def part_dir_name(part: Part, replica: int = 0) -> str:
        """``part-<p>of<P>`` (``-dp<d>`` for data-parallel engine ``d > 0``, which keeps its own)."""
        return f"{_PART}{part.name}" + (f"{_REPLICA}{replica}" if replica else "")

    @staticmethod
    def parse_part_dir(name: str) -> tuple[Part, int] | None:
        """(part, replica) of a :meth:`part_dir_name`; None for any other name."""
        if not name.startswith(_PART):
            return None
        body, sep, replica = name.removeprefix(_PART).partition(_REPLICA)
        part = parse_part(body)
        if part is None or (sep and (not replica.isdigit() or str(int(replica)) != replica
                                     or int(replica) == 0)):
            return None
        return part, int(replica) if sep else 0

    @staticmethod
    def old_rank_of(name: str) -> int | None:
        """``r`` of an older format's ``rank-<r>`` directory; None for any other name."""
        suffix = name.removeprefix(_OLD_RANK)
        return int(suffix) if name.startswith(_OLD_RANK) and suffix.isdigit() else None

    @staticmethod
    def is_part_dir(name: str) -> bool:
        """A part's directory (``part-<p>of<P>``), or an older format's rank's (``rank-<r>``)."""
        return (StoreLayout.parse_part_dir(name) is not None
                or StoreLayout.old_rank_of(name) is not None)

    @staticmethod
    def part_dirs(ns_dir: Path) -> list[Path]:
        """Every ``part-*`` entry of a namespace directory, sorted (moved-aside ones too)."""
        return sorted(ns_dir.glob(f"{_PART}*"))

    @staticmethod
    def old_rank_dirs(ns_dir: Path) -> list[Path]:
        """Every ``rank-*`` entry of a namespace directory (older formats'), sorted."""
        return sorted(ns_dir.glob(f"{_OLD_RANK}*"))

    @staticmethod
    def shard_name(shard: int) -> str:
        return f"{_SHARD}{shard}"

    @staticmethod
    def shard_of_dir(name: str) -> int | None:
        """``s`` of a ``shard-<s>`` directory; None for any other name (a moved-aside one)."""
        suffix = name.removeprefix(_SHARD)
        return int(suffix) if name.startswith(_SHARD) and suffix.isdigit() else None

    @staticmethod
    def shard_dirs(part_dir: Path) -> list[Path]:
        """The ``shard-<s>`` entries of a part directory, sorted (not moved-aside ones)."""
        return [path for path in sorted(part_dir.glob(f"{_SHARD}*"))
                if StoreLayout.shard_of_dir(path.name) is not None]

    @staticmethod
    def data_files(part_dir: Path) -> list[Path]:
        """Every shard's ``data.mdb`` and slab files under a part directory, sorted."""
        return sorted([*part_dir.glob(f"{_SHARD}*/data.mdb"),
                       *part_dir.glob(f"{_SHARD}*/slab-*.kv")])

    @staticmethod
    def moved_aside(part_dir: Path) -> set[Path]:
        """What was moved aside of one part: the part directory itself, or one of its shards."""
        return (set(part_dir.parent.glob(f"{part_dir.name}.*-*"))
                | set(part_dir.glob(f"{_SHARD}*.*-*")))

    @staticmethod
    def moved_aside_shards(part_dir: Path) -> list[Path]:
        """The shards of a part directory that were moved aside, sorted."""
        return sorted(part_dir.glob(f"{_SHARD}*.*-*"))
