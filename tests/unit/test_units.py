"""One byte formatter and one size parser for messages, summaries and settings."""

from __future__ import annotations

import pytest

from tierkv.units import GiB, KiB, MiB, format_bytes, parse_size


def test_format_bytes_messages_and_summaries() -> None:
    assert format_bytes(64 * GiB) == "64 GiB" and format_bytes(3 * MiB // 2) == "1.5 MiB"
    assert format_bytes(512) == "512 B" and format_bytes(256 * KiB) == "256 KiB"
    assert format_bytes(140 * KiB, 2) == "140.00 KiB" and format_bytes(9 * GiB // 4, 2) == "2.25 GiB"


@pytest.mark.parametrize("text,size", [("68719476736", 64 * GiB), ("64GiB", 64 * GiB),
                                       ("512mib", 512 * MiB), ("1.5GiB", 3 * GiB // 2),
                                       (" 4 KiB ", 4 * KiB), ("10B", 10), ("32G", 32 * GiB),
                                       ("2T", 2 << 40), ("500MB", 500 * 10**6),
                                       ("1gb", 10**9), ("10k", 10_000), ("3M", 3 * MiB),
                                       ("0", 0)])
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "lots", "1.2.3MiB", "-1GiB", "1.5B", "4 parsecs",
                                  "1e9", "0x10"])
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)
