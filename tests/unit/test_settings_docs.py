"""The settings tables of docs/configuration.md and docs/vllm.md against the declarations
(``tierkv.settings``): every field has a row, every row a field, and each declared
setting's row shows its default."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from tierkv.config import CpuTierConfig, DiskTierConfig, RemoteTierConfig, StoreConfig
from tierkv.core.costs import CostPriors
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.integrations.vllm_config import ConnectorSettings
from tierkv.settings import declared
from tierkv.units import format_bytes

DOCS = Path(__file__).resolve().parents[2] / "docs"


def table(doc: str, heading: str) -> dict[str, str]:
    """The rows of the first table under the ``## `` heading that starts with ``heading``:
    each setting's name (its first cell, in backticks) -> its default cell."""
    text = (DOCS / doc).read_text()
    start = text.index("\n## " + heading)
    section = text[start + 1:].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) > 3 and cells[1].startswith("`") and cells[1].endswith("`"):
            rows[cells[1].strip("`")] = cells[2]
    assert rows, f"no table under {heading!r} in docs/{doc}"
    return rows


def library_default(value: Any, unit: str) -> str:
    """A default as docs/configuration.md writes it: ``4 GiB``, ``"auto"``, ``None``, 5.0."""
    if unit == "bytes":
        return format_bytes(value)
    if isinstance(value, str):
        return f'`"{value}"`'
    if value is None or isinstance(value, bool):
        return f"`{value}`"
    return repr(value)


def connector_default(value: Any, unit: str) -> str:
    """A default as docs/vllm.md writes it, in JSON: ``4294967296`` (4 GiB), ``null``."""
    if value is None or isinstance(value, bool):
        return "`null`" if value is None else f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`" + (f" ({format_bytes(value)})" if unit == "bytes" else "")


# Defaults a row explains rather than shows (what None means there).
EXPLAINED = {("ConnectorSettings", "tokens_per_chunk"): "128, rounded up to a multiple"}
LIBRARY = [(StoreConfig, "`StoreConfig`"), (CpuTierConfig, "`CpuTierConfig`"),
           (DiskTierConfig, "`DiskTierConfig`"), (AdapterConfig, "`AdapterConfig`"),
           (RemoteTierConfig, "`RemoteTierConfig`"), (CostPriors, "`CostPriors`")]


@pytest.mark.parametrize(("cls", "heading"), LIBRARY, ids=[cls.__name__ for cls, _ in LIBRARY])
def test_the_configuration_doc_shows_every_setting_and_its_default(cls: type[Any],
                                                                    heading: str) -> None:
    rows = table("configuration.md", heading)
    assert set(rows) == {f.name for f in fields(cls)}
    for f in fields(cls):
        if f.default is MISSING and f.default_factory is MISSING:
            assert rows[f.name] == "(required)", f.name
    for name, spec in declared(cls).items():
        default = getattr(cls, name, MISSING)
        if default is not MISSING:
            assert rows[name] == library_default(default, spec.unit), f"{cls.__name__}.{name}"


def test_the_vllm_doc_shows_every_connector_key_and_its_default() -> None:
    rows = table("vllm.md", "Settings (`kv_connector_extra_config`)")
    assert set(rows) == {f.name for f in fields(ConnectorSettings)} | {"remote_url"}
    for name, spec in declared(ConnectorSettings).items():
        shown = EXPLAINED.get(("ConnectorSettings", name)) or \
            connector_default(getattr(ConnectorSettings, name), spec.unit)
        assert rows[name].startswith(shown), f"{name}: {rows[name]!r} does not show {shown!r}"
