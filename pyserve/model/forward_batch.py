"""The description of one forward pass that the model and attention read.

The KV cache is a pool of token slots per layer (see kv_pool.py). Every
sequence in a batch owns a list of slots, one per token it has seen; the new
tokens of this step are written to `out_cache_loc` before attention reads the
whole sequence back through `kv_indices`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64: the new tokens of all sequences, concatenated
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    out_cache_loc: torch.Tensor  # [T] int64: KV slot each new token is written to
    extend_lens: list[int]  # new tokens per sequence (1 for every sequence in decode)
    seq_lens: list[int]  # tokens per sequence after this step (cached prefix + new)
    kv_indices: list[torch.Tensor]  # per sequence: [seq_len] int64 slots, in order
    logits_indices: torch.Tensor  # [B] int64: index into T whose logits are wanted
    is_decode: bool  # every sequence adds exactly one token

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)
