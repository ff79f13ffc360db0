"""A Llama-family decoder: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Under tensor parallelism (parallel.py) each rank builds the layers of its
ModelShard: its attention heads, its slice of the MLP and of the
vocabulary, with an all-reduce after o_proj and down_proj.

The layers follow Hugging Face's numerics (RMSNorm in float32, rotate-half
RoPE computed in float32 then cast) so greedy tokens match transformers on
the same weights. q/k/v and gate/up are fused into one matmul each; the
loader fills the fused weights. Attention reads and writes the KV cache
through an AttentionBackend, so this file never sees the cache layout.

On CUDA the elementwise work (residual add + RMSNorm, rotary, SiLU * up)
runs as fused Triton kernels (fused_ops.py) that round where the torch code
here rounds; the torch code is the CPU path and the reference (a model
built with `fused_kernels=False` runs it on CUDA too).

Which code runs a step's layers is the step's plan (step_plan.py): these
modules op by op, one compiled decode layer, or the native layers
(cpu/native_layers.py) that the step's owner builds and hands in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.attention.base import AttentionBackend
from pyserve.model.config import ModelConfig
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.parallel import ModelShard, embed
from pyserve.model.step_plan import TORCH_STEP, Layers, StepPlan

if TYPE_CHECKING:
    from pyserve.model.cpu.native_layers import NativeDecode


def _fused_ops():
    # Imported on first use: Triton is a Linux-only dependency, unused on CPU.
    from pyserve.model import fused_ops

    return fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused_kernels: bool = True):
        """`fused_kernels`: on CUDA, fused_ops.py's kernels (else the torch code)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused_kernels = fused_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); given the residual stream, (norm(x + residual), x + residual)."""
        fused = self.fused_kernels and x.is_cuda
        if residual is None:
            return _fused_ops().rms_norm(x, self.weight, self.eps) if fused else self._norm(x)
        if fused:
            return _fused_ops().add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Float32 inverse frequencies [head_dim / 2] with the checkpoint's scaling
    applied, and the factor cos/sin are multiplied by (yarn's attention scale)."""
    dim = config.head_dim
    # An explicit CPU device: the model may be built under torch.device("meta").
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    wave = config.rope_theta**exponents  # positions per radian, per dimension pair
    inv_freq = 1.0 / wave
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, factor, scaling), 1.0
    if kind == "yarn":
        return _yarn_frequencies(wave, factor, scaling, config)
    raise ValueError(f"rope scaling type {kind!r} is not supported")


