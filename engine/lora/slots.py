"""Which adapter sits in which of the device's max_loras slots: the scheduler's side of the pool.

A sequence under an adapter is admitted only when its adapter has a slot or can take one that no running
sequence uses (the least recently used); the step that admits it tells the runner to load the adapter there."""
from __future__ import annotations

from engine.lora.request import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int):
        self.held: list[LoRARequest | None] = [None] * max_loras  # the adapter in each slot
        self.last_used = [0] * max_loras
        self.clock = 0
        self.loads: list[tuple[int, int, str, str]] = []  # (slot, int_id, name, path) for the next step

    def acquire(self, lora: LoRARequest, busy: set[int]) -> int | None:
        """The slot of `lora` (loading it into a free or the least recently used idle slot), or None while
        every slot is busy with other adapters. busy: the slots of running sequences."""
        self.clock += 1
        for slot, held in enumerate(self.held):
            if held is not None and held.int_id == lora.int_id:
                self.last_used[slot] = self.clock
                return slot
        idle = [s for s in range(len(self.held)) if s not in busy]
        if not idle:
            return None
        slot = min(idle, key=lambda s: (self.held[s] is not None, self.last_used[s]))
        self.held[slot] = lora
        self.last_used[slot] = self.clock
        self.loads.append((slot, lora.int_id, lora.name, lora.path))
        return slot

    def take_loads(self) -> list[tuple[int, int, str, str]]:
        loads, self.loads = self.loads, []
        return loads
