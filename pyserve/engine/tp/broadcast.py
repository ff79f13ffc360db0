"""Rank 0 sends each step's forward batch to the other tensor-parallel ranks.

A step costs two broadcasts whatever the batch holds: a fixed header of
sizes on the CPU group (tp/group.py), then every field of the ForwardBatch
back to back as one int64 tensor on the model's device and group (NCCL on
CUDA: no copy through the host, and the ids rank 0 resolved from the
previous step on the device travel as they are); a third carries the rows
a step's prompts give as embeddings, in float32, when it has any. The other ranks rebuild
the same batch and run the same forward, joining the model's collectives.
A header of all -1 tells them to stop. Before the first step, rank 0
tells them the KV cache's size (it decides it; every rank holds as many
pages), and every rank says it is ready. A LoRA adapter loaded at run
time reaches them the same way, between steps: a header saying which slot
and how long its path is, then the path (each rank reads its own shard).
So do the K/V copies that move a draft tree's accepted nodes to their
sequence's next slots after a verify step (speculative/tree.py): a
header with their count, then the slots on the model's device. A weight
sync operation (runner/weight_sync.py) goes as JSON text, as a path does;
every rank performs it and rank 0 gathers their outcomes.
"""

from __future__ import annotations

import msgspec
import torch
import torch.distributed as dist

from dataclasses import dataclass

from pyserve.engine.runner.weight_sync import Operation, Outcome
from pyserve.engine.tp.group import Membership
from pyserve.lora.batch import LoraBatch
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import SlotCopies

# tokens, sequences, is_decode, logits rows, kv slots, whether tokens run under adapters, whether
# there are sliding slots, rows given as embeddings and their width
_HEADER = 9
_STOP = -1
_LOAD_ADAPTER = -2  # then the slot and the path's length in bytes
_COPY_KV = -3  # then the copies' count and whether they carry sliding slots
_SWAP_WEIGHTS = -4  # then the checkpoint path's length in bytes
_WEIGHT_SYNC = -5  # then the operation's length in bytes


@dataclass(frozen=True)
class AdapterLoad:
    """Rank 0's word to put the adapter at `path` in `slot`."""

    slot: int
    path: str


@dataclass(frozen=True)
class WeightSwap:
    """Rank 0's word to copy the checkpoint at `path` into the served model."""

    path: str


def header(batch: ForwardBatch) -> torch.Tensor:
    """The batch's sizes, on the CPU."""
    embedded = batch.input_embeds.shape if batch.input_embeds is not None else (0, 0)
    return torch.tensor([batch.input_ids.numel(), batch.batch_size, int(batch.is_decode),
                         batch.logits_indices.numel(), batch.kv_indices.numel(), int(batch.lora is not None),
                         int(batch.window_kv_indices is not None), *embedded],
                        dtype=torch.long)


def payload(batch: ForwardBatch) -> torch.Tensor:
    """Every field of the batch as one int64 tensor on its device."""
    device = batch.input_ids.device
    lists = torch.tensor(batch.extend_lens + batch.seq_lens, dtype=torch.long)
    if device.type == "cuda":
        lists = lists.pin_memory().to(device, non_blocking=True)
    adapters = [batch.lora.per_token] if batch.lora is not None else []
    window = [batch.window_out_cache_loc, batch.window_kv_indices] if batch.window_kv_indices is not None else []
    embedded = [batch.embeds_rows] if batch.embeds_rows is not None else []
    return torch.cat([batch.input_ids, batch.positions, batch.out_cache_loc, lists, batch.kv_indptr,
                      batch.kv_indices, batch.logits_indices, *adapters, *window, *embedded])


def payload_size(sizes: list[int]) -> int:
    tokens, seqs, _, logits_rows, kv_slots, lora, window, embedded, _ = sizes
    return (3 + lora + window) * tokens + 3 * seqs + 1 + (1 + window) * kv_slots + logits_rows + embedded


def unpack(sizes: list[int], data: torch.Tensor, input_embeds: torch.Tensor | None = None) -> ForwardBatch:
    """The batch whose header is `sizes` from its payload (and the rows
    given as embeddings); tensors are views of it."""
    tokens, seqs, is_decode, logits_rows, kv_slots, lora, window, embedded, _ = sizes
    split = [tokens, tokens, tokens, 2 * seqs, seqs + 1, kv_slots, logits_rows, lora * tokens, window * tokens,
             window * kv_slots, embedded]
    (input_ids, positions, out_cache_loc, lists, kv_indptr, kv_indices, logits_indices, per_token,
     window_out_cache_loc, window_kv_indices, embeds_rows) = data.split(split)
    lists = lists.tolist()
    return ForwardBatch(
        input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc, extend_lens=lists[:seqs],
        seq_lens=lists[seqs:], kv_indptr=kv_indptr, kv_indices=kv_indices, logits_indices=logits_indices,
        is_decode=bool(is_decode), lora=LoraBatch.of_tokens(per_token) if lora else None,
        window_out_cache_loc=window_out_cache_loc if window else None,
        window_kv_indices=window_kv_indices if window else None,
        input_embeds=input_embeds, embeds_rows=embeds_rows if embedded else None,
    )


