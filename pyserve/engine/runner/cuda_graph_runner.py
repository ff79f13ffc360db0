"""Decode and verify forward passes captured as CUDA graphs and replayed.

A decode step of a small model is mostly kernel launch overhead: hundreds of
small kernels, each launched from Python. A CUDA graph records the launches
once and replays them with one call. A graph replays fixed shapes at fixed
addresses, so one graph is captured per padded batch size (1, 2, 4, 8, then
steps of 8) and row length over static input buffers; a batch is copied into
the buffers of the smallest size that fits, the spare rows padded with the
reserved KV slot 0 (never handed out, so padded rows may read and write it).

Decode graphs run rows of one new token. With speculative decoding there
are verify graphs too, rows of `verify_tokens` new tokens (a sequence's
newest token and its drafts): every row of a batch whose rows have at most
that many is padded to exactly that many, the padding tokens after the
row's own, so that causal attention keeps them out of the real tokens'
view. They write their K/V to slot 0, and the row's kv table gets one
slot-0 entry per padding token. Logits come out for every padded row and
the batch's own are gathered. Larger batches, and longer rows, run eagerly.

The attention backend owns the static kv tables (see TritonAttention); the
kernels read sequence lengths on the device, so a graph captured over
short sequences replays any lengths.

With an EAGLE-3 head the graphs also keep the hidden states entering its
layers (AuxCapture): captured once into static tensors, gathered per replay.

`replay_on_host` is for tests on a CPU (the Triton interpreter): there a
"graph" is the captured call itself, rerun over the same static buffers,
which checks everything here but the recording.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from pyserve.model.attention.triton_backend import TritonAttention
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.causal_lm import AuxCapture, CausalLM

logger = logging.getLogger("pyserve.engine")

# Tokens a verify graph holds at most: speculation pays at small batches,
# and each graph keeps its logits ([tokens, vocab] float32).
VERIFY_GRAPH_TOKENS = 128


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... below max_bs, and max_bs itself."""
    sizes = [1, 2, 4, 8] + list(range(16, max_bs, 8))
    return [s for s in sizes if s < max_bs] + [max_bs]


Outputs = tuple[torch.Tensor, list[torch.Tensor]]  # logits of every padded row, captured hidden states


