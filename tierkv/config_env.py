"""A :class:`~tierkv.config.StoreConfig` from a YAML file and environment variables, through
the one settings source (:func:`StoreConfig.from_dict` and the declarations of
:mod:`tierkv.settings`): what ``TierKVStore(config=None)`` opens with.

- ``TIERKV_CONFIG=/path/store.yaml``: a YAML mapping in ``from_dict``'s shape
  (``blocks_per_chunk: 16``, ``cpu: {max_bytes: 8GiB}``, ``disk: {path: ...}``,
  ``remote: {url: ...}``); needs PyYAML (the ``config`` extra).
- ``TIERKV_<SETTING>`` for a setting of ``StoreConfig`` (``TIERKV_BLOCKS_PER_CHUNK=16``),
  ``TIERKV_<SECTION>_<SETTING>`` for one of ``cpu``, ``disk`` and ``remote``
  (``TIERKV_CPU_MAX_BYTES=8GiB``, ``TIERKV_DISK_PATH=/var/cache/tierkv``,
  ``TIERKV_REMOTE_URL=redis://host:7000``): each overrides the file's value. The text is
  read as its setting's kind says (:meth:`Setting.from_text`: ``true``/``false``, sizes with
  units, ``none`` for an optional one).

Defaults, then the file, then the environment. A ``TIERKV_CPU_``/``DISK_``/``REMOTE_``
variable that names no setting is an error naming it (a typo never passes silently);
other ``TIERKV_`` variables (``TIERKV_REMOTE_PASSWORD``, ``TIERKV_MALLOPT``, a
``remote.password_env``) are not settings and are left alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tierkv.config import CpuTierConfig, DiskTierConfig, RemoteTierConfig, StoreConfig
from tierkv.errors import ConfigError
from tierkv.extras import needs
from tierkv.settings import INVALID, declared

__all__ = ["CONFIG_VARIABLE", "PREFIX", "environment_settings", "from_environment"]

CONFIG_VARIABLE = "TIERKV_CONFIG"
PREFIX = "TIERKV_"
SECTIONS = {"cpu": CpuTierConfig, "disk": DiskTierConfig, "remote": RemoteTierConfig}
NOT_SETTINGS = ("TIERKV_REMOTE_PASSWORD",)  # the default remote.password_env


def variables() -> dict[str, tuple[str | None, str]]:
    """Every settings variable: ``TIERKV_...`` -> (section or None, setting name)."""
    out: dict[str, tuple[str | None, str]] = {
        PREFIX + name.upper(): (None, name) for name in declared(StoreConfig)}
    for section, cls in SECTIONS.items():
        names = ["url", *declared(cls)] if cls is RemoteTierConfig else list(declared(cls))
        out.update((f"{PREFIX}{section.upper()}_{name.upper()}", (section, name))
                   for name in names)
    return out


def read_file(path: str) -> dict[str, Any]:
    """The settings of the YAML file ``path`` (``TIERKV_CONFIG``)."""
    with needs("config", f"{CONFIG_VARIABLE} (a YAML file of settings)"):
        import yaml
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{CONFIG_VARIABLE}={path!r} cannot be read: {exc.strerror or exc} "
                          f"(point it at a YAML file of settings, or unset it)") from exc
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{CONFIG_VARIABLE}={path!r} is not valid YAML: {exc}") from exc
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{CONFIG_VARIABLE}={path!r} must hold a mapping of settings "
                          f"(blocks_per_chunk: 16, cpu: {{max_bytes: 8GiB}}, ...), got a "
                          f"{type(raw).__name__}")
    return dict(raw)


def environment_settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``TIERKV_*`` settings variables of ``environ`` in ``from_dict``'s shape."""
    known = variables()
    ignored = set(NOT_SETTINGS)
    password_env = environ.get(f"{PREFIX}REMOTE_PASSWORD_ENV")
    if password_env is not None:
        ignored.add(password_env)
    sections = tuple(f"{PREFIX}{section.upper()}_" for section in SECTIONS)
    out: dict[str, Any] = {}
    for variable, text in sorted(environ.items()):
        if variable not in known:
            if variable.startswith(sections) and variable not in ignored:
                section = variable.split("_")[1].lower()
                names = sorted(name for name, (where, _) in known.items() if where == section)
                raise ConfigError(f"{variable} names no setting; the {section} settings' "
                                  f"variables are {names}")
            continue
        where, name = known[variable]
        cls = StoreConfig if where is None else SECTIONS[where]
        spec = declared(cls).get(name)
        value = text if spec is None else spec.from_text(text)
        if value is INVALID:
            assert spec is not None
            raise ConfigError(f"{variable} must be {spec.need(none='none')}, got {text!r}")
        (out if where is None else out.setdefault(where, {}))[name] = value
    return out


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over``'s values, section by section."""
    out = dict(base)
    for name, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(name), Mapping):
            out[name] = {**out[name], **value}
        else:
            out[name] = value
    return out


def from_environment(environ: Mapping[str, str] | None = None) -> StoreConfig:
    """The defaults, then the file ``TIERKV_CONFIG`` names, then the ``TIERKV_*`` settings
    variables, through :meth:`StoreConfig.from_dict` (none set: ``StoreConfig()``)."""
    environ = os.environ if environ is None else environ
    path = environ.get(CONFIG_VARIABLE)
    raw = merged(read_file(path) if path else {}, environment_settings(environ))
    try:
        return StoreConfig.from_dict(raw)
    except ConfigError as exc:
        where = f"{CONFIG_VARIABLE}={path!r} and " if path else ""
        raise ConfigError(f"{exc} (from {where}the TIERKV_* variables)") from exc
