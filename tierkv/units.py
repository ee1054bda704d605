"""Byte sizes: the constants, one formatter and one parser (settings, messages, summaries).
Everything tierkv prints is in binary units (KiB = 1024 B ... TiB), rates too.

- ``format_bytes(n)`` for messages: ``64 GiB``, ``1.5 MiB``, ``512 B`` (whole units exact);
  ``format_bytes(n, 2)`` for summary lines: ``2.25 GiB``, ``140.00 KiB``.
- ``format_rate(n, seconds)``: ``n`` bytes over ``seconds`` as ``1.23 GiB/s``,
  ``850.00 MiB/s``; ``n/a`` without a positive duration.
- ``parse_size("64GiB")``: ints, or a number with a unit: binary (``KiB`` ... ``TiB``, any
  case; one upper-case letter ``K M G T`` as vLLM reads it), decimal (``kB`` ... ``TB``;
  one lower-case letter ``k m g t``), or ``B``; ``ValueError`` for anything else.

A size setting's check (an int of bytes or a size string) is :mod:`tierkv.settings`'s.
"""

from __future__ import annotations

import re

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
_UNITS = ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))


def format_bytes(num_bytes: int, decimals: int | None = None) -> str:
    """``num_bytes`` in the largest binary unit it reaches; see the module docstring."""
    for unit, name in _UNITS:
        if num_bytes >= unit:
            if decimals is not None:
                return f"{num_bytes / unit:.{decimals}f} {name}"
            if num_bytes % unit == 0:
                return f"{num_bytes // unit} {name}"
            return f"{num_bytes / unit:.1f} {name}"
    return f"{num_bytes} B"


def format_rate(num_bytes: int, seconds: float, decimals: int = 2) -> str:
    """``num_bytes`` per ``seconds`` in the largest binary unit the rate reaches, per second
    (``1.23 GiB/s``, ``850.00 MiB/s``, ``12 B/s``); ``n/a`` when ``seconds`` is not positive."""
    if not seconds > 0:
        return "n/a"
    per_second = num_bytes / seconds
    if per_second < KiB:
        return f"{per_second:.0f} B/s"
    return f"{format_bytes(int(per_second), decimals)}/s"


_BINARY = {"kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
# One letter, as vLLM's sizes (``human_readable_int``): upper case binary, lower decimal.
_LETTER = {"K": KiB, "M": MiB, "G": GiB, "T": TiB, "k": 10**3, "m": 10**6, "g": 10**9,
           "t": 10**12}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(text: str) -> int:
    """``68719476736``, ``64GiB``, ``512MiB``, ``1.5GiB``, ``32G`` (GiB, as vLLM reads it),
    ``500MB`` (10**6: SI), ``10k`` (vLLM's lower-case letters are decimal) -> bytes: a whole
    number of bytes, at least 0; ``ValueError`` naming the text otherwise."""
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if match is not None:
        number, unit = match.groups()
        scale = _LETTER.get(unit) or _BINARY.get(unit.lower()) or _DECIMAL.get(unit.lower()) \
            or (1 if unit.lower() in ("", "b") else None)
        if scale is not None:
            size = float(number) * scale
            if size == int(size):
                return int(size)
    raise ValueError(f"not a size: {text!r} (an int of bytes, or e.g. 64GiB, 32G = 32 GiB, "
                     f"500MB = 500 x 10**6)")
