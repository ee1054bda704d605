"""Security: nothing read from disk is unpickled or evaluated, crafted values are rejected
without trusting their lengths or types, files are private to the user whatever the
umask, and namespaces and tenant salts keep one model's or tenant's KV from another.

``tests/integration/test_disk_tier.py`` already rejects a tiny pickle header, the usual
malformed headers and checks the modes under the default umask; this file adds a working
pickle exploit on the store's read path, bounded-length attacks, a permissive umask and
isolation through the public API.
"""

from __future__ import annotations

import ast
import builtins
import logging
import marshal
import os
import pickle
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.profiles import thorough
import tierkv
from tests.reliability import support
from tierkv.keys import FORMAT_VERSION, ROOT_KEY, Namespace, chunk_keys, salted_root
from tierkv.tiers.disk.tier import DiskTier, ReadStatus, list_namespaces, shard_of
from tierkv.tiers.disk.format import MAGIC, checksum

PACKAGE = Path(tierkv.__file__).parent

# -- nothing is unpickled or evaluated ----------------------------------------------------

# Modules that turn bytes into objects or code. The read path may not even import them;
# elsewhere only their writing side may be used (warmup hashes like vLLM: pickle.dumps).
UNSAFE_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle",
                  "joblib", "copyreg"}
READ_PATH = ("tiers", "transfer", "engine", "core", "keys.py", "config.py", "errors.py",
             "tools.py")
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
UNSAFE_ATTRIBUTES = {("torch", "load"), ("np", "load"), ("numpy", "load"), ("yaml", "load"),
                     ("yaml", "unsafe_load"), ("pickle", "loads"), ("pickle", "load"),
                     ("pickle", "Unpickler"), ("marshal", "loads"), ("marshal", "load"),
                     ("shelve", "open")}
UNSAFE_NAMES = {"loads", "load", "Unpickler"}  # from pickle/marshal import ...
UNSAFE_HOOKS = {"ext_hook", "object_hook", "object_pairs_hook", "list_hook"}


def _sources() -> Iterator[tuple[Path, ast.AST]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _dotted(node: ast.AST) -> tuple[str, str] | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


def _problems(path: Path, tree: ast.AST) -> list[str]:
    where = path.relative_to(PACKAGE.parent)
    on_read_path = path.relative_to(PACKAGE).parts[0] in READ_PATH
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name.split(".")[0] for alias in node.names]
            problems += [f"{where}:{node.lineno} imports {name} on the read path"
                         for name in modules if name in UNSAFE_MODULES and on_read_path]
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[0]
            if module in UNSAFE_MODULES:
                names = {alias.name for alias in node.names}
                if on_read_path or names & UNSAFE_NAMES or "*" in names:
                    problems.append(f"{where}:{node.lineno} imports {sorted(names)} from {module}")
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in UNSAFE_CALLS:
                problems.append(f"{where}:{node.lineno} calls {node.func.id}()")
            dotted = _dotted(node.func)
            if dotted in UNSAFE_ATTRIBUTES:
                problems.append(f"{where}:{node.lineno} calls {'.'.join(dotted)}()")
            hooks = {kw.arg for kw in node.keywords} & UNSAFE_HOOKS
            if hooks:
                problems.append(f"{where}:{node.lineno} passes {sorted(hooks)}")
    return problems


def test_the_package_never_unpickles_or_evaluates_and_the_read_path_never_imports_pickle(
) -> None:
    sources = list(_sources())
    assert len(sources) > 20  # the scan saw the package
    problems = [problem for path, tree in sources for problem in _problems(path, tree)]
    assert not problems, problems


def test_the_source_scan_catches_what_it_looks_for(tmp_path: Path) -> None:
    """The scanner is not blind: each pattern it forbids, planted in a file, is reported."""
    planted = {
        "tiers/bad.py": ["import pickle", "import marshal as m"],
        "warmup_bad.py": ["from pickle import loads", "x = pickle.loads(b'')", "eval('1')",
                          "torch.load('f')", "msgpack.unpackb(b'', ext_hook=print)",
                          "json.loads('1', object_hook=dict)"],
    }
    for name, lines in planted.items():
        for line in lines:
            path = PACKAGE / name
            found = _problems(path, ast.parse(line))
            assert found, (name, line)
    assert not _problems(PACKAGE / "warmup_ok.py", ast.parse("import pickle\npickle.dumps(1)"))


