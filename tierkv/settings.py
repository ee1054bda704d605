"""Settings declared once: a setting is a dataclass field whose metadata says what it takes.

A field's name, type and default are the dataclass's; :func:`setting` adds the rest (a
:class:`Setting`: kind, bounds, choices, unit, help), and :func:`check_settings` checks
every declared field of a config against it, in its ``__post_init__``. The vLLM
connector's settings are the library's under the connector's names: :func:`derived`
copies a field's declaration (its default too, unless told another), so the connector
checks a value as the library does and says the same of it.

- ``setting(default, *, kind, low, high, above, choices, optional, unit, help)``: a field;
  ``field(metadata=required(kind, ...))``: one without a default;
  ``derived(cls, name, ...)``: the field ``cls.name`` is, under another name.
- :func:`declared`: a config class's declared fields (``name -> Setting``).
- :meth:`Setting.accept`: a value as the setting holds it, or :data:`INVALID`;
  :meth:`Setting.from_text`: a value from text (an environment variable), or INVALID;
  :meth:`Setting.need`: what it takes, in words (``an int >= 1``).
- :func:`check_settings`: each declared field of a config, or a ``ConfigError``
  ``<section>.<name> must be <need>, got <value>``; sizes become ints.

Kinds: ``int``, ``number`` (int or float, never NaN), ``flag`` (a bool), ``size`` (an
int of bytes or a size string, :func:`tierkv.units.parse_size`), ``choice``, ``str``,
``path`` (a non-empty str or ``os.PathLike``, held as the str). ``optional``: None too.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from tierkv.checks import FLAG_NEED, int_need, is_int, is_number, number_need
from tierkv.errors import ConfigError
from tierkv.units import parse_size

KINDS = ("int", "number", "flag", "size", "choice", "str", "path")
INVALID: Any = object()  # what Setting.accept returns for a value it does not take
_KEY = "tierkv.setting"  # the metadata key of a field's Setting


@dataclass(frozen=True)
class Setting:
    """What one setting takes, and what it is for (see the module docstring)."""

    kind: str
    low: float | None = None  # inclusive bounds (a size's low: 1 unless told)
    high: float | None = None
    above: float | None = None  # an exclusive lower bound: a number > 0
    choices: tuple[Any, ...] = ()
    optional: bool = False  # None is a value too
    unit: str = ""  # "bytes", "seconds", ...
    help: str = ""
    source: str = ""  # the library setting a connector setting is ("CpuTierConfig.max_bytes")

    def accept(self, value: Any) -> Any:
        """``value`` as the setting holds it (a size string as its int), or :data:`INVALID`."""
        if value is None:
            return None if self.optional else INVALID
        kind, low, high = self.kind, self.low, self.high
        if kind == "int":
            ok = is_int(value, _int(low), _int(high))
        elif kind == "number":
            ok = is_number(value, low, high, self.above)
        elif kind == "flag":
            ok = isinstance(value, bool)
        elif kind == "size":
            if isinstance(value, str):
                try:
                    value = parse_size(value)
                except ValueError:
                    return INVALID
            ok = is_int(value, 1 if low is None else _int(low), _int(high))
        elif kind == "choice":
            ok = isinstance(value, str) and value in self.choices
        elif kind == "str":
            ok = isinstance(value, str)
        else:  # path
            text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
            ok, value = isinstance(text, str) and bool(text) and "\0" not in text, text
        return value if ok else INVALID

    def from_text(self, text: str) -> Any:
        """The value ``text`` (an environment variable's) stands for, as this setting's kind
        reads it: ``none`` (any case) or nothing for None when optional, ``true``/``false``
        (``1``/``0``, ``yes``/``no``, ``on``/``off``) for a flag, a number for an int or a
        number; :data:`INVALID` when it is none of what the kind takes. What comes back is
        checked as any value is (:meth:`accept`)."""
        text = text.strip()
        if self.optional and text.lower() in ("", "none", "null"):
            return None
        kind = self.kind
        try:
            if kind == "int" or (kind == "size" and text.isdigit()):
                value: Any = int(text)
            elif kind == "number":
                value = float(text)
            elif kind == "flag":
                value = {"true": True, "1": True, "yes": True, "on": True, "false": False,
                         "0": False, "no": False, "off": False}[text.lower()]
            else:
                value = text
        except (ValueError, KeyError):
            return INVALID
        return self.accept(value)

    def need(self, none: str = "None") -> str:
        """What the setting takes, as the end of ``<name> must be ...`` (``none``: how the
        message writes None, ``null`` to a JSON config)."""
        kind, low, high = self.kind, self.low, self.high
        if kind == "int":
            need = int_need(_int(low), _int(high))
        elif kind == "number":
            need = number_need(low, high, self.above)
        elif kind == "flag":
            need = FLAG_NEED
        elif kind == "size":
            need = (f"{int_need(1 if low is None else _int(low), _int(high))} (bytes) or a "
                    f"size such as '32GiB' or '32G'")
        elif kind == "choice":
            need = f"one of {list(self.choices)}"
        elif kind == "str":
            need = "a str"
        else:
            need = "a directory path (a non-empty str or Path)"
        return need + (f" or {none}" if self.optional else "")


def _int(bound: float | None) -> int | None:
    return None if bound is None else int(bound)


def _spec(default: Any, kind: str | None, choices: tuple[Any, ...], unit: str) -> str:
    """The kind a declaration leaves out, from its choices, unit and default."""
    if kind is None:
        kind = "choice" if choices else "size" if unit == "bytes" else \
            "flag" if isinstance(default, bool) else "int" if is_int(default) else \
            "number" if isinstance(default, float) else ""
    if kind not in KINDS:
        raise TypeError(f"setting: kind must be one of {list(KINDS)}, got {kind!r}")
    return kind


def setting(default: Any, *, kind: str | None = None, low: float | None = None,
            high: float | None = None, above: float | None = None,
            choices: tuple[Any, ...] = (), optional: bool = False, unit: str = "",
            help: str = "") -> Any:
    """A dataclass field with ``default``, declared as the module docstring says."""
    spec = Setting(_spec(default, kind, choices, unit), low, high, above, tuple(choices),
                   optional or default is None, unit, help)
    return field(default=default, metadata={_KEY: spec})


def required(kind: str, *, low: float | None = None, high: float | None = None,
             unit: str = "", help: str = "") -> dict[str, Setting]:
    """The metadata of a field without a default (an argument the caller must give):
    ``name: int = field(metadata=required("int", low=1))``."""
    return {_KEY: Setting(_spec(None, kind, (), unit), low, high, unit=unit, help=help)}


def derived(cls: type[Any], name: str, *, default: Any = MISSING, help: str = "") -> Any:
    """A field declared as ``cls.name`` is (kind, bounds, choices, unit, help), with its
    default unless ``default`` is given; ``help`` says what differs under this name."""
    spec = declared(cls)[name]
    source: Field[Any] = next(f for f in fields(cls) if f.name == name)
    value = source.default if default is MISSING else default
    spec = Setting(spec.kind, spec.low, spec.high, spec.above, spec.choices,
                   spec.optional or value is None, spec.unit,
                   f"{spec.help}; {help}" if help else spec.help, f"{cls.__name__}.{name}")
    return field(default=value, metadata={_KEY: spec})


def declared(cls: Any) -> dict[str, Setting]:
    """The declared settings of a config class (or instance), in field order."""
    return {f.name: f.metadata[_KEY] for f in fields(cls) if _KEY in f.metadata}


def check_settings(config: Any, section: str = "") -> None:
    """Check each declared field of a frozen config (sizes become their ints); a
    :class:`ConfigError` names ``section.name`` (``name`` without a section) and the value."""
    for name, spec in declared(config).items():
        value = getattr(config, name)
        accepted = spec.accept(value)
        if accepted is INVALID:
            where = f"{section}.{name}" if section else name
            raise ConfigError(f"{where} must be {spec.need()}, got {value!r}")
        if spec.kind == "size" and accepted is not value:
            object.__setattr__(config, name, accepted)
