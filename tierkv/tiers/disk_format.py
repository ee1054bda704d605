"""The disk tier's on-disk format and plain records (``docs/on-disk-format.md`` has every byte).

Primitives and contracts:

- A value is ``prefix | header | payload``: prefix ``"<2sH"`` (magic ``b"TK"``, header
  length, at most :data:`MAX_HEADER_BYTES`), header the canonical msgpack array
  ``[format_version, payload_len, seq, checksum]`` of unsigned ints, then the raw payload.
- :func:`binding_of` is what binds a value to where it belongs: the 16 bytes of its
  namespace fingerprint and its rank (``<I``).
- :func:`checksum` is xxh3_64 over ``binding | key | <QQQ>(version, payload_len, seq) |
  payload``: a value copied under another key, into another namespace's or rank's
  environment, with a changed header field or payload byte, fails it.
- :class:`ValueWriter` builds values into one reused buffer.
- :func:`check_value` accepts only a value this build would have written for that
  binding, key and payload size; it copies the payload into the caller's buffer and then
  verifies the checksum there. It never unpickles or evaluates anything; msgpack input is
  bounded.
- :func:`pack_index` / :func:`unpack_index`: the "index" sub-db value ``<QQ`` (payload
  length, seq), so a restart rebuilds its index without reading payloads.
- :func:`map_size_for`: LMDB ``map_size`` from the disk cap, with headroom.
- :func:`tune_malloc` (glibc, once per process, ``TIERKV_MALLOPT=0`` opts out) keeps the
  heap blocks LMDB allocates for each value's pages from being faulted in afresh per put.
- :func:`namespace_record` (the meta record: namespace, fingerprint, rank, format) and
  :func:`list_namespaces` (``namespace.json`` files, for operators).
- The plain records the tier returns: :class:`ReadStatus`, :class:`PutResult`,
  :class:`DiskRecord`, :class:`VerifyReport`, :class:`DiskStatistics`.

Files and directories (private modes, ownership checks, moving aside) are
:mod:`tierkv.tiers.disk_files`.
"""

from __future__ import annotations

import ctypes
import enum
import json
import logging
import os
import platform
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import xxhash

from tierkv.keys import FORMAT_VERSION
from tierkv.units import MiB
from tierkv.tiers.disk_files import Trust, check_dir, read_private_file

logger = logging.getLogger("tierkv.disk")

MAGIC = b"TK"
MAX_HEADER_BYTES = 64
LMDB_PAGE_HEADER = 16  # bytes before the data on an LMDB overflow page
_PREFIX = struct.Struct("<2sH")  # magic, msgpack header length
_FIXED = struct.Struct("<QQQ")  # format version, payload length, seq: fed to the checksum
_INDEX = struct.Struct("<QQ")  # "index" sub-db value: payload length, seq
_RANK = struct.Struct("<I")
PREFIX_BYTES = _PREFIX.size
MAX_VALUE_OVERHEAD = _PREFIX.size + MAX_HEADER_BYTES
BINDING_BYTES = 16 + _RANK.size


def binding_of(fingerprint: str, rank: int) -> bytes:
    """The bytes every value's checksum starts with: namespace fingerprint (16 bytes) and
    rank (``<I``)."""
    raw = bytes.fromhex(fingerprint)
    if len(raw) != 16:
        raise ValueError(f"a namespace fingerprint is 32 hex digits, got {fingerprint!r}")
    return raw + _RANK.pack(rank)


def checksum(binding: bytes, key: bytes, version: int, payload_len: int, seq: int,
             payload: Any) -> int:
    """xxh3_64 over the binding (namespace, rank), the key, the header fields and the payload."""
    hasher = xxhash.xxh3_64(binding)
    hasher.update(key)
    hasher.update(_FIXED.pack(version, payload_len, seq))
    hasher.update(payload)
    return int(hasher.intdigest())


def pack_header(binding: bytes, key: bytes, payload: Any, seq: int) -> bytes:
    """Prefix and msgpack header of the value of ``key`` holding ``payload``."""
    size = len(payload)
    header: bytes = msgpack.packb(
        [FORMAT_VERSION, size, seq, checksum(binding, key, FORMAT_VERSION, size, seq, payload)])
    return _PREFIX.pack(MAGIC, len(header)) + header


