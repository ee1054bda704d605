"""tierkv's statistics model: each figure is declared once, as a field of the record that
holds it.

- :func:`counter` / :func:`gauge`  declare a record's field as a figure: its name is the
  field's, its kind (a counter only grows; a gauge is a value now) and a help text.
- :func:`figures`                  the figures a record type declares (:class:`Figure`:
  name, kind, help, record), in field order.
- :func:`values`                   a record's figures by name, optionally of one kind.
- :class:`Snapshot`                a read-only snapshot of a record of counters, which
  derives from it (the counters declared once).

A record is a dataclass: the hot path increments plain attributes
(``counters.loads_cpu += 1``), never a dict by string. Everything that reports them reads
the model: ``statistics()`` and ``figures()`` snapshots, the vLLM connector's payloads and
log line, and the Prometheus exporters (:mod:`tierkv.engine.metrics`, whose metrics that
read one figure take their kind and help from its declaration). A new figure is one field.

A field declared ``reported=False`` is kept on its record (tests and tools read it) but
left out of :func:`values`: a sum reported under another name, or one another record's
figure already counts.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field, fields, is_dataclass
from typing import Any, Literal, Self

Kind = Literal["counter", "gauge"]
_FIGURE = "tierkv.figure"  # the field metadata key holding a figure's (kind, help, reported)
_DECLARED: dict[type, tuple[Figure, ...]] = {}  # figures() by record type, read once


@dataclass(frozen=True)
class Figure:
    name: str  # the field's name: the key in statistics(), figures() and payloads
    kind: Kind
    help: str
    record: str  # the record (class) that declares it
    reported: bool = True


def counter(help: str, *, reported: bool = True, default: float = 0) -> Any:
    """A counter field (starts at ``default``, only grows)."""
    return field(default=default, metadata={_FIGURE: ("counter", help, reported)})


def gauge(help: str, *, reported: bool = True) -> Any:
    """A gauge field (a value now; no default: the snapshot sets it)."""
    return field(metadata={_FIGURE: ("gauge", help, reported)})


def figures(record: type) -> tuple[Figure, ...]:
    """The figures ``record`` (a dataclass) declares, in field order."""
    known = _DECLARED.get(record)
    if known is not None:
        return known
    assert is_dataclass(record), record
    out = []
    for item in fields(record):
        declared = item.metadata.get(_FIGURE)
        if declared is not None:
            kind, help, reported = declared
            out.append(Figure(item.name, kind, help, record.__name__, reported))
    known = _DECLARED[record] = tuple(out)
    return known


class Snapshot:
    """A read-only snapshot of a record of counters, declared as a dataclass deriving from
    this mixin and the mutable record (``class IndexStats(Snapshot, Counters)``), so the
    counters are declared once. It refuses a second assignment, as a frozen dataclass does
    (declare it ``unsafe_hash=True`` to keep it hashable)."""

    @classmethod
    def of(cls, counters: object, **gauges: Any) -> Self:
        """The snapshot of ``counters`` and ``gauges`` (the snapshot's other fields, every
        one), made without the assignments ``__init__`` checks one by one: as cheap as a
        frozen dataclass's."""
        snapshot = object.__new__(cls)
        snapshot.__dict__.update(vars(counters), **gauges)
        assert len(snapshot.__dict__) == len(fields(cls)), sorted(gauges)  # type: ignore[arg-type]
        return snapshot

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")


def values(record: object, kind: Kind | None = None) -> dict[str, Any]:
    """``record``'s reported figures by name (only those of ``kind`` if given)."""
    return {figure.name: getattr(record, figure.name) for figure in figures(type(record))
            if figure.reported and (kind is None or figure.kind == kind)}


__all__ = ["Figure", "Kind", "Snapshot", "counter", "figures", "gauge", "values"]
