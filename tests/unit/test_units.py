"""One byte formatter, one rate formatter and one size parser for messages, summaries and
settings."""

from __future__ import annotations

import pytest

from tierkv.units import GiB, KiB, MiB, format_bytes, format_rate, parse_size


def test_format_bytes_messages_and_summaries() -> None:
    assert format_bytes(64 * GiB) == "64 GiB" and format_bytes(3 * MiB // 2) == "1.5 MiB"
    assert format_bytes(512) == "512 B" and format_bytes(256 * KiB) == "256 KiB"
    assert format_bytes(140 * KiB, 2) == "140.00 KiB" and format_bytes(9 * GiB // 4, 2) == "2.25 GiB"


def test_format_rate_is_binary_per_second() -> None:
    assert format_rate(3 * GiB, 2.0) == "1.50 GiB/s"  # 1.61 "GB/s" in decimal units
    assert format_rate(850 * MiB, 1.0) == "850.00 MiB/s" and format_rate(GiB, 4.0) == "256.00 MiB/s"
    assert format_rate(3 * KiB, 2.0) == "1.50 KiB/s" and format_rate(12, 1.0) == "12 B/s"
    assert format_rate(5 * GiB, 2.0, decimals=1) == "2.5 GiB/s"
    assert format_rate(GiB, 0.0) == "n/a" and format_rate(0, -1.0) == "n/a"
    assert format_rate(0, 3.0) == "0 B/s"


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
