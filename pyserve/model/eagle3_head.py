"""An EAGLE-3 draft head, as SGLang's `LlamaForCausalLMEagle3` checkpoints
lay it out: one decoder layer over the target model's hidden states.

The head reads, per token, the embedding of the token (the target's
embedding matrix unless the checkpoint ships its own) and a hidden state:
for the first draft after target tokens, `fc` of three of the target's
hidden states concatenated (those entering the layers the head was trained
on, default 2, L // 2 and L - 3 of the target's L layers); for the
following drafts, the head's own output hidden state. The layer's
attention reads concat(input_layernorm(embedding), hidden_norm(hidden)),
so q/k/v project 2 * hidden; the residual stream starts from the hidden
state. Its logits cover a reduced vocabulary of `draft_vocab_size`
tokens; `d2t` maps draft id i to target id i + d2t[i].

Checkpoint: config.json (architectures ["LlamaForCausalLMEagle3"]) and
model.safetensors or pytorch_model.bin with `fc.weight`, `midlayer.*`
(q/k/v/o_proj, gate/up/down_proj, input_layernorm, hidden_norm,
post_attention_layernorm), `norm.weight`, `lm_head.weight`, `d2t` and
`t2d`, names optionally under `model.`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pyserve.model.attention.base import AttentionBackend
from pyserve.model.config import ModelConfig, base_fields
from pyserve.model.draft_heads import checkpoint_tensors, fill_head, head_config, in_target_vocabulary
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.attention import Attention
from pyserve.model.layers.mlp import MLP
from pyserve.model.layers.norms import RMSNorm
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.parallel import ModelShard
from pyserve.model.step_plan import TORCH_STEP

ARCHITECTURE = "LlamaForCausalLMEagle3"


class Eagle3Config:
    """What the head's config.json says, checked against the target's."""

    name = "EAGLE-3 head"

    def __init__(self, head_dir: Path):
        path, cfg = head_config(head_dir, self.name)
        if ARCHITECTURE not in (cfg.get("architectures") or []):
            raise ValueError(f"{path} is not an EAGLE-3 head: its architectures are {cfg.get('architectures')}, "
                             f"not [{ARCHITECTURE!r}]")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{path}: EAGLE-3 heads of {cfg['num_hidden_layers']} decoder layers are not "
                             "supported; pyserve runs heads of one layer")
        self.model = ModelConfig(architecture=ARCHITECTURE, **base_fields(cfg, {}, str(path)))
        self.draft_vocab_size = int(cfg.get("draft_vocab_size") or self.model.vocab_size)
        self.target_hidden_size = int(cfg.get("target_hidden_size") or self.model.hidden_size)
        self.fc_bias = bool(cfg.get("bias", False))
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        self.aux_layer_ids = None if ids is None else [int(i) for i in ids]

    def aux_layers(self, target_layers: int) -> frozenset[int]:
        """The target layers whose entering hidden states `fc` reads. The
        checkpoint names layers by output (layer i's output enters layer
        i + 1); without names, SGLang's default (2, L // 2, L - 3)."""
        if self.aux_layer_ids is None:
            layers = [2, target_layers // 2, target_layers - 3]
        else:
            layers = [i + 1 for i in self.aux_layer_ids]
        chosen = frozenset(layers)
        if len(chosen) != 3 or not all(0 <= i < target_layers for i in chosen):
            raise ValueError(f"the EAGLE-3 head reads three hidden states of the target, entering layers {layers}; "
                             f"the target has {target_layers} layers (name three others in the head's "
                             "eagle_config.eagle_aux_hidden_state_layer_ids)")
        return chosen


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, embed_tokens: torch.Tensor, fused_kernels: bool = True):
        """`embed_tokens`: the target's embedding matrix, unless the checkpoint has one."""
        super().__init__()
        c = config.model
        self.config = c
        hidden = c.hidden_size
        shard = ModelShard.of(c)
        self.fc = nn.Linear(3 * config.target_hidden_size, hidden, bias=config.fc_bias)
        self.input_layernorm = RMSNorm(hidden, c.rms_norm_eps, fused_kernels)
        self.hidden_norm = RMSNorm(hidden, c.rms_norm_eps, fused_kernels)
        self.post_attention_layernorm = RMSNorm(hidden, c.rms_norm_eps, fused_kernels)
        self.self_attn = Attention(c, 0, shard, fused_kernels)
        attn = self.self_attn
        self.self_attn.qkv_proj = nn.Linear(2 * hidden, attn.q_size + 2 * attn.kv_size, bias=c.attention_bias)
        self.mlp = MLP(c, shard, fused_kernels)
        self.norm = RMSNorm(hidden, c.rms_norm_eps, fused_kernels)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.embed_tokens = embed_tokens.detach()  # a plain tensor: not among the head's parameters
        self.rotary = RotaryEmbedding(c)
        # Target id of each draft id.
        self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size), persistent=False)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """For the rows in batch.logits_indices: float32 logits over the
        draft vocabulary, and the pre-norm hidden state the next draft
        step reads. `hidden` [tokens, 3 * target hidden] (the target's,
        through fc) or [tokens, hidden] (the head's own); the layer's KV
        goes to batch.out_cache_loc."""
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        embeds = nn.functional.embedding(input_ids, self.embed_tokens).to(hidden.dtype)
        attn.prepare(batch, TORCH_STEP)
        cos, sin = self.rotary.of_batch(batch, hidden.dtype)
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q, k, v = self.self_attn.project(x, cos, sin)
        out = self.self_attn.output(self.self_attn.attend(q, k, v, batch, attn))
        h, residual = self.post_attention_layernorm(out, hidden)
        rows = batch.logits_indices  # the MLP and the norms are per token: only these rows go on
        x, residual = self.norm(self.mlp(h[rows]), residual[rows])
        return self.lm_head(x).float(), residual

    def target_features(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The hidden states the head reads from what the target kept: the
        three concatenated, which `fc` projects."""
        return torch.cat(states, dim=-1)

    def target_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return in_target_vocabulary(logits, self.draft_to_target, vocab_size)


def load_eagle3_head(head_dir: Path, config: Eagle3Config, target_embed: torch.Tensor,
                     target_lm_head: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> Eagle3Head:
    """The head with its checkpoint's weights. Without its own embedding
    (the usual case) it reads the target's; without `lm_head` (and with the
    target's vocabulary) it projects with the target's dense
    `target_lm_head` (None: the target's is quantized); without `d2t` its
    vocabulary is the target's."""
    tensors = checkpoint_tensors(head_dir)
    embed = tensors.pop("embed_tokens.weight", None)
    embed = target_embed if embed is None else embed.to(device, dtype)
    head = Eagle3Head(config, embed).to(dtype)
    if "lm_head.weight" not in tensors and target_lm_head is not None \
            and target_lm_head.shape == (config.draft_vocab_size, config.model.hidden_size):
        tensors["lm_head.weight"] = target_lm_head
    # The checkpoint's names: the decoder layer's parts under `midlayer.`.
    fill_head(head, tensors, "midlayer.", ("fc.", "lm_head.", "norm."), f"the EAGLE-3 head in {head_dir}")
    with torch.no_grad():
        d2t = tensors.get("d2t")
        if d2t is not None:
            if d2t.shape != (config.draft_vocab_size,):
                raise ValueError(f"the EAGLE-3 head's d2t has {d2t.shape[0]} entries for a draft vocabulary "
                                 f"of {config.draft_vocab_size}")
            head.draft_to_target += d2t.long()
    target_vocab = target_embed.shape[0]
    if int(head.draft_to_target.max()) >= target_vocab or int(head.draft_to_target.min()) < 0:
        raise ValueError(f"the EAGLE-3 head's d2t maps draft tokens outside the target's vocabulary of {target_vocab}")
    return head.to(device)
