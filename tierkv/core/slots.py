"""CPU slot allocator: which slab slots are free. Knows nothing of keys or recency.

- ``allocate()`` a free slot, or None when none is free (a value, not an error);
  ``allocate_many(n)`` up to n of them at once; ``give_back`` returns the unused ones.
- ``free(slot)`` returns it; freeing a free slot is an internal invariant violation.
"""

from __future__ import annotations

from tierkv.core.jobs import SlotId
from tierkv.errors import InvariantError


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        # Reverse so that slot 0 is handed out first (easier to read in tests).
        self._free: list[SlotId] = [SlotId(s) for s in reversed(range(num_slots))]
        self._is_free = [True] * num_slots

    def allocate(self) -> SlotId | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._is_free[slot] = False
        return slot

    def allocate_many(self, count: int) -> list[SlotId]:
        """Up to ``count`` free slots, in the order ``allocate`` would hand them out."""
        take = min(count, len(self._free))
        if take <= 0:
            return []
        slots = self._free[-take:]
        del self._free[-take:]
        slots.reverse()
        is_free = self._is_free
        for slot in slots:
            is_free[slot] = False
        return slots

    def give_back(self, slots: list[SlotId]) -> None:
        """Return unused slots of ``allocate_many`` so that they are handed out next, in
        the same order."""
        is_free = self._is_free
        for slot in slots:
            assert not is_free[slot], f"slot {slot} freed twice"
            is_free[slot] = True
        self._free.extend(reversed(slots))

    def free(self, slot: SlotId) -> None:
        self.give_back([slot])

    def is_free(self, slot: SlotId) -> bool:
        return self._is_free[slot]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def check(self, used: set[SlotId]) -> None:
        """Raise :class:`~tierkv.errors.InvariantError` unless the slots ``used`` (by
        entries) and the free ones are every slot, each once."""
        if len(used) + self.num_free != self.num_slots or any(map(self.is_free, used)):
            raise InvariantError(f"{len(used)} slots used + {self.num_free} free != "
                                 f"{self.num_slots}, or a used slot is free")
