"""Configuration: frozen dataclasses, one per tier, composed into :class:`StoreConfig`.

Defaults live here and only here; ``docs/configuration.md`` describes each one.
Every ``__post_init__`` names the bad field and its value.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from tierkv.checks import is_int
from tierkv.core.policy import DEFAULT_POLICY, policy_names
from tierkv.errors import ConfigError
from tierkv.units import GiB, MiB, size_setting

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


def _is_number(value: Any) -> bool:
    """An int or float, not a bool, not NaN (NaN compares false with everything)."""
    return (is_int(value) or isinstance(value, float)) and not math.isnan(value)


def _positive(section: str, name: str, value: Any) -> None:
    if not _is_number(value) or value <= 0:
        raise ConfigError(f"{section}.{name} must be a positive number, got {value!r}")


def _sizes(config: Any, section: str, *names: str) -> None:
    """Byte counts of a frozen config: ints, or size strings (``"32GiB"``, ``"32G"``) made
    ints (a float would reach slab and map sizes that need ints)."""
    for name in names:
        object.__setattr__(config, name, size_setting(section, name, getattr(config, name)))


def _non_negative(section: str, name: str, value: Any) -> None:
    if not _is_number(value) or value < 0:
        raise ConfigError(f"{section}.{name} must be >= 0, got {value!r}")


@dataclass(frozen=True)
class CpuTierConfig:
    """The pinned CPU slab: one allocation, carved into chunk slots."""

    max_bytes: int = 4 * GiB
    pin_memory: str = "auto"  # "auto" (pin when CUDA is present), "always", "never"
    spill_ahead_fraction: float = 0.25
    eviction_policy: str = DEFAULT_POLICY  # the order chunks leave the tier: "lru", "arc"

    def __post_init__(self) -> None:
        _sizes(self, "cpu", "max_bytes")
        if self.pin_memory not in ("auto", "always", "never"):
            raise ConfigError(
                f"cpu.pin_memory must be 'auto', 'always' or 'never', got {self.pin_memory!r}"
            )
        fraction = self.spill_ahead_fraction
        if not _is_number(fraction) or not 0.0 <= fraction <= 1.0:
            raise ConfigError(
                f"cpu.spill_ahead_fraction must be within [0, 1], got {self.spill_ahead_fraction!r}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ConfigError(f"cpu.eviction_policy must be one of {list(EVICTION_POLICIES)}, "
                              f"got {self.eviction_policy!r}")


@dataclass(frozen=True)
class DiskTierConfig:
    """The LMDB disk tier. ``path=None`` turns the tier off."""

    path: Path | None = None
    max_bytes: int = 64 * GiB
    write_through: bool = False
    write_batch_bytes: int = 8 * MiB
    sync_mode: str = "periodic"  # "periodic", "always" (fsync each txn), "close"
    sync_every_bytes: int = 256 * MiB
    sync_every_seconds: float = 5.0
    retry_after_full_seconds: float = 1.0
    reader_threads: int = 4  # a load's chunks are read in parallel (docs/benchmarks/disk.md)
    # Payloads are written with O_DIRECT where the filesystem takes it (docs/benchmarks/disk.md).
    direct_io: bool = True
    # max_bytes is one cap for every namespace under path: a store recomputes its share this
    # often (and when it is full), docs/operations.md "One cap per disk path".
    budget_check_seconds: float = 10.0
    # Process-wide glibc malloc tuning for LMDB's page buffers (docs/configuration.md).
    tune_malloc: bool = True

    def __post_init__(self) -> None:
        if self.path is not None:
            raw = self.path
            text = os.fspath(raw) if isinstance(raw, (str, os.PathLike)) else None
            if not isinstance(text, str) or not text or "\0" in text:
                raise ConfigError(f"disk.path must be a directory path (a non-empty str or "
                                  f"Path) or None, got {raw!r}")
            if not isinstance(raw, Path):
                object.__setattr__(self, "path", Path(text))
        _sizes(self, "disk", "max_bytes", "write_batch_bytes", "sync_every_bytes")
        if not is_int(self.reader_threads) or self.reader_threads <= 0:
            raise ConfigError(f"disk.reader_threads must be a positive int, got "
                              f"{self.reader_threads!r}")
        _positive("disk", "sync_every_seconds", self.sync_every_seconds)
        _positive("disk", "budget_check_seconds", self.budget_check_seconds)
        _non_negative("disk", "retry_after_full_seconds", self.retry_after_full_seconds)
        if self.sync_mode not in ("periodic", "always", "close"):
            raise ConfigError(
                f"disk.sync_mode must be 'periodic', 'always' or 'close', got {self.sync_mode!r}"
            )
        for name in ("write_through", "tune_malloc", "direct_io"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"disk.{name} must be a bool, got {getattr(self, name)!r}")


@dataclass(frozen=True, repr=False)
class RemoteTierConfig:
    """A shared remote tier on Redis / Valkey (Cluster) behind the disk tier
    (``StoreConfig.remote``; ``docs/remote.md``). Its ``repr`` masks the URL's password."""

    url: str  # redis://host:port or rediss:// (TLS); more seed nodes after commas
    key_prefix: str = "tierkv:"
    timeout_seconds: float = 0.5  # a call's deadline (plus its bytes at min_mib_per_second)
    min_mib_per_second: float = 64.0  # the slowest transfer a call's deadline allows for
    ttl_seconds: float | None = None  # None: no TTL (rely on the server's maxmemory-policy)
    password_env: str = "TIERKV_REMOTE_PASSWORD"  # used when the URL carries no password
    breaker_failures: int = 5  # consecutive failed calls that open the circuit breaker
    breaker_seconds: float = 10.0  # how long an open breaker skips the tier before a probe
    queue_bytes: int = 256 * MiB  # write-behind pushes queued at most (RemoteIO); more: skipped
    push: str = "on_store"  # "on_store", "on_evict" (when written back to disk), "read_only"
    lookup_deadline_seconds: float = 0.01  # a lookup waits this long for the server, then "not yet"
    lookup_chunks: int = 64  # candidate chunks beyond the local prefix asked in one lookup
    mark_seconds: float = 10.0  # a chunk the server had counts as a remote hit this long
    reader_threads: int = 4  # remote reads of a load run in parallel
    # Process-wide glibc malloc tuning for the value buffers (as disk.tune_malloc).
    tune_malloc: bool = True

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
        _positive("remote", "timeout_seconds", self.timeout_seconds)
        _positive("remote", "min_mib_per_second", self.min_mib_per_second)
        _positive("remote", "breaker_seconds", self.breaker_seconds)
        _sizes(self, "remote", "queue_bytes")
        if not is_int(self.breaker_failures) or self.breaker_failures < 1:
            raise ConfigError(f"remote.breaker_failures must be an int >= 1, got "
                              f"{self.breaker_failures!r}")
        if self.ttl_seconds is not None:
            _positive("remote", "ttl_seconds", self.ttl_seconds)
        if not isinstance(self.password_env, str):
            raise ConfigError(f"remote.password_env must be a str, got {self.password_env!r}")
        if self.push not in PUSH_POLICIES:
            raise ConfigError(f"remote.push must be one of {list(PUSH_POLICIES)}, got "
                              f"{self.push!r}")
        _positive("remote", "lookup_deadline_seconds", self.lookup_deadline_seconds)
        _positive("remote", "mark_seconds", self.mark_seconds)
        for name in ("lookup_chunks", "reader_threads"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"remote.{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.tune_malloc, bool):
            raise ConfigError(f"remote.tune_malloc must be a bool, got {self.tune_malloc!r}")

    def __repr__(self) -> str:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["url"] = safe_url(self.url)
        return f"RemoteTierConfig({', '.join(f'{k}={v!r}' for k, v in values.items())})"


@dataclass(frozen=True)
class StoreConfig:
    """Everything a :class:`tierkv.engine.store.TierKVStore` needs besides the KV tensors."""

    blocks_per_chunk: int = 16
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    device: str = "auto"  # "auto", "cpu", "cuda"
    rank: int = 0
    # Ranks of the engine's tensor parallelism: rank r stores part r of tp_size of each
    # chunk (disk: part-<r>of<tp_size>/, remote keys ...:<r>of<tp_size>).
    tp_size: int = 1
    remote: RemoteTierConfig | None = None  # None: no remote tier
    # TierKVStore.store(): "copied" returns once the source blocks are copied (rewriting
    # them afterwards is safe); "async" returns at once and the engine must fence() the
    # blocks before it writes them. The vLLM connector fences by itself: not read there.
    store_mode: str = "copied"

    def __post_init__(self) -> None:
        if not is_int(self.blocks_per_chunk):
            raise ConfigError(f"blocks_per_chunk must be an int, got {self.blocks_per_chunk!r}")
        _positive("store", "blocks_per_chunk", self.blocks_per_chunk)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if not is_int(self.rank) or self.rank < 0:
            raise ConfigError(f"rank must be an int >= 0, got {self.rank!r}")
        if not is_int(self.tp_size) or not 1 <= self.tp_size <= 0xFFFF:
            raise ConfigError(f"tp_size must be an int in [1, 65535], got {self.tp_size!r}")
        if self.store_mode not in STORE_MODES:
            raise ConfigError(f"store_mode must be one of {list(STORE_MODES)}, got "
                              f"{self.store_mode!r}")
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
