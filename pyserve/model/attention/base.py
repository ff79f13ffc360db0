"""The interface the model calls for attention over the KV cache.

Per forward pass the model calls `prepare(batch, plan)` once, then
`forward` once per layer. Backends build whatever per-batch metadata they
need (slot tables, masks, kernel work lists) in `prepare`, so the layers
reuse it. The plan (step_plan.py) is the step owner's word on how the step
runs; a backend follows what of it concerns attention and infers nothing
from elsewhere.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.step_plan import TORCH_STEP, StepPlan


class AttentionBackend(ABC):
    """Implementations set `kv_buffer` (per-layer `k_buffer` / `v_buffer`
    views by token slot) and remember the batch `prepare` saw in `_batch`."""

    kv_buffer: KVBuffer
    _batch: ForwardBatch | None = None

    @abstractmethod
    def prepare(self, batch: ForwardBatch, plan: StepPlan = TORCH_STEP) -> None:
        """Build the per-batch metadata every layer's `forward` reuses, for
        the step as `plan` says it runs."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, heads, head_dim], the new tokens of all sequences
        k: torch.Tensor,  # [T, kv_heads, head_dim]
        v: torch.Tensor,  # [T, kv_heads, head_dim]
        layer_id: int,
        batch: ForwardBatch,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k/v at `batch.out_cache_loc` in layer `layer_id`'s cache, then
        attend every new token over its own sequence (its stretch of
        `batch.kv_indices`, see ForwardBatch),
        causally: the new token at absolute position p sees positions <= p.
        Query head h reads kv head h // (heads // kv_heads). Returns
        [T, heads, v's head_dim] in q's dtype. In a latent cache
        (kv_buffer.LatentDim) v is a view of k's first values, so storing
        it writes those values again.

        The layer's options, as transformers applies them (None: off):
        `window`, a sliding window: position p sees only p - window < j <= p;
        `softcap`: each score s (after `scale`) becomes
        softcap * tanh(s / softcap) before the mask and softmax (Gemma 2);
        `sinks` [heads]: one learned logit per query head that joins the
        softmax's denominator and nothing else (gpt-oss)."""

    # Backends whose decode-step attention is a function of tensors alone
    # set `attend_decode(q, k, v, *decode_inputs(layer_id, window), scale,
    # softcap, sinks)` and override `decode_inputs`; torch.compile then
    # takes that attention into the compiled decoder layer
    # (CausalLM.compile_decode).
    attend_decode = None

    def decode_inputs(self, layer_id: int, window: int | None = None) -> tuple | None:
        """The tensors `attend_decode` reads for layer `layer_id`, of sliding
        window `window` (None: global), when the prepared batch is a decode
        step; None otherwise."""
        return None

    def native_extends(self) -> list[tuple[int, torch.Tensor, bool]] | None:
        """For a prepared step planned with native extend attention, whose
        layers may then run natively (cpu/native_layers.py, over this
        backend's `kv_buffer`): each sequence's count of new tokens, its
        slots (the new tokens' last), and whether its new tokens attend as
        decode rows (a speculative verify row's: rust/kernels/decode_layer.rs's
        NewTokens). None for any other step, and on backends that keep
        their own attention."""
        return None

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                 batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new tokens' k/v at `batch.out_cache_loc`; returns the
        layer's (k_cache, v_cache) for the attention that follows."""
        if batch is not self._batch:
            raise RuntimeError(f"{type(self).__name__}.prepare(batch) must be called before forward")
        k_cache = self.kv_buffer.k_buffer[layer_id]
        v_cache = self.kv_buffer.v_buffer[layer_id]
        out_cache_loc = self.slot_tables(layer_id, batch)[0]
        k_cache[out_cache_loc] = k.to(k_cache.dtype)  # an FP8 cache (--kv-cache-dtype) rounds them
        v_cache[out_cache_loc] = v.to(v_cache.dtype)
        return k_cache, v_cache

    def in_window_pool(self, layer_id: int) -> bool:
        """Whether layer `layer_id`'s K/V lives in the sliding pool (kv_buffer.py)."""
        return layer_id in getattr(self.kv_buffer, "window_layers", ())

    def slot_tables(self, layer_id: int, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(out_cache_loc, kv_indices) of `batch` as layer `layer_id`'s
        cache addresses them: the sliding pool's for its sliding layers."""
        if self.in_window_pool(layer_id):
            if batch.window_kv_indices is None:
                raise ValueError("a batch without the sliding pool's slots reached a layer of the sliding pool")
            return batch.window_out_cache_loc, batch.window_kv_indices
        return batch.out_cache_loc, batch.kv_indices


def check_options(num_heads: int, window: int | None = None, softcap: float | None = None,
                  sinks: torch.Tensor | None = None) -> None:
    """Refuse layer options (see AttentionBackend.forward) that mean nothing."""
    if window is not None and window < 1:
        raise ValueError(f"a sliding window of {window} tokens sees nothing")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"an attention soft-cap must be positive, not {softcap}")
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} for {num_heads} query heads")
