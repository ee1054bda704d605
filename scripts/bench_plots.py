"""The benchmark scripts' ``--plot``: matplotlib, imported only when a plot is asked for
(:func:`pyplot`), and panels of median figures drawn as lines against the one setting a
script sweeps (:func:`lines`: bench_disk's chunk sizes, bench_remote's, bench_restart's
chunk counts). bench_ttft draws its own panels on :func:`pyplot`."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NEEDS = ("--plot needs matplotlib, which is not installed here: "
         "pip install -r requirements/dev.txt (the engine venv has it: requirements/engine.txt)")


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display), or exit naming what installs
    it. Call it before measuring, so a missing matplotlib stops a run before its minutes."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(NEEDS) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@dataclass(frozen=True)
class Panel:
    """One panel: ``series`` are (row of the figures, label, matplotlib format); a row not
    measured at every x is left out."""

    title: str
    ylabel: str
    series: Sequence[tuple[str, str, str]]


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    """The first and third quartile of the rounds (one round: its value twice)."""
    if len(values) < 2:
        return values[0], values[0]
    low, _, high = statistics.quantiles(values, n=4)
    return low, high


def lines(path: Path, by_x: Mapping[float, Mapping[str, float]], panels: Sequence[Panel], *,
          xlabel: str, title: str, tick: Callable[[float], str] = "{:g}".format,
          rounds: Mapping[float, Mapping[str, Sequence[float]]] | None = None) -> None:
    """A PNG of ``panels`` side by side: each series' figure (``by_x[x][row]``) against x,
    on a log-2 x axis with a tick at every x, the y axis from 0; where ``rounds[x][row]``
    holds the rounds a median was taken of, a band spans their interquartile range."""
    plt = pyplot()
    xs = sorted(by_x)
    figure, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.6), squeeze=False)
    for axis, panel in zip(axes[0], panels):
        for row, label, style in panel.series:
            if not all(row in by_x[x] for x in xs):
                continue
            line, = axis.plot(xs, [by_x[x][row] for x in xs], style, label=label)
            if rounds is not None and all(row in rounds.get(x, {}) for x in xs):
                bands = [quartiles(rounds[x][row]) for x in xs]
                axis.fill_between(xs, [b[0] for b in bands], [b[1] for b in bands],
                                  color=line.get_color(), alpha=0.12)
        axis.set_xscale("log", base=2)
        axis.set_xticks(xs, [tick(x) for x in xs])
        axis.minorticks_off()
        axis.set_xlabel(xlabel)
        axis.set_ylabel(panel.ylabel)
        axis.set_title(panel.title)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
