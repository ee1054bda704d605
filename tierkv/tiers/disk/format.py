"""The disk tier's value format (``docs/on-disk-format.md`` has every byte).

Primitives and contracts:

- A value is ``prefix | header | payload``: prefix ``"<2sH"`` (magic ``b"TK"``, header
  length, at most :data:`MAX_HEADER_BYTES`), header the canonical msgpack array
  ``[format_version, payload_len, seq, checksum]`` of unsigned ints, then the raw payload.
- :func:`binding_of` is what binds a value to where it belongs: the 16 bytes of its
  namespace fingerprint and its part (``<HH``: index, count).
- :func:`checksum` is xxh3_64 over ``binding | key | <QQQ>(version, payload_len, seq) |
  payload``: a value copied under another key, into another namespace's or part's
  environment, with a changed header field or payload byte, fails it.
- :class:`ValueWriter` builds values into one reused buffer.
- :func:`check_value` accepts only a value this build would have written for that
  binding, key and payload size; it copies the payload into the caller's buffer and then
  verifies the checksum there. It never unpickles or evaluates anything; msgpack input is
  bounded.
- A slab slot (:func:`slot_bytes_for`) is a :data:`HEADER_BLOCK` holding the value's
  prefix and header (zero padded), then the payload, padded to :data:`ALIGN`; so a payload
  is written and read at an aligned offset (``O_DIRECT``).
- :func:`seal` gives a slot's header block and checksum; :func:`check_slot` accepts a
  slot only if its header is what this build writes, names the index entry's sequence,
  length and checksum, and the payload (already in the caller's buffer) matches the
  checksum bound to key, namespace and part.
- :class:`IndexEntry` / :func:`pack_index` / :func:`unpack_index`: the "index" sub-db value
  ``<IQQQQ`` (slab, slot, payload length, seq, checksum): where a chunk is and what its
  slot must hold; a restart rebuilds from it without reading payloads.

The environment's layout and sizing are :mod:`tierkv.tiers.disk.env` and
:mod:`tierkv.tiers.tuning`; files and directories :mod:`tierkv.tiers.disk.files`.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import msgpack
import numpy as np
import xxhash

from tierkv.checks import is_int
from tierkv.keys import FORMAT_VERSION, Part, as_part

MAGIC = b"TK"
MAX_HEADER_BYTES = 64
_PREFIX = struct.Struct("<2sH")  # magic, msgpack header length
_FIXED = struct.Struct("<QQQ")  # format version, payload length, seq: fed to the checksum
_INDEX = struct.Struct("<IQQQQ")  # "index" value: slab, slot, payload length, seq, checksum
ALIGN = 4096  # slots, and payloads inside them, start at multiples of this (O_DIRECT)
HEADER_BLOCK = ALIGN  # a slot's first block: prefix + header, zero padded
_PART = struct.Struct("<HH")
MAX_VALUE_OVERHEAD = _PREFIX.size + MAX_HEADER_BYTES


def copy_bytes(out: Any, data: Any) -> None:
    """``out[:] = data`` for equal-sized byte buffers, with the GIL released (numpy does;
    a memoryview assignment holds it, so the disk threads' copies ran one at a time)."""
    np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(data, np.uint8))


def binding_of(fingerprint: str, part: Part | int) -> bytes:
    """What every value's checksum starts with: the fingerprint (16 bytes), then the part
    (``<HH``: index, count; 4 bytes, as format 4's rank)."""
    raw = bytes.fromhex(fingerprint)
    if len(raw) != 16:
        raise ValueError(f"a namespace fingerprint is 32 hex digits, got {fingerprint!r}")
    part = as_part(part)
    return raw + _PART.pack(part.index, part.count)


def checksum(binding: bytes, key: bytes, version: int, payload_len: int, seq: int,
             payload: Any) -> int:
    """xxh3_64 over the binding (namespace, part), the key, the header fields and the payload."""
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
    """Builds values of one binding in one reused buffer; one user at a time (LMDB's writer)."""

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
        copy_bytes(self._view[start : start + len(payload)], payload)
        return self._view[: start + len(payload)]


