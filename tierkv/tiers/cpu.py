"""The CPU tier's bytes: one slab allocated once (pinned when CUDA is present), carved
into fixed-size chunk slots. Pinning costs ~4 GiB/s and fresh large allocations copy
slowly, so nothing is ever allocated or pinned per copy.

Primitives:
- ``view(slot)``        1-D uint8 tensor over the slot's bytes (no copy).
- ``memoryview(slot)``  writable buffer over the same bytes, for disk I/O.

What cannot be allocated is a :class:`ConfigError` naming ``cpu.max_bytes`` or
``cpu.pin_memory``, the value and the limit, never a raw torch error: a slab larger than
this machine's memory (:func:`physical_memory_bytes`), ``pin_memory="always"`` without
CUDA, or an allocation the system refuses.
"""

from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from tierkv.core.jobs import SlotId
from tierkv.errors import ConfigError
from tierkv.units import format_bytes


def physical_memory_bytes() -> int | None:
    """This machine's memory (``SC_PHYS_PAGES`` x page size), None where it is not known."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class CpuSlab:
    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: str = "auto") -> None:
        if num_slots <= 0:
            raise ConfigError(
                f"cpu tier: {num_slots} slots of {slot_bytes} bytes; raise cpu.max_bytes "
                f"to at least one chunk ({slot_bytes} bytes)"
            )
        if slot_bytes <= 0:
            raise ConfigError(f"cpu tier: slot_bytes must be > 0, got {slot_bytes}")
        total = num_slots * slot_bytes
        if pin_memory == "always" and not torch.cuda.is_available():
            raise ConfigError(
                "cpu tier: cpu.pin_memory='always' needs CUDA, and torch.cuda.is_available() "
                "is False here; use cpu.pin_memory='auto' (pins when CUDA is present) or "
                "'never'")
        memory = physical_memory_bytes()
        if memory is not None and total > memory:
            raise ConfigError(
                f"cpu tier: cpu.max_bytes asks for a slab of {format_bytes(total, 2)} "
                f"({num_slots} slots of {slot_bytes} bytes), more than this machine's memory "
                f"({format_bytes(memory, 2)}); lower cpu.max_bytes (well below the memory, "
                f"leaving the engine its own)")
        pin = pin_memory == "always" or (pin_memory == "auto" and torch.cuda.is_available())
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.pinned = pin
        self._map: mmap.mmap | None = None
        try:
            if pin:  # cudaHostAlloc: page-aligned already
                self.tensor = torch.empty((num_slots, slot_bytes), dtype=torch.uint8,
                                          pin_memory=True)
            else:  # an anonymous map is page-aligned, so the disk tier's O_DIRECT writes go
                # straight from the slots (torch.empty gives 64-byte alignment: a bounce copy)
                self._map = mmap.mmap(-1, max(total, 1))
                self.tensor = torch.frombuffer(self._map, dtype=torch.uint8,
                                               count=total).view(num_slots, slot_bytes)
        except (RuntimeError, MemoryError, OSError, ValueError) as exc:
            why = (str(exc).splitlines() or [type(exc).__name__])[0][:120]
            hint = " or set cpu.pin_memory='never'" if pin else ""
            raise ConfigError(
                f"cpu tier: cannot allocate {'a pinned' if pin else 'a'} slab of "
                f"{format_bytes(total, 2)} for cpu.max_bytes ({why}); lower "
                f"cpu.max_bytes{hint}") from exc
        self._array = self.tensor.numpy()

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"cpu tier: slot {slot} out of range [0, {self.num_slots})")

    def view(self, slot: SlotId | int) -> torch.Tensor:
        self._check(slot)
        return self.tensor[slot]

    def memoryview(self, slot: SlotId | int) -> memoryview:
        self._check(slot)
        row: np.ndarray = self._array[slot]
        return memoryview(row)  # type: ignore[arg-type]  # ndarray implements the buffer protocol
