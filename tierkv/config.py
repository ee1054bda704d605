"""Configuration: frozen dataclasses, one per tier, composed into :class:`StoreConfig`.

Defaults live here and only here; ``docs/configuration.md`` describes each one. Each
setting is declared once (:func:`tierkv.settings.setting`: kind, bounds, unit, help) and
checked by :func:`tierkv.settings.check_settings`, whose errors name the field and its value;
the vLLM connector's keys derive from these declarations.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tierkv.core.policy import DEFAULT_POLICY, policy_names
from tierkv.errors import ConfigError
from tierkv.settings import check_settings, setting
from tierkv.units import GiB, MiB

EVICTION_POLICIES = policy_names()  # one module each under tierkv/core/policies/

PUSH_POLICIES = ("on_store", "on_evict", "read_only")  # when chunks go to the remote tier
# When TierKVStore.store() returns: once its source blocks are copied, or at once.
STORE_MODES = ("copied", "async")

# Per-chunk disk overhead assumed for capacity accounting: the slot's 4 KiB header block,
# its padding to 4 KiB and the index entry (docs/on-disk-format.md).
DISK_OVERHEAD_BYTES = 8192


def cpu_slot_count(cpu_bytes: int, chunk_bytes: int, ranks: int = 1) -> int:
    """CPU slots ``cpu_bytes`` holds, each ``chunk_bytes`` on each of ``ranks`` ranks."""
    return cpu_bytes // (chunk_bytes * ranks)


def disk_chunk_capacity(disk_bytes: int, chunk_bytes: int, ranks: int = 1) -> int:
    """Chunks a disk cap of ``disk_bytes`` holds, each ``chunk_bytes`` on each of ``ranks``
    ranks (with :data:`DISK_OVERHEAD_BYTES` per chunk and rank): the one capacity formula."""
    return max(disk_bytes // ((chunk_bytes + DISK_OVERHEAD_BYTES) * ranks), 0)


# The credentials of anything URL-shaped: "//user:password@" (with or without a scheme).
_USERINFO = re.compile(r"(//)([^/@\s'\"]*)@")


def redact(text: str) -> str:
    """``text`` with the credentials of every URL-shaped part masked (``user:***@``,
    ``***@``): what an error message may show of a value it did not expect."""
    return _USERINFO.sub(lambda m: m[1] + (m[2].split(":")[0] + ":***@" if ":" in m[2]
                                           else "***@"), text)


def has_password(text: str) -> bool:
    """Whether ``text`` holds a URL with a password (``//user:password@``)."""
    return any(":" in match[2] for match in _USERINFO.finditer(text))


def safe_url(url: str) -> str:
    """``url`` without its password (for messages and logs); every seed of a list."""
    if "," in url:
        return ",".join(safe_url(part) for part in url.split(","))
    try:
        parts = urlsplit(url)
        password, host, port = parts.password, parts.hostname or "", parts.port
    except ValueError:  # not a URL one can split: show its scheme only
        return url.split("://")[0] + "://..."
    if password is None:
        return redact(url)  # "redis//:pw@host" splits as a path: mask what looks like one
    netloc = f"{parts.username + ':***@' if parts.username else '***@'}{host}" + \
        (f":{port}" if port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


@dataclass(frozen=True)
class CpuTierConfig:
    """The pinned CPU slab: one allocation, carved into chunk slots."""

    max_bytes: int = setting(4 * GiB, unit="bytes", help="size of the pinned slab")
    pin_memory: str = setting("auto", choices=("auto", "always", "never"),
                              help="pin the slab: 'auto' (when CUDA is present)")
    spill_ahead_fraction: float = setting(0.25, low=0.0, high=1.0,
                                          help="share of the slots kept clean early")
    eviction_policy: str = setting(DEFAULT_POLICY, choices=EVICTION_POLICIES,
                                   help="the order chunks leave the CPU tier")

    def __post_init__(self) -> None:
        check_settings(self, "cpu")


@dataclass(frozen=True)
class DiskTierConfig:
    """The LMDB disk tier. ``path=None`` turns the tier off."""

    path: Path | None = setting(None, kind="path", help="the disk tier's root; None: no disk tier")
    max_bytes: int = setting(64 * GiB, unit="bytes",
                             help="disk cap of every namespace under path together")
    write_through: bool = setting(False, help="spill every stored chunk at once (write-behind)")
    write_batch_bytes: int = setting(8 * MiB, unit="bytes", help="bytes per write transaction")
    sync_mode: str = setting("periodic", choices=("periodic", "always", "close"),
                             help="when the disk tier fsyncs")
    sync_every_bytes: int = setting(256 * MiB, unit="bytes", help="periodic sync threshold")
    sync_every_seconds: float = setting(5.0, above=0, unit="seconds",
                                        help="periodic sync interval")
    retry_after_full_seconds: float = setting(1.0, low=0, unit="seconds",
                                              help="spills pause this long after a full disk")
    # A load's chunks are read in parallel (docs/benchmarks/disk.md).
    reader_threads: int = setting(4, low=1, help="threads reading chunks from disk")
    # Payloads are written and read with O_DIRECT where the filesystem takes it, reads in
    # pieces many at a time (docs/benchmarks/disk.md, "O_DIRECT reads").
    direct_io: bool = setting(True, help="write and read payloads with O_DIRECT")
    read_bytes_in_flight: int = setting(32 * MiB, unit="bytes",
                                        help="payload bytes read at once (O_DIRECT pieces)")
    # max_bytes is one cap for every namespace under path: a store recomputes its share this
    # often (and when it is full), docs/operations.md "One cap per disk path".
    budget_check_seconds: float = setting(10.0, above=0, unit="seconds",
                                          help="how often a store recomputes its share")
    # Process-wide glibc malloc tuning for LMDB's page buffers (docs/configuration.md).
    tune_malloc: bool = setting(True, help="tune glibc malloc for LMDB's page buffers")

    def __post_init__(self) -> None:
        check_settings(self, "disk")
        if self.path is not None and not isinstance(self.path, Path):
            object.__setattr__(self, "path", Path(self.path))


@dataclass(frozen=True, repr=False)
class RemoteTierConfig:
    """A shared remote tier on Redis / Valkey (Cluster) behind the disk tier
    (``StoreConfig.remote``; ``docs/remote.md``). Its ``repr`` masks the URL's password."""

    url: str  # redis://host:port or rediss:// (TLS); more seed nodes after commas
    key_prefix: str = setting("tierkv:", kind="str", help="first part of every key")
    timeout_seconds: float = setting(0.5, above=0, unit="seconds",
                                     help="a call's deadline (plus its bytes at "
                                          "min_mib_per_second)")
    min_mib_per_second: float = setting(64.0, above=0, unit="MiB/s",
                                        help="the slowest transfer a call's deadline allows for")
    ttl_seconds: float | None = setting(None, kind="number", above=0, unit="seconds",
                                        help="EX of every value; None: no TTL (rely on the "
                                             "server's maxmemory-policy)")
    password_env: str = setting("TIERKV_REMOTE_PASSWORD", kind="str",
                                help="the password's environment variable, when the URL "
                                     "carries none")
    breaker_failures: int = setting(5, low=1, help="consecutive failed calls that open the "
                                                   "circuit breaker")
    breaker_seconds: float = setting(10.0, above=0, unit="seconds",
                                     help="how long an open breaker skips the tier before "
                                          "a probe")
    queue_bytes: int = setting(256 * MiB, unit="bytes",
                               help="write-behind pushes queued at most (RemoteIO); more: "
                                    "skipped")
    push: str = setting("on_store", choices=PUSH_POLICIES,
                        help="when chunks go to the remote tier: as stored, as written back "
                             "to disk, or never")
    lookup_deadline_seconds: float = setting(0.01, above=0, unit="seconds",
                                             help="a lookup waits this long for the server, "
                                                  "then answers 'not yet'")
    lookup_chunks: int = setting(64, low=1, help="candidate chunks beyond the local prefix "
                                                 "asked in one lookup")
    mark_seconds: float = setting(10.0, above=0, unit="seconds",
                                  help="a chunk the server had counts as a remote hit this long")
    reader_threads: int = setting(4, low=1, help="remote reads of a load run in parallel")
    usage_seconds: float = setting(30.0, low=0, unit="seconds",
                                   help="how often the servers' memory (INFO memory) is "
                                        "polled for the capacity gauges; 0: never")
    # Process-wide glibc malloc tuning for the value buffers (as disk.tune_malloc).
    tune_malloc: bool = setting(True, help="tune glibc malloc for the value buffers")

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("redis://", "rediss://")):
            shown = repr(safe_url(self.url)) if isinstance(self.url, str) else \
                redact(repr(self.url))
            raise ConfigError(f"remote.url must start with redis:// or rediss://, got "
                              f"{shown:.80}")
        if not isinstance(self.key_prefix, str) or not self.key_prefix or \
                any(ch in self.key_prefix for ch in "{}*?[] "):
            raise ConfigError(f"remote.key_prefix must be a non-empty str without braces, "
                              f"wildcards or spaces, got {self.key_prefix!r}")
        check_settings(self, "remote")

    def __repr__(self) -> str:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["url"] = safe_url(self.url)
        return f"RemoteTierConfig({', '.join(f'{k}={v!r}' for k, v in values.items())})"


@dataclass(frozen=True)
class StoreConfig:
    """Everything a :class:`tierkv.engine.store.TierKVStore` needs besides the KV tensors."""

    blocks_per_chunk: int = setting(16, low=1, help="engine blocks per chunk (the offload "
                                                     "unit)")
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    device: str = setting("auto", choices=("auto", "cpu", "cuda"),
                          help="transfer engine: 'auto' (CUDA when the KV tensors are)")
    rank: int = setting(0, low=0, help="the part of each chunk this store holds")
    # Ranks of the engine's tensor parallelism: rank r stores part r of tp_size of each
    # chunk (disk: part-<r>of<tp_size>/, remote keys ...:<r>of<tp_size>).
    tp_size: int = setting(1, low=1, high=0xFFFF, help="the engine's tensor-parallel ranks")
    remote: RemoteTierConfig | None = None  # None: no remote tier
    # TierKVStore.store(): "copied" returns once the source blocks are copied (rewriting
    # them afterwards is safe); "async" returns at once and the engine must fence() the
    # blocks before it writes them. The vLLM connector fences by itself: not read there.
    store_mode: str = setting("copied", choices=STORE_MODES,
                              help="when TierKVStore.store() returns")
    # The weights that computed the KV: their fingerprint is part of the namespace, so KV of
    # other weights (a checkpoint saved over the old one) is never served
    # (tierkv.model_identity; docs/configuration.md, "Model fingerprint").
    model_path: Path | None = setting(None, kind="path",
                                      help="the model's directory or weight file; None: "
                                           "model_id alone names the weights")
    model_fingerprint: str = setting("auto", kind="str",
                                     help="'auto' (config, weight files' sizes, mtimes and "
                                          "sampled bytes), 'content' (every byte, cached), "
                                          "or the operator's own name of the weights")

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.model_fingerprint or "\0" in self.model_fingerprint:
            raise ConfigError(f"model_fingerprint must be 'auto', 'content' or a non-empty "
                              f"name of the weights, got {self.model_fingerprint!r}")
        if self.model_path is not None and not isinstance(self.model_path, Path):
            object.__setattr__(self, "model_path", Path(self.model_path))
        for name, cls in (("cpu", CpuTierConfig), ("disk", DiskTierConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__} (a dict in from_dict), "
                                  f"got {redact(repr(getattr(self, name))):.80}")
        if self.remote is not None:
            if not isinstance(self.remote, RemoteTierConfig):
                raise ConfigError(f"remote must be a RemoteTierConfig (a dict in from_dict) or "
                                  f"None, got {redact(repr(self.remote)):.80}")
            if self.remote.push == "on_evict" and self.disk.path is None:
                raise ConfigError("remote.push='on_evict' pushes chunks as they are written "
                                  "back to the disk tier, and disk.path is None: set "
                                  "disk.path, or use remote.push='on_store'")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StoreConfig:
        """Build from plain data (JSON, vLLM extra config): ``{"cpu": {...}, "disk": {...}}``."""
        if not isinstance(raw, Mapping):
            raise ConfigError(f"store settings must be a mapping of setting names to values, "
                              f"got {redact(repr(raw)):.80}")
        _refuse_unknown(cls, raw)
        kwargs = dict(raw)
        for name, sub in (("cpu", CpuTierConfig), ("disk", DiskTierConfig),
                          ("remote", RemoteTierConfig)):
            if name in kwargs and isinstance(kwargs[name], Mapping):
                _refuse_unknown(sub, kwargs[name], f"{name}.")
                if sub is RemoteTierConfig and "url" not in kwargs[name]:
                    raise ConfigError("remote.url is required (redis://host:port, or "
                                      "rediss:// for TLS)")
                kwargs[name] = sub(**kwargs[name])
        return cls(**kwargs)


def _refuse_unknown(cls: type[Any], raw: Mapping[str, Any], prefix: str = "") -> None:
    known = {f.name for f in fields(cls)}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(prefix + name for name in unknown)}; "
                          f"known: {sorted(known)}")