def _llama3_frequencies(inv_freq: torch.Tensor, factor: float, scaling: dict) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, and the
    # band between the two is blended linearly in 1/wavelength.
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_frequencies(
    wave: torch.Tensor, factor: float, scaling: dict, config: ModelConfig
) -> tuple[torch.Tensor, float]:
    # Dimensions that rotate many times within the original context keep their
    # frequency (extrapolate), slow ones are divided by `factor`
    # (interpolate), with a linear ramp between; cos/sin get a magnitude fix.
    dim = config.head_dim
    base = config.rope_theta
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    inv_freq = 1.0 / (factor * wave) * (1 - keep) + 1.0 / wave * keep

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin per position, cached and grown on demand.

    A plain object rather than a module: casting the model to bf16 must not
    round the frequencies, and the cache lives wherever the positions are.
    The cache holds cos/sin already cast to the model dtype, exactly as
    transformers computes them (float32, scaled, then cast). It grows from
    the batch's longest sequence, a host-side int, so checking it never
    waits on the device; CUDA-graph capture should run at the longest length.
    """

    def __init__(self, config: ModelConfig):
        self.inv_freq, self.attention_scaling = rope_frequencies(config)
        self._cos = self._sin = None

    def _grow(self, length: int, device: torch.device, dtype: torch.dtype) -> None:
        # Powers of two: a long-running server rebuilds the cache a few times at most.
        length = 1 << max(length - 1, 1).bit_length()
        positions = torch.arange(length, dtype=torch.float32, device=device)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        self._cos = (freqs.cos() * self.attention_scaling).to(dtype)
        self._sin = (freqs.sin() * self.attention_scaling).to(dtype)

    def cos_sin(
        self, positions: torch.Tensor, max_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [T, 1, head_dim / 2] for positions that are all < max_len."""
        c = self._cos
        if c is None or c.shape[0] < max_len or c.device != positions.device or c.dtype != dtype:
            self._grow(max_len, positions.device, dtype)
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, head_dim]; the same arithmetic as
    transformers' `x * cos + rotate_half(x) * sin` on half-width cos/sin."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_rotary_qk(q, k, cos, sin, fused_kernels: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q and k; on CUDA with `fused_kernels` one fused kernel, in place."""
    if fused_kernels and q.is_cuda:
        _fused_ops().rotary_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, shard: ModelShard, fused_kernels: bool = True):
        super().__init__()
        self.layer_id = layer_id
        self.fused_kernels = fused_kernels
        self.tp = shard.tp
        self.num_heads = len(shard.q_heads)
        self.num_kv_heads = len(shard.kv_heads)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        # Row-parallel: the ranks' partial outputs are summed, so only rank 0 adds the bias.
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_proj_bias and self.tp.rank == 0)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused_kernels)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused_kernels)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the new tokens, q and k rotated."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary_qk(q, k, cos, sin, self.fused_kernels)
        return q, k, v

    def attend(self, q, k, v, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        return attn.forward(q, k, v, self.layer_id, batch, self.scale)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: ModelShard, fused_kernels: bool = True):
        super().__init__()
        self.tp = shard.tp
        self.fused_kernels = fused_kernels
        self.intermediate_size = len(shard.intermediate)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias and self.tp.rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_kernels and gate_up.is_cuda:
            return self.tp.all_reduce(self.down_proj(_fused_ops().silu_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, shard: ModelShard, fused_kernels: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_kernels)
        self.self_attn = Attention(config, layer_id, shard, fused_kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_kernels)
        self.mlp = MLP(config, shard, fused_kernels)

    # A layer runs as before_attention, the attention backend, after_attention:
    # the two halves hold no layer index or cache, so one compiled decode
    # layer serves every layer (LlamaForCausalLM.compile_decode).

    def before_attention(self, x, residual, cos, sin):
        """x: the previous layer's MLP output, or the embeddings (residual
        None) for the first layer. Returns q, k, v and the residual stream:
        each residual add is left to the next norm, which fuses it on CUDA."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        return (*self.self_attn.project(h, cos, sin), residual)

    def after_attention(self, out, residual):
        """(this layer's MLP output, the residual stream before it)."""
        attn = self.self_attn
        h = attn.tp.all_reduce(attn.o_proj(out.reshape(-1, attn.q_size)))
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Parameter names are the checkpoint's minus the leading `model.`, with
    q/k/v fused as `qkv_proj` and gate/up as `gate_up_proj`. `shard`: the
    part this tensor-parallel rank holds (default: all of it).
    `fused_kernels`: on CUDA, fused_ops.py's kernels for the elementwise work."""

    def __init__(self, config: ModelConfig, shard: ModelShard | None = None, fused_kernels: bool = True):
        super().__init__()
        self.config = config
        self.shard = shard = shard or ModelShard.of(config)
        self.embed_tokens = nn.Embedding(len(shard.vocab), config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, shard, fused_kernels)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused_kernels)
        # Tied checkpoints reuse the embedding matrix as the output projection
        # (quantize_model may give them a quantized copy of it).
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, len(shard.vocab), bias=False)
        self.rotary = RotaryEmbedding(config)
        self.compiled_decode_layer = None  # set by compile_decode

    def compile_decode(self, attend_decode) -> None:
        """Compile `compiled_decode_layer`, which runs decode steps planned
        as Layers.COMPILED_DECODE: on a CPU a small model's step is mostly
        per-op overhead, which compiling the whole layer (norms,
        projections, rotary, the KV write and attention, SiLU, residual
        adds) into one graph removes. The graph is compiled once for all
        layers (with torch.compile's inductor), with the batch size and the
        sequence length dynamic (marked so: guessing would also tie them to
        model sizes that happened to be equal); only the batch's attention
        metadata is built eagerly, in `prepare`.
        `attend_decode`: the attention backend's tensor-only decode attention
        (AttentionBackend.attend_decode)."""

        def decode_layer(layer, x, residual, cos, sin, kv_inputs):
            q, k, v, residual = layer.before_attention(x, residual, cos, sin)
            out = attend_decode(q, k, v, *kv_inputs, layer.self_attn.scale)
            return layer.after_attention(out, residual)

        self.compiled_decode_layer = torch.compile(decode_layer)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend, plan: StepPlan = TORCH_STEP,
                native_layers: NativeDecode | None = None) -> torch.Tensor:
        """Float32 logits [B, vocab], one row per `batch.logits_indices` entry."""
        return self.logits(self.hidden_states(batch, attn, batch.logits_indices, plan, native_layers))

    def hidden_states(self, batch: ForwardBatch, attn: AttentionBackend, rows: torch.Tensor,
                      plan: StepPlan = TORCH_STEP, native_layers: NativeDecode | None = None) -> torch.Tensor:
        """Final-norm hidden states [len(rows), hidden] of the token rows
        `rows` (indices into the batch's new tokens): what the vocabulary
        projection reads, and what embedding models pool. `plan`: how the
        step runs, decided by its owner; `native_layers`: the owner's native
        layer runner, for plans of native layers."""
        if plan.layers in (Layers.NATIVE_DECODE, Layers.NATIVE_EXTENDS) and native_layers is None:
            raise ValueError(f"a step planned for the {plan.layers.value} layers needs the native layer runner")
        attn.prepare(batch, plan)
        x = embed(batch.input_ids, self.embed_tokens.weight, self.shard.vocab.start, self.shard.tp)
        cos, sin = self.rotary.cos_sin(batch.positions, max(batch.seq_lens), x.dtype)
        match plan.layers:
            case Layers.TORCH:
                x, residual = self._torch_layers(x, cos, sin, batch, attn)
            case Layers.COMPILED_DECODE:
                x, residual = self._compiled_decode_layers(x, cos, sin, attn)
            case Layers.NATIVE_DECODE:
                x, residual = native_layers.run(x, cos, sin, batch.seq_lens, _decode_inputs(attn))
            case Layers.NATIVE_EXTENDS:
                x, residual = native_layers.run_extends(x, cos, sin, batch.out_cache_loc, _native_extends(attn),
                                                        attn.kv_buffer)
        # Only the rows whose next token (or hidden state) is wanted go
        # through the last residual add, the norm and the vocabulary
        # projection, the most expensive matmul for small models.
        x, _ = self.norm(x[rows], residual[rows])
        return x

    def _torch_layers(self, x, cos, sin, batch: ForwardBatch, attn: AttentionBackend):
        """(the last layer's MLP output, the residual stream before it), op by op."""
        residual = None
        for layer in self.layers:
            q, k, v, residual = layer.before_attention(x, residual, cos, sin)
            x, residual = layer.after_attention(layer.self_attn.attend(q, k, v, batch, attn), residual)
        return x, residual

    def _compiled_decode_layers(self, x, cos, sin, attn: AttentionBackend):
        """As `_torch_layers`, each layer the one compiled graph (compile_decode)."""
        compiled = self.compiled_decode_layer
        if compiled is None:
            raise ValueError("a step planned for the compiled decode layer before compile_decode")
        decode_inputs = _decode_inputs(attn)
        # A zero residual into the first layer (x + 0 is x) keeps every
        # layer the same graph.
        residual = torch.zeros_like(x)
        if x.shape[0] > 1:
            # The batch size varies between steps; the hidden size does not.
            for t in (x, residual, cos, sin):
                torch._dynamo.mark_dynamic(t, 0)
        for i, layer in enumerate(self.layers):
            x, residual = compiled(layer, x, residual, cos, sin, decode_inputs(i))
        return x, residual

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final-norm hidden states, over the whole
        vocabulary (gathered from the ranks' shards)."""
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        return self.shard.tp.gather_vocab(logits, self.config.vocab_size).float()


def _decode_inputs(attn: AttentionBackend):
    """The backend's per-layer decode inputs, for a step prepared as a decode step."""
    if attn.decode_inputs(0) is None:
        raise ValueError("a step planned as a decode step, which the attention backend did not prepare as one")
    return attn.decode_inputs


def _native_extends(attn: AttentionBackend) -> list[tuple[int, torch.Tensor]]:
    extends = attn.native_extends()
    if extends is None:
        raise ValueError("a step planned for the native extends, which the attention backend did not prepare so")
    return extends
