"""Settings, geometry and namespace of tierkv's vLLM connector (no torch, no LMDB here).

Primitives (each a pure function of vLLM's config objects; both connector roles call
them and must get the same answer):

- :func:`parse_settings`      ``kv_connector_extra_config`` -> :class:`ConnectorSettings`;
  an unknown key or a bad value raises :class:`ConfigError` naming the key and the value.
- :func:`build_geometry`      chunk size, slot count and disk capacity from the
  ``KVCacheConfig``, as a :class:`~tierkv.integrations.vllm_geometry.Geometry`
  (``chunk_bytes = page_bytes x layers x blocks_per_chunk x groups``,
  ``num_slots = cpu_bytes // (chunk_bytes x world_size)``). The worker recomputes
  ``chunk_bytes`` from the tensors it registers and refuses to run if they differ.
- :func:`check_hash_stability` refuses a disk tier when vLLM's block hashes change from
  one process to the next (xxhash without ``PYTHONHASHSEED``).
- :func:`build_namespace`     what makes stored chunks incompatible (the list and the
  reasons are ``docs/vllm.md``, "Namespace").

``cpu_bytes`` and ``disk_bytes`` are the engine's totals over all TP ranks, as vLLM's
own ``cpu_bytes_to_use``: each rank holds ``1 / world_size`` of every chunk.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from tierkv import model_identity
from tierkv.config import (CpuTierConfig, DiskTierConfig, RemoteTierConfig, StoreConfig,
                           cpu_slot_count, disk_chunk_capacity, has_password, redact)
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.errors import ConfigError, TierKVError
from tierkv.integrations.vllm_geometry import Geometry, KVGroup
from tierkv.integrations.vllm_versions import chunks_minor
from tierkv.keys import FORMAT_VERSION, Namespace
from tierkv.settings import INVALID, declared, derived, setting

log = logging.getLogger("tierkv.vllm")
DEFAULT_TOKENS_PER_CHUNK = 128  # a hit recomputes up to this many tokens (docs/design.md)
DEFAULT_SYNC_LOAD_BYTES = 64 << 20  # docs/benchmarks/ttft.md, "Same-step loads"
DEFAULT_LOAD_POLICY = "cost"  # docs/benchmarks/ttft.md, "Cost-aware loads"
# Layouts whose per-block page is one dense [H, N, C] region, and its memory order.
PAGE_ORDER = {"LBNHC": "NHD", "BLNHC": "NHD", "LBHNC": "HND", "BLHNC": "HND",
              "NHD": "NHD", "HND": "HND"}
STABLE_HASHES = ("sha256", "sha256_cbor")
KNOWN_HASHES = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config`` keys. Each is a setting of the library's
    (:mod:`tierkv.config`, :class:`AdapterConfig`) under the connector's name, declared
    there once (:func:`tierkv.settings.derived`: kind, bounds, default, help), or one of the
    connector's own; :func:`store_config` and :func:`adapter_config` translate them."""

    cpu_bytes: int = derived(CpuTierConfig, "max_bytes", help="total over TP ranks")
    disk_path: str | None = derived(DiskTierConfig, "path")
    disk_bytes: int = derived(DiskTierConfig, "max_bytes", help="total over TP ranks")
    tokens_per_chunk: int | None = setting(None, kind="int", low=1,
                                           help="tokens per chunk; None: 128 rounded up to "
                                                "the block size")
    offload_prompt_only: bool = derived(AdapterConfig, "offload_prompt_only")
    # Write-behind of every stored chunk (the library's default is write-back): `vllm serve`
    # kills its workers at SIGTERM (--shutdown-timeout 0), before any shutdown flush.
    write_through: bool = derived(DiskTierConfig, "write_through", default=True,
                                  help="on here: vllm serve kills its workers at SIGTERM")
    spill_ahead_fraction: float = derived(CpuTierConfig, "spill_ahead_fraction")
    disk_sync_mode: str = derived(DiskTierConfig, "sync_mode")
    max_chunks_per_request: int | None = derived(AdapterConfig, "max_chunks_per_request")
    promotion_wait_seconds: float = derived(AdapterConfig, "promotion_wait_seconds")
    # Same-step loads: a hit held in the CPU tier is copied before the step's forward pass,
    # up to this many bytes per rank and step (0: every load waits a step or two).
    sync_load_bytes: int = setting(DEFAULT_SYNC_LOAD_BYTES, unit="bytes", low=0,
                                   help="same-step loads: bytes per rank and step")
    # Cost-aware loads (tierkv.core.costs): "cost" declines the part of a hit whose load
    # would take longer than computing it; "always" loads every hit.
    load_policy: str = derived(AdapterConfig, "load_policy", default=DEFAULT_LOAD_POLICY)
    load_bias: float = derived(AdapterConfig, "load_bias")
    load_deadline_ms: float | None = derived(AdapterConfig, "load_deadline_ms")
    device: str = derived(StoreConfig, "device")
    pin_memory: str = derived(CpuTierConfig, "pin_memory")
    flush_on_shutdown: bool = setting(True, help="at shutdown, write the CPU chunks that "
                                                 "were never on disk")
    eviction_policy: str = derived(CpuTierConfig, "eviction_policy")
    # The weights' fingerprint in the namespace (tierkv.model_identity): of vLLM's model.
    model_fingerprint: str = derived(StoreConfig, "model_fingerprint")
    # The shared remote tier: extra config "remote_url", and optionally "remote", a mapping
    # of RemoteTierConfig's other settings (key_prefix, push, timeout_seconds, ...).
    remote: RemoteTierConfig | None = None


