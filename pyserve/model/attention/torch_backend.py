"""Attention in plain torch: gather a sequence's slots, then SDPA.

The CPU production path and the reference the Triton kernels are checked
against. Inputs to scaled_dot_product_attention are always 4-D with
`enable_gqa`: on CPU that takes the fused flash kernel, several times faster
than 3-D inputs or repeating the kv heads.

A sliding window trims each sequence's slots to the keys its new tokens
can see and masks the rest, per window size, once per step; layers of a
sliding pool (kv_buffer.py) read the same keys by their sliding slots. Soft-capping
and sinks have no SDPA form: those layers compute the scores explicitly.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from pyserve.model.cpu import extend_attention
from pyserve.model.attention.base import AttentionBackend, check_options
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.step_plan import TORCH_STEP, StepPlan, TorchThreads, adds_one_token


# New tokens x keys from which an extend's SDPA is long enough to pay for
# waking the plan's `long_attention_threads`.
LONG_ATTENTION = 16 * 1024


@dataclass
class _ExtendSeq:
    start: int  # first row of this sequence in q/k/v
    num_new: int
    slots: torch.Tensor  # [seq_len], the new tokens' last
    # [num_new, seq_len] additive (see _additive) for SDPA; None: no cached
    # prefix (causal), or a step of the native kernel, which needs no mask
    mask: torch.Tensor | None


@dataclass
class _SingleTokenRows:
    """Rows that add one token to a sequence (all of a decode batch, the
    running streams of a mixed batch): one padded SDPA call for all."""

    rows: torch.Tensor | None  # indices into q/k/v; None: every row
    slots: torch.Tensor  # [B, max_len] slots, padded with slot 0
    mask: torch.Tensor | None  # [B, 1, 1, max_len] additive; None when no padding


def attend_single_tokens(q, k, v, k_cache, v_cache, out_cache_loc, slots, mask, scale: float,
                         softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's attention for one layer, tensors in, tensor out (so
    torch.compile can take it into the compiled decoder layer, see
    CausalLM.compile_decode): store each row's new k/v at its slot,
    then attend over its sequence's slots (a window's, from
    `decode_inputs(layer, window)`)."""
    k_cache[out_cache_loc] = k.to(k_cache.dtype)  # an FP8 cache (--kv-cache-dtype) rounds them
    v_cache[out_cache_loc] = v.to(v_cache.dtype)
    return _single_tokens(q, k_cache, v_cache, slots, mask, scale, softcap, sinks)


