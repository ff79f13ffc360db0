"""A checkpoint's own multi-token-prediction layer as a draft head: what
SGLang runs for `--speculative-algorithm NEXTN` (or EAGLE with no draft
path) over DeepSeek V3 and GLM-4.5, whose checkpoints carry
`num_nextn_predict_layers` such layers after the model's own.

The first of them, layer L = num_hidden_layers in the checkpoint, reads
per token the embedding of the token and a hidden state (the target's
last, after its final norm, for the first draft; the layer's own output
for chained ones): `eh_proj` of concat(enorm(embedding), hnorm(hidden)),
then a whole decoder layer of the model's own kind (its attention, its
experts), then `shared_head.norm`. The output goes through the target's
vocabulary projection and is the next draft's hidden state. Its tensors
are `model.layers.L.{enorm,hnorm,eh_proj,shared_head.norm}` and the
decoder layer's under `model.layers.L.`; an `embed_tokens` or
`shared_head.head` there is the target's again and is not read.

The layer loads as a one-layer model of the target's family (`MtpPart`,
through the loader's `part`), so its attention and experts are read,
dequantized (a quantized checkpoint's), fused and placed as the target's
are.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from pyserve.model.attention.base import AttentionBackend
from pyserve.model.draft_heads import OverTargetConfig, OverTargetHead
from pyserve.model.families import read_config
from pyserve.model.families.family import Family
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.causal_lm import CausalLM
from pyserve.model.layers.norms import rms_norm
from pyserve.model.parallel import ModelShard

_OWN = ("enorm.", "hnorm.", "eh_proj.")  # the layer's tensors outside its decoder layer
_TARGETS = ("embed_tokens.", "shared_head.head.")  # copies of the target's


def has_mtp_layers(model_dir: Path) -> bool:
    """Whether the checkpoint in `model_dir` is of a served family and carries MTP layers."""
    try:
        return getattr(read_config(model_dir), "mtp_layers", 0) > 0
    except (ValueError, OSError, KeyError):
        return False


class MtpConfig(OverTargetConfig):
    """The target checkpoint's first MTP layer, as a one-layer model's config."""

    name = "multi-token-prediction layer"

    def __init__(self, model_dir: Path, overrides: dict | None = None):
        """`overrides`: the target's --json-model-override-args, which the
        layer, a part of the target, runs with too."""
        checkpoint = read_config(model_dir)
        if not getattr(checkpoint, "mtp_layers", 0):
            raise ValueError(f"{model_dir} has no multi-token-prediction layers (its config.json's "
                             "num_nextn_predict_layers) for NEXTN to draft with")
        self.layer = checkpoint.num_hidden_layers  # its index in the checkpoint, whatever the overrides say
        self.overrides = overrides
        target = read_config(model_dir, overrides) if overrides else checkpoint
        # Experts where the model has any (DeepSeek V3's and GLM-4.5's MTP layers are sparse).
        self.model = replace(target, num_hidden_layers=1, mtp_layers=0,
                             dense_layers=frozenset() if target.moe.num_experts else frozenset({0}))
        self.target_hidden_size = target.hidden_size


class MtpPart:
    """The loader's view of the checkpoint (loader.ModelPart): layer L's
    decoder layer as layer 0 of a one-layer model, its shared_head.norm as
    that model's final norm, enorm/hnorm/eh_proj as modules added to it."""

    def __init__(self, config: MtpConfig):
        self.config = config.model
        self.prefix = f"model.layers.{config.layer}."

    def model(self, family: Family, shard: ModelShard) -> CausalLM:
        c = self.config
        model = family.model(c, shard)
        model.embed_tokens = model.lm_head = None  # the target's are read
        model.enorm = rms_norm(c, c.hidden_size)
        model.hnorm = rms_norm(c, c.hidden_size)
        model.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        return model

    def name_of(self, hf_name: str) -> str | None:
        if not hf_name.startswith(self.prefix):
            return None
        rest = hf_name.removeprefix(self.prefix)
        if rest.startswith(_TARGETS):
            return None
        if rest.startswith(_OWN):
            return "model." + rest
        if rest.startswith("shared_head.norm."):
            return "model.norm." + rest.removeprefix("shared_head.norm.")
        return "model.layers.0." + rest


class MtpHead(OverTargetHead):
    def __init__(self, layer: CausalLM, embed_tokens: torch.Tensor, lm_head: torch.Tensor, target_norm: nn.Module):
        """`layer`: the one-layer model MtpPart loads; the target's matrices
        and final norm: OverTargetHead."""
        super().__init__(embed_tokens, lm_head, target_norm)
        self.layer = layer

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                attn: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """For the rows in batch.logits_indices: float32 logits over the
        target's vocabulary, and the output hidden state the next draft step
        reads. `hidden` [tokens, hidden]: the target's (target_features) or
        the layer's own; the layer's KV goes to batch.out_cache_loc."""
        layer = self.layer
        embeds = nn.functional.embedding(input_ids, self.embed_tokens).to(hidden.dtype)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))
        out = layer.hidden_states_from(x, batch, attn, batch.logits_indices)
        return (out @ self.lm_head.T).float(), out


def load_mtp_head(model_dir: Path, config: MtpConfig, target_embed: torch.Tensor, target_lm_head: torch.Tensor,
                  target_norm: nn.Module, dtype: torch.dtype, device: torch.device,
                  quantization: str = "auto", dummy: bool = False) -> MtpHead:
    """The checkpoint's first MTP layer, whole on this rank, over the
    target's embedding, vocabulary projection and final norm;
    `quantization` as the loader reads it (--speculative-draft-model-quantization);
    `dummy` (--load-format dummy): drawn at random, not read."""
    from pyserve.model.loader import load_model

    layer, _ = load_model(model_dir, dtype, device, quantization=quantization, part=MtpPart(config),
                          config_overrides=config.overrides, dummy=dummy)
    return MtpHead(layer, target_embed, target_lm_head, target_norm).to(device)
