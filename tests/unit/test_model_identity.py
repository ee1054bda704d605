"""The model fingerprint (tierkv.model_identity): what changes it, what does not, and what
it reads. Real files in temp directories; a hub cache laid out as huggingface_hub lays it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tierkv import model_identity
from tierkv.model_identity import (WINDOW_BYTES, WINDOWS, ContentCache, model_fingerprint,
                                   overrides_fingerprint, path_fingerprint, window_offsets)

WEIGHT_BYTES = 3 << 20  # larger than the windows together: "auto" samples it


def checkpoint(folder: Path, seed: int = 0, rope_theta: float = 10000.0) -> Path:
    """A model directory: config, tokenizer, and two weight files of ``seed``'s bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama",
                                                    "rope_theta": rope_theta}))
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "README.md").write_text("a model")
    for index in range(2):
        data = bytes((seed * 31 + index * 7 + position) % 251 for position in range(4096))
        (folder / f"model-0000{index}.safetensors").write_bytes(data * (WEIGHT_BYTES // 4096))
    return folder


def overwrite_in_place(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def test_a_checkpoint_saved_over_the_old_one_is_another_fingerprint(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    before = {mode: path_fingerprint(model, mode) for mode in ("auto", "content")}
    checkpoint(model, seed=1)  # a fine-tune saved into the same directory, same sizes
    after = {mode: path_fingerprint(model, mode) for mode in ("auto", "content")}
    assert all(before[mode] != after[mode] for mode in before)
    assert after["auto"].startswith("auto:") and after["content"].startswith("content:")


def test_a_byte_changed_between_the_windows_is_caught_by_its_mtime_and_by_content(
        tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    weights = model / "model-00000.safetensors"
    stat = weights.stat()
    auto, content = path_fingerprint(model, "auto"), path_fingerprint(model, "content")
    overwrite_in_place(weights, WINDOW_BYTES + 1, b"\xff")  # no window covers this byte
    assert all(offset > WINDOW_BYTES + 1 or offset + length <= WINDOW_BYTES + 1
               for offset, length in window_offsets(stat.st_size))
    assert path_fingerprint(model, "auto") != auto  # its mtime moved
    assert path_fingerprint(model, "content") != content
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a tool that restores mtimes
    assert path_fingerprint(model, "auto") == auto  # what "auto" misses (documented)
    assert path_fingerprint(model, "content") != content


def test_config_values_that_keep_every_size_change_it(tmp_path: Path) -> None:
    one = path_fingerprint(checkpoint(tmp_path / "a"))
    assert path_fingerprint(checkpoint(tmp_path / "a", rope_theta=500000.0)) != one


def test_tokenizer_docs_and_hidden_files_do_not(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    fingerprints = {mode: path_fingerprint(model, mode) for mode in ("auto", "content")}
    (model / "tokenizer.json").write_text('{"version": "2.0"}')
    (model / "README.md").write_text("another card")
    (model / "generation_config.json").write_text('{"temperature": 0.1}')
    (model / ".complete").write_text("x")
    assert {mode: path_fingerprint(model, mode) for mode in fingerprints} == fingerprints


def test_a_copy_with_new_mtimes_keeps_content_not_auto(tmp_path: Path) -> None:
    model = checkpoint(tmp_path / "m")
    copy = checkpoint(tmp_path / "copy")  # the same bytes, written later
    for path in copy.iterdir():
        os.utime(path, ns=(1, 1))
    assert path_fingerprint(copy, "content") == path_fingerprint(model, "content")
    assert path_fingerprint(copy, "auto") != path_fingerprint(model, "auto")


def test_auto_reads_windows_never_a_whole_weight_file(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = checkpoint(tmp_path / "m")
    reads: list[int] = []
    real = os.pread

    def counting(fd: int, length: int, offset: int) -> bytes:
        reads.append(length)
        return real(fd, length, offset)

    monkeypatch.setattr(model_identity.os, "pread", counting)
    path_fingerprint(model, "auto")
    assert reads == [WINDOW_BYTES] * (2 * WINDOWS)  # two weight files, WINDOWS windows each
    assert WINDOWS * WINDOW_BYTES < WEIGHT_BYTES


def test_content_hashes_are_cached_by_inode_size_and_mtime(tmp_path: Path) -> None:
    model, cache = checkpoint(tmp_path / "m"), tmp_path / "cache"
    first = path_fingerprint(model, "content", cache)
    warm = ContentCache(cache)
    assert len(warm.entries) == 2
    assert path_fingerprint(model, "content", cache) == first
    again = ContentCache(cache)
    for path in sorted(model.glob("*.safetensors")):
        again.digest(path)
    assert again.hashed == 0  # every file was found in the cache
    checkpoint(model, seed=2)  # rewritten: new mtimes, so hashed again
    assert path_fingerprint(model, "content", cache) != first
    (cache / model_identity.CACHE_FILE).write_text("not json")  # a broken cache is ignored
    assert path_fingerprint(model, "content", cache).startswith("content:")


def test_an_operators_name_is_taken_as_it_is(tmp_path: Path) -> None:
    assert model_fingerprint(tmp_path / "absent", "registry/llama:v7") == "name:registry/llama:v7"
    assert model_fingerprint(tmp_path / "absent", "auto") is None  # neither a path nor a hub id


def test_a_single_weight_file_is_fingerprinted(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(1 << 20))
    first = path_fingerprint(gguf)
    gguf.write_bytes(b"GGUF" + bytes([1]) * (1 << 20))
    assert path_fingerprint(gguf) != first


def _hub_cache(root: Path, repo: str, commit: str, seed: int) -> None:
    """One snapshot of ``repo`` at ``commit`` in a hub cache, ``main`` pointing at it."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    checkpoint(repo_dir / "snapshots" / commit, seed=seed)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)


def test_a_hub_id_is_its_snapshots_commit_and_a_moved_main_is_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("huggingface_hub", reason="hub ids resolve through huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    _hub_cache(cache, "org/tiny", "a" * 40, seed=0)
    assert model_fingerprint("org/tiny", hub_cache=cache) == "hub:" + "a" * 40
    _hub_cache(cache, "org/tiny", "b" * 40, seed=1)  # main moved to a new commit
    assert model_fingerprint("org/tiny", hub_cache=cache) == "hub:" + "b" * 40
    assert model_fingerprint("org/tiny", revision="a" * 40, hub_cache=cache) == "hub:" + "a" * 40
    assert model_fingerprint("org/absent", hub_cache=cache) is None
    snapshot = cache / "models--org--tiny" / "snapshots" / ("a" * 40)
    assert model_identity.snapshot_commit(snapshot) == "a" * 40
    assert model_identity.snapshot_commit(tmp_path) is None


def test_config_overrides_are_fingerprinted_and_stable() -> None:
    assert overrides_fingerprint({}) == overrides_fingerprint(None) == ""
    rope = overrides_fingerprint({"rope_theta": 1e6})
    assert rope.startswith("+overrides:") and rope != overrides_fingerprint({"rope_theta": 1e4})
    assert overrides_fingerprint({"a": 1, "b": 2}) == overrides_fingerprint({"b": 2, "a": 1})
    assert overrides_fingerprint(test_config_overrides_are_fingerprinted_and_stable) == \
        overrides_fingerprint(test_config_overrides_are_fingerprinted_and_stable)  # no address


def test_processes_that_start_together_hash_each_file_once(tmp_path: Path) -> None:
    """The ranks of one engine fingerprint the same weights at once under ``content``: the
    first hashes them under the cache's lock, the others wait and find them in the cache."""
    import multiprocessing

    model, cache = checkpoint(tmp_path / "m"), tmp_path / "cache"
    context = multiprocessing.get_context("fork")
    with context.Pool(3) as pool:
        hashed = pool.starmap(_hash_count, [(model, cache)] * 3)
    assert sorted(hashed) == [0, 0, 2]  # two weight files, hashed by one process


def _hash_count(model: Path, cache: Path) -> int:
    """Files this process hashed while it fingerprinted ``model`` under ``content``."""
    counted = []
    real = model_identity._content

    def counting(path: Path) -> bytes:
        counted.append(path)
        return real(path)

    model_identity._content = counting  # a forked child's own module
    path_fingerprint(model, "content", cache)
    return len(counted)