class ValueWriter:
    """Builds values of one binding in one reused buffer; one user at a time (the LMDB
    write lock holder)."""

    def __init__(self, payload_bytes: int, binding: bytes) -> None:
        self._buffer = bytearray(MAX_VALUE_OVERHEAD + payload_bytes)
        self._view = memoryview(self._buffer)
        self._binding = binding

    def build(self, key: bytes, payload: memoryview | bytes, seq: int) -> memoryview:
        """The value as a view into the buffer, valid until the next ``build``."""
        if isinstance(payload, memoryview) and payload.format != "B":
            payload = payload.cast("B")
        head = pack_header(self._binding, key, payload, seq)
        start = len(head)
        self._view[:start] = head
        self._view[start : start + len(payload)] = payload
        return self._view[: start + len(payload)]


def check_value(binding: bytes, key: bytes, value: Any, payload_bytes: int,
                out: memoryview) -> str | None:
    """None when ``value`` is a good value of ``key`` under ``binding`` (its payload is then
    in ``out``), else what is wrong with it."""
    total = len(value)
    if total < _PREFIX.size:
        return f"value of {total} bytes is shorter than its prefix"
    magic, header_len = _PREFIX.unpack_from(value, 0)
    if magic != MAGIC:
        return f"bad magic {bytes(magic)!r}"
    if header_len > MAX_HEADER_BYTES:
        return f"header length {header_len} > {MAX_HEADER_BYTES}"
    start = _PREFIX.size + header_len
    if start > total:
        return f"value of {total} bytes truncated inside its header"
    header = bytes(value[_PREFIX.size : start])
    try:
        fields = msgpack.unpackb(header, raw=False, max_array_len=8, max_map_len=0,
                                 max_str_len=0, max_bin_len=0, max_ext_len=0)
    except Exception as exc:  # msgpack raises several types; the input is at most 64 bytes
        return f"header is not msgpack ({type(exc).__name__})"
    if not (isinstance(fields, list) and len(fields) == 4
            and all(type(item) is int and item >= 0 for item in fields)):
        return "header is not an array of 4 unsigned ints"
    if msgpack.packb(fields) != header:
        return "header is not canonical msgpack"
    version, payload_len, seq, expected = fields
    if version != FORMAT_VERSION:
        return f"format version {version}, this build reads {FORMAT_VERSION}"
    if payload_len != payload_bytes:
        return f"payload length field {payload_len}, the tier stores {payload_bytes}"
    if total - start != payload_len:
        return f"payload has {total - start} bytes, header says {payload_len}"
    target = out[:payload_len]
    target[:] = value[start:]
    if checksum(binding, key, version, payload_len, seq, target) != expected:
        return "checksum mismatch (damaged, or a value of another key, namespace or rank)"
    return None


def pack_index(payload_len: int, seq: int) -> bytes:
    return _INDEX.pack(payload_len, seq)


def unpack_index(raw: bytes) -> tuple[int, int] | None:
    """(payload_len, seq), or None for a malformed entry."""
    if len(raw) != _INDEX.size:
        return None
    payload_len, seq = _INDEX.unpack(raw)
    return int(payload_len), int(seq)


