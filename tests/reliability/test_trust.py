"""A store trusts only files that this user owns and no one else can write, and says what is
wrong with a store path as a tierkv error that names ``disk.path``.

Before these fixes an engine (running as root) served forged KV from a world-writable
``disk.path`` another user had pre-created, kept writing into that user's ``data.mdb``,
hung on a FIFO in place of ``data.mdb``, and raised raw ``NotADirectoryError``,
``PermissionError`` or ``OSError`` for bad paths.

Tests that need two users chown files to another uid, which needs root; CI runs as root.
Without root they are skipped with the reason printed.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability import support
from tierkv.errors import ConfigError, TierKVError

OTHER_UID = 4242  # "another local user"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
REPO = Path(__file__).resolve().parents[2]


def _forge(root: Path, keys: list[bytes]) -> None:
    """A valid environment of forged KV for known keys, as another user could write it."""
    kv = support.make_kv()
    with support.open_store(root, kv) as store:
        support.store_chunks(store, kv, keys, variant=b"forged")


def _chown_tree(path: Path, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(path):
        os.chown(dirpath, uid, uid)
        for name in filenames:
            os.chown(Path(dirpath) / name, uid, uid)


def _serves_forged(root: Path, keys: list[bytes]) -> bool:
    kv = support.make_kv()
    with support.open_store(root, kv) as store:
        for key in keys:
            blocks = support.chunk_blocks(0, 32)
            if store.lookup([key]) and support.load_chunks(store, [key])[1] is not None \
                    and support.chunk_matches(kv, key, blocks, variant=b"forged"):
                return True
    return False


@needs_root
def test_a_root_pre_created_by_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "tierkv-example"
    keys = support.request_keys(1)
    _forge(root, keys)
    _chown_tree(root, OTHER_UID)
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError, match="disk.path") as info:
        support.open_store(root)
    assert f"uid {OTHER_UID}" in str(info.value)
    assert support.data_files(support.env_dirs(root)[0])[0].stat().st_uid == OTHER_UID


def test_a_root_others_can_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError, match="chmod 700"):
        support.open_store(root)
    os.chmod(root, 0o755)  # readable by others is fine: everything below is private
    with support.open_store(root):
        pass


@needs_root
@pytest.mark.parametrize("planted", ["namespace dir", "rank dir", "data.mdb", "lock.mdb"])
def test_entries_of_another_user_are_moved_aside_never_used(tmp_path: Path, planted: str) -> None:
    root = tmp_path / "store"
    keys = support.request_keys(2)
    _forge(root, keys)
    env_dir = support.env_dirs(root)[0]
    shards = support.shard_dirs(env_dir)
    targets = {"namespace dir": [env_dir.parent], "rank dir": [env_dir],
               "data.mdb": [shard / "data.mdb" for shard in shards],
               "lock.mdb": [shard / "lock.mdb" for shard in shards]}[planted]
    for target in targets:
        _chown_tree(target, OTHER_UID) if target.is_dir() else os.chown(target, OTHER_UID, OTHER_UID)
    assert not _serves_forged(root, keys)
    env_dir = support.env_dirs(root)[0]
    for path in (root, env_dir.parent, env_dir, *(shard / name for shard in shards
                                                   for name in ("", "data.mdb", "lock.mdb"))):
        info = path.lstat()
        assert info.st_uid == os.geteuid(), path
        assert stat.S_IMODE(info.st_mode) & 0o077 == 0, path
    kept = [p for p in (root.rglob("*.foreign-*")) if p.stat().st_uid == OTHER_UID]
    assert kept or planted in ("data.mdb", "lock.mdb")  # moved aside, kept for inspection
    assert list(root.rglob("*.foreign-*")) or list(root.rglob("*.broken-*"))


def test_own_files_readable_by_others_are_tightened_and_served(tmp_path: Path) -> None:
    kv = support.make_kv()
    keys = support.request_keys(3)
    with support.open_store(tmp_path, kv) as store:
        support.store_chunks(store, kv, keys)
    env_dir = support.env_dirs(tmp_path)[0]
    shard = support.shard_dirs(env_dir)[0]
    for path, mode in ((env_dir.parent, 0o755), (env_dir, 0o750), (shard, 0o750),
                       (shard / "data.mdb", 0o644), (env_dir.parent / "namespace.json", 0o640)):
        os.chmod(path, mode)
    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        assert store.lookup(keys) == len(keys)  # nobody else could have written them
    for path in (env_dir.parent, env_dir, shard, shard / "data.mdb",
                 env_dir.parent / "namespace.json"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, path


@pytest.mark.parametrize("loose", ["everything below the root", "rank dir", "data.mdb"])
def test_own_files_others_could_write_are_never_trusted(tmp_path: Path, loose: str) -> None:
    """Files of this user's that others can write may hold anything: a forged value with a
    valid checksum (the fingerprint is the directory's name) planted in them is never
    served; they are moved aside (they used to be chmod-ed and trusted)."""
    keys = support.request_keys(4)
    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        support.store_chunks(store, kv, keys)
    env_dir = support.env_dirs(tmp_path)[0]
    from tierkv.tiers.disk.format import ValueWriter

    forged = bytes(ValueWriter(support.CHUNK_BYTES, support.binding()).build(
        keys[0], support.payload_for(keys[0], variant=b"forged"), seq=999))
    with support.raw_env(env_dir) as (txn, chunks, _):  # what another user could now write
        txn.put(keys[0], forged, db=chunks)
    targets = {"everything below the root": [p for p in tmp_path.rglob("*")],
               "rank dir": [env_dir], "data.mdb": support.data_files(env_dir)}[loose]
    for path in targets:
        os.chmod(path, 0o777 if path.is_dir() else 0o666)
    assert not _serves_forged(tmp_path, keys)
    assert list(tmp_path.rglob("*.foreign-*")) or list(tmp_path.rglob("*.broken-*"))


def _fifo_open(tmp_path: Path, which: str) -> subprocess.CompletedProcess[str]:
    """Open a store whose ``which`` file is a FIFO, in a child that must finish in time."""
    code = f"""
import os, sys
from pathlib import Path
from tests.reliability import support
root = Path({str(tmp_path)!r})
kv = support.make_kv()
keys = support.request_keys(4)
with support.open_store(root, kv) as store:
    support.store_chunks(store, kv, keys)
env_dir = support.env_dirs(root)[0]
shard = support.shard_dirs(env_dir)[0]
target = env_dir.parent / "namespace.json" if {which!r} == "namespace.json" else shard / {which!r}
target.unlink()
os.mkfifo(target, 0o600)
with support.open_store(root, kv) as store:
    support.store_chunks(store, kv, support.request_keys(5))
    print("hits", store.lookup(support.request_keys(5)))
"""
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("which", ["data.mdb", "lock.mdb", "namespace.json"])
def test_a_fifo_in_place_of_a_store_file_never_hangs(tmp_path: Path, which: str) -> None:
    try:
        done = _fifo_open(tmp_path, which)
    except subprocess.TimeoutExpired:
        pytest.fail(f"TierKVStore() hung on a FIFO in place of {which}")
    assert done.returncode == 0, done.stderr
    assert "hits 4" in done.stdout


def test_disk_path_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "a-file"
    path.write_text("notes")
    for bad in (path, path / "below"):
        with pytest.raises(ConfigError, match="disk.path"):
            support.open_store(bad)
    assert path.read_text() == "notes"


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this user cannot create anything in: a read-only tmpfs as root (root
    ignores permission bits), a 0o500 directory otherwise."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a read-only tmpfs as root: {done.stderr.strip()}")
        try:
            yield path
        finally:
            subprocess.run(["umount", str(path)], capture_output=True)
    else:
        os.chmod(path, 0o500)
        try:
            yield path
        finally:
            os.chmod(path, 0o700)


def test_an_unwritable_or_read_only_place_is_a_config_error(read_only_dir: Path) -> None:
    for bad in (read_only_dir / "store", read_only_dir / "deep" / "store"):
        with pytest.raises(ConfigError, match="disk.path") as info:
            support.open_store(bad)
        assert str(read_only_dir) in str(info.value)


@needs_root
def test_a_pre_owned_empty_directory_is_a_config_error(tmp_path: Path) -> None:
    root = tmp_path / "owned"
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_UID, OTHER_UID)
    with pytest.raises(ConfigError, match="owned by"):
        support.open_store(root)


def test_an_older_format_is_never_read_and_is_named(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A namespace directory of format version 1 (written by an older tierkv) is not read; a
    new store under the same root starts empty and says why, and ``tierkv verify`` refuses
    it with a message."""
    from tierkv.cli import main

    old = tmp_path / "ns-0123456789abcdef0123456789abcdef"
    old.mkdir(parents=True)
    record = ('{"fingerprint": "0123456789abcdef0123456789abcdef", "format_version": 1, '
              '"namespace": {"model_id": "reliability-tiny"}}')
    (old / "namespace.json").write_text(record)
    os.chmod(old / "namespace.json", 0o600)
    os.chmod(old, 0o700)
    with caplog.at_level("WARNING", logger="tierkv.disk"):
        with support.open_store(tmp_path) as store:
            assert store.lookup(support.request_keys(6)) == 0
    assert "another tierkv format" in caplog.text and old.name in caplog.text
    assert main(["verify", str(tmp_path)]) == 2


def test_tierkv_errors_only_for_every_bad_path(tmp_path: Path) -> None:
    """Whatever is wrong with the path, the caller gets a TierKVError, never a raw OSError."""
    file_path = tmp_path / "file"
    file_path.write_text("x")
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "nowhere" / "at-all")
    for bad in (file_path, file_path / "x", link, Path("/proc/self/tierkv")):
        with pytest.raises(TierKVError):
            support.open_store(bad)


