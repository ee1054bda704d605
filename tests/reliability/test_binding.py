"""Wrong KV is never served: every value is bound to its namespace, rank and key, and the
namespace holds everything that decides what the bytes mean (layer names and order, the
block split of a chunk). Each test here served wrong bytes as hits, or destroyed valid
chunks, before format version 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.profiles import thorough
from tests.reliability import support
from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.store import TierKVStore
from tierkv.errors import NamespaceMismatchError
from tierkv.keys import Namespace, Part, chunk_keys
from tierkv.tiers.disk.tier import SHARDS, DiskTier
from tierkv.tiers.disk.format import ValueWriter, binding_of, check_value


def _store_two_ranks(root: Path, keys: list[bytes]) -> None:
    """Ranks 0 and 1 of one namespace, different bytes (their shards) under the same keys."""
    for rank in (0, 1):
        kv = support.make_kv()
        with support.open_store(root, kv, rank=rank) as store:
            support.store_chunks(store, kv, keys, variant=b"rank%d" % rank)


def _swap_ranks(ns_dir: Path) -> None:
    """Swap the rank-0 and rank-1 directories, as an operator's mistake would."""
    (ns_dir / "part-0of2").rename(ns_dir / "swap")
    (ns_dir / "part-1of2").rename(ns_dir / "part-0of2")
    (ns_dir / "swap").rename(ns_dir / "part-1of2")


def _served_bytes(store: TierKVStore, kv: list[torch.Tensor], keys: list[bytes],
                  variant: bytes) -> tuple[int, int]:
    """(chunks loaded byte-exact as ``variant``, chunks loaded with other bytes)."""
    right = wrong = 0
    for position, key in enumerate(keys):
        if store.lookup([key]) != 1:
            continue
        blocks = support.chunk_blocks(0, 32)
        support.poison(kv, blocks)
        _, completion = support.load_chunks(store, [key])
        if completion is None or not completion.ok:
            continue
        if support.chunk_matches(kv, key, blocks, variant=variant):
            right += 1
        else:
            wrong += 1
    return right, wrong


