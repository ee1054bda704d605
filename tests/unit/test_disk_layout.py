"""StoreLayout: the one owner of a store root's directory names (ns-, part-, rank-, shard-)."""

from __future__ import annotations

from pathlib import Path

from tierkv.keys import Part
from tierkv.tiers.disk.layout import StoreLayout


def test_the_directories_of_a_root_are_named_once() -> None:
    layout = StoreLayout("/store")
    assert layout.namespace_dir("ab12") == Path("/store/ns-ab12")
    assert layout.part_dir("ab12", Part(1, 2)) == Path("/store/ns-ab12/part-1of2")
    assert layout.part_dir("ab12", Part(0, 1), replica=3) == Path("/store/ns-ab12/part-0of1-dp3")
    assert layout.shard_dir("ab12", Part(0, 1), 2) == Path("/store/ns-ab12/part-0of1/shard-2")
    assert StoreLayout.fingerprint_of(layout.namespace_dir("ab12")) == "ab12"


def test_names_parse_back_and_others_are_refused() -> None:
    assert StoreLayout.old_rank_of("rank-3") == 3
    assert [StoreLayout.old_rank_of(name) for name in ("rank-", "rank-x", "rank-0.broken-1",
                                                         "part-0of1")] == [None] * 4
    assert StoreLayout.is_part_dir("part-0of2") and StoreLayout.is_part_dir("rank-0")
    assert not StoreLayout.is_part_dir("part-0of2.broken-x")
    assert StoreLayout.shard_of_dir("shard-3") == 3
    assert StoreLayout.shard_of_dir("shard-3.broken-20250101T000000Z") is None
    assert StoreLayout.is_namespace_name("ns-ab") and not StoreLayout.is_namespace_name("x")


def test_listings_keep_what_each_caller_needs(tmp_path: Path) -> None:
    layout = StoreLayout(tmp_path)
    part = layout.part_dir("ab12", Part(0, 1))
    for shard in (0, 1):
        (part / StoreLayout.shard_name(shard)).mkdir(parents=True)
        (part / StoreLayout.shard_name(shard) / "data.mdb").write_bytes(b"")
    (part / "shard-1" / "slab-0.kv").write_bytes(b"")
    (part / "shard-2.broken-20250101T000000Z").mkdir()
    (part.parent / "part-0of1.foreign-20250101T000000Z").mkdir()
    (part.parent / "rank-0").mkdir()
    (tmp_path / "stray").mkdir()
    assert layout.namespace_dirs() == [tmp_path / "ns-ab12"]
    assert [path.name for path in StoreLayout.shard_dirs(part)] == ["shard-0", "shard-1"]
    assert [path.relative_to(part).as_posix() for path in StoreLayout.data_files(part)] == \
        ["shard-0/data.mdb", "shard-1/data.mdb", "shard-1/slab-0.kv"]
    assert {path.name for path in StoreLayout.moved_aside(part)} == \
        {"shard-2.broken-20250101T000000Z", "part-0of1.foreign-20250101T000000Z"}
    assert [path.name for path in StoreLayout.old_rank_dirs(part.parent)] == ["rank-0"]
    assert [path.name for path in StoreLayout.part_dirs(part.parent)] == \
        ["part-0of1", "part-0of1.foreign-20250101T000000Z"]
