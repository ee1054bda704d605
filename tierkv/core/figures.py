"""tierkv's statistics model: each figure is declared once, as a field of the record that
holds it, and each object keeps one record (as trio does).

- :func:`counter` / :func:`gauge`  a record's field as a figure: its name is the field's,
  its kind (a counter only grows; a gauge is a value now) and a help text.
- :func:`per`                      a field of sub-records keyed by medium or path
  (``stats.tier["disk"].declined_tokens``): their figures are the record's, as
  ``<figure>_<key>`` (``declined_tokens_disk``).
- :class:`Record`                  a record's base: ``record.snapshot(**gauges)`` is a
  read-only copy of the same class (its sub-records and nested records copied too).
- :func:`figures` / :func:`values`  the figures a record type declares (:class:`Figure`),
  in field order; a record's reported figures by name, optionally of one kind.

The hot path increments plain attributes (``counts.loads_cpu += 1``), never a dict by
string. Everything that reports reads the model: ``statistics()`` (snapshots), the flat
figures of ``figures()``, the vLLM connector's payloads and log line, the Prometheus
exporters (:mod:`tierkv.engine.metrics`). A new figure is one field. One declared
``reported=False`` is kept on its record (tests and tools read it) but left out of
:func:`values`: a sum reported under another name, or what another record counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import FrozenInstanceError, dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import Any, Literal, Self

Kind = Literal["counter", "gauge"]
_FIGURE = "tierkv.figure"  # the field metadata key holding a figure's (kind, help, reported)
_PER = "tierkv.per"  # the field metadata key of a field of sub-records: (keys, record type)
_DECLARED: dict[type, tuple[Figure, ...]] = {}  # figures() by record type, read once
_FROZEN: dict[type, type] = {}  # a record type's read-only twin, made once (not declared)
_SHAPES: dict[type, _Shape] = {}


@dataclass(frozen=True)
class Figure:
    name: str  # the key in figures() and payloads: the field's (of a sub-record: _<key>)
    kind: Kind
    help: str
    record: str  # the record (class) that declares it
    reported: bool = True
    field: str = ""  # the field's name (of a sub-record: the sub-record's field)
    key: str | None = None  # a sub-record's key (the medium, the path); None: the record's own


def counter(help: str, *, reported: bool = True, default: float = 0) -> Any:
    """A counter field (starts at ``default``, only grows)."""
    return field(default=default, metadata={_FIGURE: ("counter", help, reported)})


def gauge(help: str, *, reported: bool = True) -> Any:
    """A gauge field (a value now: 0 in the running record, which ``snapshot`` sets)."""
    return field(default=0, metadata={_FIGURE: ("gauge", help, reported)})


def per(keys: tuple[str, ...], record: Callable[[], Any]) -> Any:
    """A field of sub-records, one ``record()`` per key (a medium, a path), as a dict."""
    return field(default_factory=lambda: {key: record() for key in keys},
                 metadata={_PER: (keys, record)})


def figures(record: type) -> tuple[Figure, ...]:
    """The figures ``record`` (a dataclass) declares, in field order; a :func:`per` field's
    as ``<figure>_<key>`` for each key and figure of its sub-record."""
    known = _DECLARED.get(record)
    if known is not None:
        return known
    assert is_dataclass(record), record
    out = []
    for item in fields(record):
        declared = item.metadata.get(_FIGURE)
        if declared is not None:
            kind, help, reported = declared
            out.append(Figure(item.name, kind, help, record.__name__, reported, item.name))
        elif _PER in item.metadata:
            keys, sub = item.metadata[_PER]
            out.extend(Figure(_flat(figure.name, key), figure.kind, f"{figure.help} ({key})",
                              record.__name__, figure.reported, figure.name, key)
                       for key in keys for figure in figures(sub))
    known = _DECLARED[record] = tuple(out)
    return known


def _flat(figure: str, key: str) -> str:
    """The flat name of a sub-record's ``figure`` under ``key``: ``declined_tokens_disk``."""
    return f"{figure}_{key}"


