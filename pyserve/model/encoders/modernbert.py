"""ModernBERT (gte-modernbert, modernbert-embed, gte-reranker-modernbert):
pre-LN blocks (the first without its attention norm) and a final norm,
LayerNorms without biases by default, rotary positions, a GLU MLP
(act(input) * gate), and attention that alternates between global layers
(every `global_attn_every_n_layers`-th, from the first) and local ones
that see the tokens at most `local_attention / 2` positions away, each kind
with its own rotary base. No token types.

A classifier's head: the pooled rows (the first token's, or the mean of
all, as `classifier_pooling` says) through a dense layer, its activation
and a LayerNorm, then the labels' projection.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pyserve.model.attention.bidirectional import attend_within
from pyserve.model.encoders.base import ACTIVATIONS, Encoder, EncoderConfig, EncoderFamily, HeadNames

_NOT_THE_ENCODERS = ("head.", "classifier.", "decoder.")


@dataclass
class ModernBertConfig(EncoderConfig):
    norm_bias: bool = False
    local_window: int = 64  # a local layer's tokens see this far either side
    local_layers: frozenset[int] = frozenset()
    local_rope_theta: float = 10000.0


def _rope_thetas(cfg: dict, source: Path) -> tuple[float, float]:
    """(global, local) rotary bases, from transformers 5's rope_parameters or the original keys."""
    params = cfg.get("rope_parameters") or {}
    kinds = [params.get(kind) or {} for kind in ("full_attention", "sliding_attention")]
    if any(p.get("rope_type", "default") != "default" for p in kinds):
        raise ValueError(f"{source}: ModernBERT's rope scaling is not supported; pyserve takes plain rotary bases")
    return (float(kinds[0].get("rope_theta") or cfg.get("global_rope_theta") or 160000.0),
            float(kinds[1].get("rope_theta") or cfg.get("local_rope_theta") or 10000.0))


def _parse(cfg: dict, arch: str, model_dir: Path) -> ModernBertConfig:
    act = cfg.get("hidden_activation", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{model_dir}: hidden_activation {act!r} is not supported; pyserve's encoders take "
                         f"{list(ACTIVATIONS)}")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["full_attention" if i % cfg.get("global_attn_every_n_layers", 3) == 0
                                       else "sliding_attention" for i in range(layers)]
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    global_theta, local_theta = _rope_thetas(cfg, model_dir)
    return ModernBertConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=hidden // heads, rms_norm_eps=0.0, rope_theta=global_theta,
        rope_scaling=None, max_position_embeddings=cfg.get("max_position_embeddings", 8192),
        tie_word_embeddings=False, torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"), hidden_act=act,
        attention_bias=bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias", False)),
        causal=False, layer_norm_eps=float(cfg.get("norm_eps", 1e-5)), norm_bias=bool(cfg.get("norm_bias", False)),
        local_window=int(cfg.get("local_attention", 128)) // 2,
        local_layers=frozenset(i for i, kind in enumerate(types) if kind == "sliding_attention"),
        local_rope_theta=local_theta)


def _norm(c: ModernBertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, bias=c.norm_bias)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] turned by its positions' angles (halves paired)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class _Attention(nn.Module):
    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.Wqkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=c.attention_bias)
        self.Wo = nn.Linear(c.hidden_size, c.hidden_size, bias=c.attention_bias)


class _Mlp(nn.Module):
    def __init__(self, c: ModernBertConfig):
        super().__init__()
        self.Wi = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=c.mlp_bias)
        self.Wo = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)


class _Layer(nn.Module):
    def __init__(self, c: ModernBertConfig, index: int):
        super().__init__()
        self.attn_norm = _norm(c) if index else None  # the embeddings' norm serves the first layer
        self.attn = _Attention(c)
        self.mlp_norm = _norm(c)
        self.mlp = _Mlp(c)
        self.window = c.local_window if index in c.local_layers else None
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.attn
        h = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = a.Wqkv(h).view(-1, 3, a.heads, a.head_dim).unbind(1)
        out = attend_within(_rotate(q, cos, sin), _rotate(k, cos, sin), v, lengths, reach=self.window)
        x = x + a.Wo(out.reshape(x.shape))
        gated, gate = self.mlp.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp.Wo(self.act(gated) * gate)


class ModernBertEncoder(Encoder):
    """Parameter names are the checkpoint's, less a classifier's `model.`."""

    def __init__(self, config: ModernBertConfig):
        super().__init__(config)
        self.embeddings = nn.Module()
        self.embeddings.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embeddings.norm = _norm(config)
        self.layers = nn.ModuleList(_Layer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = _norm(config)

    def _angles(self, positions: torch.Tensor, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.config.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device=positions.device) / d))
        freqs = positions.float()[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [tokens, 1, head_dim]: every head alike
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def encode(self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        c = self.config
        x = self.embeddings.norm(self.embeddings.tok_embeddings(ids))
        by_kind = {theta: self._angles(positions, theta, x.dtype) for theta in (c.rope_theta, c.local_rope_theta)}
        for layer in self.layers:
            cos, sin = by_kind[c.local_rope_theta if layer.window is not None else c.rope_theta]
            x = layer(x, lengths, cos, sin)
        return self.final_norm(x)


def _param_name(key: str) -> str | None:
    key = key.removeprefix("model.")
    return None if key.startswith(_NOT_THE_ENCODERS) else key


def _head(cfg: dict) -> HeadNames:
    pooling = cfg.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ValueError(f"classifier_pooling {pooling!r} is not supported; pyserve pools by cls or mean")
    return HeadNames("head.dense", "classifier", cfg.get("classifier_activation", "gelu"), "head.norm",
                     float(cfg.get("norm_eps", 1e-5)), pooling)


FAMILY = EncoderFamily(("ModernBert",), _parse, ModernBertEncoder, _param_name, _head)