def _gathered(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for slots of any shape. index_select copies the rows
    several times faster than advanced indexing on the CPU, and a long
    extend gathers every layer."""
    return torch.index_select(cache, 0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def _single_tokens(q, k_cache, v_cache, slots, mask, scale: float, softcap=None, sinks=None) -> torch.Tensor:
    # One query per sequence: every sequence is padded to the longest
    # (padding reads slot 0, masked out), so the rows are one SDPA call.
    ks = _gathered(k_cache, slots).to(q.dtype).transpose(1, 2)  # [B, kv_heads, max_len, D]
    vs = _gathered(v_cache, slots).to(q.dtype).transpose(1, 2)
    return _attention(q[:, :, None, :], ks, vs, mask, scale, softcap, sinks)[:, :, 0, :]


def _attention(q, k, v, mask, scale: float, softcap=None, sinks=None, causal: bool = False) -> torch.Tensor:
    """q [B, heads, Lq, D] over k, v [B, kv_heads, Lk, D] with an additive
    `mask` (or `causal`, Lq == Lk). With neither soft-cap nor sinks that is
    SDPA; otherwise the scores are computed in float32 as transformers'
    eager attention does: capped as softcap * tanh(s / softcap) before the
    mask, and with one more logit per head (the sink) in the softmax's
    denominator only."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        sink = sinks.float()[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.matmul(probs, v).to(q.dtype)


# The longest verify row attended as decode rows: each row reads its whole
# past, where extend_attention reads it once for every 4 tokens, so past
# this a prompt's tokens that all want logits (prompt logprobs) take the tiles.
VERIFY_AS_DECODE_ROWS = 64


class TorchAttention(AttentionBackend):
    attend_decode = staticmethod(attend_single_tokens)

    def __init__(self, kv_buffer: KVBuffer, threads: TorchThreads | None = None):
        """`threads`: the process's torch thread count, through which a
        step's plan gives a long extend's SDPA more threads than the step's
        own (new tokens over a long cached prefix, a chat's next turn or a
        shared system prompt, spend most of their step here). Without it
        the backend takes plans that leave the threads alone."""
        self.kv_buffer = kv_buffer
        self.threads = threads
        # Set when torch.compile compiles the decode layers over `attend_decode`:
        # only then are the varying sizes marked (torch._dynamo's import alone
        # costs a second and a half on the first decode step).
        self.compiled_decode = False
        self._batch: ForwardBatch | None = None
        self._plan = TORCH_STEP
        self._extend: list[_ExtendSeq] = []
        self._single: _SingleTokenRows | None = None
        self._single_slots: list[torch.Tensor] = []  # each single-token row's sequence slots
        # Which sequence of the batch each extend and each single-token row is.
        self._extend_seqs: list[int] = []
        self._single_seqs: list[int] = []
        # (window, in the sliding pool) -> the step's extends and single-token rows trimmed to it
        self._windowed: dict[tuple[int, bool], tuple[list[_ExtendSeq], _SingleTokenRows | None]] = {}

    def prepare(self, batch: ForwardBatch, plan: StepPlan = TORCH_STEP) -> None:
        if plan.long_attention_threads is not None and self.threads is None:
            raise ValueError("the step's plan sets attention threads; this backend was given no TorchThreads")
        self._batch = batch
        self._plan = plan
        device = batch.input_ids.device
        per_seq = batch.kv_indices.split(batch.seq_lens)
        self._extend = []
        single_rows, single_slots = [], []
        self._extend_seqs, self._single_seqs = [], []
        start = 0
        for i, (num_new, seq_len, slots) in enumerate(zip(batch.extend_lens, batch.seq_lens, per_seq)):
            if adds_one_token(num_new, seq_len):
                single_rows.append(start)
                single_slots.append(slots)
                self._single_seqs.append(i)
                start += num_new
                continue
            self._extend_seqs.append(i)
            if num_new == seq_len or plan.native_extend_attention:
                # No cached prefix (SDPA's causal mask), or the native
                # kernel, which applies the causal rule itself.
                self._extend.append(_ExtendSeq(start, num_new, slots, None))
            else:
                # New token i sits at position seq_len - num_new + i and sees
                # every position up to itself.
                q_pos = torch.arange(seq_len - num_new, seq_len, device=device)
                sees = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
                self._extend.append(_ExtendSeq(start, num_new, slots, self._additive(sees)))
            start += num_new
        self._single = None
        self._single_slots = single_slots
        self._windowed = {}
        if single_rows:
            rows = None if len(single_rows) == start else torch.tensor(single_rows, device=device)
            self._single = self._single_token_rows(rows, single_slots, batch.out_cache_loc)

    def _single_token_rows(self, rows: torch.Tensor | None, slots: list[torch.Tensor],
                           out_cache_loc: torch.Tensor) -> _SingleTokenRows:
        """Rows `rows` each attending over its `slots`, padded into one call
        (`out_cache_loc`: where a decode step's layers store, see below)."""
        lens = [s.numel() for s in slots]
        mask = None
        device = slots[0].device
        if min(lens) != max(lens):
            lens_t = torch.tensor(lens, device=device)
            sees = torch.arange(max(lens), device=device)[None, :] < lens_t[:, None]
            mask = self._additive(sees)[:, None, None, :]
        single = _SingleTokenRows(rows, pad_sequence(slots, batch_first=True, padding_value=0), mask)
        if rows is None and self.compiled_decode:
            self._mark_dynamic_decode_dims(out_cache_loc, single)
        return single

    def _in_window(self, window: int | None, pooled: bool = False) -> tuple[list[_ExtendSeq], _SingleTokenRows | None]:
        """The step's extends and single-token rows as a layer of sliding
        window `window` attends them (None: the whole sequence): the new
        token at position i sees keys at i - window < j <= i (transformers'
        sliding_window_overlay), so only those slots are gathered; by their
        sliding slots for a layer of the sliding pool (`pooled`). Built on
        the first layer that asks, reused by the rest."""
        if window is None:
            if pooled:
                raise ValueError("a layer of the sliding pool attends without a window")
            return self._extend, self._single
        key = (window, pooled)
        if key not in self._windowed:
            extend, single_slots = self._extend, self._single_slots
            if pooled:
                batch = self._batch
                per_seq = batch.window_kv_indices.split(batch.seq_lens)
                extend = [replace(s, slots=per_seq[i]) for s, i in zip(extend, self._extend_seqs)]
                single_slots = [per_seq[i] for i in self._single_seqs]
            self._windowed[key] = ([self._extend_in_window(s, window) for s in extend],
                                   self._single_rows_in_window(window, single_slots, pooled))
        return self._windowed[key]

    def _extend_in_window(self, s: _ExtendSeq, window: int) -> _ExtendSeq:
        seq_len = s.slots.numel()
        if seq_len <= window:  # every key is within the window of every query
            return s
        device = s.slots.device
        first = seq_len - s.num_new  # the first new token's position
        lo = max(0, first - window + 1)  # the first key any new token sees
        q_pos = torch.arange(first, seq_len, device=device)[:, None]
        k_pos = torch.arange(lo, seq_len, device=device)[None, :]
        sees = (k_pos <= q_pos) & (k_pos > q_pos - window)
        return _ExtendSeq(s.start, s.num_new, s.slots[lo:], self._additive(sees))

    def _single_rows_in_window(self, window: int, slots: list[torch.Tensor], pooled: bool) -> _SingleTokenRows | None:
        single = self._single
        if single is None or (not pooled and max(s.numel() for s in slots) <= window):
            return single
        out_cache_loc = self._batch.window_out_cache_loc if pooled else self._batch.out_cache_loc
        return self._single_token_rows(single.rows, [s[-window:] for s in slots], out_cache_loc)

    def forward(self, q, k, v, layer_id: int, batch: ForwardBatch, scale: float, *, window: int | None = None,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        check_options(q.shape[1], window, softcap, sinks)
        decode = self.decode_inputs(layer_id, window) if batch is self._batch else None
        if decode is not None:
            return attend_single_tokens(q, k, v, *decode, scale, softcap, sinks)
        k_cache, v_cache = self.store_kv(k, v, layer_id, batch)
        extends, single = self._in_window(window, self.in_window_pool(layer_id))
        if extends and self._plan.native_extend_attention and (window, softcap, sinks) != (None, None, None):
            # The step's owner plans native extends only for layers without options.
            raise ValueError("the native extend kernel has no sliding window, soft-cap or sinks")
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        if single is not None:
            out[single.rows] = _single_tokens(q[single.rows], k_cache, v_cache, single.slots, single.mask, scale,
                                              softcap, sinks)
        for s in extends:
            rows = slice(s.start, s.start + s.num_new)
            if self._plan.native_extend_attention:
                # The kernel shares the block kernels' threads: all of the plan's attention threads.
                out[rows] = extend_attention.attend(q[rows], k_cache, v_cache, s.slots, scale,
                                                    self._plan.long_attention_threads or 1)
                continue
            if s.mask is None:
                ks, vs = k[rows], v[rows]
                if k_cache.dtype != k.dtype:  # as an FP8 cache holds them, which the Triton kernels read
                    ks, vs = ks.to(k_cache.dtype).to(k.dtype), vs.to(v_cache.dtype).to(v.dtype)
            else:
                ks, vs = _gathered(k_cache, s.slots).to(q.dtype), _gathered(v_cache, s.slots).to(q.dtype)
            # [tokens, heads, dim] -> [1, heads, tokens, dim]
            with self._threads_for(s.num_new * ks.shape[0]):
                o = _attention(q[rows].transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                               s.mask, scale, softcap, sinks, causal=s.mask is None)
            out[rows] = o[0].transpose(0, 1)
        return out

    def _threads_for(self, work: int):
        """The plan's long-attention threads for an SDPA of `work` queries x
        keys from LONG_ATTENTION on; the step's own below."""
        if work < LONG_ATTENTION or self._plan.long_attention_threads is None:
            return nullcontext()
        return self.threads.using(self._plan.long_attention_threads)

    def _additive(self, sees: torch.Tensor) -> torch.Tensor:
        """A boolean "query sees key" mask as the additive one SDPA takes
        (0 where seen, -inf elsewhere): on the CPU, SDPA with a boolean mask
        runs about twice as long as with the same mask added. Every query
        sees at least itself, so no row is all -inf."""
        mask = torch.zeros(sees.shape, dtype=self.kv_buffer.dtype, device=sees.device)
        return mask.masked_fill_(~sees, float("-inf"))

    @staticmethod
    def _mark_dynamic_decode_dims(out_cache_loc: torch.Tensor, single: _SingleTokenRows) -> None:
        """For a compiled decode layer: the rows (past one) and the longest
        sequence are the sizes that vary between decode steps."""
        if out_cache_loc.shape[0] > 1:
            for t in (out_cache_loc, single.slots, single.mask):
                if t is not None:
                    torch._dynamo.mark_dynamic(t, 0)
        torch._dynamo.mark_dynamic(single.slots, 1)
        if single.mask is not None:
            torch._dynamo.mark_dynamic(single.mask, 3)

    def native_extends(self) -> list[tuple[int, torch.Tensor, bool]] | None:
        """Every sequence of a step whose plan has extends run
        extend_attention's kernel: the native layer runs them with that same
        kernel, and its decode rows (a mixed step's, a verify step's
        undrafted ones) as a decode step's. A sequence whose every new token
        after a cached past wants its logits (a verify row: the known token
        and its drafts), up to VERIFY_AS_DECODE_ROWS of them, attends as
        that many decode rows: each token then gets a decode step's bits."""
        if not self._plan.native_extend_attention:
            return None
        batch = self._batch
        wanted = set(batch.logits_indices.tolist())
        extends, first = [], 0
        for count, slots in zip(batch.extend_lens, batch.kv_indices.split(batch.seq_lens)):
            verify = 1 < count <= VERIFY_AS_DECODE_ROWS and len(slots) > count and all(
                row in wanted for row in range(first, first + count))
            extends.append((count, slots, verify))
            first += count
        return extends

    def decode_inputs(self, layer_id: int, window: int | None = None) -> tuple | None:
        """For a prepared batch of single-token rows only (a decode step):
        the tensors `attend_single_tokens` takes after q, k, v, for layer
        `layer_id` of sliding window `window` (None: global); None for any
        other batch."""
        if self._single is None or self._single.rows is not None:
            return None
        check_options(0, window)
        single = self._in_window(window, self.in_window_pool(layer_id))[1]
        return (self.kv_buffer.k_buffer[layer_id], self.kv_buffer.v_buffer[layer_id],
                self.slot_tables(layer_id, self._batch)[0], single.slots, single.mask)
