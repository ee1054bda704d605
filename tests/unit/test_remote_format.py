"""The remote tier's value format: only the exact value of (namespace, part, key) passes."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.profiles import thorough
from tierkv.keys import Part
from tierkv.tiers.remote.format import HEADER_BYTES, check_value, pack_value, redis_key

FP = "802a6c76d0e36bab4a92f7e8a8c80f25"
OTHER_FP = "0123456789abcdef0123456789abcdef"
KEY = bytes(range(32))
PAYLOAD = os.urandom(4096)


def check(value: bytes, fp: str = FP, part: Part | int = 0, key: bytes = KEY) -> str | None:
    out = memoryview(bytearray(len(PAYLOAD)))
    problem = check_value(fp, part, key, value, len(PAYLOAD), out)
    if problem is None:
        assert bytes(out) == PAYLOAD
    return problem


def test_a_value_round_trips_and_its_header_is_80_bytes() -> None:
    value = pack_value(FP, 0, KEY, PAYLOAD)
    assert len(value) == HEADER_BYTES + len(PAYLOAD) == 80 + 4096
    assert value[:4] == b"TKRV" and value[HEADER_BYTES:] == PAYLOAD
    assert check(value) is None


@pytest.mark.parametrize("what,args", [
    ("another namespace", dict(fp=OTHER_FP)),
    ("another part", dict(part=Part(1, 2))),
    ("another part count", dict(part=Part(0, 2))),
    ("another key", dict(key=bytes(32))),
])
def test_a_value_read_for_another_namespace_part_or_key_fails(what: str, args: dict) -> None:
    assert check(pack_value(FP, 0, KEY, PAYLOAD), **args) is not None, what


@pytest.mark.parametrize("edit", [
    lambda v: v[:-1], lambda v: v + b"\0", lambda v: v[:HEADER_BYTES - 1], lambda v: b"",
    lambda v: b"XKRV" + v[4:], lambda v: v[:4] + b"\x01" + v[5:], lambda v: v[:4] + b"\x03" + v[5:],
])
def test_truncated_extended_or_misframed_values_fail(edit: object) -> None:
    assert check(edit(pack_value(FP, 0, KEY, PAYLOAD))) is not None  # type: ignore[operator]


@thorough(60)
@given(st.integers(0, HEADER_BYTES + len(PAYLOAD) - 1), st.integers(1, 255))
def test_any_changed_byte_fails(position: int, flip: int) -> None:
    value = bytearray(pack_value(FP, 0, KEY, PAYLOAD))
    value[position] ^= flip
    assert check(bytes(value)) is not None


@pytest.mark.parametrize("position", range(HEADER_BYTES))
def test_every_header_byte_is_checked(position: int) -> None:
    """The reserved bytes 76..79 too: a flip there passed (struct skips pad bytes)."""
    value = bytearray(pack_value(FP, 0, KEY, PAYLOAD))
    value[position] ^= 1
    assert check(bytes(value)) is not None


def test_the_parts_of_a_chunk_share_one_hash_tag_under_every_part_count() -> None:
    keys = [redis_key(b"tierkv:", FP, part, KEY)
            for part in (Part(0, 1), Part(0, 2), Part(1, 2), Part(3, 4))]
    assert keys[0] == b"tierkv:" + FP.encode() + b":{" + KEY.hex().encode() + b"}:0of1"
    assert keys[2].endswith(b"}:1of2")
    tags = {k[k.index(b"{") + 1 : k.index(b"}")] for k in keys}
    assert tags == {KEY.hex().encode()}


def test_a_redis_key_parses_back_and_other_keys_do_not() -> None:
    from tierkv.tiers.remote.format import parse_redis_key

    from tierkv.tiers.remote.format import parse_old_key

    name = redis_key(b"tierkv:", FP, Part(3, 4), KEY)
    assert parse_redis_key(b"tierkv:", name) == (FP, Part(3, 4), KEY)
    for other in (name[:-2], b"tierkv:not-a-chunk", name.replace(b"{", b""),
                  b"elsewhere:" + name[len(b"tierkv:"):], name + b"x", name[:-4] + b"4of4",
                  name[:-4] + b"03of4"):
        assert parse_redis_key(b"tierkv:", other) is None
    # A key of tierkv format 4 (one per rank) is not a part's: the tools name it as old.
    old = name[:-4] + b"3"
    assert parse_redis_key(b"tierkv:", old) is None
    assert parse_old_key(b"tierkv:", old) == (FP, 3, KEY)
