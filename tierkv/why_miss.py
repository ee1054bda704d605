"""``tierkv why-miss``: for each chunk of one prompt, where an engine configured as given
would hit it, or why it misses (``docs/warmup.md``, "tierkv why-miss").

The engine is the warm-up's :class:`~tierkv.integrations.vllm_warmup.VllmTarget` (the
settings ``tierkv warmup`` takes), keyed as tierkv's vLLM connector keys a request: vLLM's
block hashes of the prompt (with its ``cache_salt``, LoRA adapter and multimodal inputs),
then :func:`~tierkv.integrations.vllm_keys.adapter_key`. :func:`explain` reads the store's
disk tier read-only (index records, and the values of the chunks it would load, checked as
a load checks them) and gives each chunk one verdict (:data:`VERDICTS`):

- ``hit-disk``: every part of one part count holds it and its values pass their checks;
- ``hit-remote``: not on disk; the remote tier (``remote``, when given) holds every part
  of one part count and its values pass their checks;
- ``damaged``: it is there (on disk, else remote), and a value fails its header or
  checksum check;
- ``partial``: some parts of a part count hold it, not all (a chunk is served only whole);
- ``other-dp``: another data-parallel engine's part directories hold it;
- ``other-key``: the prompt's keys without one of its key inputs (``cache_salt``, the LoRA
  adapter, the multimodal inputs) are stored: the chunk was stored by such a request;
- ``other-namespace``: a namespace that differs in the named settings holds it, under the
  keys that namespace's key settings (hash algorithm, seed, hash block size, tokens per
  chunk) give this prompt;
- ``not-stored``: none of the above. The disk tier keeps no record of what it evicted, so
  "never stored" and "evicted" are one verdict; nor can keys stored in a cache epoch after
  a reset (random, never persisted) be derived. Namespaces whose keys cannot be derived
  here (another PYTHONHASHSEED, another tierkv format) are named with how they differ;
- ``refused``: an engine with these settings never starts with tierkv (pipeline parallel).

The remote tier records no namespace's settings, only its fingerprint: a namespace found
only there is named by its fingerprint; the disk's records describe the others. The CPU
tier lives inside a running engine: it is not looked at. Nothing is written.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tierkv.checks import is_int
from tierkv.config import RemoteTierConfig
from tierkv.errors import BrokenError, ConfigError, DamagedError, NamespaceMismatchError
from tierkv.integrations.vllm_config import KNOWN_HASHES, STABLE_HASHES
from tierkv.integrations.vllm_keys import adapter_key, chunk_keys_from_block_hashes
from tierkv.integrations.vllm_warmup import MultiModalInput, VllmTarget, vllm_block_hashes
from tierkv.keys import FORMAT_VERSION, Namespace, Part, parse_part
from tierkv.tiers.base import ReadStatus
from tierkv.tiers.disk.files import NamespaceInfo, describe_differences, list_namespaces
from tierkv.tiers.disk.layout import StoreLayout
from tierkv.tiers.disk.opener import open_disk, tool_config
from tierkv.tiers.remote.tools import Session
from tierkv.tiers.remote.tools import scan_entries as entries

VERDICTS = ("hit-disk", "hit-remote", "damaged", "partial", "other-dp", "other-key",
            "other-namespace", "not-stored", "refused")
HITS = ("hit-disk", "hit-remote")
NOT_STORED = ("never stored, or evicted (the disk tier keeps no record of evictions; keys "
              "stored in a cache epoch after a reset_prefix_cache are other, random keys, "
              "never hit again)")
# The parts of a model fingerprint (vllm_config.engine_model_fingerprint), in words.
FINGERPRINT_PARTS = {"": "the weights and config files", "overrides": "hf_overrides",
                     "config": "hf_config_path's config", "draft": "the speculative draft model"}


@dataclass(frozen=True)
class KeyInputs:
    """What a request's keys bind besides its tokens: ``cache_salt``, a LoRA adapter
    (``lora``: vLLM's name and path; ``adapter``: its content fingerprint, as the
    connector computes it) and multimodal inputs (``(identifier, offset, length)``)."""

    cache_salt: str | None = None
    lora: tuple[str, str] | None = None
    adapter: str = ""
    multimodal: tuple[MultiModalInput, ...] = ()

    def without_each(self) -> list[tuple[str, KeyInputs]]:
        """(the input's name, these inputs without it), for each input given."""
        out = []
        if self.cache_salt:
            out.append(("cache_salt", replace(self, cache_salt=None)))
        if self.lora:
            out.append(("lora", replace(self, lora=None, adapter="")))
        if self.multimodal:
            out.append(("multimodal", replace(self, multimodal=())))
        return out


INPUT_WORDS = {"cache_salt": "cache_salt (--salt)",
               "lora": "LoRA adapter (--lora)", "multimodal": "multimodal inputs (--mm)"}


@dataclass(frozen=True)
class KeyScheme:
    """What a namespace's chunk keys depend on besides the request."""

    algorithm: str
    hash_seed: str | None
    hash_block: int
    tokens_per_chunk: int

    def keys(self, token_ids: Sequence[int], inputs: KeyInputs) -> list[bytes]:
        """Keys of the full chunks of ``token_ids``, as the connector derives them."""
        full = len(token_ids) // self.tokens_per_chunk * self.tokens_per_chunk
        hashes = vllm_block_hashes(token_ids[:full], self.hash_block, self.algorithm,
                                   self.hash_seed, inputs.cache_salt, inputs.lora,
                                   inputs.multimodal)
        keys = chunk_keys_from_block_hashes(hashes, self.tokens_per_chunk // self.hash_block)
        return [adapter_key(key, inputs.adapter) for key in keys]


_SCHEME = re.compile(r"^vllm-(?P<algo>[^/]+)/seed:(?P<seed>[^/]+)/hash-block:(?P<block>\d+)"
                     r"/lookahead:(?P<ahead>\d+)/key:tierkv-vllm-v1$")


def scheme_of(description: dict[str, Any], ours: KeyScheme, our_hash_scheme: str
              ) -> KeyScheme | str:
    """The key scheme a namespace record describes; a str says why its keys cannot be
    derived here."""
    text = str(description.get("hash_scheme", ""))
    found, mine = _SCHEME.match(text), _SCHEME.match(our_hash_scheme)
    if found is None or mine is None:
        return f"its keys come from another key scheme (hash_scheme {text!r})"
    if found["ahead"] != mine["ahead"]:
        return f"its keys look ahead {found['ahead']} tokens"
    seed: str | None
    if found["seed"] == mine["seed"]:
        seed = ours.hash_seed
    elif found["seed"] == "unset":
        seed = None
    else:
        return (f"its keys depend on a PYTHONHASHSEED it records only as a fingerprint "
                f"({found['seed']}); pass --hash-seed with that server's PYTHONHASHSEED to "
                f"look them up")
    algorithm, block = found["algo"], int(found["block"])
    tpc = description.get("tokens_per_chunk")
    if algorithm not in KNOWN_HASHES or (seed is None and algorithm not in STABLE_HASHES):
        return f"its hash algorithm {algorithm!r} gives keys no restart reproduces"
    if not is_int(tpc) or tpc <= 0 or block <= 0 or tpc % block:
        return f"its tokens_per_chunk {tpc!r} is not a multiple of its hash block {block}"
    return KeyScheme(algorithm, seed, block, tpc)


# ------------------------------------------------------------------------------ the store
@dataclass
class PartDir:
    """One ``part-<p>of<P>[-dp<d>]`` directory: which of the keys asked for it holds, and
    which of the values read failed their checks."""

    part: Part
    replica: int
    keys: set[bytes] = field(default_factory=set)
    corrupt: set[bytes] = field(default_factory=set)
    problem: str | None = None

    @property
    def name(self) -> str:
        return StoreLayout.part_dir_name(self.part, self.replica)


def scan_namespace(root: Path, info: NamespaceInfo, wanted: AbstractSet[bytes],
                   read: AbstractSet[bytes] = frozenset()) -> list[PartDir]:
    """Every part directory of ``info``, opened read-only: the ``wanted`` keys its index
    holds, and which of the ``read`` ones fail the checks of a load."""
    namespace = Namespace(**info.description)
    dirs = []
    for part, replica in info.parts:
        found = PartDir(part, replica)
        dirs.append(found)
        path = StoreLayout(root).part_dir(info.fingerprint, part, replica)
        size = sum(data.stat().st_size for data in StoreLayout.data_files(path))
        payload = namespace.chunk_bytes // part.count or 1
        try:
            with open_disk(tool_config(root, size), namespace, part, "tool",
                           payload_bytes=payload, replica=replica) as tier:
                found.keys = {record.key for record in tier.scan() if record.key in wanted}
                out = memoryview(bytearray(payload))
                found.corrupt = {key for key in found.keys & read
                                 if tier.read_into(key, out) is ReadStatus.CORRUPT}
        except (DamagedError, NamespaceMismatchError, BrokenError, ConfigError, OSError) as exc:
            found.problem = str(exc)
    return dirs


def complete_groups(dirs: Sequence[PartDir], key: bytes) -> list[list[PartDir]]:
    """The part counts whose every part (of one replica) holds ``key``, as their dirs."""
    groups: dict[tuple[int, int], dict[int, PartDir]] = {}
    for found in dirs:
        if key in found.keys:
            groups.setdefault((found.part.count, found.replica), {})[found.part.index] = found
    return [list(parts.values()) for (count, _), parts in sorted(groups.items())
            if len(parts) == count]


@dataclass
class RemoteHoldings:
    """What the remote tier holds of the keys asked for: fingerprint -> part -> keys."""

    config: RemoteTierConfig
    keys: dict[str, dict[Part, set[bytes]]] = field(default_factory=dict)

    def parts_holding(self, fingerprint: str, key: bytes) -> list[Part]:
        return sorted(part for part, keys in self.keys.get(fingerprint, {}).items()
                      if key in keys)

    def complete(self, fingerprint: str, key: bytes) -> list[Part]:
        """The parts of the first part count whose every part holds ``key`` ([]: none)."""
        held = self.parts_holding(fingerprint, key)
        for count in sorted({part.count for part in held}):
            group = [part for part in held if part.count == count]
            if len(group) == count:
                return group
        return []

    def corrupt(self, fingerprint: str, parts: Sequence[Part], key: bytes,
                payload: int) -> list[Part]:
        """The parts whose value of ``key`` fails the checks of a load."""
        from tierkv.tiers.remote.tier import RemoteTier

        with RemoteTier(self.config, fingerprint, parts[0], payload,
                        role="tierkv why-miss") as tier:
            return [part for part in parts
                    if tier.verify_chunk(key, part).status is ReadStatus.CORRUPT]


def read_remote(config: RemoteTierConfig, wanted: AbstractSet[bytes]) -> RemoteHoldings:
    """The ``wanted`` keys the remote tier holds (``SCAN`` of its prefix on every primary;
    keys of an older tierkv format are left out: never read)."""
    holdings = RemoteHoldings(config)
    session = Session(config)
    try:
        for _, fingerprint, label, key in entries(session, report_every=None):
            part = parse_part(label)
            if part is not None and key in wanted:
                holdings.keys.setdefault(fingerprint, {}).setdefault(part, set()).add(key)
    finally:
        session.close()
    return holdings


# ------------------------------------------------------------------------------ verdicts
@dataclass
class ChunkVerdict:
    index: int
    start: int
    end: int
    key: str
    verdict: str
    detail: str
    dimensions: list[str] = field(default_factory=list)  # what differs, for machines

    def line(self) -> str:
        return (f"chunk {self.index} tokens [{self.start}, {self.end}) {self.key[:8]}: "
                f"{self.verdict}: {self.detail}")


@dataclass
class WhyMiss:
    store: str
    namespace: str
    tokens: int
    tokens_per_chunk: int
    chunks: list[ChunkVerdict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {verdict: count for verdict in VERDICTS
                if (count := sum(chunk.verdict == verdict for chunk in self.chunks))}

    def served(self) -> int:
        """Chunks an engine would load: the prefix of hits."""
        count = 0
        for chunk in self.chunks:
            if chunk.verdict not in HITS:
                break
            count += 1
        return count

    def summary(self) -> str:
        counts = ", ".join(f"{count} {verdict}" for verdict, count in self.counts().items())
        return (f"why-miss: {len(self.chunks)} chunk(s) of {self.tokens} tokens in namespace "
                f"{self.namespace[:8]} of {self.store}: {counts or 'none'}; a request loads "
                f"the first {self.served()} ({self.served() * self.tokens_per_chunk} tokens) "
                f"from its lower tiers (the CPU tier is a running engine's own: not looked at)")

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "counts": self.counts(), "served_chunks": self.served(),
                "summary": self.summary()}


def fingerprint_differences(there: str, here: str) -> list[str]:
    """Which parts of two model fingerprints differ, in words (:data:`FINGERPRINT_PARTS`)."""
    def parts(text: str) -> dict[str, str]:
        head, *rest = text.split("+")
        return {"": head, **dict(item.partition(":")[::2] for item in rest)}

    mine, theirs = parts(here), parts(there)
    return [FINGERPRINT_PARTS.get(name, name) for name in dict.fromkeys([*theirs, *mine])
            if theirs.get(name) != mine.get(name)]


@dataclass
class _Other:
    """Another namespace on disk: how it differs, its keys of the prompt (per chunk of
    ours: the key of its chunk holding our chunk's last token), or why there are none."""

    info: NamespaceInfo
    differs: list[str]
    keys: list[bytes | None] = field(default_factory=list)
    spans: list[tuple[int, int] | None] = field(default_factory=list)
    dirs: list[PartDir] = field(default_factory=list)
    why_not: str | None = None

    def describe(self, namespace: Namespace, hints: dict[str, str]) -> str:
        text = describe_differences(self.info, self.differs, namespace, hints)
        if "model_fingerprint" in self.differs:
            parts = fingerprint_differences(str(self.info.description.get("model_fingerprint")),
                                            namespace.model_fingerprint)
            text += f" (model_fingerprint differs in: {', '.join(parts)})"
        return text

    def dimensions(self, namespace: Namespace) -> list[str]:
        extra = (["draft"] if "model_fingerprint" in self.differs and "the speculative draft "
                 "model" in fingerprint_differences(str(self.info.description.get(
                     "model_fingerprint")), namespace.model_fingerprint) else [])
        return [*self.differs, *extra]


def _other_namespace(root: Path, info: NamespaceInfo, namespace: Namespace, ours: KeyScheme,
                     token_ids: Sequence[int], inputs: KeyInputs, num_chunks: int) -> _Other:
    described = namespace.describe()
    other = _Other(info, [name for name in described
                          if info.description.get(name) != described[name]])
    if info.format_version != FORMAT_VERSION:
        other.why_not = (f"it was written by another tierkv (format {info.format_version}), "
                         f"which this tierkv never reads")
        return other
    scheme = scheme_of(info.description, ours, namespace.hash_scheme)
    if isinstance(scheme, str):
        other.why_not = scheme
        return other
    theirs = scheme.keys(token_ids, inputs)
    for index in range(num_chunks):
        last = (index + 1) * ours.tokens_per_chunk - 1
        position = last // scheme.tokens_per_chunk
        held = position < len(theirs)
        other.keys.append(theirs[position] if held else None)
        other.spans.append((position * scheme.tokens_per_chunk,
                            (position + 1) * scheme.tokens_per_chunk) if held else None)
    try:
        other.dirs = scan_namespace(root, info, {key for key in other.keys if key})
    except (ConfigError, TypeError) as exc:
        other.why_not = f"its record cannot be read as a namespace ({exc})"
    return other


Verdict = tuple[str, str, list[str]]  # (verdict, detail, dimensions)


@dataclass
class _Look:
    """What :func:`explain` found, for the verdict of each chunk."""

    namespace: Namespace
    parts: int  # this engine's part count
    data_parallel_index: int
    own_dirs: list[PartDir]
    variants: list[tuple[str, list[bytes]]]
    others: list[_Other]
    remote: RemoteHoldings | None
    hints: dict[str, str]

    @property
    def short(self) -> str:
        return self.namespace.fingerprint()[:8]

    def on_disk(self, key: bytes) -> Verdict | None:
        """A hit or a damaged value in this engine's own part directories."""
        mine = [found for found in self.own_dirs if found.replica == self.data_parallel_index]
        groups = complete_groups(mine, key)
        if not groups:
            return None
        group = next((g for g in groups if len(g) == self.parts), groups[0])
        bad = [found.name for found in group if key in found.corrupt]
        if bad:
            return ("damaged", f"{', '.join(bad)} of namespace {self.short} holds it, and its "
                    f"value fails the checks of a load (header or checksum): the engine "
                    f"recomputes it; tierkv verify reports it, --repair deletes it", ["damaged"])
        shared = "" if len(group) == self.parts else (
            f" (another TP size's parts: read whole or cut per head; this engine stores "
            f"{self.parts} part(s))")
        return ("hit-disk", f"on disk in namespace {self.short}, "
                f"{', '.join(found.name for found in group)}{shared}", [])

    def on_remote(self, key: bytes) -> Verdict | None:
        fingerprint = self.namespace.fingerprint()
        group = self.remote.complete(fingerprint, key) if self.remote else []
        if not group or self.remote is None:
            return None
        payload = self.namespace.chunk_bytes // group[0].count
        bad = self.remote.corrupt(fingerprint, group, key, payload)
        names = ", ".join(f"part {part.name}" for part in bad or group)
        if bad:
            return ("damaged", f"not on disk; the remote tier's value of {names} (namespace "
                    f"{self.short}) fails the checks of a load (header or checksum): the "
                    f"engine recomputes it; tierkv verify --repair URL deletes it", ["damaged"])
        return ("hit-remote", f"not on disk; on the remote tier in namespace {self.short}, "
                f"{names}", [])

    def partial(self, key: bytes) -> Verdict | None:
        mine = [found for found in self.own_dirs if found.replica == self.data_parallel_index]
        held = [found.part for found in mine if key in found.keys]
        where = "on disk"
        if not held and self.remote is not None:
            held, where = self.remote.parts_holding(self.namespace.fingerprint(), key), "remote"
        if not held:
            return None
        count = held[0].count
        missing = sorted(set(range(count)) - {part.index for part in held if part.count == count})
        return ("partial", f"part(s) {', '.join(part.name for part in held)} hold it ({where}), "
                f"not part(s) {', '.join(f'{index}of{count}' for index in missing)}: a chunk is "
                f"served only whole, every part of one part count (a TP part is missing: the "
                f"writer's other ranks did not store it, or it was evicted there)", ["part"])

    def other_replica(self, key: bytes) -> Verdict | None:
        groups = complete_groups(self.own_dirs, key)  # other replicas' (ours: on_disk)
        if not groups:
            return None
        return ("other-dp", f"stored by data-parallel engine {groups[0][0].replica} "
                f"({', '.join(found.name for found in groups[0])}); an engine of "
                f"data_parallel_index {self.data_parallel_index} reads only its own part "
                f"directories", ["data_parallel_index"])

    def holds(self, fingerprint: str, dirs: Sequence[PartDir], key: bytes | None) -> bool:
        return key is not None and (any(key in found.keys for found in dirs) or bool(
            self.remote and self.remote.parts_holding(fingerprint, key)))

    def other_key(self, index: int) -> Verdict | None:
        fingerprint = self.namespace.fingerprint()
        name = next((name for name, found in self.variants if index < len(found)
                     and self.holds(fingerprint, self.own_dirs, found[index])), None)
        if name is None:
            return None
        return ("other-key", f"the prompt's keys without its {INPUT_WORDS[name]} are stored in "
                f"namespace {self.short}: a request without it stored this chunk; the key "
                f"binds it, so these keys miss", [name])

    def other_namespace(self, index: int, key: bytes) -> Verdict | None:
        holder = next((other for other in self.others if other.keys and self.holds(
            other.info.fingerprint, other.dirs, other.keys[index])), None)
        if holder is not None:
            start, end = holder.spans[index] or (0, 0)
            return ("other-namespace", f"stored under namespace {holder.info.fingerprint[:8]} "
                    f"(its chunk of tokens [{start}, {end})), which differs: "
                    f"{holder.describe(self.namespace, self.hints)}",
                    holder.dimensions(self.namespace))
        known = {other.info.fingerprint for other in self.others} | {self.namespace.fingerprint()}
        remote_only = sorted(fp for fp in (self.remote.keys if self.remote else {})
                             if fp not in known and self.holds(fp, (), key))
        if remote_only:
            return ("other-namespace", f"stored on the remote tier under namespace "
                    f"{remote_only[0][:8]}, which no namespace record on disk describes (the "
                    f"remote tier keeps fingerprints only; an engine of those settings wrote "
                    f"it: tierkv inspect of its disk_path names them)", ["namespace"])
        return None

    def not_stored(self, own: bool) -> Verdict:
        unknown = [other for other in self.others if other.why_not]
        maybe = "".join(f"; namespace {other.info.fingerprint[:8]} may hold it, but "
                        f"{other.why_not}; it differs: {other.describe(self.namespace, self.hints)}"
                        for other in unknown)
        where = f"namespace {self.short}" if own else "this store"
        tiers = "on disk or on the remote tier" if self.remote else "on disk"
        return ("not-stored", f"not {tiers} in {where}: {NOT_STORED}{maybe}",
                [name for other in unknown for name in other.dimensions(self.namespace)])


def explain(root: Path | str, target: VllmTarget, token_ids: Sequence[int],
            inputs: KeyInputs = KeyInputs(), *, data_parallel_index: int = 0,
            pipeline_parallel_size: int = 1, hints: dict[str, str] | None = None,
            remote: RemoteTierConfig | None = None) -> WhyMiss:
    """Each chunk's verdict (see the module docstring) for an engine like ``target`` (of
    data-parallel index ``data_parallel_index``) over the store at ``root`` (and the remote
    tier of ``remote``). ``hints``: the option that sets each namespace field, for the
    lines."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"why-miss: --store {root} is not a directory (the connector's "
                          f"disk_path)")
    namespace = target.namespace()
    fingerprint = namespace.fingerprint()
    ours = KeyScheme(target.hash_algo, target.hash_seed, target.hash_block, target.chunk_tokens)
    keys = ours.keys(token_ids, inputs)
    tpc = ours.tokens_per_chunk
    report = WhyMiss(str(root), fingerprint, len(token_ids), tpc)

    def verdict(index: int, found: Verdict) -> None:
        report.chunks.append(ChunkVerdict(index, index * tpc, (index + 1) * tpc,
                                          keys[index].hex(), *found))

    if pipeline_parallel_size > 1:
        for index in range(len(keys)):
            verdict(index, ("refused", f"pipeline_parallel_size={pipeline_parallel_size}: an "
                            f"engine with pipeline parallelism never starts with tierkv (a "
                            f"stage holds only its layers' KV; no layer split is stored)",
                            ["pipeline_parallel_size"]))
        return report
    infos = list_namespaces(root)
    own = next((info for info in infos if info.fingerprint == fingerprint), None)
    variants = [(name, ours.keys(token_ids, without)) for name, without in inputs.without_each()]
    wanted = set(keys).union(*(set(found) for _, found in variants))
    own_dirs: list[PartDir] = []
    if own is None:
        report.notes.append(f"namespace {fingerprint[:8]} (these settings') is not in {root}")
    else:
        own_dirs = scan_namespace(root, own, wanted, read=set(keys))
        report.notes += [f"{own.fingerprint[:8]} {found.name}: not read: {found.problem}"
                         for found in own_dirs if found.problem]
    others = [_other_namespace(root, info, namespace, ours, token_ids, inputs, len(keys))
              for info in infos if info.fingerprint != fingerprint]
    holdings = None
    if remote is not None:
        holdings = read_remote(remote, wanted.union(
            *({key for key in other.keys if key} for other in others)))
    look = _Look(namespace, len(target.parts()), data_parallel_index, own_dirs, variants,
                 others, holdings, hints or {})
    for index, key in enumerate(keys):
        verdict(index, look.on_disk(key) or look.on_remote(key) or look.partial(key)
                or look.other_replica(key) or look.other_key(index)
                or look.other_namespace(index, key) or look.not_stored(own is not None))
    return report
