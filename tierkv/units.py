"""Byte sizes: the constants, one formatter and one parser (settings, messages, summaries).

- ``format_bytes(n)`` for messages: ``64 GiB``, ``1.5 MiB``, ``512 B`` (whole units exact);
  ``format_bytes(n, 2)`` for summary lines: ``2.25 GiB``, ``140.00 KiB``.
- ``parse_size("64GiB")``: ints, or a number with a binary unit (``B``, ``KiB``, ``MiB``,
  ``GiB``, ``TiB``, case-insensitive); ``ValueError`` for anything else.
"""

from __future__ import annotations

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


def parse_size(text: str) -> int:
    """``68719476736``, ``64GiB``, ``512MiB``, ``1.5GiB`` -> bytes."""
    lowered = text.strip().lower()
    for unit, name in (*_UNITS, (1, "B")):
        if lowered.endswith(name.lower()):
            number, scale = lowered[: -len(name)], unit
            break
    else:
        number, scale = lowered, 1
    try:
        return int(float(number) * scale)
    except ValueError as exc:
        raise ValueError(f"not a size: {text!r} (e.g. 64GiB)") from exc
