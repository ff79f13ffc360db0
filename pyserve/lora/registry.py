"""The adapters a server has loaded: names, slots and what a request gets.

Written on the event loop only. A slot is taken by a load and given back
by the unload of its adapter, but reused only once no request started
under the old adapter is still running (the caller passes the slots in
use). Each load gets a new `uid`: the prefix cache is keyed by it, so a
name reloaded with other weights never reuses the old adapter's KV.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraRef:
    """The adapter a request runs under."""

    name: str
    slot: int
    uid: int  # this load's: the prefix cache's namespace for it


class LoraRegistry:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.adapters: dict[str, LoraRef] = {}
        self.paths: dict[str, str] = {}
        self._uids = itertools.count()

    def get(self, name: str) -> LoraRef | None:
        return self.adapters.get(name)

    def names(self) -> list[str]:
        return sorted(self.adapters)

    def take_slot(self, name: str, slots_in_use: set[int]) -> LoraRef:
        """A slot for a new adapter `name`; ValueError when every slot is taken."""
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        busy = slots_in_use | {ref.slot for ref in self.adapters.values()}
        free = [slot for slot in range(self.num_slots) if slot not in busy]
        if not free:
            raise ValueError(f"all {self.num_slots} adapter slots (--max-loras-per-batch) are taken or still "
                             "used by running requests")
        return LoraRef(name, free[0], next(self._uids))

    def add(self, ref: LoraRef, path: str) -> None:
        self.adapters[ref.name] = ref
        self.paths[ref.name] = path

    def remove(self, name: str) -> LoraRef:
        """KeyError for a name not loaded."""
        self.paths.pop(name)
        return self.adapters.pop(name)
