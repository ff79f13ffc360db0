"""Steps of a model in the 8da4w layout as one Rust call per layer
(rust/decode_layer.rs): norms, Q4_1 projections, rotary, the KV write and
attention over each sequence's slots, SiLU, without a torch op between.
Decode steps, and the prefill steps that the attention backend hands over
(`native_extends`: the one-thread 8da4w steps of prefill chunks alone,
whose attention is rust/extend_attention.rs).

At batch 1 a small model's projections are about half of a step on a CPU;
the other half was the cost around them (torch.compile's per-call checks,
custom-op dispatch, SDPA's set-up for one query). In a prefill chunk over a
cached prefix, torch's ops between the kernels ran on one thread while the
kernels' helper waited: a quarter of the step. Llama-style layers on
one rank only: Q4_1 q/k/v (with or without a bias), o, gate/up and down
projections without biases, no q/k norms, float32 KV cache. Mixed steps
(decode rows beside a prefill chunk) keep the torch layers.
"""

from __future__ import annotations

import torch

from pyserve import _rust
from pyserve.model.cpu import blocks
from pyserve.model.cpu.blocks import Q4_1Linear


def unfit_reason(model) -> str | None:
    """Why `model`'s decode steps cannot run natively, or None when they can."""
    if model.shard.tp.size != 1:
        return "tensor parallelism all-reduces inside the layer"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, Q4_1Linear) for p in projections):
            return "its projections are not all Q4_1 blocks"
        if any(p.bias is not None for p in projections[1:]):
            return "o_proj or the MLP has a bias"
        if attn.q_norm is not None:
            return "it normalizes q and k per head"
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.float32 for w in norms):
            return f"the model runs in {norms[0].dtype}, the native layer in float32"
    return None


class NativeDecode:
    """The layers' weights as the addresses the Rust layer reads (the model
    keeps the tensors alive); `run`, a decode step's layers, and
    `run_extends`, a prefill step's."""

    def __init__(self, model):
        config, first = model.config, model.layers[0].self_attn
        self.dims = (config.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                     model.layers[0].mlp.intermediate_size, float(config.rms_norm_eps), float(first.scale))
        self.layers = []
        self._kept = []  # the tensors the addresses point into, kept alive here
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm.weight.contiguous(), layer.post_attention_layernorm.weight.contiguous())
            self._kept.extend(norms)
            bias = attn.qkv_proj.bias
            if bias is not None:
                bias = bias.float().contiguous()
                self._kept.append(bias)
            self.layers.append((
                tuple(w.data_ptr() for w in norms),
                tuple(p.tiles.data_ptr() for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)),
                0 if bias is None else bias.data_ptr(),
            ))

    def run(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq_lens: list[int],
            decode_inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's MLP output, the residual stream before it) for
        the embeddings `x` [rows, hidden] of a decode step.
        `decode_inputs(i)`: layer i's (k cache, v cache, new slots, slots, mask)."""
        rows = x.shape[0]
        lens = torch.tensor(seq_lens, dtype=torch.long)
        _, _, new_slots, slots, _ = decode_inputs(0)
        slots = slots.to(torch.long).contiguous()
        if slots.shape[0] != rows or lens.shape[0] != rows or int(lens.max()) > slots.shape[1]:
            raise ValueError("a decode step's slots do not match its rows")
        decode = (slots.data_ptr(), slots.shape[1], lens.data_ptr())
        caches = [decode_inputs(i)[:2] for i in range(len(self.layers))]
        return self._layers(x, cos, sin, new_slots, decode, [], caches)

    def run_extends(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, new_slots: torch.Tensor,
                    extends: list[tuple[int, torch.Tensor]], kv_buffer) -> tuple[torch.Tensor, torch.Tensor]:
        """As `run`, for a prefill step: `extends` holds each sequence's
        count of new tokens (the next rows in order) and its slots (int64,
        the new tokens' last); `new_slots` the rows' KV slots."""
        if sum(count for count, _ in extends) != x.shape[0]:
            raise ValueError("a prefill step's sequences do not match its rows")
        extends = [(count, slots.to(torch.long).contiguous()) for count, slots in extends]
        described = [(count, slots.data_ptr(), slots.numel()) for count, slots in extends]
        caches = list(zip(kv_buffer.k_buffer, kv_buffer.v_buffer))
        return self._layers(x, cos, sin, new_slots, None, described, caches)

    def _layers(self, x, cos, sin, new_slots, decode, extends, caches) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on the step's rows: `decode` (slots, width, lens
        addresses) for a decode step, else `extends` (new tokens, slots
        address, slot count) per sequence; `caches` each layer's (k, v)."""
        rows = x.shape[0]
        x = x.to(torch.float32).contiguous().clone()
        residual = torch.zeros_like(x)
        cos = cos.reshape(rows, -1).to(torch.float32).contiguous()
        sin = sin.reshape(rows, -1).to(torch.float32).contiguous()
        new_slots = new_slots.to(torch.long).contiguous()
        if new_slots.shape != (rows,):
            raise ValueError("one new KV slot per row")
        step = (cos.data_ptr(), sin.data_ptr(), new_slots.data_ptr())
        threads = blocks.kernel_threads()
        for (norms, projections, bias), (k_cache, v_cache) in zip(self.layers, caches):
            if k_cache.dtype != torch.float32 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
                raise ValueError("the native layer needs a contiguous float32 KV cache")
            _rust.decode_layer_q4_1(x.data_ptr(), residual.data_ptr(), rows, self.dims, norms, projections, bias,
                                    step, decode, extends, (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0]),
                                    threads)
        return x, residual