def check_value(binding: bytes, key: bytes, value: Any, payload_bytes: int,
                out: memoryview) -> str | None:
    """None when ``value`` (prefix, header and payload, contiguous: what a slot holds
    without its padding) is a good value of ``key`` under ``binding`` (its payload is then
    in ``out``), else what is wrong with it."""
    parsed = parse_header(value, payload_bytes)
    if isinstance(parsed, str):
        return parsed
    (version, payload_len, seq, expected), start = parsed
    if len(value) - start != payload_len:
        return f"payload has {len(value) - start} bytes, header says {payload_len}"
    target = out[:payload_len]
    copy_bytes(target, value[start:])
    if checksum(binding, key, version, payload_len, seq, target) != expected:
        return CHECKSUM_MISMATCH
    return None


CHECKSUM_MISMATCH = "checksum mismatch (damaged, or a value of another key, namespace or part)"


def parse_header(value: Any, payload_bytes: int | None = None) -> tuple[list[int], int] | str:
    """(the 4 header fields, where the payload starts) of a value's prefix and header, or
    what is wrong with them (the checks 1-4 of docs/on-disk-format.md, and with
    ``payload_bytes`` the length field's check against the tier's)."""
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
            and all(is_int(item, low=0) for item in fields)):
        return "header is not an array of 4 unsigned ints"
    if msgpack.packb(fields) != header:
        return "header is not canonical msgpack"
    if fields[0] != FORMAT_VERSION:
        return f"format version {fields[0]}, this build reads {FORMAT_VERSION}"
    if payload_bytes is not None and fields[1] != payload_bytes:
        return f"payload length field {fields[1]}, the tier stores {payload_bytes}"
    return fields, start


def slot_bytes_for(payload_bytes: int) -> int:
    """Bytes of one slab slot: the header block, then the payload padded to :data:`ALIGN`."""
    return HEADER_BLOCK + -(-payload_bytes // ALIGN) * ALIGN


def seal(binding: bytes, key: bytes, payload: Any, seq: int) -> tuple[bytes, int]:
    """(prefix + header, checksum) of ``key``'s value holding ``payload`` at ``seq``."""
    size = len(payload)
    check = checksum(binding, key, FORMAT_VERSION, size, seq, payload)
    header: bytes = msgpack.packb([FORMAT_VERSION, size, seq, check])
    return _PREFIX.pack(MAGIC, len(header)) + header, check


class IndexEntry(NamedTuple):
    """Where a chunk's payload is (slab file, slot) and what the slot's header must say."""

    slab: int
    slot: int
    payload_len: int
    seq: int
    checksum: int


def check_slot(binding: bytes, key: bytes, head: Any, entry: IndexEntry, payload_bytes: int,
               out: memoryview) -> str | None:
    """None when the slot whose header block is ``head`` and whose payload was read into
    ``out[:payload_bytes]`` holds ``key``'s value that ``entry`` names; else what is wrong.
    The sequence and checksum must equal the index entry's: a slot freed and written again
    (another key, or a newer write of this one) never answers for an older entry."""
    if entry.payload_len != payload_bytes:
        return f"index says {entry.payload_len} payload bytes, the tier stores {payload_bytes}"
    parsed = parse_header(head, payload_bytes)
    if isinstance(parsed, str):
        return parsed
    (_, payload_len, seq, expected), _ = parsed
    if seq != entry.seq or expected != entry.checksum:
        return (f"slot {entry.slot} holds write {seq}, the index names write {entry.seq} "
                f"(slot reused, or a stale index entry)")
    if checksum(binding, key, FORMAT_VERSION, payload_len, seq, out[:payload_len]) != expected:
        return CHECKSUM_MISMATCH
    return None


def pack_index(entry: IndexEntry) -> bytes:
    return _INDEX.pack(*entry)


def unpack_index(raw: Any) -> IndexEntry | None:
    """The entry, or None for a malformed one."""
    if raw is None or len(raw) != _INDEX.size:
        return None
    return IndexEntry(*(int(field) for field in _INDEX.unpack(bytes(raw))))