def test_swapped_rank_directories_are_never_served_nor_destroyed(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Rank 0 reopened over rank 1's directory served rank 1's shard as hits. Now the store
    starts empty with a warning naming what the directory holds, and keeps that directory
    aside, intact; moved back, each rank serves exactly its own shard."""
    keys = support.request_keys(1)
    _store_two_ranks(tmp_path, keys)
    ns_dir = support.env_dirs(tmp_path)[0].parent
    _swap_ranks(ns_dir)
    with caplog.at_level("WARNING", logger="tierkv.disk"):
        for rank in (0, 1):
            kv = support.make_kv()
            with support.open_store(tmp_path, kv, rank=rank) as store:
                assert store.lookup(keys) == 0
                assert _served_bytes(store, kv, keys, b"rank%d" % (1 - rank)) == (0, 0)
    assert "part '1of2'" in caplog.text and "part '0of2'" in caplog.text
    for rank in (0, 1):  # put each rank's environments back where they belong
        for shard in range(SHARDS):
            (aside,) = (ns_dir / f"part-{rank}of2").glob(f"shard-{shard}.foreign-*")
            aside.rename(ns_dir / f"back-{1 - rank}-{shard}")
        shutil.rmtree(ns_dir / f"part-{rank}of2")
        (ns_dir / f"part-{rank}of2").mkdir(mode=0o700)
    for rank in (0, 1):
        for shard in range(SHARDS):
            (ns_dir / f"back-{rank}-{shard}").rename(ns_dir / f"part-{rank}of2" / f"shard-{shard}")
    for rank in (0, 1):
        kv = support.make_kv()
        with support.open_store(tmp_path, kv, rank=rank) as store:
            assert _served_bytes(store, kv, keys, b"rank%d" % rank) == (len(keys), 0)


def test_a_value_copied_from_another_rank_or_model_is_a_miss(tmp_path: Path) -> None:
    keys = support.request_keys(2)
    _store_two_ranks(tmp_path, keys)
    other_root = tmp_path / "other-model"
    kv = support.make_kv()
    with support.open_store(other_root, kv, model_id="model-b") as store:
        support.store_chunks(store, kv, keys, variant=b"model-b")
    rank0, rank1 = support.env_dirs(tmp_path)
    (model_b,) = support.env_dirs(other_root)
    with support.raw_env(rank1) as (txn, chunks, _):
        from_rank1 = txn.get(keys[0], db=chunks)
    with support.raw_env(model_b) as (txn, chunks, _):
        from_model_b = txn.get(keys[1], db=chunks)
    with support.raw_env(rank0) as (txn, chunks, _):  # valid values, planted under their keys
        txn.put(keys[0], from_rank1, db=chunks)
        txn.put(keys[1], from_model_b, db=chunks)
    kv = support.make_kv()
    with support.open_store(tmp_path, kv, rank=0) as store:
        assert store.lookup(keys) == len(keys)  # the index still names them
        blocks = support.chunk_blocks(0, 32)
        support.poison(kv, blocks)
        num, completion = support.load_chunks(store, keys[:1])
        assert num == 1 and completion is not None and completion.corrupt_keys == (keys[0],)
        assert support.untouched(kv, blocks)  # rank 1's shard never landed
        num, completion = support.load_chunks(store, keys[1:2])
        assert completion is not None and completion.corrupt_keys == (keys[1],)
        assert support.untouched(kv, blocks)
        assert store.statistics().index.corrupt == 2 and store.lookup(keys) == 0
        assert _served_bytes(store, kv, keys[2:], b"rank0") == (len(keys) - 2, 0)  # its own: exact


CHANGES: list[dict[str, Any]] = [
    {}, {"model_id": "other"}, {"layer_names": ["layer 1", "layer 0"]}, {"blocks_per_chunk": 2},
    {"tokens_per_chunk": 2 * support.TOKENS_PER_CHUNK}, {"dtype": "float16"}]


@thorough(60)
@given(source=st.tuples(st.integers(0, len(CHANGES) - 1), st.integers(0, 3), st.integers(0, 3)),
       target=st.tuples(st.integers(0, len(CHANGES) - 1), st.integers(0, 3), st.integers(0, 3)))
def test_a_value_verifies_only_where_it_was_written(source: tuple[int, int, int],
                                                    target: tuple[int, int, int]) -> None:
    """Any value moved to another (namespace, rank, key) fails its checks, whatever moved."""
    base = support.namespace_of().describe()
    namespaces = [Namespace(**(base | change)) for change in CHANGES]

    def place(where: tuple[int, int, int]) -> tuple[bytes, bytes]:
        namespace, rank, key = where
        return binding_of(namespaces[namespace].fingerprint(), Part(rank, 4)), support.pool_key(key)

    payload = support.payload_for(b"x", 256)
    binding, key = place(source)
    value = bytes(ValueWriter(256, binding).build(key, payload, seq=7))
    out = memoryview(bytearray(256))
    problem = check_value(*place(target), value, 256, out)
    if target == source:
        assert problem is None and bytes(out) == payload
    else:
        assert problem is not None


def _named_kv(names: list[str], fill: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    return {name: torch.full((support.NUM_BLOCKS, *support.PAGE_SHAPE), (fill or {}).get(name, 0),
                             dtype=torch.uint8) for name in names}


def _named_store(root: Path, kv: dict[str, torch.Tensor], **changes: Any) -> TierKVStore:
    config = StoreConfig(blocks_per_chunk=changes.pop("blocks_per_chunk", support.BPC),
                         cpu=CpuTierConfig(max_bytes=16 * support.CHUNK_BYTES, pin_memory="never"),
                         disk=DiskTierConfig(path=root, max_bytes=64 << 20), device="cpu")
    return TierKVStore(kv, model_id=support.MODEL_ID, config=config,
                       tokens_per_block=changes.pop("tokens_per_block", support.TOKENS_PER_BLOCK))


def test_layers_in_another_order_or_under_other_names_never_hit(tmp_path: Path) -> None:
    keys = chunk_keys(list(range(2 * support.TOKENS_PER_CHUNK)), support.TOKENS_PER_CHUNK)
    blocks = list(range(2 * support.BPC))
    kv = _named_kv(["layers.0", "layers.1"], {"layers.0": 10, "layers.1": 11})
    with _named_store(tmp_path, kv) as store:
        store.wait([store.store(keys, blocks)])
    for names in (["layers.1", "layers.0"], ["model.layers.0", "model.layers.1"]):
        with _named_store(tmp_path, _named_kv(names)) as other:
            assert other.lookup(keys) == 0, names
    kv = _named_kv(["layers.0", "layers.1"])  # the same order: each layer gets its own KV
    with _named_store(tmp_path, kv) as store:
        assert store.lookup(keys) == 2
        handle = store.load(keys, list(range(32, 32 + 2 * support.BPC)))
        store.wait([handle.job_id])
        assert all(c.ok for c in store.poll())
        assert bool((kv["layers.0"][32:40] == 10).all()) and bool((kv["layers.1"][32:40] == 11).all())


def test_another_block_split_of_the_same_tokens_never_hits_nor_destroys(tmp_path: Path) -> None:
    """Flat pages: the page geometry does not tell how many tokens a block holds, so the same
    tokens per chunk in another split looked like the same namespace; its chunks were
    served as hits, failed as corrupt and deleted."""
    flat = [torch.zeros((64, 4096), dtype=torch.uint8) for _ in range(2)]
    keys = chunk_keys(list(range(4 * 64)), 64)  # 64 tokens per chunk in both stores
    for layer in flat:
        layer[:16] = 7
    with _named_store(tmp_path, {"a": flat[0], "b": flat[1]}, tokens_per_block=16) as first:
        first.wait([first.store(keys, list(range(16)))])  # 4 blocks of 16 tokens a chunk
    other = {"a": torch.zeros((64, 4096), dtype=torch.uint8),
             "b": torch.zeros((64, 4096), dtype=torch.uint8)}
    with _named_store(tmp_path, other, tokens_per_block=32, blocks_per_chunk=2) as second:
        assert second.lookup(keys) == 0  # 2 blocks of 32 tokens: other bytes
    again = {"a": torch.zeros((64, 4096), dtype=torch.uint8),
             "b": torch.zeros((64, 4096), dtype=torch.uint8)}
    with _named_store(tmp_path, again, tokens_per_block=16) as first:
        assert first.lookup(keys) == 4  # nothing was destroyed
        handle = first.load(keys, list(range(32, 48)))
        first.wait([handle.job_id])
        assert all(c.ok and not c.corrupt_keys for c in first.poll())
        assert bool((again["a"][32:48] == 7).all())
    assert first.statistics().index.corrupt == 0


def test_a_directory_copied_under_another_namespace_is_never_read(tmp_path: Path) -> None:
    keys = support.request_keys(3)
    kv = support.make_kv()
    with support.open_store(tmp_path, kv) as store:
        support.store_chunks(store, kv, keys)
    with support.open_store(tmp_path, model_id="model-b"):
        pass
    source, target = (path for path in support.env_dirs(tmp_path))
    if support.namespace_of().fingerprint() not in str(source):
        source, target = target, source
    shutil.rmtree(target)
    shutil.copytree(source, target)
    with pytest.raises(NamespaceMismatchError):  # a handle that may not repair is told
        DiskTier(tmp_path, support.namespace_of("model-b"), support.part(0), support.store_config(tmp_path).disk,
                 support.CHUNK_BYTES, repair=False)
    with support.open_store(tmp_path, support.make_kv(), model_id="model-b") as other:
        assert other.lookup(keys) == 0
    for shard in range(SHARDS):  # kept, never read
        (aside,) = target.glob(f"shard-{shard}.foreign-*")
        assert (aside / "data.mdb").stat().st_size == \
            (source / f"shard-{shard}" / "data.mdb").stat().st_size


def test_verify_reports_swapped_ranks_and_repair_moves_them_aside(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tierkv.cli import main

    keys = support.request_keys(11)
    _store_two_ranks(tmp_path, keys)
    ns_dir = support.env_dirs(tmp_path)[0].parent
    _swap_ranks(ns_dir)
    assert main(["verify", str(tmp_path)]) == 1  # reported, nothing touched
    out = capsys.readouterr().out
    assert out.count(": damaged environment") == 2 and not list(ns_dir.glob("*.foreign-*"))
    assert "part '1of2', shard 0; expected" in out and "part '0of2', shard 0; expected" in out
    assert main(["verify", "--repair", str(tmp_path)]) == 1
    assert len(list(ns_dir.glob("part-*/shard-*.foreign-*"))) == 2 * SHARDS
    assert main(["verify", str(tmp_path)]) == 0
