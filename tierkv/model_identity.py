"""The model fingerprint: what identifies the weights and config that computed stored KV.

Every namespace carries one (:attr:`tierkv.keys.Namespace.model_fingerprint`), so KV that
other weights computed is never served, even from the same path: a fine-tune saved over
the old checkpoint is a new namespace. ``docs/configuration.md`` ("Model fingerprint")
says what each mode catches and costs; ``docs/operations.md`` has the measured start cost.

- :func:`model_fingerprint` ``(source, mode)``: ``source`` is a local directory, a single
  weight file (GGUF), or a hub model id with its revision.
  - ``auto`` (the default): sha256 over the config files' contents and, for every weight
    file, its name, size and ``mtime_ns`` and the bytes of :data:`WINDOWS` fixed windows of
    :data:`WINDOW_BYTES` (first, last and evenly between): a few reads a file, never a
    whole weight file. ``auto:<32 hex>``.
  - ``content``: every byte of every weight file hashed (xxh3-128), the digests cached
    under ``cache_dir`` by (path, inode, size, mtime_ns), so a copy with new mtimes keeps
    its fingerprint and a restart reads nothing again. ``content:<32 hex>``.
  - any other string: the operator's own name for the weights, taken as it is
    (``name:<string>``), for registries that version by name.
  - a hub id: the commit its local snapshot resolves to (``hub:<commit>``; a moved
    ``main`` is another commit). :func:`resolve_hub_snapshot` finds it in the hub cache.
- :func:`directory_files` sorts a directory's files into config files (hashed whole),
  weight files (sampled) and files that do not shape KV (tokenizers, docs).

Pure Python over ``os`` and ``hashlib`` (and ``xxhash`` for ``content``): no torch, no LMDB.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("tierkv")

MODES = ("auto", "content")
WINDOWS = 8  # sampled windows per weight file in "auto"
WINDOW_BYTES = 64 << 10
READ_BYTES = 8 << 20  # one read of the whole-content hash
CONFIG_MAX_BYTES = 16 << 20  # a config file larger than this is sampled like weights
CACHE_FILE = "model-content-hashes.json"  # the whole-content hashes, under cache_dir
CACHE_ENTRIES = 512  # entries the cache keeps (newest)
# What shapes the KV: weights (sampled) and config (hashed whole). Tokenizers, templates and
# docs do not (tierkv keys token ids, never text), nor does generation_config.json.
CONFIG_SUFFIXES = (".json", ".py", ".yaml", ".yml")
NOT_KV = frozenset(("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                    "tokenizer.model", "spiece.model", "chat_template.json",
                    "chat_template.jinja", "generation_config.json"))
NOT_KV_SUFFIXES = (".md", ".txt", ".jinja", ".tiktoken", ".png", ".jpg", ".jpeg", ".gif",
                   ".lock", ".metadata")


def is_mode(value: str) -> bool:
    """Whether ``value`` names a computed mode (else it is the operator's own string)."""
    return value in MODES


def directory_files(folder: Path) -> tuple[list[Path], list[Path]]:
    """(config files, weight files) at the top of ``folder``, each sorted by name. Hidden
    files, subdirectories and files that do not shape KV (:data:`NOT_KV`) are left out;
    a file of any other kind counts as weights."""
    config: list[Path] = []
    weights: list[Path] = []
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        name = path.name
        if name.startswith(".") or name in NOT_KV or name.lower().endswith(NOT_KV_SUFFIXES) \
                or not path.is_file():
            continue
        small = path.stat().st_size <= CONFIG_MAX_BYTES
        (config if name.lower().endswith(CONFIG_SUFFIXES) and small else weights).append(path)
    return config, weights


def window_offsets(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the windows ``auto`` reads of a file of ``size`` bytes: the
    whole file when it is small, else :data:`WINDOWS` windows from its first to its last byte."""
    if size <= WINDOWS * WINDOW_BYTES:
        return [(0, size)]
    last = size - WINDOW_BYTES
    return [(last * index // (WINDOWS - 1), WINDOW_BYTES) for index in range(WINDOWS)]


def _sample(path: Path, size: int) -> bytes:
    """sha256 of the windows of one weight file."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in window_offsets(size):
            digest.update(os.pread(fd, length, offset))
    finally:
        os.close(fd)
    return digest.digest()


def _content(path: Path) -> bytes:
    """xxh3-128 of every byte of one file."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as handle:
        while chunk := handle.read(READ_BYTES):
            digest.update(chunk)
    return digest.digest()


class ContentCache:
    """Whole-content hashes by (real path, inode, size, mtime_ns), in one JSON file under
    ``folder`` (None: kept in memory only). A file changed in place has a new mtime or size,
    so it is hashed again; a broken cache file is ignored and rewritten."""

    def __init__(self, folder: Path | None) -> None:
        self.path = None if folder is None else Path(folder) / CACHE_FILE
        self.entries: dict[str, str] = {}
        self.hashed = 0  # files hashed (not found in the cache)
        self._load()

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            loaded = json.loads(self.path.read_text())
            if isinstance(loaded, dict):
                self.entries = {str(k): str(v) for k, v in loaded.items()}
        except (OSError, ValueError):
            pass

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the cache's lock (an ``flock``) while hashing: the ranks of one engine that
        start together hash each file once, the others then find it in the cache."""
        if self.path is None:
            yield
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.path.with_name(f".{CACHE_FILE}.lock"), os.O_RDWR | os.O_CREAT,
                         0o600)
        except OSError:  # no lock, no harm: each hashes on its own
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._load()  # what another process saved while this one waited
            yield
        finally:
            os.close(fd)

    @staticmethod
    def key(path: Path) -> str:
        stat = path.stat()
        return f"{os.path.realpath(path)}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}"

    def digest(self, path: Path) -> bytes:
        key = self.key(path)
        known = self.entries.pop(key, None)
        if known is None:
            known = _content(path).hex()
            self.hashed += 1
        self.entries[key] = known  # newest last
        return bytes.fromhex(known)

    def save(self) -> None:
        if self.path is None or not self.hashed:
            return
        keep = dict(list(self.entries.items())[-CACHE_ENTRIES:])
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            temp = self.path.with_name(f".{CACHE_FILE}.{os.getpid()}")
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                json.dump(keep, handle)
            os.replace(temp, self.path)
        except OSError as exc:  # a cache: the fingerprint stands without it
            log.warning("tierkv: could not save the model content hashes under %s (%s); "
                        "the next start hashes the weights again", self.path.parent, exc)


def _files_fingerprint(config: Iterable[Path], weights: Iterable[Path], mode: str,
                       cache: ContentCache | None) -> str:
    digest = hashlib.sha256(f"tierkv-model-fingerprint-v1/{mode}".encode())
    for path in config:
        data = path.read_bytes()
        digest.update(b"config\0" + path.name.encode() + b"\0" + len(data).to_bytes(8, "big"))
        digest.update(data)
    for path in weights:
        stat = path.stat()
        digest.update(b"weights\0" + path.name.encode() + b"\0"
                      + stat.st_size.to_bytes(8, "big"))
        if mode == "content":
            digest.update((cache or ContentCache(None)).digest(path))
        else:
            digest.update(stat.st_mtime_ns.to_bytes(16, "big", signed=True))
            digest.update(_sample(path, stat.st_size))
    return f"{mode}:{digest.hexdigest()[:32]}"


def path_fingerprint(path: Path, mode: str = "auto", cache_dir: Path | None = None) -> str:
    """The fingerprint of a local model directory or single weight file (see the module
    docstring); ``OSError`` when it cannot be read."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    path = Path(path)
    if not path.is_dir() and not path.is_file():
        raise FileNotFoundError(f"no model directory or file at {path}")
    config, weights = directory_files(path) if path.is_dir() else ([], [path])
    if mode != "content":
        return _files_fingerprint(config, weights, mode, None)
    cache = ContentCache(cache_dir)
    with cache.locked():
        fingerprint = _files_fingerprint(config, weights, mode, cache)
        cache.save()
    return fingerprint


def resolve_hub_snapshot(repo_id: str, revision: str | None = None,
                         cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The local snapshot directory a hub model id resolves to (its name is the commit),
    from the hub cache only (never the network); None when there is none."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        found = snapshot_download(repo_id, revision=revision, local_files_only=True,
                                  cache_dir=None if cache_dir is None else str(cache_dir))
    except Exception:  # not in the cache, not a repo id, offline: unresolved
        return None
    return Path(found)


def snapshot_commit(path: Path) -> str | None:
    """The commit a hub cache snapshot directory (``.../snapshots/<commit>``) holds, else None."""
    name = Path(path).resolve().name
    if Path(path).resolve().parent.name == "snapshots" and len(name) == 40 \
            and all(ch in "0123456789abcdef" for ch in name):
        return name
    return None


def model_fingerprint(source: str | os.PathLike[str], mode: str = "auto", *,
                      revision: str | None = None, cache_dir: Path | None = None,
                      hub_cache: str | os.PathLike[str] | None = None) -> str | None:
    """The fingerprint of the model at ``source`` under ``mode`` (``auto``, ``content``, or
    the operator's own string); None when ``source`` is neither a readable local path nor a
    hub id found in the hub cache."""
    if not is_mode(mode):
        return f"name:{mode}"
    path = Path(source).expanduser()
    if path.exists():
        try:
            return path_fingerprint(path, mode, cache_dir)
        except OSError as exc:
            log.warning("tierkv: cannot read the model at %s for its fingerprint (%s)",
                        path, exc)
            return None
    snapshot = resolve_hub_snapshot(str(source), revision, hub_cache)
    return None if snapshot is None else f"hub:{snapshot.name}"


def overrides_fingerprint(overrides: Mapping[str, Any] | Any) -> str:
    """``""`` for no config overrides, else ``+overrides:`` and 12 hex digits of their
    canonical JSON: values an engine lays over the config files (RoPE scaling, for one)
    shape the KV too. A function (vLLM takes one) is named by its module and name."""
    if not overrides:
        return ""
    if callable(overrides):
        text = f"callable:{getattr(overrides, '__module__', '')}." \
               f"{getattr(overrides, '__qualname__', type(overrides).__name__)}"
    else:
        text = json.dumps(overrides, sort_keys=True, default=str)
    return "+overrides:" + hashlib.sha256(text.encode()).hexdigest()[:12]


__all__ = ["MODES", "ContentCache", "directory_files", "is_mode", "model_fingerprint",
           "overrides_fingerprint", "path_fingerprint", "resolve_hub_snapshot",
           "snapshot_commit", "window_offsets"]
