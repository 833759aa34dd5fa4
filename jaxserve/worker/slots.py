"""Device slots filled on demand: which key (a LoRA adapter, a steering) each of a fixed number of
slots holds, reused least recently used first, never while the step being prepared needs it."""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable


class LruSlots:
    def __init__(self, num_slots: int, what: str):
        self.num_slots, self.what = num_slots, what
        self._slot_of: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # key -> slot, LRU first

    def assign(self, needed: dict, load: Callable[[int, object], None]) -> dict:
        """Key -> slot for the keys of a step (`needed`: key -> what `load(slot, it)` writes into a
        slot), loading those not in a slot into free ones, else into those of the least recently used
        keys the step does not need."""
        if len(needed) > self.num_slots:
            raise RuntimeError(f"a step needs {len(needed)} {self.what} but there are {self.num_slots} slots")
        for key in needed:
            if key in self._slot_of:
                self._slot_of.move_to_end(key)
        for key, item in needed.items():
            if key in self._slot_of:
                continue
            free = sorted(set(range(self.num_slots)) - set(self._slot_of.values()))
            slot = free[0] if free else self._slot_of.pop(next(k for k in self._slot_of if k not in needed))
            load(slot, item)
            self._slot_of[key] = slot
        return {key: self._slot_of[key] for key in needed}
