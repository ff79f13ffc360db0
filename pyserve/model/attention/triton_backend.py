"""Attention with the Triton kernels: split-KV decode and paged extend.

The GPU production path. Both kernels read K/V straight from the pool
through `batch.kv_indices`, so nothing is gathered or padded per layer;
a sliding window only moves where they start reading.
`prepare` builds what the kernels need besides the batch: the query row
offsets of an extend batch, the split scratch of a decode batch.

For CUDA graphs the backend also owns static kv tables (`kv_indptr`,
`kv_indices` sized for max_bs sequences of context_len tokens): a graph is
captured reading them, and before each replay the real batch's tables are
copied in, padded rows pointing at the reserved slot 0 (verify graphs'
rows of several tokens get their padding tokens' slot-0 entries placed
after each row's own, on the device). With a sliding
pool (kv_buffer.py) there is a second static `kv_indices` table for the
sliding layers' slots, filled the same way.
"""

from __future__ import annotations

import os

import torch

from pyserve.model.attention.base import AttentionBackend, check_options
from pyserve.model.attention.triton_decode import decode_attention, decode_scratch
from pyserve.model.attention.triton_extend import extend_attention
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.step_plan import TORCH_STEP, StepPlan

# Decode programs to aim for, per streaming multiprocessor: enough that a
# small batch still occupies the whole GPU. Measured on an H100 (bf16, 8 kv
# heads of 128): at batch 1 to 8, 8 to 16 splits run the kernel about 4x
# faster than one; at batch 64 the count changes nothing (~2.2 TB/s of KV).
_PROGRAMS_PER_SM = 4


