"""Which adapter each token of a forward pass runs under."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraBatch:
    """A step's tokens by adapter slot, worked out once per step for every
    adapted layer: `per_token` [T] (-1: the base model); `groups`, (slot,
    token indices) per slot present; and the same groups as one padded
    block of `width` rows per slot below `blocks` (= the highest slot + 1):
    adapted token `tokens[i]` is row `padded[i]` of the blocks x width
    block. Tokens of base-model rows are in no group: their outputs stay
    the base's. `segments` (int32 [3, groups]: each group's slot, its
    first position in `tokens` and its length) is what the CUDA kernel reads."""

    per_token: torch.Tensor
    groups: list[tuple[int, torch.Tensor]]
    blocks: int
    tokens: torch.Tensor
    padded: torch.Tensor
    width: int
    segments: torch.Tensor

    @classmethod
    def of_rows(cls, row_slots: list[int], lengths: list[int]) -> LoraBatch | None:
        """Row i's `lengths[i]` new tokens run under slot `row_slots[i]`.
        None when every row is the base model's."""
        if all(slot < 0 for slot in row_slots):
            return None
        return cls.of_tokens(torch.repeat_interleave(torch.tensor(row_slots, dtype=torch.long),
                                                     torch.tensor(lengths, dtype=torch.long)))

    @classmethod
    def of_tokens(cls, per_token: torch.Tensor) -> LoraBatch:
        slots = [s for s in torch.unique(per_token).tolist() if s >= 0]
        groups = [(slot, (per_token == slot).nonzero().flatten()) for slot in slots]
        width = max(idx.numel() for _, idx in groups)
        padded = torch.cat([slot * width + torch.arange(idx.numel()) for slot, idx in groups])
        lengths = torch.tensor([idx.numel() for _, idx in groups], dtype=torch.int32)
        starts = torch.cumsum(lengths, 0, dtype=torch.int32) - lengths
        segments = torch.stack([torch.tensor(slots, dtype=torch.int32), starts, lengths])
        return cls(per_token, groups, slots[-1] + 1, torch.cat([idx for _, idx in groups]), padded, width, segments)

    def to(self, device: torch.device, pin: bool) -> LoraBatch:
        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        return LoraBatch(move(self.per_token), [(slot, move(idx)) for slot, idx in self.groups], self.blocks,
                         move(self.tokens), move(self.padded), self.width,
                         move(self.segments))