def test_msgpack_from_disk_never_accepts_extension_types() -> None:
    """Every ``msgpack.unpackb`` in the package either refuses extension types
    (``max_ext_len=0``) or decodes bytes it just packed itself."""
    problems: list[str] = []
    calls = 0
    for path, tree in _sources():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and _dotted(node.func) in
                    {("msgpack", "unpackb"), ("msgpack", "Unpacker")}):
                continue
            calls += 1
            own_bytes = bool(node.args) and isinstance(node.args[0], ast.Call) and \
                _dotted(node.args[0].func) == ("msgpack", "packb")
            no_ext = any(kw.arg == "max_ext_len" and isinstance(kw.value, ast.Constant)
                         and kw.value.value == 0 for kw in node.keywords)
            if not (own_bytes or no_ext):
                problems.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert calls >= 2 and not problems, problems


class _Exploit:
    """Unpickling this creates a directory: proof that something ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _tk_value(header: bytes, payload: bytes) -> bytes:
    return MAGIC + len(header).to_bytes(2, "little") + header + payload


@pytest.mark.parametrize("shape", ["whole value", "as the header", "header then pickle"])
def test_a_pickle_on_disk_is_corrupt_through_the_store(tmp_path: Path, shape: str) -> None:
    marker = tmp_path / "exploited"
    exploit = pickle.dumps(_Exploit(marker), protocol=pickle.HIGHEST_PROTOCOL)
    pickle.loads(exploit)  # the exploit works when it is unpickled
    assert marker.is_dir()
    marker.rmdir()

    kv = support.make_kv()
    keys = support.request_keys(5, num_chunks=2)
    root = tmp_path / "store"
    with support.open_store(root, kv) as store:
        assert support.store_chunks(store, kv, keys) is not None
    payload = support.payload_for(keys[1])
    value = {"whole value": exploit,
             "as the header": _tk_value(exploit[:60], payload),
             "header then pickle": _tk_value(msgpack.packb([FORMAT_VERSION, len(exploit), 1, 0]),
                                             exploit)}[shape]
    (env_dir,) = support.env_dirs(root)
    with support.raw_env(env_dir) as (txn, chunks, _):
        txn.put(keys[1], value, db=chunks)
    _load_with_unpickling_refused(root, keys)
    assert not marker.exists()


def _load_with_unpickling_refused(root: Path, keys: list[bytes]) -> None:
    """Load through the store while every unpickling or evaluating entry point fails loudly."""
    mp = pytest.MonkeyPatch()
    try:
        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("tierkv unpickled or evaluated data")

        for module, name in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                             (marshal, "loads"), (marshal, "load"), (builtins, "eval")):
            mp.setattr(module, name, refuse)
        kv = support.make_kv()
        with support.open_store(root, kv) as store:
            assert store.lookup(keys) == 2
            support.poison(kv, support.chunk_blocks(1, 32))
            num, completion = support.load_chunks(store, keys, first_block=32)
            assert num == 2 and completion is not None
            assert completion.corrupt_keys == (keys[1],) and completion.failed_keys == (keys[1],)
            assert support.untouched(kv, support.chunk_blocks(1, 32))
            assert support.chunk_matches(kv, keys[0], support.chunk_blocks(0, 32))
            assert store.lookup(keys) == 1
    finally:
        mp.undo()


# -- crafted lengths and types ------------------------------------------------------------

SIZE = 4096
KEY = support.pool_key(1, b"crafted")


def _sealed(version: int, length: int, seq: int, payload: bytes) -> bytes:
    """A value with a correct checksum for the fields given."""
    fields = [version, length, seq, checksum(support.binding(), KEY, version, length, seq, payload)]
    return _tk_value(msgpack.packb(fields), payload)


CRAFTED: dict[str, bytes] = {
    "payload length 2**64-1": _sealed(FORMAT_VERSION, 2**64 - 1, 1, bytes(SIZE)),
    "payload length 2**32": _sealed(FORMAT_VERSION, 2**32, 1, bytes(SIZE)),
    "payload length 0": _sealed(FORMAT_VERSION, 0, 1, b""),
    "header length 64, past the end": MAGIC + (64).to_bytes(2, "little") + b"\x94",
    "array32 of 2**32-1 items": _tk_value(b"\xdd\xff\xff\xff\xff" + b"\x01" * 8, bytes(SIZE)),
    "map32 of 2**32-1 pairs": _tk_value(b"\xdf\xff\xff\xff\xff" + b"\x01" * 8, bytes(SIZE)),
    "bin32 of 4 GiB": _tk_value(b"\xc6\xff\xff\xff\xff" + b"\x00" * 8, bytes(SIZE)),
    "str32 of 4 GiB": _tk_value(b"\xdb\xff\xff\xff\xff" + b"a" * 8, bytes(SIZE)),
    "ext32 of 4 GiB": _tk_value(b"\xc9\xff\xff\xff\xff\x01" + b"\x00" * 8, bytes(SIZE)),
    "fixext header": _tk_value(b"\xd4\x01\x00", bytes(SIZE)),
    "timestamp ext field": _tk_value(b"\x94\x01\xcd\x10\x00\x01\xd6\xff\x00\x00\x00\x00",
                                     bytes(SIZE)),
    "nested array field": _tk_value(msgpack.packb([[1], SIZE, 1, 1]), bytes(SIZE)),
    "nil field": _tk_value(msgpack.packb([1, SIZE, None, 1]), bytes(SIZE)),
    "bin field": _tk_value(msgpack.packb([1, SIZE, b"\x01", 1], use_bin_type=True), bytes(SIZE)),
    "str field": _tk_value(msgpack.packb([1, SIZE, "1", 1]), bytes(SIZE)),
    "float field": _tk_value(msgpack.packb([1, float(SIZE), 1, 1]), bytes(SIZE)),
    "value of 1 MiB more than the header says": _sealed(FORMAT_VERSION, SIZE, 1, bytes(SIZE))
    + bytes(1 << 20),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_crafted_lengths_and_types_are_rejected(tmp_path: Path, name: str) -> None:
    config = support.store_config(tmp_path).disk
    with DiskTier(tmp_path, support.namespace_of(), support.part(0), config, SIZE) as tier:
        tier.put_many([(KEY, bytes(SIZE))])
    (env_dir,) = support.env_dirs(tmp_path)
    with support.raw_env(env_dir) as (txn, chunks, _):
        txn.put(KEY, CRAFTED[name], db=chunks)
    with DiskTier(tmp_path, support.namespace_of(), support.part(0), config, SIZE) as tier:
        assert tier.verify().bad_keys == (KEY,)
        out = bytearray(b"\xee" * SIZE)
        assert tier.read_into(KEY, memoryview(out)) is ReadStatus.CORRUPT
        assert tier.statistics().corrupt == 1 and tier.statistics().chunks == 0


def test_a_crafted_meta_record_is_damage_not_code(tmp_path: Path, caplog: Any) -> None:
    """The namespace record inside LMDB replaced with a pickle or an extension type: the
    environment counts as damaged (moved aside, rebuilt empty); nothing runs."""
    marker = tmp_path / "exploited"
    config = support.store_config(tmp_path).disk
    for number, record in enumerate([pickle.dumps(_Exploit(marker)), b"\xd4\x01\x00",
                                     msgpack.packb({"namespace": msgpack.ExtType(1, b"x")})]):
        with DiskTier(tmp_path, support.namespace_of(), support.part(0), config, SIZE) as tier:
            tier.put_many([(KEY, bytes(SIZE))])
        (rank_dir,) = support.env_dirs(tmp_path)
        env_dir = support.shard_dirs(rank_dir)[shard_of(KEY)]
        env = lmdb.open(str(env_dir), max_dbs=4)
        with env.begin(write=True) as txn:
            txn.put(b"namespace", record, db=env.open_db(b"meta", txn=txn))
        env.close()
        with caplog.at_level(logging.WARNING, logger="tierkv.disk"), \
                DiskTier(tmp_path, support.namespace_of(), support.part(0), config, SIZE) as tier:
            assert tier.statistics().chunks == 0
        assert len(list(rank_dir.glob(f"{env_dir.name}.broken-*"))) == number + 1
        assert not marker.exists()
    assert "is damaged" in caplog.text


@pytest.mark.parametrize("content", [
    "[" * 100_000 + "]" * 100_000,  # deeper than the JSON parser's recursion limit
    '"just a string"',
    '{"fingerprint": "x", "format_version": "1", "namespace": [1, 2]}',
    "\xff\xfe not json",
    "",
])
def test_a_crafted_namespace_json_is_skipped_not_fatal(tmp_path: Path, content: str,
                                                       caplog: Any) -> None:
    """``list_namespaces`` (operators' tools, the inspector) skips a namespace.json it
    cannot read, whatever its content, and still lists the good ones."""
    with support.open_store(tmp_path / "store") as store:
        good = store.namespace.fingerprint()
    bad_dir = tmp_path / "store" / "ns-0123456789abcdef0123456789abcdef"
    bad_dir.mkdir(mode=0o700)
    (bad_dir / "namespace.json").write_text(content, errors="surrogateescape")
    with caplog.at_level(logging.WARNING, logger="tierkv.disk"):
        infos = list_namespaces(tmp_path / "store")
    assert [info.fingerprint for info in infos] == [good]
    assert "unreadable namespace.json" in caplog.text


def test_an_oversized_namespace_json_is_not_read_whole(tmp_path: Path, caplog: Any) -> None:
    """A namespace.json padded past 1 MiB is skipped unread (a crafted file cannot make an
    operator's tool read gigabytes), even when its start is a well-formed record."""
    with support.open_store(tmp_path / "store") as store:
        good_dir = store.disk.namespace_dir if store.disk is not None else None
    assert good_dir is not None
    record = (good_dir / "namespace.json").read_text()
    (good_dir / "namespace.json").write_text(record + " " * (2 << 20))
    with caplog.at_level(logging.WARNING, logger="tierkv.disk"):
        assert list_namespaces(tmp_path / "store") == []
    assert "larger than" in caplog.text


# -- private files ------------------------------------------------------------------------

def _modes(top: Path) -> dict[Path, int]:
    return {path: stat.S_IMODE(path.lstat().st_mode) for path in [top, *top.rglob("*")]}


def test_files_are_private_under_a_permissive_umask(tmp_path: Path) -> None:
    root = tmp_path / "made" / "by" / "tierkv"  # three directories tierkv creates
    old = os.umask(0)
    try:
        kv = support.make_kv()
        keys = support.request_keys(9, num_chunks=2)
        with support.open_store(root, kv) as store:
            assert support.store_chunks(store, kv, keys) is not None
        (env_dir,) = support.env_dirs(root)
        for data in support.data_files(env_dir):  # damage: moved aside, rebuilt
            data.write_bytes(os.urandom(8192))
        with support.open_store(root, kv) as store:
            assert support.store_chunks(store, kv, keys) is not None
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "made")
    assert len(modes) >= 10
    wrong = {str(path): oct(mode) for path, mode in modes.items()
             if mode != (0o700 if path.is_dir() else 0o600)}
    assert not wrong, wrong
    assert list(env_dir.glob("shard-*.broken-*"))


# -- namespaces and tenant salts ----------------------------------------------------------

def test_two_models_under_one_root_never_see_each_others_kv(tmp_path: Path) -> None:
    root = tmp_path / "store"
    keys = support.request_keys(3, num_chunks=3)
    only_a = support.request_keys(4, num_chunks=2)
    kv_a, kv_b = support.make_kv(), support.make_kv()
    with support.open_store(root, kv_a, model_id="model-a") as a, \
            support.open_store(root, kv_b, model_id="model-b") as b:
        assert a.namespace.fingerprint() != b.namespace.fingerprint()
        assert support.store_chunks(a, kv_a, keys, variant=b"A") is not None
        assert support.store_chunks(a, kv_a, only_a, first_block=16, variant=b"A") is not None
        assert b.lookup(keys) == 0 and b.lookup(only_a) == 0  # open at the same time
        assert support.store_chunks(b, kv_b, keys, variant=b"B") is not None
    kv_a, kv_b = support.make_kv(), support.make_kv()
    with support.open_store(root, kv_a, model_id="model-a") as a, \
            support.open_store(root, kv_b, model_id="model-b") as b:
        assert b.lookup(only_a) == 0 and b.load(only_a, [0] * 8).num_chunks == 0
        for store, kv, variant in ((a, kv_a, b"A"), (b, kv_b, b"B")):
            num, completion = support.load_chunks(store, keys, first_block=32)
            assert num == 3 and completion is not None and completion.ok
            for i, key in enumerate(keys):
                blocks = support.chunk_blocks(i, 32)
                assert support.chunk_matches(kv, key, blocks, variant=variant)
                other = b"B" if variant == b"A" else b"A"
                assert not support.chunk_matches(kv, key, blocks, variant=other)
        for store, expected in ((a, set(keys) | set(only_a)), (b, set(keys))):
            assert store.disk is not None
            assert {record.key for record in store.disk.scan()} == expected
    assert len(list_namespaces(root)) == 2


NAMESPACE = Namespace(model_id="m", dtype="bfloat16", kv_layout="NHD", page_bytes=4096,
                      tokens_per_chunk=256, num_layers=32, num_kv_heads=8)
CHANGES: dict[str, Any] = {"model_id": "m2", "dtype": "float16", "kv_layout": "HND",
                           "page_bytes": 8192, "tokens_per_chunk": 512, "num_layers": 16,
                           "num_kv_heads": 4, "rank_layout": "mla", "hash_scheme": "other",
                           "format_version": FORMAT_VERSION + 1, "extra": "quant:fp8",
                           "layer_names": tuple(f"model.layers.{i}" for i in range(32)),
                           "blocks_per_chunk": 16, "chunk_bytes": 1 << 20,
                           "model_fingerprint": "auto:0123456789abcdef0123456789abcdef"}


def test_every_namespace_field_changes_the_directory() -> None:
    assert set(CHANGES) == set(NAMESPACE.describe())
    seen = {NAMESPACE.fingerprint()}
    for name, value in CHANGES.items():
        other = Namespace(**(NAMESPACE.describe() | {name: value}))
        assert other.fingerprint() not in seen, name
        seen.add(other.fingerprint())


def test_a_model_id_cannot_escape_the_root(tmp_path: Path) -> None:
    root = tmp_path / "a" / "root"
    with support.open_store(root, model_id="../../../escape/..//etc") as store:
        assert store.disk is not None
        assert store.disk.path.resolve().is_relative_to(root.resolve())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    assert [p.name[:3] for p in root.iterdir()] == ["ns-"]


def test_tenant_salts_keep_tenants_apart_through_the_store(tmp_path: Path) -> None:
    tokens = list(range(3 * support.TOKENS_PER_CHUNK))
    per_tenant = {name: [bytes(k) for k in chunk_keys(tokens, support.TOKENS_PER_CHUNK,
                                                     parent=salted_root(name))]
                  for name in ("tenant-a", "tenant-b")}
    plain = [bytes(k) for k in chunk_keys(tokens, support.TOKENS_PER_CHUNK)]
    assert not set(per_tenant["tenant-a"]) & set(per_tenant["tenant-b"])
    assert not set(plain) & (set(per_tenant["tenant-a"]) | set(per_tenant["tenant-b"]))
    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        assert support.store_chunks(store, kv, per_tenant["tenant-a"]) is not None
        assert store.lookup(per_tenant["tenant-a"]) == 3
        assert store.lookup(per_tenant["tenant-b"]) == 0 and store.lookup(plain) == 0
        assert store.load(per_tenant["tenant-b"], [0] * 12).num_chunks == 0


@thorough(60)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=64),
       salts=st.lists(st.text(max_size=12) | st.binary(max_size=12), min_size=2, max_size=2,
                      unique=True))
def test_different_salts_never_share_a_chunk_key(tokens: list[int], salts: list[Any]) -> None:
    first, second = (salt if isinstance(salt, bytes) else salt.encode() for salt in salts)
    if first == second:  # "a" and b"a" are the same salt
        return
    keys = [set(chunk_keys(tokens, 16, parent=salted_root(salt))) for salt in (first, second)]
    assert keys[0] and not keys[0] & keys[1]
    assert salted_root(first) != ROOT_KEY


def test_a_private_file_is_written_through_a_new_name_never_an_existing_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary name of an atomic write was predictable (pid, thread id) and opened
    without O_EXCL: a FIFO planted there blocked the store's constructor."""
    import itertools
    import os

    from tierkv.tiers.disk import files as disk_files

    names = itertools.chain(["planted"], (f"n{i}" for i in itertools.count()))
    monkeypatch.setattr(disk_files.secrets, "token_hex", lambda n: next(names))
    target = tmp_path / "namespace.json"
    os.mkfifo(tmp_path / f".namespace.json.{os.getpid()}.planted.tmp")
    disk_files.write_private_file(target, b"{}")  # would block on the FIFO
    assert target.read_bytes() == b"{}" and (target.stat().st_mode & 0o777) == 0o600
