"""Steps of a model in the 8da4w layout as one Rust call per layer
(rust/kernels/decode_layer.rs): norms, Q4_1 projections, rotary, the KV write and
attention over each sequence's slots, SiLU, without a torch op between.
Decode steps, and the steps that the attention backend hands over
(`native_extends`: the one-thread 8da4w steps of prefill chunks or
speculative verify rows, whose attention is rust/kernels/extend_attention.rs;
decode rows among them attend as in a decode step).

At batch 1 a small model's projections are about half of a step on a CPU;
the other half was the cost around them (torch.compile's per-call checks,
custom-op dispatch, SDPA's set-up for one query). In a prefill chunk over a
cached prefix, torch's ops between the kernels ran on one thread while the
kernels' helper waited: a quarter of the step. Llama-style layers on
one rank only: Q4_1 q/k/v (with or without a bias), o, gate/up and down
projections without biases, no q/k norms, float32 KV cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pyserve import _rust
from pyserve.model.cpu.blocks import Q4_1Linear
from pyserve.model.layers.mlp import MLP

if TYPE_CHECKING:
    from pyserve.model.layers.causal_lm import AuxCapture


def unfit_reason(model) -> str | None:
    """Why `model`'s decode steps cannot run natively, or None when they can."""
    if model.shard.tp.size != 1:
        return "tensor parallelism all-reduces inside the layer"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(attn, "qkv_proj"):
            return "its attention is latent attention, not fused q/k/v heads"
        if not isinstance(mlp, MLP):
            return "its feed-forward block is a mixture of experts, not the gated MLP"
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, Q4_1Linear) for p in projections):
            return "its projections are not all Q4_1 blocks"
        if any(p.bias is not None for p in projections[1:]):
            return "o_proj or the MLP has a bias"
        reason = layer.unlike_llama()
        if reason is not None:
            return reason
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.float32 for w in norms):
            return f"the model runs in {norms[0].dtype}, the native layer in float32"
    return None


class NativeDecode:
    """The layers' weights as the numpy views the Rust layer borrows, made
    once (views of the model's own tensors: no copy); `run`, a decode
    step's layers, and `run_extends`, a prefill step's. The kernels split
    their work among the thread count the model's Q4_1 layers were built
    with (blocks.Q4_1Linear.threads)."""

    def __init__(self, model):
        config, first = model.config, model.layers[0].self_attn
        self.dims = (config.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                     model.layers[0].mlp.intermediate_size, float(config.rms_norm_eps), float(first.scale))
        self.threads = first.qkv_proj.threads
        self.layers = []  # per layer: (input norm, post norm, qkv, o, gate_up, down tiles, qkv bias or None)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            tiles = tuple(p.tiles for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
            bias = attn.qkv_proj.bias
            bias = None if bias is None else _view(bias.float())
            self.layers.append((*(_view(t) for t in norms + tiles), bias))
        self._cache_of = None  # the KV buffer's first k tensor, whose layers `_caches` views
        self._caches: list[tuple] = []

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: list[int],
            decode_inputs, capture: AuxCapture | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it) for
        the embeddings `x` [rows, hidden] of a decode step.
        `decode_inputs(i)`: layer i's (k cache, v cache, new slots, slots, mask);
        `capture`: filled with the hidden states entering its layers."""
        k_cache, _, new_slots, slots, _ = decode_inputs(0)
        if k_cache is not self._cache_of:
            self._view_caches(k_cache, [decode_inputs(i)[:2] for i in range(len(self.layers))])
        lens = torch.tensor(seq_lens, dtype=torch.long)
        decode = (_view(slots.to(torch.long)), lens.numpy())
        return self._layers(x, cos, sin, new_slots, decode, [], capture)

    def run_extends(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, new_slots: torch.Tensor,
                    extends: list[tuple[int, torch.Tensor, bool]], kv_buffer,
                    capture: AuxCapture | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As `run`, for a step of prefill chunks or verify rows (decode rows
        among them or not): `extends` holds each sequence's count of new
        tokens (the next rows in order), its slots (int64, the new tokens'
        last) and whether its tokens attend as decode rows; `new_slots` the
        rows' KV slots."""
        if kv_buffer.k_buffer[0] is not self._cache_of:
            self._view_caches(kv_buffer.k_buffer[0], list(zip(kv_buffer.k_buffer, kv_buffer.v_buffer)))
        extends = [(count, _view(slots.to(torch.long)), as_decode) for count, slots, as_decode in extends]
        return self._layers(x, cos, sin, new_slots, None, extends, capture)

    def _view_caches(self, first_k: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if len(caches) != len(self.layers):
            raise ValueError(f"a KV cache of {len(caches)} layers for {len(self.layers)}")
        self._cache_of = first_k
        self._caches = [(k.numpy(), v.numpy()) for k, v in caches]

    def _layers(self, x, cos, sin, new_slots, decode, extends,
                capture: AuxCapture | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on the step's rows: `decode` (slots, lens) for a
        decode step, else `extends` (new tokens, slots, whether they attend
        as decode rows) per sequence. The
        Rust side checks every shape, dtype and slot; each call updates x
        and the residual in place, so a captured state is a sum made anew."""
        rows = x.shape[0]
        x = x.to(torch.float32).contiguous().clone()
        residual = torch.zeros_like(x)
        step = (_view(cos.reshape(rows, -1).to(torch.float32)), _view(sin.reshape(rows, -1).to(torch.float32)),
                _view(new_slots.to(torch.long)))
        x_view, residual_view = x.numpy(), residual.numpy()
        for i, (layer, cache) in enumerate(zip(self.layers, self._caches)):
            if capture is not None and i in capture.layers:
                capture.states.append(x + residual)
            _rust.decode_layer_q4_1(x_view, residual_view, self.dims, layer, step, decode, extends, cache,
                                    self.threads)
        if capture is not None:
            capture.keep_last(len(self.layers), x, residual)
        return x, residual


def _view(tensor: torch.Tensor):
    """A contiguous CPU tensor's numpy view (no copy when it is contiguous already)."""
    return tensor.detach().contiguous().numpy()