def _bad(key: str, value: Any, need: str) -> ConfigError:
    """The error of one setting; a value that may hold a password (the remote settings, a
    key named like a secret) is not shown, and no URL's credentials ever are."""
    secret = key == "remote" or not _SECRET_WORDS.isdisjoint(str(key).lower().split("_"))
    shown = "(not shown)" if secret else redact(repr(value))
    return ConfigError(f"tierkv vLLM connector: kv_connector_extra_config[{key!r}] = {shown}: {need}")


# Words of a key whose value an error never shows (a secret's name: "remote_password").
_SECRET_WORDS = frozenset(("password", "passwd", "pass", "pw", "secret", "token", "auth",
                           "credential", "credentials"))


def parse_settings(raw: Mapping[str, Any] | None) -> ConnectorSettings:
    """Validate ``kv_connector_extra_config``; unknown keys and bad values raise."""
    raw = dict(raw or {})
    if "cpu_bytes_to_use" in raw:  # vLLM's own OffloadingConnector key
        if "cpu_bytes" in raw:
            raise _bad("cpu_bytes_to_use", raw["cpu_bytes_to_use"],
                       "is another name of cpu_bytes: give one of them")
        raw["cpu_bytes"] = raw.pop("cpu_bytes_to_use")
    known = {f.name for f in fields(ConnectorSettings)} | {"remote_url", "cpu_bytes_to_use"}
    for key in raw:
        if key not in known:
            raise _bad(key, raw[key], f"unknown key; known keys: {sorted(known)}")
    warn_of_password(raw.get("remote_url"), raw.get("remote"))
    out: dict[str, Any] = {}
    remote = _remote_settings(raw.pop("remote_url", None), raw.pop("remote", None))
    if remote is not None:
        out["remote"] = remote
    settings = declared(ConnectorSettings)
    for key, value in raw.items():
        spec = settings[key]
        accepted = spec.accept(value)
        if accepted is INVALID:
            raise _bad(key, value, f"must be {spec.need(none='null')}")
        if spec.kind == "path" and accepted is not None:
            accepted = str(Path(accepted).expanduser())
        elif spec.kind == "number":
            accepted = float(accepted)
        out[key] = accepted
    if not out.get("model_fingerprint", "auto"):
        raise _bad("model_fingerprint", "", "must be 'auto', 'content' or a non-empty name "
                                            "of the weights")
    return ConnectorSettings(**out)


_warned = False