def map_size_for(max_bytes: int, payload_bytes: int, page_bytes: int = 4096) -> int:
    """LMDB ``map_size`` for a disk cap of ``max_bytes`` of payloads.

    ``chunks = ceil(max_bytes / payload_bytes)``; each value takes
    ``ceil((payload + 68 + 16) / page)`` overflow pages (68: largest prefix + header, 16:
    LMDB's page header); the two B-trees take under 256 bytes per chunk; then 25% for
    copy-on-write and free-list fragmentation, plus 4 MiB for meta pages and roots, rounded
    up to 1 MiB. 64 GiB of 2 MiB chunks gives 80.2 GiB (a sparse file: only written pages
    take disk space).
    """
    num_chunks = -(-max_bytes // payload_bytes)
    value_pages = -(-(payload_bytes + MAX_VALUE_OVERHEAD + LMDB_PAGE_HEADER) // page_bytes)
    data = num_chunks * value_pages * page_bytes
    total = data + data // 4 + num_chunks * 256 + 4 * MiB
    return -(-total // MiB) * MiB


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


@dataclass(frozen=True)
class PutResult:
    """What one ``put_many`` did. ``full`` keys found no room in the map (not an error)."""

    written: tuple[bytes, ...]
    full: tuple[bytes, ...] = ()
    deleted: int = 0
    num_bytes: int = 0
    message: str | None = None


@dataclass(frozen=True)
class DiskRecord:
    """One stored chunk as the index knows it (the value itself is checked on read)."""

    key: bytes
    payload_len: int
    seq: int


@dataclass(frozen=True)
class VerifyReport:
    """``bad_keys``: values failing any check, or index entries without a value.
    ``damaged``: the environment itself was found damaged (what LMDB or the checks said);
    it was then moved aside and rebuilt empty (``rebuilt``) when the tier may repair."""

    checked: int
    bad_keys: tuple[bytes, ...]
    repaired: int
    damaged: str | None = None
    rebuilt: bool = False


@dataclass(frozen=True)
class DiskStatistics:
    """Counters since open; ``chunks`` and ``map_size`` are current."""

    chunks: int
    bytes_written: int
    bytes_read: int
    puts: int
    reads: int
    hits: int
    misses: int
    corrupt: int
    full: int
    syncs: int
    map_size: int
    write_txns: int = 0
    rebuilds: int = 0  # damaged or misplaced environments moved aside, started empty
    stale_readers: int = 0  # reader slots of dead processes cleared
    map_adopted: int = 0  # times a map grown by another process was adopted


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
_malloc_tuned = False


def tune_malloc(write_batch_bytes: int) -> bool:
    """Keep LMDB's freed dirty pages in the heap (glibc; once per process; opt out with
    ``TIERKV_MALLOPT=0``). Returns whether it changed anything.

    With ``writemap=False`` LMDB mallocs every value's overflow pages in the write txn and
    frees them at commit. Once a process has loaded torch, glibc often serves each of those
    multi-MiB blocks with a fresh ``mmap`` (or trims the heap after each commit), so every
    put page-faults its buffer in again: measured 0.4-0.5x of ``dd`` instead of 0.75-0.8x
    (``docs/benchmarks/disk.md``). This sets ``M_MMAP_THRESHOLD`` to 32 MiB (glibc's own
    dynamic ceiling) and ``M_TRIM_THRESHOLD`` to ``max(4 * write_batch_bytes, 32 MiB)``:
    the process keeps up to that much free heap instead of returning it to the OS.
    """
    global _malloc_tuned
    if _malloc_tuned or os.environ.get("TIERKV_MALLOPT", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    trim = min(max(4 * write_batch_bytes, 32 << 20), 1 << 30)
    _malloc_tuned = bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim))
    logger.debug("disk tier: mallopt(M_MMAP_THRESHOLD=32 MiB, M_TRIM_THRESHOLD=%d): %s",
                 trim, _malloc_tuned)
    return _malloc_tuned


@dataclass(frozen=True)
class NamespaceInfo:
    """One ``ns-<fingerprint>`` directory as ``namespace.json`` describes it."""

    fingerprint: str
    path: Path
    description: dict[str, Any]
    format_version: int
    ranks: tuple[int, ...] = ()


def namespace_record(fingerprint: str, description: dict[str, Any],
                     rank: int | None = None) -> dict[str, Any]:
    """What ``namespace.json`` holds; the "meta" sub-db's record adds the ``rank``."""
    record = {"fingerprint": fingerprint, "format_version": FORMAT_VERSION,
              "namespace": description}
    if rank is not None:
        record["rank"] = rank
    return record


MAX_NAMESPACE_JSON_BYTES = 1 << 20  # tierkv writes a few hundred bytes


def list_namespaces(root: Path) -> list[NamespaceInfo]:
    """Namespaces under ``root`` from their ``namespace.json`` (unreadable ones are skipped:
    missing, too big, not JSON, nested too deep, or not the shape tierkv writes)."""
    infos: list[NamespaceInfo] = []
    for ns_dir in sorted(Path(root).glob("ns-*")):
        if check_dir(ns_dir, fix=False) is not Trust.OK:
            continue
        try:
            raw = read_private_file(ns_dir / "namespace.json", MAX_NAMESPACE_JSON_BYTES)
            if raw is None:
                raise ValueError("missing, or not a regular file of this user's")
            if len(raw) > MAX_NAMESPACE_JSON_BYTES:
                raise ValueError(f"larger than {MAX_NAMESPACE_JSON_BYTES} bytes")
            record = json.loads(raw.decode())
            description = dict(record["namespace"])
            version = int(record["format_version"])
            fingerprint = str(record["fingerprint"])
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            logger.warning("disk tier: skipping %s: unreadable namespace.json (%s)", ns_dir, exc)
            continue
        ranks = sorted(int(p.name[5:]) for p in ns_dir.glob("rank-*") if p.name[5:].isdigit())
        infos.append(NamespaceInfo(fingerprint, ns_dir, description, version, tuple(ranks)))
    return infos