@dataclass(frozen=True)
class _Shape:
    gauges: frozenset[str]  # the gauge fields (a snapshot sets each)
    subs: tuple[str, ...]  # the per-key fields (dicts of sub-records)
    nested: tuple[str, ...]  # the fields made as a nested record (default_factory)
    own: tuple[Figure, ...]  # the record's own figures


def _shape(record: type) -> _Shape:
    """What a snapshot and values() walk of ``record``, read once."""
    shape = _SHAPES.get(record)
    if shape is None:
        own = tuple(figure for figure in figures(record) if figure.key is None)
        made = {item.name: item.default_factory for item in fields(record)}
        shape = _SHAPES[record] = _Shape(
            frozenset(figure.name for figure in own if figure.kind == "gauge"),
            tuple(item.name for item in fields(record) if _PER in item.metadata),
            tuple(name for name, factory in made.items()
                  if isinstance(factory, type) and issubclass(factory, Record)), own)
    return shape


def values(record: object, kind: Kind | None = None) -> dict[str, Any]:
    """``record``'s reported figures by name (only those of ``kind`` if given); a
    :func:`per` field's as ``<figure>_<key>``."""
    shape = _shape(_declared(type(record)))
    out = {figure.name: getattr(record, figure.name) for figure in shape.own
           if figure.reported and (kind is None or figure.kind == kind)}
    for name in shape.subs:
        for key, sub in getattr(record, name).items():
            out.update((_flat(figure, key), value) for figure, value in values(sub, kind).items())
    return out


class _ReadOnly:
    """What a snapshot's class adds to its record's: it refuses a second assignment, as a
    frozen dataclass does, hashes, and pickles as a snapshot."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __hash__(self) -> int:
        return hash(tuple(tuple(value.items()) if isinstance(value, Mapping) else value
                          for value in vars(self).values()))

    def __reduce__(self) -> tuple[Any, ...]:
        return _thawed, (_declared(type(self)), {
            name: dict(value) if isinstance(value, Mapping) else value
            for name, value in vars(self).items()})


def _thawed(record: type[Record], state: dict[str, Any]) -> Record:
    """The snapshot of ``record`` pickled as ``state``."""
    return record(**state)._copy({})


def _frozen(record: type) -> type:
    """``record``'s read-only twin (:class:`_ReadOnly` over it), made once, never declared."""
    twin = _FROZEN.get(record)
    if twin is None:
        twin = _FROZEN[record] = type(record.__name__, (_ReadOnly, record), {
            "__module__": record.__module__, "__qualname__": record.__qualname__,
            "_twin_of": record})
    return twin


def _declared(record: type) -> type:
    """The declared record of ``record`` (itself, or the class its read-only twin copies)."""
    return record.__dict__.get("_twin_of", record)  # type: ignore[no-any-return]


class Record:
    """A record of figures (declare it ``@dataclass(eq=False)``): one per object, mutable
    while it counts; :meth:`snapshot` is a read-only copy of the same class. Records are
    equal when they are of the same class and hold the same values."""

    def snapshot(self, **now: Any) -> Self:
        """A read-only copy, with ``now`` set (every gauge it declares, and any other field:
        a nested record's snapshot). Sub-records and nested records are copied read-only."""
        gauges = _shape(_declared(type(self))).gauges
        assert gauges <= now.keys(), sorted(gauges - now.keys())
        return self._copy(now)

    def _copy(self, now: dict[str, Any]) -> Self:
        declared = _declared(type(self))
        shape = _shape(declared)
        state = dict(vars(self))
        state.update(now)
        for name in shape.subs:
            state[name] = MappingProxyType({key: sub._copy({})
                                            for key, sub in state[name].items()})
        for name in shape.nested:
            if name not in now:
                state[name] = state[name]._copy({})
        copy: Self = object.__new__(_frozen(declared))
        copy.__dict__.update(state)
        return copy

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return _declared(type(self)) is _declared(type(other)) and vars(self) == vars(other)

    __hash__ = None  # type: ignore[assignment]  # a running record changes; a snapshot hashes


__all__ = ["Figure", "Kind", "Record", "counter", "figures", "gauge", "per", "values"]
