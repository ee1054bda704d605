"""The CPU tier's bytes: one slab allocated once (pinned when CUDA is present), carved
into fixed-size chunk slots. Pinning costs ~4 GiB/s and fresh large allocations copy
slowly, so nothing is ever allocated or pinned per copy.

Primitives:
- ``view(slot)``        1-D uint8 tensor over the slot's bytes (no copy).
- ``memoryview(slot)``  writable buffer over the same bytes, for disk I/O.
"""

from __future__ import annotations

import numpy as np
import torch

from tierkv.core.jobs import SlotId
from tierkv.errors import ConfigError


class CpuSlab:
    def __init__(self, num_slots: int, slot_bytes: int, pin_memory: str = "auto") -> None:
        if num_slots <= 0:
            raise ConfigError(
                f"cpu tier: {num_slots} slots of {slot_bytes} bytes; raise cpu.max_bytes "
                f"to at least one chunk ({slot_bytes} bytes)"
            )
        if slot_bytes <= 0:
            raise ConfigError(f"cpu tier: slot_bytes must be > 0, got {slot_bytes}")
        pin = pin_memory == "always" or (pin_memory == "auto" and torch.cuda.is_available())
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.pinned = pin
        self.tensor = torch.empty((num_slots, slot_bytes), dtype=torch.uint8, pin_memory=pin)
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
