"""``tierkv inspect``, ``tierkv verify`` and ``tierkv rm`` through ``tierkv.cli.main`` on real
stores (slab files indexed by LMDB).

Corruption is injected at tierkv's own boundary: the tiers are closed, the index and slab
are opened directly (``tests.reliability.support.raw_env``) and stored values are rewritten
(a flipped payload byte, a flipped header byte, a truncated value, a value moved under
another key, an index entry whose slot was zeroed) or ``data.mdb`` is cut short.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import time
from pathlib import Path

import lmdb
import pytest

from tests.reliability import support
from tierkv.cli import main
from tierkv.config import DiskTierConfig
from tierkv.keys import FORMAT_VERSION, Namespace, Part
from tierkv.tiers.disk.tier import DiskTier, ReadStatus, shard_of
from tierkv.units import format_bytes

PAYLOAD = 4096
NS = Namespace(model_id="tiny", dtype="float16", kv_layout="NHD", page_bytes=512, tokens_per_chunk=16)
OTHER = Namespace(model_id="tiny", dtype="bfloat16", kv_layout="NHD", page_bytes=512, tokens_per_chunk=16,
                  model_fingerprint="auto:0123456789abcdef0123456789abcdef")


def key_of(index: int) -> bytes:
    return bytes([0x3C]) + index.to_bytes(31, "big")


def payload_of(index: int) -> bytes:
    return random.Random(index).randbytes(PAYLOAD)


def make_store(root: Path, namespace: Namespace, count: int, first: int = 0) -> Path:
    with DiskTier(root, namespace, 0, DiskTierConfig(path=root, max_bytes=16 << 20), PAYLOAD) as tier:
        tier.put_many([(key_of(i), payload_of(i)) for i in range(first, first + count)])
        return tier.path


def rewrite(env_path: Path, edits: dict[bytes, object]) -> None:
    """Apply edits to a (closed) shard directly: bytes = new value (header and payload, in
    its slot), None = zero its slot only (the index still names it)."""
    with support.raw_env(env_path) as (txn, chunks, _):
        for key, value in edits.items():
            if value is None:
                txn.clear(key)
            else:
                assert isinstance(value, bytes)
                txn.put(key, value, db=chunks)


def stored_value(env_path: Path, key: bytes) -> bytes:
    with support.raw_env(env_path) as (txn, chunks, _):
        return bytes(txn.get(key, db=chunks))


def flip(value: bytes, position: int) -> bytes:
    return value[:position] + bytes([value[position] ^ 0x01]) + value[position + 1:]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    make_store(tmp_path, NS, 30)
    make_store(tmp_path, OTHER, 5, first=100)
    return tmp_path


def test_inspect_reports_namespaces_chunks_bytes_and_ends(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = {path: (path.stat().st_size, path.stat().st_mtime_ns)
             for path in [*store.rglob("data.mdb"), *store.rglob("slab-*.kv")]}
    assert any(path.name.startswith("slab-") for path in files)
    today = time.strftime("%Y-%m-%dT", time.gmtime())
    assert main(["inspect", str(store)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"inspected 2 namespace(s): 35 chunks (140.00 KiB) in {store}"
    assert f"namespace {NS.fingerprint()} (format version {FORMAT_VERSION})" in out
    assert "part 0of1: 30 chunks, 120.00 KiB" in out and "part 0of1: 5 chunks, 20.00 KiB" in out
    assert f"oldest {key_of(0).hex()[:8]} (written {today}" in out
    assert f"newest {key_of(29).hex()[:8]} (written {today}" in out
    assert "dtype:            bfloat16" in out
    assert "model_fingerprint: auto:0123456789abcdef0123456789abcdef" in out  # per namespace
    assert main(["inspect", str(store), "--json"]) == 0
    reports = {item["fingerprint"]: item for item in json.loads(capsys.readouterr().out)}
    rank = reports[NS.fingerprint()]["ranks"][0]
    assert (rank["chunks"], rank["payload_bytes"], rank["payload_len"]) == (30, 30 * PAYLOAD, PAYLOAD)
    rank_dir = store / f"ns-{NS.fingerprint()}" / "part-0of1"  # the index and the slabs count
    slabs = sum(path.stat().st_size for path in rank_dir.glob("shard-*/slab-*.kv"))
    assert slabs >= 30 * PAYLOAD and rank["file_bytes"] == slabs + sum(
        path.stat().st_size for path in rank_dir.glob("shard-*/data.mdb"))
    assert rank["newest"][0] == key_of(29).hex() and rank["oldest"][1] < rank["newest"][1]
    assert reports[OTHER.fingerprint()]["format_version"] == FORMAT_VERSION
    # Read-only: the data files are untouched (readers only register in lock.mdb).
    assert {path: (path.stat().st_size, path.stat().st_mtime_ns)
            for path in [*store.rglob("data.mdb"), *store.rglob("slab-*.kv")]} == files


def test_verify_finds_every_corrupted_chunk_and_repair_keeps_the_good_ones(
        store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = store / f"ns-{NS.fingerprint()}" / "part-0of1" / f"shard-{shard_of(key_of(0))}"
    other_env = store / f"ns-{OTHER.fingerprint()}" / "part-0of1" / f"shard-{shard_of(key_of(0))}"
    value = stored_value(env, key_of(3))
    bad = {
        key_of(3): flip(value, len(value) - 100),  # a payload byte
        key_of(7): flip(stored_value(env, key_of(7)), 0),  # the magic
        key_of(11): stored_value(env, key_of(11))[:-1],  # truncated
        key_of(15): stored_value(env, key_of(16)),  # another key's (valid) value
        key_of(20): None,  # the index still lists it, its slot was zeroed
    }
    rewrite(env, bad)
    rewrite(other_env, {key_of(102): flip(stored_value(other_env, key_of(102)), 30)})  # a header byte
    corrupted = set(bad) | {key_of(102)}

    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    reported = {bytes.fromhex(line.split()[-1]) for line in out.splitlines() if line.startswith("  bad chunk ")}
    assert reported == corrupted
    # every index entry is checked (format 4), the one whose slot was zeroed too
    assert out.splitlines()[-1].startswith("verified 35 chunks in 2 namespace(s): 6 bad, run with --repair")
    assert stored_value(env, key_of(3)) == bad[key_of(3)]  # verify alone changed nothing

    assert main(["verify", str(store), "--repair"]) == 1  # found bad ones (and deleted them)
    assert "6 bad, deleted 6, moved aside 0" in capsys.readouterr().out
    assert main(["verify", str(store)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("verified 29 chunks in 2 namespace(s): clean")

    with DiskTier(store, NS, 0, DiskTierConfig(path=store), PAYLOAD) as tier:
        out_buffer = memoryview(bytearray(PAYLOAD))
        for index in range(30):
            status = tier.read_into(key_of(index), out_buffer)
            if key_of(index) in corrupted:
                assert status is ReadStatus.MISSING
            else:
                assert status is ReadStatus.OK and bytes(out_buffer) == payload_of(index)


def test_verify_reports_a_damaged_environment_and_repair_moves_it_aside(
        store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shard = f"shard-{shard_of(key_of(0))}"
    data = store / f"ns-{OTHER.fingerprint()}" / "part-0of1" / shard / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert "damaged environment" in out and f"data.mdb has {size // 2} bytes" in out
    assert data.stat().st_size == size // 2  # left as it was
    assert main(["inspect", str(store)]) == 0
    assert "part 0of1: DAMAGED" in capsys.readouterr().out
    assert main(["verify", str(store), "--repair"]) == 1
    assert f"moved it to {shard}.broken-" in capsys.readouterr().out
    assert main(["verify", str(store)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(store)]) == 0
    assert f"moved aside: part-0of1/{shard}.broken-" in capsys.readouterr().out


def spread_key(index: int) -> bytes:
    """Keys whose first byte walks every shard (``key_of``'s all land in one)."""
    return bytes([index % 256]) + index.to_bytes(31, "big")


def test_one_damaged_shard_does_not_hide_the_good_ones(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: one damaged shard made inspect and verify report 0 chunks for the whole
    rank until --repair, though the other shards' chunks were there and served."""
    with DiskTier(tmp_path, NS, 0, DiskTierConfig(path=tmp_path, max_bytes=16 << 20), PAYLOAD) as tier:
        tier.put_many([(spread_key(i), payload_of(i)) for i in range(40)])
    damaged = 2
    good = sum(shard_of(spread_key(i)) != damaged for i in range(40))
    assert good == 30
    data = tmp_path / f"ns-{NS.fingerprint()}" / "part-0of1" / f"shard-{damaged}" / "data.mdb"
    os.truncate(data, data.stat().st_size // 2)

    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"part 0of1: {good} chunks in shards 0, 1, 3, {format_bytes(good * PAYLOAD, 2)}" in out
    assert f"part 0of1: DAMAGED shard-{damaged}: " in out and "data.mdb has" in out
    assert f"--repair moves shard-{damaged} aside" in out and "the other shards' are kept" in out
    assert out.splitlines()[-1].startswith(f"inspected 1 namespace(s): {good} chunks")
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    (rank,) = json.loads(capsys.readouterr().out)[0]["ranks"]
    assert rank["chunks"] == good and list(rank["damaged_shards"]) == [str(damaged)]

    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"part 0of1: damaged environment {data.parent}: " in out
    assert f"  not checked: tierkv verify --repair moves shard-{damaged} aside" in out
    assert f"part 0of1: {good} chunks checked, 0 bad" in out
    assert out.splitlines()[-1].startswith(
        f"verified {good} chunks in 1 namespace(s): 0 bad, 1 damaged environment(s), run with "
        f"--repair to delete them and move the damaged environments aside")
    assert data.stat().st_size > 0 and not list(data.parent.parent.glob("shard-*.broken-*"))

    assert main(["verify", str(tmp_path), "--repair"]) == 1
    out = capsys.readouterr().out
    assert f"moved it to shard-{damaged}.broken-" in out and f"{good} chunks checked, 0 bad" in out
    assert main(["verify", str(tmp_path)]) == 0
    assert f"verified {good} chunks in 1 namespace(s): clean" in capsys.readouterr().out


def test_verify_only_one_namespace(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(store), "--namespace", NS.fingerprint()[:6]]) == 0
    assert "verified 30 chunks in 1 namespace(s): clean" in capsys.readouterr().out


@pytest.mark.parametrize("args,message", [
    (["verify", "{tmp}/missing"], "no such store directory"),
    (["inspect", "{tmp}/empty"], "holds no tierkv store"),
    (["verify", "{store}", "--namespace", "zz"], "no namespace under"),
])
def test_errors_exit_2_with_a_message(args: list[str], message: str, store: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    argv = [arg.format(tmp=tmp_path, store=store) for arg in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tierkv {argv[0]}: error: ") and message in err


# ------------------------------------------------------------------------------ verify progress
def test_verify_prints_progress_and_a_speed_line_on_stderr(
        store: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from tierkv import tools

    monkeypatch.setattr(tools, "PROGRESS_SECONDS", 0.0)  # a line after every environment
    assert main(["verify", str(store)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("verified 35 chunks in 2 namespace(s): clean (")
    assert "verify:" not in out  # stdout's report is unchanged
    lines = err.splitlines()
    # The total comes from the index records up front; namespaces in fingerprint order.
    first, second = sorted([(NS, 30), (OTHER, 5)], key=lambda item: item[0].fingerprint())
    assert lines[0].startswith(f"verify: {first[1]} / 35 chunks, {first[1] * 4}.0 KiB, ")
    assert lines[1].startswith("verify: 35 / 35 chunks, 140.0 KiB, ") and lines[1].endswith("/s")
    assert re.fullmatch(r"verify: checked 35 chunks, 140\.00 KiB in \d+\.\d s \(.+/s\)", lines[-1])
    assert len(lines) == 3

    assert main(["verify", str(store), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("verified 35 chunks in 2 namespace(s): clean (")
    assert err.splitlines() == [line for line in err.splitlines() if "checked 35 chunks" in line]
    assert len(err.splitlines()) == 1  # the closing line only


def test_progress_lines_are_throttled_and_the_speed_is_binary(store: Path) -> None:
    from tierkv.tiers.disk.tools import verify_store
    from tierkv.tools import ProgressLine
    from tierkv.units import GiB

    now = [100.0]
    stream = io.StringIO()
    meter = ProgressLine("verify", 1.0, stream, clock=lambda: now[0])
    for at, chunks in ((100.5, 1), (100.9, 2), (101.0, 3), (101.4, 4), (102.5, 5)):
        now[0] = at
        meter.update(chunks, chunks * GiB // 4, 5)
    assert stream.getvalue().splitlines() == [
        "verify: 3 / 5 chunks, 768.0 MiB, 768.00 MiB/s",  # 1 s after the start
        "verify: 5 / 5 chunks, 1.2 GiB, 512.00 MiB/s"]  # the next one >= 1 s later
    now[0] = 104.5
    assert meter.summary() == "verify: checked 5 chunks, 1.25 GiB in 4.5 s (284.44 MiB/s)"

    # The library function drives it: every environment reports, the closing line counts all.
    stream = io.StringIO()
    meter = ProgressLine("verify", 0.0, stream)
    outcome = verify_store(store, only=NS.fingerprint()[:6], progress=meter.update)
    assert outcome.checked == 30 and outcome.checked_bytes == 30 * PAYLOAD
    (line,) = stream.getvalue().splitlines()  # one environment, one line
    assert line.startswith("verify: 30 / 30 chunks, 120.0 KiB, ") and line.endswith("/s")
    assert meter.summary().startswith("verify: checked 30 chunks, 120.00 KiB in ")
    silent = io.StringIO()
    quiet = ProgressLine("verify", None, silent)  # --no-progress
    verify_store(store, progress=quiet.update)
    assert silent.getvalue() == "" and quiet.chunks == 35
    assert quiet.summary().startswith("verify: checked 35 chunks, 140.00 KiB in ")


def test_progress_is_reported_within_an_environment(tmp_path: Path) -> None:
    """A store of one big environment shows progress while it is checked, not only at its end."""
    from tierkv.tiers.disk.tools import verify_store

    make_store(tmp_path, NS, 300)
    seen: list[tuple[int, int, int | None]] = []
    outcome = verify_store(tmp_path, progress=lambda *report: seen.append(report))
    assert outcome.checked == 300
    counts = [chunks for chunks, _, _ in seen]
    assert counts == sorted(counts) and counts[-1] == 300 and counts[0] < 300
    assert len(set(counts)) >= 300 // 64  # about one report per batch of 64 values
    assert all(total == 300 and num_bytes == chunks * PAYLOAD for chunks, num_bytes, total in seen)
    with DiskTier(tmp_path, NS, 0, DiskTierConfig(path=tmp_path, max_bytes=16 << 20), PAYLOAD,
                  read_only=True) as tier:
        calls: list[int] = []
        assert tier.verify(batch=10, progress=calls.append).checked == 300
    assert calls == sorted(calls) and calls[-1] == 300 and len(calls) >= 30


# ------------------------------------------------------------------------------ rm
def tree(root: Path) -> dict[str, bytes]:
    """Every path under ``root`` with the bytes of its files (lock.mdb: readers use it)."""
    return {str(path.relative_to(root)): (b"" if path.is_dir() or path.name == "lock.mdb"
                                          else path.read_bytes())
            for path in sorted(root.rglob("*"))}


def tree_bytes(path: Path) -> int:
    return sum(item.lstat().st_size for item in path.rglob("*") if item.is_file())


def add_rank(root: Path, namespace: Namespace, rank: Part | int, count: int) -> None:
    with DiskTier(root, namespace, rank, DiskTierConfig(path=root, max_bytes=16 << 20),
                  PAYLOAD) as tier:
        tier.put_many([(key_of(i), payload_of(i)) for i in range(count)])


def test_rm_deletes_one_namespace_and_the_other_is_still_served(
        store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    add_rank(store, NS, Part(1, 2), 7)
    ns_dir = store / f"ns-{NS.fingerprint()}"
    (ns_dir / "part-0of1.broken-20250101T000000Z").mkdir()  # leftovers of repairs go too
    (ns_dir / "part-1of2" / "shard-2.broken-20250101T000000Z").mkdir()
    size = tree_bytes(ns_dir)
    other = tree(store / f"ns-{OTHER.fingerprint()}")

    assert main(["rm", str(store), "--namespace", NS.fingerprint()[:5], "--yes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"namespace {NS.fingerprint()} (tiny, format version {FORMAT_VERSION}) "
                             f"in {store}: 2 part(s), 37 chunks, {format_bytes(size, 2)} of files, "
                             f"2 moved-aside environment(s)")
    assert out[-1] == (f"removed namespace {NS.fingerprint()[:8]} from {store}: 37 chunks, "
                       f"{format_bytes(size, 2)} freed")
    assert not ns_dir.exists()
    assert sorted(path.name for path in store.iterdir()) == [f"ns-{OTHER.fingerprint()}"]
    assert tree(store / f"ns-{OTHER.fingerprint()}") == other
    assert main(["verify", str(store)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(
        "verified 5 chunks in 1 namespace(s): clean")
    with DiskTier(store, OTHER, 0, DiskTierConfig(path=store), PAYLOAD) as tier:
        buffer = memoryview(bytearray(PAYLOAD))
        for index in range(100, 105):
            assert tier.read_into(key_of(index), buffer) is ReadStatus.OK
            assert bytes(buffer) == payload_of(index)


def test_rm_dry_run_and_a_missing_yes_delete_nothing(store: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    before = tree(store)
    ns_dir = store / f"ns-{OTHER.fingerprint()}"
    assert main(["rm", str(store), "--namespace", OTHER.fingerprint(), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1 part(s), 5 chunks" in out
    assert out.splitlines()[-1] == f"dry run: would delete {ns_dir}; nothing deleted"
    assert main(["rm", str(store), "--namespace", OTHER.fingerprint()[:4], "--yes",
                 "--dry-run"]) == 0  # --dry-run wins
    capsys.readouterr()
    assert main(["rm", str(store), "--namespace", OTHER.fingerprint()[:4]]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == f"not deleted: add --yes to delete {ns_dir}"
    assert tree(store) == before


def twins(prefix_length: int = 1) -> tuple[Namespace, Namespace]:
    """Two namespaces whose fingerprints start alike (one of 17 shares a first hex digit)."""
    seen: dict[str, Namespace] = {}
    for number in range(16 ** prefix_length + 1):
        namespace = Namespace(model_id=f"twin-{number}", dtype="float16", kv_layout="NHD",
                              page_bytes=512, tokens_per_chunk=16)
        start = namespace.fingerprint()[:prefix_length]
        if start in seen:
            return seen[start], namespace
        seen[start] = namespace
    raise AssertionError("pigeonhole")


@pytest.mark.parametrize("prefix,message", [
    ("{twin}", "2 namespaces in {store} start with '{twin}': "),
    ("abcdefabcdef", "no namespace in {store} starts with 'abcdefabcdef' (--namespace); "
                     "nothing deleted; tierkv inspect {store} lists them"),
    ("ns-", "--namespace 'ns-' is not the start of a namespace fingerprint"),
    ("", "is not the start of a namespace fingerprint"),
])
def test_rm_refuses_an_unknown_or_ambiguous_prefix(prefix: str, message: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    first, second = twins()
    make_store(tmp_path, first, 3)
    make_store(tmp_path, second, 4)
    before = tree(tmp_path)
    twin = first.fingerprint()[:1]
    assert main(["rm", str(tmp_path), "--namespace", prefix.format(twin=twin), "--yes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tierkv rm: error: ")
    assert message.format(store=tmp_path, twin=twin) in err
    if prefix == "{twin}":  # both listed with their models, and what to do
        assert f"{first.fingerprint()} (twin-" in err and f"{second.fingerprint()} (twin-" in err
        assert "give a longer --namespace prefix" in err
    assert tree(tmp_path) == before


def test_rm_refuses_a_namespace_a_running_engine_holds(store: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    before = tree(store)
    ns_dir = store / f"ns-{NS.fingerprint()}"
    # exclusive=True: the claim a TierKVStore, a vLLM worker or a warm-up takes at open
    with DiskTier(store, NS, 0, DiskTierConfig(path=store), PAYLOAD, exclusive=True) as tier:
        assert tier.claimed
        for extra in (["--yes"], ["--dry-run"]):
            assert main(["rm", str(store), "--namespace", NS.fingerprint()[:6], *extra]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"tierkv rm: error: namespace {NS.fingerprint()[:8]} "
                                  f"(--namespace {NS.fingerprint()[:6]}) in {store} is in use: ")
            assert "claimed by this process" in err and "stop it, then rerun tierkv rm" in err
            assert ns_dir.is_dir()
        buffer = memoryview(bytearray(PAYLOAD))  # the engine's store is intact under it
        assert tier.read_into(key_of(1), buffer) is ReadStatus.OK
    assert set(before) <= set(tree(store))
    assert main(["verify", str(store), "--namespace", NS.fingerprint()[:6]]) == 0
    assert "verified 30 chunks in 1 namespace(s): clean" in capsys.readouterr().out
    assert main(["rm", str(store), "--namespace", NS.fingerprint()[:6], "--yes"]) == 0
    assert not ns_dir.exists()


def test_rm_refuses_while_an_engine_in_another_process_holds_the_namespace(
        store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess
    import sys

    code = f"""
import sys
from pathlib import Path
from tests.integration.test_tools import NS, PAYLOAD
from tierkv.config import DiskTierConfig
from tierkv.tiers.disk.tier import DiskTier
root = Path({str(store)!r})
with DiskTier(root, NS, 0, DiskTierConfig(path=root), PAYLOAD, exclusive=True):
    print("open", flush=True)
    sys.stdin.readline()
"""
    child = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).parents[2],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "open"
        assert main(["rm", str(store), "--namespace", NS.fingerprint()[:6], "--yes"]) == 2
        assert f"is claimed by process {child.pid}, a running engine" in capsys.readouterr().err
        assert (store / f"ns-{NS.fingerprint()}").is_dir()
    finally:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.close()
        assert child.wait(timeout=30) == 0
    assert main(["rm", str(store), "--namespace", NS.fingerprint()[:6], "--yes"]) == 0  # gone now


def test_rm_never_follows_a_link_out_of_the_store(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    outside, store = tmp_path / "outside", tmp_path / "store"
    make_store(outside, NS, 3)
    make_store(store, OTHER, 2)
    target = outside / f"ns-{NS.fingerprint()}"
    (store / target.name).symlink_to(target)
    before = tree(outside)
    assert main(["rm", str(store), "--namespace", NS.fingerprint()[:8], "--yes"]) == 2
    err = capsys.readouterr().err
    assert "is a symbolic link" in err and f"only directories inside the store {store}" in err
    assert tree(outside) == before and (store / target.name).is_symlink()


def test_rm_deletes_a_namespace_of_an_older_format_that_verify_refuses(
        store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import replace

    old = replace(NS, format_version=2)  # format 2: one environment per rank, rank-<r>/data.mdb
    rank_dir = store / f"ns-{old.fingerprint()}" / "rank-0"
    rank_dir.mkdir(parents=True, mode=0o700)
    os.chmod(rank_dir.parent, 0o700)
    record = {"fingerprint": old.fingerprint(), "format_version": 2, "namespace": old.describe()}
    (rank_dir.parent / "namespace.json").write_text(json.dumps(record))
    os.chmod(rank_dir.parent / "namespace.json", 0o600)
    env = lmdb.open(str(rank_dir), max_dbs=4)
    env.close()
    assert main(["verify", str(store)]) == 2
    assert f"tierkv rm STORE --namespace {old.fingerprint()[:8]} --yes" in capsys.readouterr().err
    assert main(["rm", str(store), "--namespace", old.fingerprint()[:8], "--yes"]) == 0
    out = capsys.readouterr().out
    assert "format version 2" in out and "1 environment(s) not readable" in out
    assert not rank_dir.parent.exists()
    assert main(["verify", str(store)]) == 0


# ------------------------------------------------------------------------------ units
DECIMAL = re.compile(r"\d ?[kKMGT]B(/s)?\b")  # 1.2 GB, 500 MB, 0.85 GB/s


def test_commands_print_sizes_and_rates_in_binary_units(
        store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One unit family in what the commands print: KiB, MiB, GiB and the same per second,
    never the decimal MB, GB or GB/s (the demo's table printed GB/s)."""
    from tierkv import tools

    monkeypatch.setattr(tools, "PROGRESS_SECONDS", 0.0)
    assert main(["demo", "--dir", str(tmp_path / "demo"), "--conversations", "2", "--turns", "2",
                 "--layers", "2"]) == 0
    demo = capsys.readouterr().out
    assert "chunk 128.00 KiB" in demo  # 2 layers x 4 blocks x 2 x 4 heads x 16 x 64 x 2 bytes
    assert re.search(r"GPU->CPU +\d+\.\d (?:KiB|MiB|GiB) +\d+\.\d\d (?:KiB|MiB|GiB)/s$", demo,
                     re.M), demo
    printed = [demo]
    for argv in (["inspect", str(store)], ["verify", str(store)],
                 ["rm", str(store), "--namespace", NS.fingerprint()[:8]]):
        main(argv)
        printed += capsys.readouterr()
    assert all(DECIMAL.search(text) is None for text in printed), printed
    assert any(re.search(r"\d (?:KiB|MiB)/s", text) for text in printed)  # verify's speed
