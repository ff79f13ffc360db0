"""Which adapter each token of a forward pass runs under."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraBatch:
    """A step's tokens grouped by adapter slot. Tokens of base-model rows
    belong to no group: their layers' outputs are left as the base computes
    them. `groups` is (slot, token indices) per slot present, computed once
    per step and read by every adapted layer."""

    groups: list[tuple[int, torch.Tensor]]

    @classmethod
    def of_rows(cls, row_slots: list[int], lengths: list[int]) -> LoraBatch | None:
        """Row i's `lengths[i]` new tokens run under slot `row_slots[i]`
        (-1: the base model). None when every row is the base model's."""
        if all(slot < 0 for slot in row_slots):
            return None
        per_token = torch.repeat_interleave(torch.tensor(row_slots, dtype=torch.long),
                                            torch.tensor(lengths, dtype=torch.long))
        groups = [(slot, (per_token == slot).nonzero().flatten()) for slot in sorted(set(row_slots)) if slot >= 0]
        return cls(groups)

    def to(self, device: torch.device, pin: bool) -> LoraBatch:
        return LoraBatch([(slot, (idx.pin_memory() if pin else idx).to(device, non_blocking=True))
                          for slot, idx in self.groups])
