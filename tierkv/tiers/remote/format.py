"""The remote tier's keys and values (``docs/remote.md`` has every byte).

Primitives and contracts:

- :func:`redis_key` is one key per (chunk, part) (:func:`parse_redis_key` reads one back):
  ``<prefix><fingerprint>:{<key hex>}:<p>of<P>``. The braces are a Redis Cluster hash tag:
  every part of a chunk (under any part count) hashes to one slot, so one node answers
  whether all of them exist and a reshard moves them together. Format 1 (tierkv format 4)
  named a rank instead (``:<rank>``): :func:`parse_old_key` finds those, for the tools.
- A value is a fixed 80-byte header, then the raw payload: magic ``b"TKRV"``, format
  version, header length, the namespace fingerprint, the part (index, count), the chunk
  key, the payload length and an xxh3 checksum (:func:`tierkv.tiers.disk.format.checksum`
  with sequence 0: over the fingerprint, part, key, header fields and payload).
- :func:`pack_value` builds one; :func:`check_value` accepts only a value this build would
  have written for that namespace, part, key and payload size, and copies its payload into
  the caller's buffer (then checks the checksum there). It answers what is wrong, never
  raises on bad bytes and never evaluates anything; :func:`check_name` says which check
  failed (``header``, ``checksum``; a reader's own checks: ``size``, ``type``).
- A reader asks for at most :func:`value_bytes` ``+ 1`` bytes (``GETRANGE``): a value of
  any other length is bad before its bytes are read.
- :data:`DELETE_BAD` deletes a bad value by what it was, never by sending it back: a key
  that holds no string or a string of the wrong length is deleted whatever it holds (no
  good value looks like that); one of the right length only while its SHA-1 is still the
  one of the bad bytes read (another engine may have stored a good value meanwhile).
"""

from __future__ import annotations

import re
import struct
from typing import Any

from tierkv.keys import Part, as_part, parse_part
from tierkv.tiers.disk.format import binding_of, checksum, copy_bytes

MAGIC = b"TKRV"
REMOTE_FORMAT = 2  # 1: tierkv format 4, one value per rank (u32 rank at offset 24)
_HEADER = struct.Struct("<4sHH16sHH32sQQ4s")  # the last 4 bytes: reserved, zero
HEADER_BYTES = _HEADER.size  # 80


def value_bytes(payload_bytes: int) -> int:
    """Length of every good value of a tier storing ``payload_bytes`` per chunk."""
    return HEADER_BYTES + payload_bytes


# KEYS[1]: the key; ARGV[1]: the length of a good value; ARGV[2]: the SHA-1 (hex) of the
# bad value read, "" when its type or length alone made it bad. Returns 1 if deleted.
DELETE_BAD = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
if kind ~= 'string' or redis.call('STRLEN', KEYS[1]) ~= tonumber(ARGV[1]) then
  return redis.call('DEL', KEYS[1])
end
if ARGV[2] ~= '' and redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
CHECKSUM_PROBLEM = "checksum mismatch (damaged, or bytes of another chunk)"


def check_name(problem: str) -> str:
    """Which check a :func:`check_value` answer failed: ``checksum`` or ``header``."""
    return "checksum" if problem == CHECKSUM_PROBLEM else "header"


def redis_key(prefix: bytes, fingerprint: str, part: Part | int, key: bytes) -> bytes:
    """The Redis key of chunk ``key``'s ``part`` in the namespace ``fingerprint``."""
    return b"%s%s:{%s}:%s" % (prefix, fingerprint.encode(), key.hex().encode(),
                              as_part(part).name.encode())


_NAME = re.compile(rb"^(?P<fp>[0-9a-f]{32}):\{(?P<key>[0-9a-f]{64})\}:(?P<part>[0-9]+of[0-9]+)$")
_OLD_NAME = re.compile(rb"^(?P<fp>[0-9a-f]{32}):\{(?P<key>[0-9a-f]{64})\}:(?P<rank>[0-9]+)$")