class CudaGraphRunner:
    def __init__(self, model: CausalLM, attention: TritonAttention, max_bs: int, context_len: int,
                 verify_tokens: int = 0, aux_layers: frozenset[int] | None = None,
                 replay_on_host: bool = False):
        """`verify_tokens`: the row length of the verify graphs (0: none);
        `aux_layers`: the layers whose entering hidden states every graph keeps."""
        self.model = model
        self.attention = attention
        self.aux_layers = aux_layers
        self.replay_on_host = replay_on_host
        self.row_lengths = [1] + ([verify_tokens] if verify_tokens > 1 else [])
        self.batch_sizes = {1: capture_batch_sizes(max_bs)}
        if verify_tokens > 1:
            self.batch_sizes[verify_tokens] = capture_batch_sizes(max(1, min(max_bs, VERIFY_GRAPH_TOKENS // verify_tokens)))
        self.graphs: dict[tuple[int, int], Callable[[], Outputs]] = {}  # (row length, batch size): replay
        # A recorded graph reads its static batch's tensors at the addresses
        # they had when captured: the batches live as long as the graphs.
        self.static_batches: dict[tuple[int, int], ForwardBatch] = {}
        device = attention.device
        max_tokens = max(max(sizes) * r for r, sizes in self.batch_sizes.items())
        max_padding = max(max(sizes) * r for r, sizes in self.batch_sizes.items() if r > 1) if verify_tokens > 1 else 0

        free_before = self._free_memory()
        start = time.perf_counter()
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
            self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
            self.out_cache_loc = torch.zeros(max_tokens, dtype=torch.long, device=device)
            self.window_out_cache_loc = torch.zeros(max_tokens, dtype=torch.long, device=device)  # a sliding pool's
            self.rows = torch.arange(max_tokens + 1, dtype=torch.long, device=device)
            attention.init_cuda_graph_state(max(self.batch_sizes[1]), max_padding)
            # A graph reads the cos/sin tensors it was captured with, so the
            # cache must already cover every position a sequence can reach.
            dtype = model.embed_tokens.weight.dtype
            model.rotary.cos_sin(self.positions[:1], context_len, dtype)
            pool = None if replay_on_host else torch.cuda.graph_pool_handle()
            stream = None if replay_on_host else torch.cuda.Stream(device)
            # Largest first: the smaller graphs reuse its memory in the shared pool.
            for r in reversed(self.row_lengths):
                for bs in reversed(self.batch_sizes[r]):
                    self.graphs[r, bs] = self._capture(r, bs, pool, stream)
        if not replay_on_host:
            torch.cuda.synchronize(device)
        logger.info(
            "CUDA graphs captured for %s in %.2f s (%.0f MiB)",
            "; ".join(f"{'decode' if r == 1 else f'verify rows of {r} tokens'}, batch sizes {self.batch_sizes[r]}"
                      for r in self.row_lengths),
            time.perf_counter() - start, (free_before - self._free_memory()) / (1 << 20),
        )

    def _free_memory(self) -> int:
        return 0 if self.replay_on_host else torch.cuda.mem_get_info(self.attention.device)[0]

    def _static_batch(self, row_tokens: int, bs: int) -> ForwardBatch:
        kv_indptr, kv_indices, window_kv_indices = self.attention.cuda_graph_kv_tables(bs, row_tokens)
        tokens = bs * row_tokens
        return ForwardBatch(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            out_cache_loc=self.out_cache_loc[:tokens],
            extend_lens=[row_tokens] * bs,
            seq_lens=[row_tokens] * bs,  # as captured; replays bring their lengths in kv_indptr
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            logits_indices=self.rows[:tokens],
            is_decode=row_tokens == 1,
            window_out_cache_loc=None if window_kv_indices is None else self.window_out_cache_loc[:tokens],
            window_kv_indices=window_kv_indices,
            qo_indptr=None if row_tokens == 1 else self.rows[: bs + 1] * row_tokens,
        )

    def _capture(self, row_tokens: int, bs: int, pool, stream) -> Callable[[], Outputs]:
        batch = self.static_batches[row_tokens, bs] = self._static_batch(row_tokens, bs)

        def run() -> Outputs:
            capture = AuxCapture(self.aux_layers) if self.aux_layers is not None else None
            logits = self.model(batch, self.attention, capture=capture)
            return logits, capture.states if capture is not None else []

        if self.replay_on_host:
            return run
        # Run once outside the graph: compiles the Triton kernels and lets
        # cuBLAS pick its algorithms, neither of which may happen in a capture.
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            outputs = run()

        def replay() -> Outputs:
            graph.replay()
            return outputs

        return replay

    def _graph_for(self, batch: ForwardBatch, capture: AuxCapture | None) -> tuple[int, int] | None:
        """(row length, batch size) of the graph that replays `batch`, or None."""
        if capture is not None and capture.layers != self.aux_layers:
            return None
        n = batch.batch_size
        if batch.is_decode:
            row_tokens = 1
        elif len(self.row_lengths) > 1 and max(batch.extend_lens) <= self.row_lengths[1]:
            row_tokens = self.row_lengths[1]
        else:
            return None
        sizes = self.batch_sizes[row_tokens]
        return (row_tokens, sizes[bisect.bisect_left(sizes, n)]) if n <= sizes[-1] else None

    def can_run(self, batch: ForwardBatch, capture: AuxCapture | None = None) -> bool:
        return self._graph_for(batch, capture) is not None

    def replay(self, batch: ForwardBatch, capture: AuxCapture | None = None) -> torch.Tensor:
        """Float32 logits [len(batch.logits_indices), vocab], as the eager
        forward returns them; `capture` filled as the eager forward fills it."""
        row_tokens, bs = self._graph_for(batch, capture)
        with torch.inference_mode():
            if row_tokens == 1:
                n = batch.batch_size
                token_rows = self.rows[:n]
                self._fill(self.input_ids, batch.input_ids, n, bs)
                self._fill(self.positions, batch.positions, n, bs)
                self._fill(self.out_cache_loc, batch.out_cache_loc, n, bs)
                if batch.window_out_cache_loc is not None:
                    self._fill(self.window_out_cache_loc, batch.window_out_cache_loc, n, bs)
                self.attention.fill_cuda_graph_kv_tables(batch, bs)
            else:
                token_rows = self._token_rows(batch, row_tokens)
                tokens = bs * row_tokens
                self._scatter(self.input_ids, batch.input_ids, token_rows, tokens)
                self._scatter(self.positions, batch.positions, token_rows, tokens)
                self._scatter(self.out_cache_loc, batch.out_cache_loc, token_rows, tokens)
                if batch.window_out_cache_loc is not None:
                    self._scatter(self.window_out_cache_loc, batch.window_out_cache_loc, token_rows, tokens)
                self.attention.fill_cuda_graph_row_tables(batch, bs, row_tokens)
            logits, states = self.graphs[row_tokens, bs]()
            # Gathers copy: the output buffers are overwritten by the next replay.
            if capture is not None:
                capture.states.extend(state[token_rows] for state in states)
            return logits[token_rows[batch.logits_indices]]

    @staticmethod
    def _fill(static: torch.Tensor, own: torch.Tensor, n: int, bs: int) -> None:
        """A decode batch's values into the first n rows; the spare rows'
        KV slots (and so their ids and positions) are 0."""
        static[:n].copy_(own)
        static[n:bs].zero_()

    @staticmethod
    def _scatter(static: torch.Tensor, own: torch.Tensor, token_rows: torch.Tensor, tokens: int) -> None:
        """Each of a batch's tokens into its padded row; padding tokens get 0
        (KV slot 0, token id 0, position 0)."""
        static[:tokens].zero_()
        static.index_copy_(0, token_rows, own)

    def _token_rows(self, batch: ForwardBatch, row_tokens: int) -> torch.Tensor:
        """Where each of the batch's tokens sits among the padded rows."""
        rows = [i * row_tokens + j for i, n in enumerate(batch.extend_lens) for j in range(n)]
        return torch.tensor(rows, dtype=torch.long).to(self.attention.device, non_blocking=True)