def warn_of_password(url: Any, options: Any) -> bool:
    """Warn (once a process) when the extra config carries a password: vLLM logs its
    kv_transfer_config as given, so the password would be in the server's log. True when
    it warned now."""
    global _warned
    found = [name for name, value in (("remote_url", url), ("remote", options))
             if value is not None and has_password(repr(value))]
    if isinstance(options, Mapping):
        found += [f"remote.{name}" for name in options if "pass" in str(name).lower()]
    if not found or _warned:
        return False
    _warned = True
    log.warning("tierkv vLLM connector: kv_connector_extra_config %s holds a password, and "
                "vLLM logs its --kv-transfer-config as given: keep it out of the URL and put it "
                "in the environment variable remote.password_env names "
                "(TIERKV_REMOTE_PASSWORD) of every vLLM process; docs/vllm.md, \"Remote tier\"",
                " and ".join(found))
    return True


def _remote_settings(url: Any, options: Any) -> RemoteTierConfig | None:
    """``remote_url`` and the optional ``remote`` mapping as a RemoteTierConfig."""
    if url is None and options is None:
        return None
    if options is not None and not isinstance(options, Mapping):
        raise _bad("remote", options, "must be a mapping of remote tier settings "
                   "(key_prefix, push, timeout_seconds, ...)")
    options = dict(options or {})
    if url is None:
        raise _bad("remote", options, "needs remote_url (redis://host:port, or rediss:// for TLS)")
    if "url" in options:
        raise _bad("remote", options, "takes no url: set remote_url")
    known = {f.name for f in fields(RemoteTierConfig)} - {"url"}
    for name in options:
        if name not in known:
            raise _bad("remote", options, f"unknown setting {name!r}; known: {sorted(known)}")
    if not isinstance(url, str):
        raise _bad("remote_url", url, "must be a redis:// or rediss:// URL (a string)")
    try:
        return RemoteTierConfig(url=url, **options)
    except ConfigError as exc:  # its messages never show the URL's password
        raise ConfigError(f"tierkv vLLM connector: kv_connector_extra_config remote settings: "
                          f"{exc}") from None


def _unsupported(what: str) -> ConfigError:
    return ConfigError(f"tierkv vLLM connector: {what}")


# Why each other parallel layout is refused, and what to use instead.
_REFUSED_PARALLEL = {
    "pipeline_parallel_size": (
        "each pipeline stage holds only its own layers' KV, and a tierkv chunk holds every "
        "layer of the model in one value (its namespace names them all); use "
        "--tensor-parallel-size over the same GPUs, or serve without the tierkv connector"),
    "decode_context_parallel_size": (
        "the ranks would hold different tokens of one block; use --tensor-parallel-size"),
    "prefill_context_parallel_size": (
        "the ranks would hold different tokens of one block; use --tensor-parallel-size"),
}


# vLLM's KV cache specs tierkv stores, and what their pages hold. MLA (DeepSeek): one latent
# vector per token (vLLM views it as [B, 1, N, C]), no K/V halves; its namespace says so.
ATTENTION_KINDS = {"FullAttentionSpec": "full", "MLAAttentionSpec": "mla"}


def world_size_of(vllm_config: Any) -> int:
    parallel = vllm_config.parallel_config
    for name, why in _REFUSED_PARALLEL.items():
        size = int(getattr(parallel, name, 1) or 1)
        if size != 1:
            raise _unsupported(f"{name}={size} is not supported: {why}")
    return int(parallel.tensor_parallel_size)


# Specs of a model with several KV cache groups (or a sliding-window one) tierkv stores.
GROUP_KINDS = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding_window"}
_SAME_PAGES = ("block_size", "page_size_bytes", "real_page_size_bytes", "num_kv_heads",
               "head_size", "dtype")


