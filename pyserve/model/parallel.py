"""Tensor parallelism: how a rank's shard of the model is cut, and the two
collectives the model needs (torch.distributed: NCCL on CUDA, gloo on CPU).

Megatron's split, as SGLang and vLLM use it:
- q/k/v and gate/up are column-parallel: each rank computes its own heads
  (its slice of the intermediate size), no communication;
- o_proj and down_proj are row-parallel: each rank multiplies its slice of
  the input, and one all-reduce sums the partial outputs (the bias is
  added once, after it);
- the embedding and the LM head are vocabulary-parallel: each rank holds a
  slice of the vocabulary rows; embedding rows outside it are zeros and an
  all-reduce fills them, and the LM head's logits are gathered.

With fewer KV heads than ranks, KV heads are replicated: rank r serves KV
head r * kv_heads // size, so each rank's query heads still read their
own group's KV head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group; None on one rank

    def shard(self, total: int) -> tuple[int, int]:
        """(first, count) of this rank's even share of `total` rows."""
        if total % self.size:
            raise ValueError(f"{total} does not split evenly over {self.size} tensor-parallel ranks")
        count = total // self.size
        return self.rank * count, count

    def vocab_shard(self, vocab: int) -> tuple[int, int]:
        """(first, count) of this rank's vocabulary rows. Shards are equal
        (the gathered logits are cut back to `vocab`), so the last one may
        run past the vocabulary: those rows are zeros."""
        count = -(-vocab // self.size)
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank serves."""
        if num_kv_heads >= self.size:
            return self.shard(num_kv_heads)
        if self.size % num_kv_heads:
            raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over {self.size} ranks")
        return self.rank * num_kv_heads // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """[rows, vocab shard] on every rank -> [rows, vocab] on every rank."""
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        dist.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab]


SINGLE = TensorParallel()


def embed(ids: torch.Tensor, weight_shard: torch.Tensor, first: int, tp: TensorParallel) -> torch.Tensor:
    """Vocabulary-parallel embedding lookup: rows this rank holds, zeros for
    the others, summed over the ranks."""
    if tp.size == 1:
        return torch.nn.functional.embedding(ids, weight_shard)
    local = ids - first
    outside = (local < 0) | (local >= weight_shard.shape[0])
    x = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight_shard)
    x.masked_fill_(outside[:, None], 0)
    return tp.all_reduce(x)
