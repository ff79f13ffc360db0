"""Rank 0 sends each step's forward batch to the other tensor-parallel ranks.

A ForwardBatch travels as one int64 tensor: a fixed header of sizes, then
every field back to back, so a step costs two broadcasts (header, then the
payload) whatever the batch holds. The other ranks rebuild the same batch
and run the same forward, joining the model's collectives. A header of
all -1 tells them to stop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.parallel import TensorParallel

# tokens, sequences, is_decode, logits rows, kv slots
_HEADER = 5
_STOP = torch.full((_HEADER,), -1, dtype=torch.long)


def pack(batch: ForwardBatch) -> torch.Tensor:
    """The batch as one int64 tensor on its device: header, then fields."""
    device = batch.input_ids.device
    header = torch.tensor(
        [batch.input_ids.numel(), batch.batch_size, int(batch.is_decode), batch.logits_indices.numel(),
         batch.kv_indices.numel()], dtype=torch.long, device=device)
    lists = torch.tensor(batch.extend_lens + batch.seq_lens, dtype=torch.long, device=device)
    return torch.cat([header, batch.input_ids, batch.positions, batch.out_cache_loc, lists, batch.kv_indptr,
                      batch.kv_indices, batch.logits_indices])


def unpack(data: torch.Tensor) -> ForwardBatch:
    tokens, seqs, is_decode, logits_rows, kv_slots = data[:_HEADER].tolist()
    sizes = [tokens, tokens, tokens, seqs, seqs, seqs + 1, kv_slots, logits_rows]
    (input_ids, positions, out_cache_loc, extend_lens, seq_lens, kv_indptr, kv_indices,
     logits_indices) = data[_HEADER:].split(sizes)
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
        extend_lens=extend_lens.tolist(), seq_lens=seq_lens.tolist(), kv_indptr=kv_indptr,
        kv_indices=kv_indices, logits_indices=logits_indices, is_decode=bool(is_decode),
    )


def send_batch(batch: ForwardBatch, tp: TensorParallel) -> None:
    """On rank 0: hand the step to the other ranks."""
    data = pack(batch)
    dist.broadcast(data[:_HEADER].clone(), src=0, group=tp.group)
    dist.broadcast(data, src=0, group=tp.group)


def send_stop(tp: TensorParallel, device: torch.device) -> None:
    dist.broadcast(_STOP.to(device), src=0, group=tp.group)


def receive_batch(tp: TensorParallel, device: torch.device) -> ForwardBatch | None:
    """On the other ranks: the next step's batch, or None when rank 0 stops."""
    header = torch.empty(_HEADER, dtype=torch.long, device=device)
    dist.broadcast(header, src=0, group=tp.group)
    if bool((header == -1).all()):
        return None
    tokens, seqs, _, logits_rows, kv_slots = header.tolist()
    data = torch.empty(_HEADER + 3 * tokens + 3 * seqs + 1 + kv_slots + logits_rows, dtype=torch.long,
                       device=device)
    dist.broadcast(data, src=0, group=tp.group)
    return unpack(data)