def _tree(root: Path) -> dict[str, tuple[int, int, int, int, bytes]]:
    """Every entry under ``root``: (mode, owner, size, mtime_ns, first bytes of files)."""
    out: dict[str, tuple[int, int, int, int, bytes]] = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        head = b""
        if stat.S_ISREG(info.st_mode) and path.name != "lock.mdb":
            head = path.read_bytes()[:4096]
        mtime = 0 if path.name == "lock.mdb" else info.st_mtime_ns  # readers use it
        out[str(path.relative_to(root))] = (info.st_mode, info.st_uid, info.st_size, mtime, head)
    return out


@pytest.mark.parametrize("state", ["clean", "foreign rank dir", "loose modes", "bad chunk",
                                   "damaged index"])
def test_verify_without_repair_changes_nothing(tmp_path: Path, state: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """It used to move a foreign directory aside, create an empty environment, chmod and
    rewrite files, and then answer "clean"."""
    from tierkv.cli import main

    if state == "foreign rank dir" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    keys = support.request_keys(9)
    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        support.store_chunks(store, kv, keys)
    env_dir = support.env_dirs(tmp_path)[0]
    if state == "foreign rank dir":
        os.chown(env_dir, OTHER_UID, OTHER_UID)  # the directory only: its files look fine
    elif state == "loose modes":
        os.chmod(env_dir.parent, 0o755)
        for data in support.data_files(env_dir):
            os.chmod(data, 0o644)
    elif state == "bad chunk":
        with support.raw_env(env_dir) as (txn, chunks, _):
            value = bytearray(txn.get(keys[0], db=chunks))
            value[-1] ^= 1
            txn.put(keys[0], bytes(value), db=chunks)
    elif state == "damaged index":
        support.damage_subdb(env_dir, b"index")
    before = _tree(tmp_path)
    code = main(["verify", str(tmp_path)])
    out = capsys.readouterr().out
    assert _tree(tmp_path) == before
    assert code == (0 if state in ("clean", "loose modes") else 1), out


@needs_root
def test_verify_repair_moves_a_foreign_rank_directory_aside_and_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The engine moves a whole rank directory aside when it is not this user's; with four
    shards below it, verify --repair looked for moved shards only and missed it."""
    from tierkv.cli import main

    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        support.store_chunks(store, kv, support.request_keys(12))
    env_dir = support.env_dirs(tmp_path)[0]
    os.chown(env_dir, OTHER_UID, OTHER_UID)
    assert main(["verify", "--repair", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    (aside,) = env_dir.parent.glob("part-0of2.foreign-*")
    assert f"moved it to {aside.name}" in out and "moved aside 1" in out, out
    assert main(["verify", str(tmp_path)]) == 0