def parse_redis_key(prefix: bytes, name: bytes) -> tuple[str, Part, bytes] | None:
    """(fingerprint, part, chunk key) of a :func:`redis_key` under ``prefix``; None for
    any other key."""
    match = _NAME.match(name[len(prefix):]) if name.startswith(prefix) else None
    part = parse_part(match["part"].decode()) if match is not None else None
    if match is None or part is None:
        return None
    return match["fp"].decode(), part, bytes.fromhex(match["key"].decode())


def parse_old_key(prefix: bytes, name: bytes) -> tuple[str, int, bytes] | None:
    """(fingerprint, rank, chunk key) of a key of tierkv format 4 (one value per rank,
    ``...:<rank>``), which this build never reads; None for any other key."""
    match = _OLD_NAME.match(name[len(prefix):]) if name.startswith(prefix) else None
    if match is None:
        return None
    return match["fp"].decode(), int(match["rank"]), bytes.fromhex(match["key"].decode())


def pack_value(fingerprint: str, part: Part | int, key: bytes, payload: Any) -> bytearray:
    """Header and payload of ``key``'s value, in one buffer (one copy of the payload)."""
    part = as_part(part)
    view = memoryview(payload).cast("B")
    size = len(view)
    digest = checksum(binding_of(fingerprint, part), key, REMOTE_FORMAT, size, 0, view)
    out = bytearray(HEADER_BYTES + size)
    _HEADER.pack_into(out, 0, MAGIC, REMOTE_FORMAT, HEADER_BYTES, bytes.fromhex(fingerprint),
                      part.index, part.count, key, size, digest, bytes(4))
    copy_bytes(memoryview(out)[HEADER_BYTES:], view)
    return out


def read_header(pipe: Any, name: bytes) -> None:
    """Queue the read of the value ``name``'s header (:data:`HEADER_BYTES`) on ``pipe``."""
    pipe.getrange(name, 0, HEADER_BYTES - 1)


def header_payload_bytes(header: Any) -> int | None:
    """The payload length a value's first :data:`HEADER_BYTES` say (None: no header of
    this format there); the tools read only those bytes of a value."""
    if not isinstance(header, bytes) or len(header) < HEADER_BYTES or header[:4] != MAGIC:
        return None
    return int(_HEADER.unpack_from(header, 0)[7])


def check_value(fingerprint: str, part: Part | int, key: bytes, value: Any, payload_bytes: int,
                out: memoryview) -> str | None:
    """None when ``value`` is a good value of ``key`` (its payload is then in
    ``out[:payload_bytes]``), else what is wrong with it."""
    total = len(value)
    if total < HEADER_BYTES:
        return f"value of {total} bytes is shorter than its {HEADER_BYTES}-byte header"
    part = as_part(part)
    magic, version, header, stored_fp, stored_index, stored_count, stored_key, size, digest, \
        zero = _HEADER.unpack_from(value, 0)
    if magic != MAGIC:
        return f"bad magic {bytes(magic)!r}"
    if zero != bytes(4):
        return "reserved header bytes are not zero"
    if version != REMOTE_FORMAT or header != HEADER_BYTES:
        return f"format {version} with a {header}-byte header, this build reads " \
               f"{REMOTE_FORMAT} with {HEADER_BYTES}"
    if stored_fp.hex() != fingerprint:
        return f"value of namespace {stored_fp.hex()[:8]}, not {fingerprint[:8]}"
    if (stored_index, stored_count) != (part.index, part.count) or stored_key != key:
        return "value of another chunk or part"
    if size != payload_bytes or total - HEADER_BYTES != size:
        return f"payload of {total - HEADER_BYTES} bytes, header says {size}, the tier " \
               f"stores {payload_bytes}"
    target = out[:size]
    copy_bytes(target, memoryview(value)[HEADER_BYTES:])
    if checksum(binding_of(fingerprint, part), key, REMOTE_FORMAT, size, 0, target) != digest:
        return CHECKSUM_PROBLEM
    return None
