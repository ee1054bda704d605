from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tierkv.config import CpuTierConfig, DiskTierConfig, StoreConfig
from tierkv.engine.adapter_config import AdapterConfig
from tierkv.errors import ConfigError
from tierkv.keys import FORMAT_VERSION, ROOT_KEY, Namespace, chunk_key, chunk_keys, salted_root


def test_chunk_keys_chain_and_cover_only_full_chunks() -> None:
    tokens = list(range(10))
    keys = chunk_keys(tokens, 4)
    assert len(keys) == 2  # 10 tokens = 2 full chunks of 4 + a partial tail
    assert keys[0] == chunk_key(ROOT_KEY, [0, 1, 2, 3])
    assert keys[1] == chunk_key(keys[0], [4, 5, 6, 7])
    assert chunk_keys(tokens[:8], 4) == keys  # the tail does not change earlier keys
    other = chunk_keys([9] + tokens[1:], 4)
    assert other[0] != keys[0] and other[1] != keys[1]  # a prefix change changes all later keys


def test_keys_are_stable_across_processes() -> None:
    code = "from tierkv.keys import chunk_keys; print(chunk_keys(list(range(8)), 4)[1].hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={"PYTHONHASHSEED": seed}, check=True).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1 and outs.pop().strip() == chunk_keys(list(range(8)), 4)[1].hex()


def test_salts_and_extra_keys_separate_tenants() -> None:
    tokens = list(range(8))
    assert chunk_keys(tokens, 4, parent=salted_root("a")) != chunk_keys(tokens, 4, parent=salted_root("b"))
    assert chunk_keys(tokens, 4, extra="lora-1") != chunk_keys(tokens, 4)


def test_namespace_fingerprint_changes_with_every_field() -> None:
    base = Namespace("m", "float16", "LBNHC", 4096, 256)
    variants = [
        Namespace("m2", "float16", "LBNHC", 4096, 256),
        Namespace("m", "bfloat16", "LBNHC", 4096, 256),
        Namespace("m", "float16", "BLNHC", 4096, 256),
        Namespace("m", "float16", "LBNHC", 8192, 256),
        Namespace("m", "float16", "LBNHC", 4096, 128),
        Namespace("m", "float16", "LBNHC", 4096, 256, num_kv_heads=8),
        Namespace("m", "float16", "LBNHC", 4096, 256, rank_layout="mla"),
        Namespace("m", "float16", "LBNHC", 4096, 256, chunk_bytes=1 << 20),
        Namespace("m", "float16", "LBNHC", 4096, 256, format_version=FORMAT_VERSION + 1),
        Namespace("m", "float16", "LBNHC", 4096, 256, layer_names=("a",)),
        Namespace("m", "float16", "LBNHC", 4096, 256, blocks_per_chunk=2),
    ]
    prints = {base.fingerprint()} | {v.fingerprint() for v in variants}
    assert len(prints) == len(variants) + 1
    # layer order and the block split are part of it
    two = Namespace("m", "float16", "LBNHC", 4096, 256, num_layers=2, layer_names=("a", "b"))
    swapped = Namespace("m", "float16", "LBNHC", 4096, 256, num_layers=2, layer_names=("b", "a"))
    assert two.fingerprint() != swapped.fingerprint()
    # a namespace rebuilt from its JSON record (lists for tuples) is the same namespace
    import json
    assert Namespace(**json.loads(json.dumps(two.describe()))) == two


@pytest.mark.parametrize(
    "build, setting",
    [
        (lambda: CpuTierConfig(max_bytes=0), "cpu.max_bytes"),
        (lambda: CpuTierConfig(pin_memory="sometimes"), "cpu.pin_memory"),
        (lambda: CpuTierConfig(spill_ahead_fraction=2.0), "cpu.spill_ahead_fraction"),
        (lambda: CpuTierConfig(eviction_policy="fifo"), "cpu.eviction_policy"),
        (lambda: DiskTierConfig(max_bytes=-1), "disk.max_bytes"),
        (lambda: DiskTierConfig(sync_mode="sometimes"), "disk.sync_mode"),
        (lambda: DiskTierConfig(write_batch_bytes=0), "disk.write_batch_bytes"),
        (lambda: StoreConfig(blocks_per_chunk=0), "blocks_per_chunk"),
        (lambda: StoreConfig(device="tpu"), "device"),
        (lambda: StoreConfig.from_dict({"cpu": {"max_bytez": 1}}), "cpu.max_bytez"),
        (lambda: StoreConfig.from_dict({"nonsense": 1}), "nonsense"),
        (lambda: Namespace("m", "f16", "L", 0, 16), "page_bytes"),
        # NaN compares false with every bound: unchecked, it made every promotion wait end
        (lambda: AdapterConfig(16, 8, promotion_wait_seconds=math.nan),
         "adapter.promotion_wait_seconds"),
        (lambda: AdapterConfig(16, 8, max_chunks_per_request=1.5),
         "adapter.max_chunks_per_request"),
    ],
)
def test_bad_settings_name_the_setting_and_value(build, setting) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError) as info:
        build()
    assert setting in str(info.value)


def test_core_imports_no_torch_lmdb_or_threads() -> None:
    code = (
        "import sys, tierkv.core.index, tierkv.core.jobs;"
        "bad = {'torch', 'lmdb', 'threading', 'numpy'} & set(sys.modules);"
        "print(sorted(bad))"
    )
    # Without pytest-cov's COV_CORE_* variables: under `--cov` its .pth would start coverage in
    # the child, and coverage imports threading itself (the check is on tierkv's own imports).
    env = {name: value for name, value in os.environ.items() if not name.startswith("COV_CORE_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    assert out.stdout.strip() == "[]"


def test_imports_flow_one_way() -> None:
    """keys -> core -> tiers -> transfer -> engine -> integrations -> the rest (cli, tools,
    warm-up): no module imports a layer above its own, lazily inside a function either."""
    import ast
    from pathlib import Path

    # config sits above core: it names core's eviction policies (and their default)
    layers = {"errors": 0, "checks": 0, "units": 0, "settings": 0, "keys": 0, "extras": 0,
              "model_identity": 0,
              "core": 1, "config": 1.5, "config_env": 1.5, "tiers": 2, "transfer": 3, "engine": 4,
              "integrations": 5}

    def layer(module: str) -> float | None:
        parts = module.split(".")
        return layers.get(parts[1], 6) if parts[0] == "tierkv" and len(parts) > 1 else None

    package = Path(__file__).resolve().parents[2] / "tierkv"
    upward = []
    for path in sorted(package.rglob("*.py")):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts)
        own = layer(module.removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            upward += [f"{module} -> {name}" for name in names
                       if own is not None and (layer(name) or 0) > own]
    assert upward == []


def test_the_integrations_use_the_engine_not_the_core() -> None:
    """The vLLM connector goes through the adapter's API: from tierkv.core it imports only
    the plain records that API carries (core/jobs.py, core/controls.py, from their defining
    modules), never the index, its states or entries (it reached into them)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).resolve().parents[2] / "tierkv" / "integrations"
    reaching = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     else [])
            reaching += [f"{path.name} -> {name}" for name in names if name.startswith("tierkv.core")
                         and name not in ("tierkv.core.jobs", "tierkv.core.controls")]
    assert reaching == []
