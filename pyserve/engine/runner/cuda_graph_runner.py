"""Decode forward passes captured as CUDA graphs and replayed.

A decode step of a small model is mostly kernel launch overhead: hundreds of
small kernels, each launched from Python. A CUDA graph records the launches
once and replays them with one call. A graph replays fixed shapes at fixed
addresses, so one graph is captured per padded batch size (1, 2, 4, 8, then
steps of 8) over static input buffers; a decode batch is copied into the
buffers of the smallest size that fits, the spare rows padded with the
reserved KV slot 0 (never handed out, so padded rows may read and write it).
Larger batches, and extend batches, run eagerly.

The attention backend owns the static kv tables (see TritonAttention); the
kernels read sequence lengths on the device, so a graph captured over
one-token sequences replays any lengths.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from pyserve.model.attention.triton_backend import TritonAttention
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.causal_lm import CausalLM

logger = logging.getLogger("pyserve.engine")


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... below max_bs, and max_bs itself."""
    sizes = [1, 2, 4, 8] + list(range(16, max_bs, 8))
    return [s for s in sizes if s < max_bs] + [max_bs]


class CudaGraphRunner:
    def __init__(self, model: CausalLM, attention: TritonAttention, max_bs: int, context_len: int):
        self.model = model
        self.attention = attention
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = max_bs
        device = attention.device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output buffer

        free_before = torch.cuda.mem_get_info(device)[0]
        start = time.perf_counter()
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=device)
            self.positions = torch.zeros(max_bs, dtype=torch.long, device=device)
            self.out_cache_loc = torch.zeros(max_bs, dtype=torch.long, device=device)
            self.window_out_cache_loc = torch.zeros(max_bs, dtype=torch.long, device=device)  # a sliding pool's
            self.logits_indices = torch.arange(max_bs, dtype=torch.long, device=device)
            attention.init_cuda_graph_state(max_bs)
            # A graph reads the cos/sin tensors it was captured with, so the
            # cache must already cover every position a sequence can reach.
            dtype = model.embed_tokens.weight.dtype
            model.rotary.cos_sin(self.positions[:1], context_len, dtype)
            pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(device)
            # Largest first: the smaller graphs reuse its memory in the shared pool.
            for bs in reversed(self.batch_sizes):
                self._capture(bs, pool, stream)
        torch.cuda.synchronize(device)
        logger.info(
            "CUDA graphs captured for decode batch sizes %s in %.2f s (%.0f MiB)",
            self.batch_sizes,
            time.perf_counter() - start,
            (free_before - torch.cuda.mem_get_info(device)[0]) / (1 << 20),
        )

    def _static_batch(self, bs: int) -> ForwardBatch:
        kv_indptr, kv_indices, window_kv_indices = self.attention.cuda_graph_kv_tables(bs)
        return ForwardBatch(
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            extend_lens=[1] * bs,
            seq_lens=[1] * bs,  # as captured; replays bring their lengths in kv_indptr
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            logits_indices=self.logits_indices[:bs],
            is_decode=True,
            window_out_cache_loc=None if window_kv_indices is None else self.window_out_cache_loc[:bs],
            window_kv_indices=window_kv_indices,
        )

    def _capture(self, bs: int, pool, stream: torch.cuda.Stream) -> None:
        batch = self._static_batch(bs)
        # Run once outside the graph: compiles the Triton kernels and lets
        # cuBLAS pick its algorithms, neither of which may happen in a capture.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.model(batch, self.attention)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.logits[bs] = self.model(batch, self.attention)
        self.graphs[bs] = graph

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.is_decode
            and batch.batch_size <= self.max_bs
            and batch.logits_indices.numel() == batch.batch_size
        )

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [B, vocab], as the eager forward returns them."""
        n = batch.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        with torch.inference_mode():
            self.input_ids[:n].copy_(batch.input_ids)
            self.positions[:n].copy_(batch.positions)
            self.out_cache_loc[:n].copy_(batch.out_cache_loc)
            # Spare rows write their K/V to slot 0; their token ids and
            # positions are left from earlier batches, valid either way.
            self.out_cache_loc[n:bs].zero_()
            if batch.window_out_cache_loc is not None:
                self.window_out_cache_loc[:n].copy_(batch.window_out_cache_loc)
                self.window_out_cache_loc[n:bs].zero_()
            self.attention.fill_cuda_graph_kv_tables(batch, bs)
            self.graphs[bs].replay()
            # The output buffer is overwritten by the next replay.
            return self.logits[bs][:n].clone()