def _stored_spec(kv_cache_config: Any) -> tuple[Any, tuple[str, ...], tuple[KVGroup, ...]]:
    """The spec of the pages tierkv stores, the layers a chunk's pages come from, and
    the groups (empty: one full-attention or MLA group)."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(group.kv_cache_spec).__name__ for group in groups]
    if len(groups) == 1 and kinds[0] in ATTENTION_KINDS:
        return groups[0].kv_cache_spec, tuple(groups[0].layer_names), ()
    instead = ("or serve it with --disable-hybrid-kv-cache-manager (vLLM then keeps every "
               "layer's blocks, as one group), or without the tierkv connector")
    for group, kind in zip(groups, kinds):
        if kind not in GROUP_KINDS:
            raise _unsupported(
                f"KV cache spec {kind} (layers {list(group.layer_names)[:3]}) is not supported; "
                f"tierkv stores full-attention, MLA and sliding-window groups {instead}")
    first = groups[0].kv_cache_spec
    for group in groups[1:]:
        for name in _SAME_PAGES:
            mine, theirs = getattr(group.kv_cache_spec, name, None), getattr(first, name, None)
            if mine != theirs:
                raise _unsupported(
                    f"the KV cache groups differ in {name} ({theirs} and {mine}); tierkv stores "
                    f"groups whose pages have one shape {instead}")
    described = tuple(KVGroup(
        kind=GROUP_KINDS[kind], layer_names=tuple(group.layer_names),
        sliding_window=int(getattr(group.kv_cache_spec, "sliding_window", 0) or 0)
        if kind == "SlidingWindowSpec" else 0,
        extra_retained_tokens=int(getattr(group.kv_cache_spec, "extra_retained_tokens", 0) or 0))
        for group, kind in zip(groups, kinds))
    widest = max(described, key=lambda group: len(group.layer_names))
    return first, widest.layer_names, described


def default_tokens_per_chunk(block_size: int, longest: int | None = None) -> int:
    """``tokens_per_chunk`` when it is not set: :data:`DEFAULT_TOKENS_PER_CHUNK` rounded up
    to the block size, at most ``longest`` (what the smallest sliding window holds)."""
    tokens = -(-DEFAULT_TOKENS_PER_CHUNK // block_size) * block_size
    return tokens if longest is None else min(tokens, longest)


def settings_in_use(settings: ConnectorSettings, vllm_config: Any) -> ConnectorSettings:
    """``settings`` with the values the connector will use where they are left unset
    (``tokens_per_chunk``), as far as ``vllm_config`` alone tells them (before the KV cache
    is planned): for ``tierkv:config_info``."""
    if settings.tokens_per_chunk is not None:
        return settings
    cache = getattr(vllm_config, "cache_config", None)
    block_size = getattr(cache, "block_size", None)
    if not isinstance(block_size, int) or block_size < 1:
        return replace(settings, tokens_per_chunk=DEFAULT_TOKENS_PER_CHUNK)
    window = None
    scheduler = getattr(vllm_config, "scheduler_config", None)
    model = getattr(vllm_config, "model_config", None)
    if model is not None and not getattr(scheduler, "disable_hybrid_kv_cache_manager", True):
        window = model.get_sliding_window()  # vLLM's KV cache groups hold the window then
    longest = max(block_size, window // block_size * block_size) \
        if isinstance(window, int) and window > 0 else None
    return replace(settings, tokens_per_chunk=default_tokens_per_chunk(block_size, longest))


def build_geometry(vllm_config: Any, kv_cache_config: Any, settings: ConnectorSettings) -> Geometry:
    spec, layer_names, groups = _stored_spec(kv_cache_config)
    if not all(hasattr(spec, name) for name in ("num_kv_heads", "head_size", "real_page_size_bytes")):
        raise _unsupported(f"KV cache spec {type(spec).__name__} is not supported "
                           f"(tierkv stores full-attention, MLA and sliding-window pages)")
    layout = (getattr(kv_cache_config, "kv_cache_layout", None)
              or getattr(vllm_config.cache_config, "kv_cache_layout", None) or "LBNHC")
    if layout not in PAGE_ORDER:
        raise _unsupported(f"KV cache layout {layout} is not supported; a block's page of one "
                           f"layer must be one dense region (use LBNHC/NHD, LBHNC/HND, BLNHC or "
                           f"BLHNC, e.g. VLLM_KV_CACHE_LAYOUT=LBNHC)")
    block_size = int(spec.block_size)
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", None) or block_size)
    # A chunk's pages must all be held when it is stored: vLLM frees a sliding window's
    # blocks as the window moves, so a chunk fits in the smallest window.
    windows = [group.sliding_window for group in groups if group.sliding_window]
    longest = max(block_size, min(windows) // block_size * block_size) if windows else None
    tokens_per_chunk = settings.tokens_per_chunk
    if tokens_per_chunk is None:
        tokens_per_chunk = default_tokens_per_chunk(block_size, longest)
    elif tokens_per_chunk % block_size or tokens_per_chunk % hash_block_size:
        raise _bad("tokens_per_chunk", tokens_per_chunk,
                   f"must be a multiple of vLLM's block size {block_size}")
    elif longest is not None and tokens_per_chunk > longest:
        raise _bad("tokens_per_chunk", tokens_per_chunk,
                   f"must be at most {longest} with a sliding window of {min(windows)} tokens: "
                   f"vLLM frees the window's blocks as it moves, and a chunk's pages must all "
                   f"still be held when the chunk is stored")
    world_size = world_size_of(vllm_config)
    attention = ATTENTION_KINDS.get(type(spec).__name__, "full")
    per_rank_heads = int(getattr(spec, "num_heads", spec.num_kv_heads))
    geometry = Geometry(
        layer_names=layer_names,
        block_size=block_size,
        hash_block_size=hash_block_size,
        blocks_per_chunk=tokens_per_chunk // block_size,
        page_bytes=int(spec.real_page_size_bytes),
        num_heads=per_rank_heads,
        content_bytes=int(getattr(spec, "state_content_size_bytes", 0)),
        dtype=str(spec.dtype).removeprefix("torch."),
        layout=layout,
        page_order=PAGE_ORDER[layout],
        world_size=world_size,
        num_slots=0,
        disk_capacity=0,
        attention=attention,
        groups=groups,
        total_heads=1 if attention == "mla" else total_kv_heads(vllm_config, per_rank_heads,
                                                                  world_size),
    )
    chunk_bytes = geometry.chunk_bytes
    num_slots = cpu_slot_count(settings.cpu_bytes, chunk_bytes, world_size)
    if num_slots < 1:
        raise _bad("cpu_bytes", settings.cpu_bytes,
                   f"holds no chunk: one chunk of {tokens_per_chunk} tokens is {chunk_bytes} bytes "
                   f"per rank x {world_size} rank(s); raise cpu_bytes or lower tokens_per_chunk")
    disk_capacity = 0
    if settings.disk_path is not None:
        copies = geometry.num_parts
        disk_capacity = disk_chunk_capacity(settings.disk_bytes, chunk_bytes, copies)
        if disk_capacity < 1:
            raise _bad("disk_bytes", settings.disk_bytes,
                       f"holds no chunk of {chunk_bytes} bytes x {copies} parts")
    return replace(geometry, num_slots=num_slots, disk_capacity=disk_capacity)


def total_kv_heads(vllm_config: Any, per_rank: int, world_size: int) -> int:
    """The model's KV heads: vLLM's model config says (``get_total_num_kv_heads``); else a
    rank's heads x ranks (each rank holds its own slice)."""
    model = getattr(vllm_config, "model_config", None)
    getter = getattr(model, "get_total_num_kv_heads", None)
    if getter is not None:
        try:
            total = int(getter())
        except Exception:  # noqa: BLE001 - a config without heads: derive them
            total = 0
        if total > 0 and total >= per_rank and (total % per_rank == 0):
            return total
    return per_rank * world_size


