"""make_transfer_engine: pick the GPU <-> CPU transfer engine for a registered KV layout.

- ``device="auto"``: :class:`~tierkv.transfer.cuda.CudaTransferEngine` when the layout's
  tensors are on a CUDA device, else :class:`~tierkv.transfer.cpu.CpuTransferEngine`.
- ``device="cuda"`` / ``device="cpu"``: that engine; it raises :class:`ConfigError` when
  the tensors are elsewhere (or CUDA is missing).
- ``**engine_options`` go to the engine (``before_copy`` for the CPU engine,
  ``staging_bytes`` / ``compute_stream`` for the CUDA one, ``remember_finished`` for both).

The CUDA module is imported only when chosen, so a CPU-only process never loads it.
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
