"""The causal language model every family builds on: the (vocabulary-
parallel) embedding, optionally scaled; the decoder layers (decoder.py);
the final norm; the vocabulary projection, its logits optionally scaled
and soft-capped. A family whose layers differ in more than config options
subclasses it (e.g. its own `build_mlp`).

Under tensor parallelism (parallel.py) each rank builds the layers of its
ModelShard: its attention heads, its slice of the MLP and of the
vocabulary, with an all-reduce after o_proj and down_proj.

The layers follow Hugging Face's numerics (RMSNorm in float32, RoPE
computed in float32 then cast) so greedy tokens match transformers on the
same weights. q/k/v and gate/up are fused into one matmul each; the
loader fills the fused weights. Attention reads and writes the KV cache
through an AttentionBackend, so the layers never see the cache layout.

On CUDA the elementwise work (residual add + RMSNorm, rotary, SiLU * up)
runs as fused Triton kernels (fused_ops.py) that round where the torch code
rounds; the torch code is the CPU path and the reference (a model built
with `fused_kernels=False` runs it on CUDA too).

Which code runs a step's layers is the step's plan (step_plan.py): these
modules op by op, one compiled decode layer, or the native layers
(cpu/native_layers.py) that the step's owner builds and hands in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.attention.base import AttentionBackend
from pyserve.model.config import ModelConfig
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.decoder import DecoderLayer
from pyserve.model.layers.mlp import MLP
from pyserve.model.layers.norms import rms_norm
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.parallel import ModelShard, embed
from pyserve.model.step_plan import TORCH_STEP, Layers, StepPlan

if TYPE_CHECKING:
    from pyserve.model.cpu.native_layers import NativeDecode


@dataclass
class AuxCapture:
    """What a forward pass keeps besides its logits, when asked: the hidden
    states entering `layers` (the residual stream before each of those
    layers; layer 0's is the embeddings; the layer count, the stream after
    the last layer) of every token row, one [tokens, hidden] tensor per
    layer in layer order, which an EAGLE or EAGLE-3 draft head reads
    (engine/speculative/eagle.py). The torch layers and the native ones
    fill it, not the compiled decode layer."""

    layers: frozenset[int]
    states: list[torch.Tensor] = field(default_factory=list)

    def keep_last(self, layer_count: int, x: torch.Tensor, residual: torch.Tensor) -> None:
        """After the last of `layer_count` layers: their output stream, if asked for."""
        if layer_count in self.layers:
            self.states.append(x + residual)


class CausalLM(nn.Module):
    """Parameter names are the checkpoint's minus the leading `model.`, with
    q/k/v fused as `qkv_proj` and gate/up as `gate_up_proj` (the family's
    checkpoint names map them, checkpoint.py). `shard`: the part this
    tensor-parallel rank holds (default: all of it).
    `fused_kernels`: on CUDA, fused_ops.py's kernels for the elementwise work."""

    def __init__(self, config: ModelConfig, shard: ModelShard | None = None, fused_kernels: bool = True):
        super().__init__()
        self.config = config
        self.shard = shard = shard or ModelShard.of(config)
        # Zeros, not nn.Embedding's random init (over half of a small model's
        # start): the checkpoint's rows replace them.
        self.embed_tokens = nn.Embedding(len(shard.vocab), config.hidden_size,
                                         _weight=torch.zeros(len(shard.vocab), config.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, shard, self.build_mlp(config, i, shard, fused_kernels), fused_kernels)
            for i in range(config.num_hidden_layers))
        self.norm = rms_norm(config, config.hidden_size, fused_kernels)
        # Tied checkpoints reuse the embedding matrix as the output projection
        # (quantize_model may give them a quantized copy of it).
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, len(shard.vocab), bias=False)
        self.rotary = RotaryEmbedding(config)
        for i in config.sliding_layers:
            self.layers[i].self_attn.window = config.sliding_window
        self.compiled_decode_layer = None  # set by compile_decode

    def build_mlp(self, config: ModelConfig, layer_id: int, shard: ModelShard, fused_kernels: bool) -> nn.Module:
        """Layer `layer_id`'s feed-forward block: the gated MLP."""
        return MLP(config, shard, fused_kernels)

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
            attn = layer.self_attn
            out = attend_decode(q, k, v, *kv_inputs, attn.scale, attn.softcap, attn.sinks)
            return layer.after_attention(out, residual)

        self.compiled_decode_layer = torch.compile(decode_layer)

    def forward(self, batch: ForwardBatch, attn: AttentionBackend, plan: StepPlan = TORCH_STEP,
                native_layers: NativeDecode | None = None, capture: AuxCapture | None = None) -> torch.Tensor:
        """Float32 logits [B, vocab], one row per `batch.logits_indices` entry."""
        return self.logits(self.hidden_states(batch, attn, batch.logits_indices, plan, native_layers, capture))

    def hidden_states(self, batch: ForwardBatch, attn: AttentionBackend, rows: torch.Tensor,
                      plan: StepPlan = TORCH_STEP, native_layers: NativeDecode | None = None,
                      capture: AuxCapture | None = None) -> torch.Tensor:
        """Final-norm hidden states [len(rows), hidden] of the token rows
        `rows` (indices into the batch's new tokens): what the vocabulary
        projection reads, and what embedding models pool. `plan`: how the
        step runs, decided by its owner; `native_layers`: the owner's native
        layer runner, for plans of native layers; `capture`: filled with the
        hidden states entering its layers (not by the compiled decode layer)."""
        if plan.layers in (Layers.NATIVE_DECODE, Layers.NATIVE_EXTENDS) and native_layers is None:
            raise ValueError(f"a step planned for the {plan.layers.value} layers needs the native layer runner")
        if capture is not None and plan.layers == Layers.COMPILED_DECODE:
            raise ValueError("hidden states are not kept by the compiled decode layer")
        attn.prepare(batch, plan)
        x = embed(batch.input_ids, self.embed_tokens.weight, self.shard.vocab.start, self.shard.tp)
        if batch.input_embeds is not None:  # rows given as embeddings, scaled below as looked-up ones are
            x = x.index_copy(0, batch.embeds_rows, batch.input_embeds.to(x.dtype))
        multiplier = self.config.embedding_multiplier
        if multiplier != 1:
            if self.config.embedding_multiplier_rounded:
                multiplier = torch.tensor(multiplier, dtype=x.dtype).item()
            x = x * multiplier
        cos, sin = self.rotary.of_batch(batch, x.dtype)
        match plan.layers:
            case Layers.TORCH:
                x, residual = self._torch_layers(x, cos, sin, batch, attn, capture)
            case Layers.COMPILED_DECODE:
                x, residual = self._compiled_decode_layers(x, cos, sin, attn)
            case Layers.NATIVE_DECODE:
                x, residual = native_layers.run(x, cos, sin, batch.seq_lens, _decode_inputs(attn), capture)
            case Layers.NATIVE_EXTENDS:
                x, residual = native_layers.run_extends(x, cos, sin, batch.out_cache_loc, _native_extends(attn),
                                                        attn.kv_buffer, capture)
        # Only the rows whose next token (or hidden state) is wanted go
        # through the last residual add, the norm and the vocabulary
        # projection, the most expensive matmul for small models.
        x, _ = self.norm(x[rows], residual[rows])
        return x

    def hidden_states_from(self, x: torch.Tensor, batch: ForwardBatch, attn: AttentionBackend,
                           rows: torch.Tensor) -> torch.Tensor:
        """As `hidden_states`, from `x` [tokens, hidden] given as the first
        layer's input instead of the tokens' embeddings (a multi-token-
        prediction layer's projection, model/mtp_head.py), by the torch layers."""
        attn.prepare(batch, TORCH_STEP)
        cos, sin = self.rotary.of_batch(batch, x.dtype)
        x, residual = self._torch_layers(x, cos, sin, batch, attn)
        x, _ = self.norm(x[rows], residual[rows])
        return x

    def _torch_layers(self, x, cos, sin, batch: ForwardBatch, attn: AttentionBackend,
                      capture: AuxCapture | None = None):
        """(the last layer's MLP output, the residual stream before it), op by op."""
        residual = None
        for i, layer in enumerate(self.layers):
            if capture is not None and i in capture.layers:
                capture.states.append(x if residual is None else x + residual)
            q, k, v, residual = layer.before_attention(x, residual, cos, sin)
            x, residual = layer.after_attention(layer.self_attn.attend(q, k, v, batch, attn), residual)
        if capture is not None:
            capture.keep_last(len(self.layers), x, residual)
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
            x, residual = compiled(layer, x, residual, cos, sin, decode_inputs(i, layer.self_attn.window))
        return x, residual

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of final-norm hidden states, over the whole
        vocabulary (gathered from the ranks' shards)."""
        config = self.config
        logits = F.linear(x, self.embed_tokens.weight) if self.lm_head is None else self.lm_head(x)
        logits = self.shard.tp.gather_vocab(logits, config.vocab_size)
        if config.logits_scaling != 1:
            logits = logits / config.logits_scaling
        if config.final_logit_softcap is not None:
            logits = torch.tanh(logits / config.final_logit_softcap) * config.final_logit_softcap
        return logits.float()


def _decode_inputs(attn: AttentionBackend):
    """The backend's per-layer decode inputs, for a step prepared as a decode step."""
    if attn.decode_inputs(0) is None:
        raise ValueError("a step planned as a decode step, which the attention backend did not prepare as one")
    return attn.decode_inputs


def _native_extends(attn: AttentionBackend) -> list[tuple[int, torch.Tensor, bool]]:
    extends = attn.native_extends()
    if extends is None:
        raise ValueError("a step planned for the native extends, which the attention backend did not prepare so")
    return extends
