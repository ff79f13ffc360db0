"""BERT, RoBERTa and XLM-RoBERTa: post-LN blocks (LayerNorm(x +
attention(x)), then LayerNorm(x + MLP(x))) with biases everywhere, learned
absolute positions (RoBERTa's counted from past its padding id), and
BERT's token types.

Token types (BERT's segment embeddings) are read off the prompt: tokens
after its first separator token are the second segment, as the
tokenizer's pair template types a (query, document) pair; a text alone is
one segment. The separator is the one tokenizer.json's post-processor
puts between a pair.

A classifier's head: BERT's pooler (dense, tanh) and classifier, or
RoBERTa's classification head (dense, tanh, out_proj), on the first token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pyserve.model.attention.bidirectional import attend_within
from pyserve.model.encoders.base import ACTIVATIONS, Encoder, EncoderConfig, EncoderFamily, HeadNames

# Tensors of the checkpoint the encoder does not hold: the classifier head
# the pooling reads, a masked-LM head.
_NOT_THE_ENCODERS = ("pooler.", "classifier.", "cls.", "lm_head.")


@dataclass
class BertConfig(EncoderConfig):
    type_vocab_size: int = 0
    position_offset: int = 0  # RoBERTa's positions start after its padding id
    separator_id: int | None = None  # where the second segment begins (with type_vocab_size > 1)


def _parse(cfg: dict, arch: str, model_dir: Path) -> BertConfig:
    act = cfg.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{model_dir}: hidden_act {act!r} is not supported; pyserve's encoders take "
                         f"{list(ACTIVATIONS)}")
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{model_dir}: position_embedding_type {kind!r} is not supported; pyserve's encoders take "
                         "absolute positions")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    # RoBERTa numbers positions from padding id + 1, so that many fewer fit.
    offset = cfg.get("pad_token_id", 1) + 1 if arch.startswith(("Roberta", "XLMRoberta")) else 0
    types = int(cfg.get("type_vocab_size", 0))
    return BertConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads, rms_norm_eps=0.0,
        rope_theta=0.0, rope_scaling=None, max_position_embeddings=cfg.get("max_position_embeddings", 512) - offset,
        tie_word_embeddings=False, torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"), hidden_act=act,
        causal=False, layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)), type_vocab_size=types,
        position_offset=offset, separator_id=separator_id(model_dir) if types > 1 else None)


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings + c.position_offset, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size) if c.type_vocab_size else None
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)


class _Output(nn.Module):
    """A dense layer, then LayerNorm of its output plus the block's input."""

    def __init__(self, c: BertConfig, inputs: int):
        super().__init__()
        self.dense = nn.Linear(inputs, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, block_input: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + block_input)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.query, self.key, self.value = (nn.Linear(c.hidden_size, c.hidden_size) for _ in range(3))
        self.output = _Output(c, c.hidden_size)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q, k, v = (proj(x).view(-1, self.heads, self.head_dim) for proj in (self.query, self.key, self.value))
        return self.output(attend_within(q, k, v, lengths).reshape(x.shape), x)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.output = _Output(c, c.intermediate_size)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.attention(x, lengths)
        return self.output(self.act(self.intermediate.dense(x)), x)


class BertEncoder(Encoder):
    """Parameter names are the checkpoint's, less a classifier's encoder
    prefix (`bert.`, `roberta.`) and with `attention.self.` as `attention.`."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.embeddings = _Embeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))

    @property
    def layers(self) -> nn.ModuleList:
        return self.encoder.layer

    def encode(self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        c, e = self.config, self.embeddings
        x = e.word_embeddings(ids)
        if e.token_type_embeddings is not None:
            x = x + e.token_type_embeddings(self._token_types(ids, lengths))
        x = e.LayerNorm(x + e.position_embeddings(positions + c.position_offset))
        for layer in self.layers:
            x = layer(x, lengths)
        return x

    def _token_types(self, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """1 for each token after its prompt's first separator, else 0."""
        sep = self.config.separator_id
        if sep is None or self.config.type_vocab_size < 2:
            return torch.zeros_like(ids)
        marks = (ids == sep).long()
        return torch.cat([(m.cumsum(0) - m).clamp(max=1) for m in marks.split(lengths)])


def separator_id(model_dir: Path) -> int | None:
    """The token tokenizer.json's post-processor puts after a pair's first
    text; None without a tokenizer.json or a pair template."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    return separator_of(json.loads(path.read_text()).get("post_processor"))


def separator_of(processor: dict | None) -> int | None:
    if not processor:
        return None
    kind = processor.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        return int(processor["sep"][1])
    if kind == "Sequence":
        return next((s for p in processor.get("processors", []) if (s := separator_of(p)) is not None), None)
    if kind == "TemplateProcessing":
        pair = processor.get("pair") or []
        first = next((i for i, piece in enumerate(pair) if piece.get("Sequence", {}).get("id") == "A"), None)
        after = pair[first + 1] if first is not None and first + 1 < len(pair) else {}
        token = after.get("SpecialToken", {}).get("id")
        ids = processor.get("special_tokens", {}).get(token, {}).get("ids")
        return int(ids[0]) if ids else None
    return None


def _param_name(prefix: str):
    def name(key: str) -> str | None:
        key = key.removeprefix(prefix)
        if key.startswith(_NOT_THE_ENCODERS) or key.endswith(("position_ids", "token_type_ids")):
            return None
        key = key.replace(".attention.self.", ".attention.")
        return key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    return name


BERT = EncoderFamily(("Bert",), _parse, BertEncoder, _param_name("bert."),
                     lambda cfg: HeadNames("bert.pooler.dense", "classifier"))
_ROBERTA_HEAD = HeadNames("classifier.dense", "classifier.out_proj")
ROBERTA = EncoderFamily(("Roberta", "XLMRoberta"), _parse, BertEncoder, _param_name("roberta."),
                        lambda cfg: _ROBERTA_HEAD)
