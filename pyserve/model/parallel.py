"""Tensor parallelism: how a rank's shard of the model is cut, and the
collectives the model needs (torch.distributed: NCCL on CUDA, gloo on CPU).

Megatron's split, as SGLang and vLLM use it:
- q/k/v and gate/up are column-parallel: each rank computes its own heads
  (its slice of the intermediate size), no communication;
- o_proj and down_proj are row-parallel: each rank multiplies its slice of
  the input, and one all-reduce sums the partial outputs (rank 0 alone
  holds the bias, so it is added once);
- the embedding and the LM head are vocabulary-parallel: each rank holds a
  slice of the vocabulary rows; embedding rows outside it are zeros and an
  all-reduce fills them, and the LM head's logits are gathered.

Attention heads go to ranks by whole KV groups (a KV head and the query
heads that read it), as evenly as they divide: 3 KV heads on 2 ranks are
1 and 2. With fewer KV heads than ranks, KV heads are replicated: each is
served by size / kv_heads ranks, which split its query heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pyserve.model.config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group; None on one rank

    def shard(self, total: int, what: str = "rows") -> range:
        """This rank's even share of `total`."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) do not split evenly over {self.size} tensor-parallel ranks")
        count = total // self.size
        return range(self.rank * count, (self.rank + 1) * count)

    def vocab_shard(self, vocab: int) -> range:
        """This rank's vocabulary rows. Shards are equal (the gathered
        logits are cut back to `vocab`), so the last one may run past the
        vocabulary: those rows are zeros."""
        count = -(-vocab // self.size)
        return range(self.rank * count, (self.rank + 1) * count)

    def attention_heads(self, heads: int, kv_heads: int) -> tuple[range, range]:
        """(query heads, KV heads) this rank serves; see the module's docstring."""
        if heads % kv_heads:
            raise ValueError(f"{heads} attention heads do not form groups over {kv_heads} KV heads")
        if kv_heads >= self.size:
            kv = range(self.rank * kv_heads // self.size, (self.rank + 1) * kv_heads // self.size)
            group = heads // kv_heads
            return range(kv.start * group, kv.stop * group), kv
        if self.size % kv_heads or heads % self.size:
            raise ValueError(f"{kv_heads} KV heads and {heads} attention heads cannot be split over "
                             f"{self.size} tensor-parallel ranks (each KV head replicated on whole ranks)")
        per_rank = heads // self.size
        kv_head = self.rank * kv_heads // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank), range(kv_head, kv_head + 1)

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


@dataclass(frozen=True)
class ModelShard:
    """The part of a model one rank holds: ranges into the checkpoint's heads,
    intermediate size and vocabulary (the whole of each on one rank)."""

    tp: TensorParallel
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range

    @classmethod
    def of(cls, config: ModelConfig, tp: TensorParallel = SINGLE) -> ModelShard:
        q_heads, kv_heads = tp.attention_heads(config.num_attention_heads, config.num_key_value_heads)
        return cls(tp, q_heads, kv_heads, tp.shard(config.intermediate_size, "the intermediate size"),
                   tp.vocab_shard(config.vocab_size))


def largest_kv_share(config: ModelConfig, size: int) -> int:
    """The most KV heads any of `size` ranks holds: what a rank's KV cache is sized by."""
    return max(len(TensorParallel(r, size).attention_heads(config.num_attention_heads,
                                                            config.num_key_value_heads)[1]) for r in range(size))


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