def check_prefill_after_hits(vllm_config: Any, geometry: Geometry, on_cpu: bool) -> None:
    """Refuse an engine that cannot compute a prompt's tail after tokens it did not compute
    in the same pass: tierkv's hits are such tokens, and that engine would read them wrong.
    vLLM's CPU platform runs MLA without AMX that way: it forces chunked prefill and prefix
    caching off (``vllm/platforms/cpu.py``), as its MLA prefill attends only to the tokens
    of the pass; served anyway, a hit gave other tokens than a recompute (tests/engine,
    ``test_mla_on_vllms_cpu_backend_is_refused``)."""
    scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
    if on_cpu and geometry.attention == "mla" and not scheduler.enable_chunked_prefill \
            and not cache.enable_prefix_caching:
        raise _unsupported(
            "vLLM's CPU backend runs this MLA model with chunked prefill and prefix caching "
            "forced off (\"MLA is enabled on a non-GPU platform\"): its MLA prefill cannot "
            "attend to KV computed before, so the tokens tierkv would load would be read "
            "wrong; serve this model without the tierkv connector on CPU (a CPU with AMX, "
            "or a GPU, runs it with tierkv)")


def hash_seed_fingerprint(environ: Mapping[str, str] | None = None) -> str:
    """``unset``, or 12 hex digits of sha256 over ``PYTHONHASHSEED`` (the value stays private)."""
    seed = (os.environ if environ is None else environ).get("PYTHONHASHSEED")
    return "unset" if seed is None else hashlib.sha256(seed.encode()).hexdigest()[:12]