class TritonAttention(AttentionBackend):
    def __init__(self, kv_buffer, num_heads: int, context_len: int, max_kv_splits: int = 16):
        """kv_buffer: anything with per-layer `k_buffer` / `v_buffer` lists of
        [num_slots, kv_heads, head_dim] tensors."""
        self.kv_buffer = kv_buffer
        k0 = kv_buffer.k_buffer[0]
        self.device = k0.device
        if self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the triton attention backend needs CUDA (on CPU use --attention-backend torch)")
        self.num_heads = num_heads
        self.num_kv_heads, self.head_dim = k0.shape[1], k0.shape[2]
        self.v_dim = kv_buffer.v_buffer[0].shape[2]  # narrower than K's in a latent cache
        self.context_len = context_len
        self.max_kv_splits = max_kv_splits
        self._target_programs = 0  # 0: always max_kv_splits (the CPU interpreter in tests)
        if self.device.type == "cuda":
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._target_programs = _PROGRAMS_PER_SM * sms
        self._batch: ForwardBatch | None = None
        self._qo_indptr: torch.Tensor | None = None  # extend: [B + 1] rows of each sequence's new tokens
        self._max_new = 0
        self._mid: tuple[torch.Tensor, torch.Tensor] | None = None  # decode: split scratch
        self._num_splits = 1
        self._graph_indptr: torch.Tensor | None = None
        self._graph_indices: torch.Tensor | None = None
        self._arange: torch.Tensor | None = None  # 0..max_bs

    def num_kv_splits(self, batch_size: int) -> int:
        """Pieces per sequence in a decode batch: as many as it takes for
        batch * kv_heads * splits programs to fill the GPU. A function of the
        batch size alone, so a captured graph keeps its split count."""
        if not self._target_programs:
            return self.max_kv_splits
        wanted = -(-self._target_programs // (batch_size * self.num_kv_heads))
        return max(1, min(self.max_kv_splits, wanted))

    def prepare(self, batch: ForwardBatch, plan: StepPlan = TORCH_STEP) -> None:
        # The plan's CPU thread counts do not concern the GPU kernels.
        if plan.native_extend_attention:
            raise ValueError("the Triton backend has no native extend kernel")
        self._batch = batch
        if batch.is_decode:
            bs = batch.batch_size
            self._mid = decode_scratch(bs, self.num_heads, self.v_dim, self.max_kv_splits, self.device)
            self._num_splits = self.num_kv_splits(bs)
            return
        self._max_new = max(batch.extend_lens)
        if batch.qo_indptr is not None:
            self._qo_indptr = batch.qo_indptr
            return
        indptr = [0]
        for n in batch.extend_lens:
            indptr.append(indptr[-1] + n)
        self._qo_indptr = torch.tensor(indptr, dtype=torch.long).to(self.device, non_blocking=True)

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch, scale: float, *, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The options are kernel arguments, so a CUDA graph captures them
        as they are: a layer's window and soft-cap are its constants, its
        sinks a tensor that must stay where it is (a parameter)."""
        check_options(q.shape[1], window, softcap, sinks)
        k_cache, v_cache = self.store_kv(k, v, layer_id, batch)
        kv_indices = self.slot_tables(layer_id, batch)[1]
        out = torch.empty(*q.shape[:-1], self.v_dim, dtype=q.dtype, device=q.device)
        options = dict(window=window, softcap=softcap, sinks=sinks)
        if batch.is_decode:
            mid_o, mid_lse = self._mid
            decode_attention(q, k_cache, v_cache, out, batch.kv_indptr, kv_indices, mid_o, mid_lse,
                             self._num_splits, scale, **options)
        else:
            extend_attention(q, k_cache, v_cache, out, self._qo_indptr, batch.kv_indptr, kv_indices,
                             self._max_new, scale, **options)
        return out

    # CUDA graphs (see cuda_graph_runner.py)

    def init_cuda_graph_state(self, max_bs: int, max_padding: int = 0) -> None:
        """Allocate the static kv tables for batches of up to max_bs
        sequences, and `max_padding` padding tokens (verify graphs)."""
        size = max_bs * self.context_len + max_padding
        self._graph_indptr = torch.zeros(max_bs + 1, dtype=torch.long, device=self.device)
        self._graph_indices = torch.zeros(size, dtype=torch.long, device=self.device)
        self._graph_window_indices = torch.zeros_like(self._graph_indices) \
            if getattr(self.kv_buffer, "window_layers", None) else None
        self._arange = torch.arange(max_bs + 1, dtype=torch.long, device=self.device)

    def cuda_graph_kv_tables(self, bs: int, row_tokens: int = 1
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(kv_indptr, kv_indices, window_kv_indices: None without a sliding
        pool) for capturing a graph of `bs` rows of `row_tokens` new tokens,
        set to bs sequences of row_tokens tokens in slot 0; replays refill them."""
        indptr = self._graph_indptr[: bs + 1]
        torch.mul(self._arange[: bs + 1], row_tokens, out=indptr)
        self._graph_indices[: bs * row_tokens].zero_()
        if self._graph_window_indices is not None:
            self._graph_window_indices[: bs * row_tokens].zero_()
        return indptr, self._graph_indices, self._graph_window_indices

    def fill_cuda_graph_kv_tables(self, batch: ForwardBatch, bs: int) -> None:
        """Copy a decode batch's kv tables into the static ones, rows past its
        batch size padded as one-token sequences in the reserved slot 0.
        Device-side copies only: no wait on the GPU."""
        n = batch.batch_size
        total = batch.kv_indices.numel()
        self._graph_indptr[: n + 1].copy_(batch.kv_indptr)
        self._graph_indices[:total].copy_(batch.kv_indices)
        if self._graph_window_indices is not None:
            self._graph_window_indices[:total].copy_(batch.window_kv_indices)
        if bs > n:
            torch.add(self._arange[1 : bs - n + 1], total, out=self._graph_indptr[n + 1 : bs + 1])
            self._graph_indices[total : total + bs - n].zero_()
            if self._graph_window_indices is not None:
                self._graph_window_indices[total : total + bs - n].zero_()

    def fill_cuda_graph_row_tables(self, batch: ForwardBatch, bs: int, row_tokens: int) -> None:
        """Copy the kv tables of a batch whose rows have at most `row_tokens`
        new tokens into the static ones of a graph of `bs` rows of exactly
        row_tokens: each row's table gets one slot-0 entry per padding token
        after its own, and rows past the batch are row_tokens padding tokens."""
        n = batch.batch_size
        padding = [row_tokens - e for e in batch.extend_lens] + [row_tokens] * (bs - n)
        indptr = [0]
        for length, pad in zip(batch.seq_lens + [0] * (bs - n), padding):
            indptr.append(indptr[-1] + length + pad)
        shift = [0]  # padding entries before each row's own
        for pad in padding[: n - 1]:
            shift.append(shift[-1] + pad)
        host = torch.tensor(indptr + shift + batch.seq_lens, dtype=torch.long)
        dev = host.to(self.device, non_blocking=True)
        self._graph_indptr[: bs + 1].copy_(dev[: bs + 1])
        total = batch.kv_indices.numel()
        # Where each of the batch's entries goes: its index plus its row's shift.
        dest = torch.repeat_interleave(dev[bs + 1 : bs + 1 + n], dev[bs + 1 + n :], output_size=total)
        dest += torch.arange(total, device=self.device)
        tables = [(self._graph_indices, batch.kv_indices)]
        if self._graph_window_indices is not None:
            tables.append((self._graph_window_indices, batch.window_kv_indices))
        for static, own in tables:
            static[: indptr[-1]].zero_()
            static.index_copy_(0, dest, own)
