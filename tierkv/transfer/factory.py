"""make_transfer_engine: pick the GPU <-> CPU transfer engine for a registered KV layout.

``device="auto"`` picks :class:`~tierkv.transfer.cuda.CudaTransferEngine` for tensors on a
CUDA device, else :class:`~tierkv.transfer.cpu.CpuTransferEngine`; ``"cuda"`` / ``"cpu"``
pick that engine, which raises :class:`ConfigError` for tensors elsewhere (or no CUDA).
``**engine_options`` go to the engine's constructor. The CUDA module is imported only
when chosen, so a CPU-only process never loads it.
"""

from __future__ import annotations

from typing import Any

from tierkv.errors import ConfigError
from tierkv.tiers.cpu import CpuSlab
from tierkv.transfer.base import TransferEngine
from tierkv.transfer.layout import KVLayout

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str, layout: KVLayout) -> str:
    """``"cpu"`` or ``"cuda"`` for a configured ``device``."""
    if device not in DEVICES:
        raise ConfigError(f"transfer: device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return "cuda" if layout.device.type == "cuda" else "cpu"
    return device


def make_transfer_engine(device: str, layout: KVLayout, slab: CpuSlab, blocks_per_chunk: int,
                         **engine_options: Any) -> TransferEngine:
    """The transfer engine for ``layout``'s device; see the module docstring."""
    if resolve_device(device, layout) == "cuda":
        from tierkv.transfer.cuda import CudaTransferEngine

        return CudaTransferEngine(layout, slab, blocks_per_chunk, **engine_options)
    from tierkv.transfer.cpu import CpuTransferEngine

    return CpuTransferEngine(layout, slab, blocks_per_chunk, **engine_options)
