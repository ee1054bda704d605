"""The checks of a value's type and bounds, written once: every setting and argument of
tierkv that must be an int, a number or a flag is checked here.

- ``is_int(value, low, high)``: an int and not a bool (``True`` is an int to Python, never
  a count to tierkv), within the bounds given (each inclusive).
- ``is_number(value, low, high, above)``: an int or float, not a bool and not NaN, within
  ``[low, high]`` and, with ``above``, greater than it.
- ``check_int``, ``check_flag``: the same, returning the value, or raising
  ``error(f"{what} must be {need}, got {value!r}")`` (a :class:`ConfigError` unless told).
- ``int_need``, ``number_need``, ``FLAG_NEED``: the ``need`` of those messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NoReturn, TypeGuard

from tierkv.errors import ConfigError

FLAG_NEED = "true or false"


def is_int(value: object, low: int | None = None, high: int | None = None) -> TypeGuard[int]:
    """``value`` is an int (a subclass such as an ``IntEnum`` too), not a bool, and within
    ``[low, high]`` (a bound left None: no bound)."""
    return isinstance(value, int) and not isinstance(value, bool) \
        and (low is None or value >= low) and (high is None or value <= high)


def is_number(value: object, low: float | None = None, high: float | None = None,
              above: float | None = None) -> TypeGuard[int | float]:
    """``value`` is an int or float, not a bool, not NaN (it compares false with every
    bound), within ``[low, high]`` and greater than ``above`` (None: no such bound)."""
    return (is_int(value) or isinstance(value, float)) and not math.isnan(value) \
        and (low is None or value >= low) and (high is None or value <= high) \
        and (above is None or value > above)


def _bound(number: float) -> str:
    return f"{number:g}" if isinstance(number, float) else str(number)


def int_need(low: int | None = None, high: int | None = None) -> str:
    """``an int >= 1``, ``an int in [1, 65535]``, ``an int``: what :func:`is_int` takes."""
    if low is not None and high is not None:
        return f"an int in [{low}, {high}]"
    return f"an int >= {low}" if low is not None else \
        f"an int <= {high}" if high is not None else "an int"


def number_need(low: float | None = None, high: float | None = None,
                above: float | None = None) -> str:
    """``a number within [0, 1]``, ``a number > 0``, ``a number >= 0``: what
    :func:`is_number` takes."""
    parts = []
    if low is not None and high is not None:
        parts.append(f"within [{_bound(low)}, {_bound(high)}]")
    elif low is not None:
        parts.append(f">= {_bound(low)}")
    elif high is not None:
        parts.append(f"<= {_bound(high)}")
    if above is not None:
        parts.append(f"> {_bound(above)}")
    return " ".join(["a number", *parts])


def _raise(error: Callable[[str], Exception], what: str, need: str, value: object) -> NoReturn:
    raise error(f"{what} must be {need}, got {value!r}")


def check_int(what: str, value: object, low: int | None = None, high: int | None = None,
              error: Callable[[str], Exception] = ConfigError) -> int:
    """``value`` if :func:`is_int` takes it; else ``error`` naming ``what`` and the value."""
    if not is_int(value, low, high):
        _raise(error, what, int_need(low, high), value)
    return value


def check_flag(what: str, value: object,
               error: Callable[[str], Exception] = ConfigError) -> bool:
    """``value`` if it is a bool (not 0 or 1, not "yes"); else ``error`` naming ``what``."""
    if not isinstance(value, bool):
        _raise(error, what, FLAG_NEED, value)
    return value