def check_hash_stability(algorithm: str, settings: ConnectorSettings,
                         environ: Mapping[str, str] | None = None) -> None:
    """Refuse a disk or remote tier when vLLM's block hashes would differ after a restart
    (or between two engines)."""
    seeded = (os.environ if environ is None else environ).get("PYTHONHASHSEED") is not None
    if (settings.disk_path is None and settings.remote is None) or algorithm in STABLE_HASHES \
            or (seeded and algorithm in KNOWN_HASHES):
        return
    tier, remove = ((f"disk tier (disk_path={settings.disk_path!r}) could never be hit after "
                     f"a restart", "disk_path") if settings.disk_path is not None else
                    ("remote tier could never be hit by another engine", "remote_url"))
    raise ConfigError(
        f"tierkv vLLM connector: prefix_caching_hash_algo={algorithm!r} without PYTHONHASHSEED "
        f"gives block hashes that change on every start, so the {tier}. Set "
        f"PYTHONHASHSEED to a fixed value in the vLLM server's environment, or use "
        f"--prefix-caching-hash-algo sha256 (or sha256_cbor), or remove {remove}"
    )


def engine_model_fingerprint(vllm_config: Any, mode: str = "auto",
                             cache_dir: Path | None = None) -> str:
    """The fingerprint of the weights and config this engine loads
    (:mod:`tierkv.model_identity`): its model directory, file or hub snapshot (``mode``:
    ``auto``, ``content`` or the operator's own name), a speculative drafter's weights (its
    layers' KV is stored too), a separate ``hf_config_path``, and the ``hf_overrides``
    laid over the config. A model it cannot find is warned about and
    named by its id alone (``unresolved``), as before fingerprints."""
    model = vllm_config.model_config
    load = getattr(vllm_config, "load_config", None)
    hub_cache = getattr(load, "download_dir", None)
    found = model_identity.model_fingerprint(
        model.model, mode, revision=getattr(model, "revision", None), cache_dir=cache_dir,
        hub_cache=hub_cache)
    if found is None:
        log.warning("tierkv: the model %r is neither a local path nor in the hub cache, so "
                    "its weights cannot be fingerprinted; chunks are named by the model id "
                    "and revision alone. Set kv_connector_extra_config model_fingerprint "
                    "to a name of these weights that changes when they do", str(model.model))
        found = "unresolved"
    # A drafter's attention layers are stored with the chunk: its weights compute them.
    draft = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config",
                    None)
    if draft is not None and getattr(draft, "model", None) not in (None, model.model):
        found += "+draft:" + (model_identity.model_fingerprint(
            draft.model, mode, revision=getattr(draft, "revision", None), cache_dir=cache_dir,
            hub_cache=hub_cache) or f"unresolved:{draft.model}")
    config_path = getattr(model, "hf_config_path", None)
    if config_path:
        found += "+config:" + (model_identity.model_fingerprint(config_path, "auto",
                                                                hub_cache=hub_cache)
                               or f"unresolved:{config_path}")
    return found + model_identity.overrides_fingerprint(getattr(model, "hf_overrides", None))


