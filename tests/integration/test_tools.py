"""``tierkv inspect`` and ``tierkv verify`` through ``tierkv.cli.main`` on real LMDB stores.

Corruption is injected at tierkv's own boundary: the tiers are closed, the environment is
opened with ``lmdb`` directly and stored values are rewritten (a flipped payload byte, a
flipped header byte, a truncated value, a value moved under another key, an index entry
whose value is gone) or ``data.mdb`` is cut short.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import lmdb
import pytest

from tierkv.cli import main
from tierkv.config import DiskTierConfig
from tierkv.keys import FORMAT_VERSION, Namespace
from tierkv.tiers.disk import DiskTier, ReadStatus, shard_of

PAYLOAD = 4096
NS = Namespace(model_id="tiny", dtype="float16", kv_layout="NHD", page_bytes=512, tokens_per_chunk=16)
OTHER = Namespace(model_id="tiny", dtype="bfloat16", kv_layout="NHD", page_bytes=512, tokens_per_chunk=16)


def key_of(index: int) -> bytes:
    return bytes([0x3C]) + index.to_bytes(31, "big")


def payload_of(index: int) -> bytes:
    return random.Random(index).randbytes(PAYLOAD)


def make_store(root: Path, namespace: Namespace, count: int, first: int = 0) -> Path:
    with DiskTier(root, namespace, 0, DiskTierConfig(path=root, max_bytes=16 << 20), PAYLOAD) as tier:
        tier.put_many([(key_of(i), payload_of(i)) for i in range(first, first + count)])
        return tier.path


def rewrite(env_path: Path, edits: dict[bytes, object]) -> None:
    """Apply edits with lmdb directly: bytes = new value, None = delete the value only."""
    env = lmdb.open(str(env_path), max_dbs=4, map_size=64 << 20)
    try:
        chunks = env.open_db(b"chunks")
        with env.begin(write=True, db=chunks) as txn:
            for key, value in edits.items():
                if value is None:
                    txn.delete(key)
                else:
                    txn.put(key, value)  # type: ignore[arg-type]
    finally:
        env.close()


def stored_value(env_path: Path, key: bytes) -> bytes:
    env = lmdb.open(str(env_path), max_dbs=4, readonly=True)
    try:
        with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
            return bytes(txn.get(key))
    finally:
        env.close()


def flip(value: bytes, position: int) -> bytes:
    return value[:position] + bytes([value[position] ^ 0x01]) + value[position + 1:]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    make_store(tmp_path, NS, 30)
    make_store(tmp_path, OTHER, 5, first=100)
    return tmp_path


def test_inspect_reports_namespaces_chunks_bytes_and_ends(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in store.rglob("data.mdb")}
    today = time.strftime("%Y-%m-%dT", time.gmtime())
    assert main(["inspect", str(store)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == f"inspected 2 namespace(s): 35 chunks (140.00 KiB) in {store}"
    assert f"namespace {NS.fingerprint()} (format version {FORMAT_VERSION})" in out
    assert "rank 0: 30 chunks, 120.00 KiB" in out and "rank 0: 5 chunks, 20.00 KiB" in out
    assert f"oldest {key_of(0).hex()[:8]} (written {today}" in out
    assert f"newest {key_of(29).hex()[:8]} (written {today}" in out
    assert "dtype:            bfloat16" in out
    assert main(["inspect", str(store), "--json"]) == 0
    reports = {item["fingerprint"]: item for item in json.loads(capsys.readouterr().out)}
    rank = reports[NS.fingerprint()]["ranks"][0]
    assert (rank["chunks"], rank["payload_bytes"], rank["payload_len"]) == (30, 30 * PAYLOAD, PAYLOAD)
    assert rank["newest"][0] == key_of(29).hex() and rank["oldest"][1] < rank["newest"][1]
    assert reports[OTHER.fingerprint()]["format_version"] == FORMAT_VERSION
    # Read-only: the data files are untouched (readers only register in lock.mdb).
    assert {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in store.rglob("data.mdb")} == files


def test_verify_finds_every_corrupted_chunk_and_repair_keeps_the_good_ones(
        store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = store / f"ns-{NS.fingerprint()}" / "rank-0" / f"shard-{shard_of(key_of(0))}"
    other_env = store / f"ns-{OTHER.fingerprint()}" / "rank-0" / f"shard-{shard_of(key_of(0))}"
    value = stored_value(env, key_of(3))
    bad = {
        key_of(3): flip(value, len(value) - 100),  # a payload byte
        key_of(7): flip(stored_value(env, key_of(7)), 0),  # the magic
        key_of(11): stored_value(env, key_of(11))[:-1],  # truncated
        key_of(15): stored_value(env, key_of(16)),  # another key's (valid) value
        key_of(20): None,  # the index still lists it, its value is gone
    }
    rewrite(env, bad)
    rewrite(other_env, {key_of(102): flip(stored_value(other_env, key_of(102)), 30)})  # a header byte
    corrupted = set(bad) | {key_of(102)}

    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    reported = {bytes.fromhex(line.split()[-1]) for line in out.splitlines() if line.startswith("  bad chunk ")}
    assert reported == corrupted
    assert out.splitlines()[-1].startswith("verified 34 chunks in 2 namespace(s): 6 bad, run with --repair")
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
    data = store / f"ns-{OTHER.fingerprint()}" / "rank-0" / shard / "data.mdb"
    size = data.stat().st_size
    os.truncate(data, size // 2)
    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert "damaged environment" in out and f"data.mdb has {size // 2} bytes" in out
    assert data.stat().st_size == size // 2  # left as it was
    assert main(["inspect", str(store)]) == 0
    assert "rank 0: DAMAGED" in capsys.readouterr().out
    assert main(["verify", str(store), "--repair"]) == 1
    assert f"moved it to {shard}.broken-" in capsys.readouterr().out
    assert main(["verify", str(store)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(store)]) == 0
    assert f"moved aside: rank-0/{shard}.broken-" in capsys.readouterr().out


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
