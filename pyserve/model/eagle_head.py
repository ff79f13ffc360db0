"""An EAGLE draft head (EAGLE-1 and EAGLE-2; SGLang's `--speculative-algorithm
EAGLE`), as SGLang's `LlamaForCausalLMEagle` runs the checkpoints of
SafeAILab's EAGLE and lmsys' sglang-EAGLE-*: one Llama decoder layer over
the target model's last hidden state.

The head reads, per token, the target's embedding of the token and a
hidden state: for the first draft after target tokens, the target's
hidden state after its final norm (what its vocabulary projection reads);
for the following drafts, the head's own output. `fc` projects the two
concatenated, embedding first, to the residual stream of the layer, whose
attention has no input norm. The layer's output (its residual stream, no
final norm) goes through the target's vocabulary projection.

Checkpoint: config.json (a LlamaConfig of one hidden layer; architectures
LlamaForCausalLM or LlamaForCausalLMEagle) and model.safetensors or
pytorch_model.bin with `fc.weight` (`fc.bias` where it has one) and the
layer's `layers.0.self_attn.{q,k,v,o}_proj`, `layers.0.mlp.{gate,up,down}_proj`
and `layers.0.post_attention_layernorm`, names optionally under `model.`.
An `embed_tokens` or `lm_head` there is not read: the head uses the
target's, as SGLang gives it them.

A token map (SGLang's `--speculative-token-map`, FR-Spec's reduced
vocabulary: a `torch.save`d list of token ids, the most frequent ones)
keeps those rows of the vocabulary projection only, so each draft step
projects onto them alone and the head proposes only them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pyserve.model.attention.base import AttentionBackend
from pyserve.model.config import ModelConfig, base_fields
from pyserve.model.draft_heads import OverTargetConfig, OverTargetHead, checkpoint_tensors, fill_head, head_config
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.attention import Attention
from pyserve.model.layers.mlp import MLP
from pyserve.model.layers.norms import RMSNorm
from pyserve.model.layers.rotary import RotaryEmbedding
from pyserve.model.parallel import ModelShard
from pyserve.model.step_plan import TORCH_STEP

ARCHITECTURES = ("LlamaForCausalLM", "LlamaForCausalLMEagle")


class EagleConfig(OverTargetConfig):
    """What the head's config.json says."""

    name = "EAGLE head"

    def __init__(self, head_dir: Path):
        path, cfg = head_config(head_dir, self.name)
        architectures = cfg.get("architectures") or []
        if not set(architectures) & set(ARCHITECTURES):
            raise ValueError(f"{path} is not an EAGLE head: its architectures are {architectures}, not one of "
                             f"{list(ARCHITECTURES)} (an EAGLE-3 head is --speculative-algorithm EAGLE3's)")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{path}: EAGLE heads of {cfg['num_hidden_layers']} decoder layers are not supported; "
                             "pyserve runs heads of one layer")
        self.model = ModelConfig(architecture=ARCHITECTURES[-1], **base_fields(cfg, {}, str(path)))
        self.target_hidden_size = self.model.hidden_size  # the head's stream is the target's


class EagleHead(OverTargetHead):
    def __init__(self, config: EagleConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor,
                 target_norm: nn.Module, hot_tokens: torch.Tensor | None = None, fused_kernels: bool = True):
        """The target's matrices, final norm and a token map: OverTargetHead."""
        super().__init__(embed_tokens, lm_head, target_norm, hot_tokens)
        c = config.model
        self.config = c
        hidden = c.hidden_size
        shard = ModelShard.of(c)
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.self_attn = Attention(c, 0, shard, fused_kernels)
        self.post_attention_layernorm = RMSNorm(hidden, c.rms_norm_eps, fused_kernels)
        self.mlp = MLP(c, shard, fused_kernels)
        self.rotary = RotaryEmbedding(c)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """For the rows in batch.logits_indices: float32 logits over the
        draft vocabulary, and the output hidden state the next draft step
        reads. `hidden` [tokens, hidden]: the target's (target_features) or
        the head's own; the layer's KV goes to batch.out_cache_loc."""
        embeds = nn.functional.embedding(input_ids, self.embed_tokens).to(hidden.dtype)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        attn.prepare(batch, TORCH_STEP)
        cos, sin = self.rotary.of_batch(batch, x.dtype)
        q, k, v = self.self_attn.project(x, cos, sin)
        out = self.self_attn.output(self.self_attn.attend(q, k, v, batch, attn))
        h, residual = self.post_attention_layernorm(out, x)
        rows = batch.logits_indices  # the MLP is per token: only these rows go on
        output = self.mlp(h[rows]) + residual[rows]
        return (output @ self.lm_head.T).float(), output


def load_token_map(path: Path, vocab_size: int) -> torch.Tensor:
    """The token ids a token map file holds (a `torch.save`d list or 1-D
    tensor of ints), checked against the target's vocabulary."""
    if not path.is_file():
        raise ValueError(f"--speculative-token-map {path} is not a file (pyserve reads local files only)")
    try:
        ids = torch.as_tensor(torch.load(path, map_location="cpu", weights_only=True))
    except Exception as e:  # torch.load raises many kinds for a file it cannot read
        raise ValueError(f"--speculative-token-map {path} is not a torch.save'd list of token ids: {e}") from None
    if ids.dim() != 1 or ids.numel() == 0 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"--speculative-token-map {path} holds a {ids.dtype} tensor of shape {list(ids.shape)}; "
                         "it must be a non-empty list of token ids")
    ids = ids.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"--speculative-token-map {path} names token ids outside the model's vocabulary of "
                         f"{vocab_size}")
    if ids.unique().numel() != ids.numel():
        raise ValueError(f"--speculative-token-map {path} names a token more than once")
    return ids


def load_eagle_head(head_dir: Path, config: EagleConfig, target_embed: torch.Tensor, target_lm_head: torch.Tensor,
                    target_norm: nn.Module, dtype: torch.dtype, device: torch.device,
                    hot_tokens: torch.Tensor | None = None) -> EagleHead:
    """The head with its checkpoint's weights, over the target's embedding,
    vocabulary projection (its `hot_tokens` rows only, where a token map
    gives them) and final norm."""
    c = config.model
    if target_embed.shape[1] != c.hidden_size or target_lm_head.shape[1] != c.hidden_size:
        raise ValueError(f"the EAGLE head in {head_dir} is of hidden size {c.hidden_size}; the target's is "
                         f"{target_embed.shape[1]}")
    tensors = checkpoint_tensors(head_dir)
    head = EagleHead(config, target_embed, target_lm_head, target_norm, hot_tokens).to(dtype)
    tensors.setdefault("fc.bias", torch.zeros(c.hidden_size))  # heads trained without one
    fill_head(head, tensors, "layers.0.", ("fc.",), f"the EAGLE head in {head_dir}")
    return head.to(device)
