"""The description of one forward pass that the model and attention read.

The KV cache is a pool of pages per layer (see kv_buffer.py); attention sees
it as token slots (page * page_size + offset). Every sequence in a batch
owns a list of slots, one per token it has seen; the new tokens of this step
are written to `out_cache_loc` before attention reads the whole sequence
back through its stretch of `kv_indices`.

With a sliding pool (kv_buffer.py) the sliding layers address the same
tokens by their sliding slots instead: `window_out_cache_loc` and
`window_kv_indices`, entry for entry the sliding slots of `out_cache_loc`
and `kv_indices` (same `kv_indptr`). Tokens before a sequence's window have
none (they read as padding slots) and the windowed attention never reads them.

Prompt tokens given as embeddings (vLLM's prompt_embeds) carry them in
`input_embeds`, one row per index of `embeds_rows`; the model reads those
rows instead of looking their placeholder ids up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pyserve.lora.batch import LoraBatch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: the new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64: KV slot each new token is written to
    extend_lens: list[int]  # new tokens per sequence (1 for every sequence in decode)
    seq_lens: list[int]  # tokens per sequence after this step (cached prefix + new)
    # Sequence i reads the slots kv_indices[kv_indptr[i]:kv_indptr[i + 1]], in order.
    kv_indptr: torch.Tensor  # [B + 1] int64
    kv_indices: torch.Tensor  # [sum(seq_lens)] int64
    logits_indices: torch.Tensor  # [B'] int64: index into T whose logits are wanted
    is_decode: bool  # every sequence adds exactly one token
    lora: LoraBatch | None = None  # the tokens run under adapters, by slot; None: all under the base model
    # The sliding layers' slots (see above); None without a sliding pool.
    window_out_cache_loc: torch.Tensor | None = None  # [T] int64
    window_kv_indices: torch.Tensor | None = None  # [sum(seq_lens)] int64
    # [B + 1] int64 on the device: sequence i's new tokens are rows
    # qo_indptr[i]:qo_indptr[i + 1]. Set by a CUDA graph's static batch, whose
    # backend may not copy from the host while it is captured; None: the
    # backend builds it from extend_lens.
    qo_indptr: torch.Tensor | None = None
    input_embeds: torch.Tensor | None = None  # [R, hidden]: token rows given as embeddings
    embeds_rows: torch.Tensor | None = None  # [R] int64: which rows of the batch they are

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(
        cls,
        input_ids: list[int],
        positions: list[int],
        out_cache_loc: torch.Tensor,
        extend_lens: list[int],
        slots: list[torch.Tensor],
        logits_indices: list[int],
        is_decode: bool,
        device: torch.device | str,
        lora: LoraBatch | None = None,
        window_slots: Callable[[torch.Tensor], torch.Tensor] | None = None,
        embeds: tuple[list[int], torch.Tensor] | None = None,
    ) -> "ForwardBatch":
        """Concatenate per-sequence CPU lists into device tensors, one copy
        each. `slots[i]` are sequence i's KV slots after this step;
        `window_slots` maps slots to the sliding pool's, when there is one;
        `embeds`: the rows given as embeddings, and those embeddings."""
        seq_lens = [s.numel() for s in slots]
        indptr = [0]
        for n in seq_lens:
            indptr.append(indptr[-1] + n)

        def to_dev(x) -> torch.Tensor:
            t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.long)
            return t.to(device, torch.long, non_blocking=True)

        out_cache_loc = torch.as_tensor(out_cache_loc, dtype=torch.long)
        kv_indices = torch.cat(slots) if slots else torch.empty(0, dtype=torch.long)
        windowed = window_slots is not None
        return cls(
            input_ids=to_dev(input_ids),
            positions=to_dev(positions),
            out_cache_loc=to_dev(out_cache_loc),
            extend_lens=list(extend_lens),
            seq_lens=seq_lens,
            kv_indptr=to_dev(indptr),
            kv_indices=to_dev(kv_indices),
            logits_indices=to_dev(logits_indices),
            is_decode=is_decode,
            lora=lora,
            window_out_cache_loc=to_dev(window_slots(out_cache_loc.cpu())) if windowed else None,
            window_kv_indices=to_dev(window_slots(kv_indices.cpu())) if windowed else None,
            input_embeds=None if embeds is None else embeds[1].to(device, non_blocking=True),
            embeds_rows=None if embeds is None else to_dev(embeds[0]),
        )

    def to(self, device: torch.device) -> "ForwardBatch":
        """The batch on `device`. Host tensors go through pinned memory so the
        copies queue behind the running step instead of waiting for it."""
        if self.input_ids.device.type == device.type:
            # Still a batch of its own, with its own token ids: the runner and
            # the drafters write tokens into the device batch (placeholders
            # resolved, drafts), which on a GPU never reach the host batch.
            return replace(self, input_ids=self.input_ids.clone())
        pin = device.type == "cuda"

        def move(t: torch.Tensor) -> torch.Tensor:
            return (t.pin_memory() if pin else t).to(device, non_blocking=True)

        return replace(
            self, input_ids=move(self.input_ids), positions=move(self.positions),
            out_cache_loc=move(self.out_cache_loc), kv_indptr=move(self.kv_indptr),
            kv_indices=move(self.kv_indices), logits_indices=move(self.logits_indices),
            lora=self.lora.to(device, pin) if self.lora is not None else None,
            window_out_cache_loc=None if self.window_out_cache_loc is None else move(self.window_out_cache_loc),
            window_kv_indices=None if self.window_kv_indices is None else move(self.window_kv_indices),
            input_embeds=None if self.input_embeds is None else move(self.input_embeds),
            embeds_rows=None if self.embeds_rows is None else move(self.embeds_rows),
        )