def copies_message(copies: SlotCopies) -> tuple[torch.Tensor, torch.Tensor]:
    """The header (on the CPU) and the slots (on their device) that carry `copies`."""
    windowed = copies.window_src is not None
    sizes = torch.tensor([_COPY_KV, copies.src.numel(), int(windowed)] + [0] * (_HEADER - 3))
    slots = [copies.src, copies.dst] + ([copies.window_src, copies.window_dst] if windowed else [])
    return sizes, torch.cat(slots)


def copies_size(sizes: list[int]) -> int:
    return (4 if sizes[2] else 2) * sizes[1]


def unpack_copies(sizes: list[int], slots: torch.Tensor) -> SlotCopies:
    return SlotCopies(*slots.split(sizes[1]))


class StepChannel:
    """Rank 0's side sends; the other ranks' side receives, in the same order."""

    def __init__(self, member: Membership):
        self.member = member

    def _broadcast_header(self, values: torch.Tensor) -> None:
        dist.broadcast(values, src=0, group=self.member.control)

    # rank 0

    def send(self, batch: ForwardBatch) -> None:
        """Hand the step (on rank 0's device, ids resolved) to the other ranks."""
        self._broadcast_header(header(batch))
        dist.broadcast(payload(batch), src=0, group=self.member.tp.group)
        if batch.input_embeds is not None:
            dist.broadcast(batch.input_embeds.float().contiguous(), src=0, group=self.member.tp.group)

    def send_stop(self) -> None:
        self._broadcast_header(torch.full((_HEADER,), _STOP, dtype=torch.long))

    def send_adapter_load(self, slot: int, path: str) -> None:
        self._send_path(_LOAD_ADAPTER, slot, path)

    def send_weight_swap(self, path: str) -> None:
        self._send_path(_SWAP_WEIGHTS, 0, path)

    def send_weight_sync(self, op: Operation) -> None:
        self._send_text(_WEIGHT_SYNC, 0, msgspec.json.encode(op))

    def gather(self, outcome: Outcome) -> list[Outcome]:
        """Every rank's outcome, in rank order."""
        outcomes = [None] * dist.get_world_size(self.member.control)
        dist.gather_object(outcome, outcomes, group=self.member.control, group_dst=0)
        return outcomes

    def _send_path(self, kind: int, value: int, path: str) -> None:
        self._send_text(kind, value, path.encode())

    def _send_text(self, kind: int, value: int, text: bytes) -> None:
        data = torch.tensor(list(text), dtype=torch.uint8)
        self._broadcast_header(torch.tensor([kind, value, data.numel()] + [0] * (_HEADER - 3)))
        dist.broadcast(data, src=0, group=self.member.control)

    def send_kv_copies(self, copies: SlotCopies) -> None:
        """Have the other ranks copy the same K/V slots in their caches."""
        sizes, slots = copies_message(copies)
        self._broadcast_header(sizes)
        dist.broadcast(slots, src=0, group=self.member.tp.group)

    def send_value(self, value: int) -> None:
        self._broadcast_header(torch.tensor([value] * _HEADER, dtype=torch.long))

    # ranks 1..N-1

    def receive(self) -> ForwardBatch | AdapterLoad | WeightSwap | SlotCopies | Operation | None:
        """The next step's batch on this rank's device, an adapter to load,
        a checkpoint to swap in, K/V slots to copy, a weight sync operation,
        or None when rank 0 stops."""
        sizes = torch.empty(_HEADER, dtype=torch.long)
        self._broadcast_header(sizes)
        sizes = sizes.tolist()
        if sizes[0] == _STOP:
            return None
        if sizes[0] in (_LOAD_ADAPTER, _SWAP_WEIGHTS, _WEIGHT_SYNC):
            data = torch.empty(sizes[2], dtype=torch.uint8)
            dist.broadcast(data, src=0, group=self.member.control)
            if sizes[0] == _WEIGHT_SYNC:
                return msgspec.json.decode(data.numpy().tobytes(), type=Operation)
            path = bytes(data.tolist()).decode()
            return AdapterLoad(sizes[1], path) if sizes[0] == _LOAD_ADAPTER else WeightSwap(path)
        if sizes[0] == _COPY_KV:
            slots = torch.empty(copies_size(sizes), dtype=torch.long, device=self.member.device)
            dist.broadcast(slots, src=0, group=self.member.tp.group)
            return unpack_copies(sizes, slots)
        data = torch.empty(payload_size(sizes), dtype=torch.long, device=self.member.device)
        dist.broadcast(data, src=0, group=self.member.tp.group)
        embeds = None
        if sizes[7]:
            embeds = torch.empty(sizes[7], sizes[8], dtype=torch.float32, device=self.member.device)
            dist.broadcast(embeds, src=0, group=self.member.tp.group)
        return unpack(sizes, data, embeds)

    def receive_value(self) -> int:
        values = torch.empty(_HEADER, dtype=torch.long)
        self._broadcast_header(values)
        return int(values[0])

    def send_outcome(self, outcome: Outcome) -> None:
        """This rank's part of rank 0's `gather`."""
        dist.gather_object(outcome, None, group=self.member.control, group_dst=0)

    # every rank

    def barrier(self) -> None:
        dist.barrier(group=self.member.control)