def build_namespace(vllm_config: Any, geometry: Geometry, vllm_version: str,
                    environ: Mapping[str, str] | None = None,
                    model_fingerprint: str | None = None) -> Namespace:
    """The namespace of this engine's chunks; equal on every role and restart that can
    share them. Pages in NHD order are the same bytes under LBNHC and BLNHC (and HND under
    LBHNC and BLHNC), so those layouts share a namespace. ``model_fingerprint``: what
    :func:`engine_model_fingerprint` gave (computed here when None)."""
    if model_fingerprint is None:
        model_fingerprint = engine_model_fingerprint(vllm_config)
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    revision = getattr(model, "revision", None)
    model_id = f"{model.model}@{revision}" if revision else str(model.model)
    quantization = getattr(model, "quantization", None)
    lookahead = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
    hash_scheme = (f"vllm-{cache.prefix_caching_hash_algo}"
                   f"/seed:{hash_seed_fingerprint(environ)}"
                   f"/hash-block:{geometry.hash_block_size}/lookahead:{lookahead}"
                   f"/key:tierkv-vllm-v1")
    # Several groups: a chunk holds, per region of the widest group's layers, the pages of
    # each group's blocks in group order; the groups' kinds and layers say whose they are.
    layers = tuple(name for group in geometry.groups for name in group.layer_names) \
        or geometry.layer_names
    groups = (" groups=[" + ", ".join(group.describe() for group in geometry.groups) + "]"
              if geometry.groups else "")
    # No TP size: a part's bytes are the heads it names, cut from the model's pages (page
    # order, heads, tokens, bytes per head and token say where each head's bytes are).
    mla = geometry.attention == "mla"
    return Namespace(
        model_id=model_id,
        dtype=f"{geometry.dtype}/{getattr(cache, 'cache_dtype', 'auto')}",
        kv_layout=(("vllm-mla-page" if mla else "vllm-page")
                   + f" {geometry.page_order} [H={geometry.model_heads}, "
                   f"N={geometry.block_size}, C={geometry.content_bytes}B]{groups}"),
        page_bytes=geometry.page_bytes * geometry.num_parts,
        tokens_per_chunk=geometry.tokens_per_chunk,
        num_layers=len(layers),
        rank_layout="mla" if mla else "heads",
        hash_scheme=hash_scheme,
        format_version=FORMAT_VERSION,
        extra=f"vllm-{chunks_minor(vllm_version)}" + (f"/quant:{quantization}" if quantization else ""),
        layer_names=layers,
        blocks_per_chunk=geometry.blocks_per_chunk,
        chunk_bytes=geometry.model_chunk_bytes,
        num_kv_heads=geometry.model_heads,
        model_fingerprint=model_fingerprint,
    )


def data_parallel_index(vllm_config: Any) -> int:
    """Which data-parallel engine this is: each keeps its own part directories
    (``part-<p>of<P>-dp<d>``), as it claims them."""
    parallel = vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_index", None)
               or getattr(parallel, "data_parallel_rank", 0) or 0)


def store_config(settings: ConnectorSettings, geometry: Geometry, rank: int = 0) -> StoreConfig:
    """One rank's :class:`~tierkv.config.StoreConfig`: its share of ``cpu_bytes`` and
    ``disk_bytes`` (the disk map is sized for it: one part's share), everything else as the
    settings say."""
    share = geometry.world_size
    return StoreConfig(
        blocks_per_chunk=geometry.pages_per_chunk,  # block ids a job copies per chunk
        cpu=CpuTierConfig(max_bytes=max(settings.cpu_bytes // share, 1),
                          pin_memory=settings.pin_memory,
                          spill_ahead_fraction=settings.spill_ahead_fraction,
                          eviction_policy=settings.eviction_policy),
        disk=DiskTierConfig(path=Path(settings.disk_path) if settings.disk_path else None,
                            max_bytes=max(settings.disk_bytes // geometry.num_parts, 1),
                            write_through=settings.write_through,
                            sync_mode=settings.disk_sync_mode),
        device=settings.device,
        rank=rank,
        remote=settings.remote,
    )


def adapter_config(settings: ConnectorSettings, geometry: Geometry) -> AdapterConfig:
    return AdapterConfig(
        tokens_per_block=geometry.block_size,
        blocks_per_chunk=geometry.blocks_per_chunk,
        world_size=geometry.world_size,
        offload_prompt_only=settings.offload_prompt_only,
        max_chunks_per_request=settings.max_chunks_per_request,
        promotion_wait_seconds=settings.promotion_wait_seconds,
        wait_for_stores=True,  # a chat's next turn hits the chunks its previous turn stores
        groups=geometry.num_groups,
        frees_running_blocks=bool(geometry.sliding_windows),
        # Several groups: vLLM maps a failed load back to a request only while it waits for
        # its load (failed_recving), so a same-step load that failed would go unnoticed.
        sync_load_chunks=(settings.sync_load_bytes // geometry.chunk_bytes
                          if geometry.num_groups == 1 else 0),
        load_policy=settings.load_policy,
        load_bias=settings.load_bias,
        load_deadline_ms=settings.load_deadline_ms,
        chunk_bytes=geometry.chunk_bytes,
    )
