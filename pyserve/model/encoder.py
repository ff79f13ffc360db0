"""Encoder models: BERT, RoBERTa and XLM-RoBERTa, the bidirectional
transformers behind most sentence-embedding models (all-MiniLM, bge, e5,
bge-m3) and cross-encoder rerankers (bge-reranker, ms-marco-MiniLM).

Every token attends to every token of its own prompt, those after it
too, so an encoder's prompt is computed whole in one step and never
starts from a cached prefix: the engine runs it unchunked and without the
prefix cache (ModelConfig.causal). Its KV slots are held for that step as
any prompt's are, but hold no memory (the cache keeps no layer of an
encoder): attention runs over the step's own rows, one prompt at a time. The blocks are post-LN
(LayerNorm(x + attention(x)), then LayerNorm(x + MLP(x))); positions are
learned and absolute, RoBERTa's counted from past its padding id.

Token types (BERT's segment embeddings) are read off the prompt: tokens
after its first separator token are the second segment, as the
tokenizer's pair template types a (query, document) pair; a text alone is
one segment. The separator is the one tokenizer.json's post-processor
puts between a pair.

A sequence classifier's head (BERT's pooler and classifier, RoBERTa's
classification head) is applied by the pooling (model/pooling.py), not here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from pyserve.model.config import SEQUENCE_CLASSIFIER, ModelConfig
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.parallel import ModelShard

# The encoder families: config.json's architecture, without its
# ForSequenceClassification suffix, and the checkpoint's prefix of the
# encoder's tensors in a classifier.
_FAMILIES = {"Bert": "bert.", "Roberta": "roberta.", "XLMRoberta": "roberta."}
ENCODER_ARCHITECTURES = tuple(name + suffix for name in _FAMILIES for suffix in ("Model", SEQUENCE_CLASSIFIER))
_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# Tensors of the checkpoint the encoder does not hold: the classifier head
# the pooling reads, a masked-LM head, saved position-id buffers.
_NOT_THE_ENCODERS = ("pooler.", "classifier.", "cls.", "lm_head.")


def classifier_head_names(cfg: dict) -> tuple[str, str]:
    """An encoder classifier's head tensors: (its dense layer, the labels' projection)."""
    arch = next(a for a in cfg["architectures"] if a in ENCODER_ARCHITECTURES)
    return ("bert.pooler.dense", "classifier") if arch.startswith("Bert") else ("classifier.dense", "classifier.out_proj")


def is_encoder(cfg: dict) -> bool:
    """Whether config.json names an encoder model this module serves."""
    return any(a in ENCODER_ARCHITECTURES for a in cfg.get("architectures") or [])


@dataclass
class EncoderConfig(ModelConfig):
    """ModelConfig (what the runner sizes the KV cache and batches by) plus
    what the encoder reads."""

    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0
    position_offset: int = 0  # RoBERTa's positions start after its padding id
    separator_id: int | None = None  # where the second segment begins (with type_vocab_size > 1)


def parse_encoder_config(cfg: dict, source: str) -> EncoderConfig:
    arch = next(a for a in cfg["architectures"] if a in ENCODER_ARCHITECTURES)
    act = cfg.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{source}: hidden_act {act!r} is not supported; pyserve's encoders take {list(_ACTIVATIONS)}")
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"{source}: position_embedding_type {kind!r} is not supported; pyserve's encoders take "
                         "absolute positions")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    # RoBERTa numbers positions from padding id + 1, so that many fewer fit.
    offset = cfg.get("pad_token_id", 1) + 1 if arch.startswith(("Roberta", "XLMRoberta")) else 0
    return EncoderConfig(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads, rms_norm_eps=0.0,
        rope_theta=0.0, rope_scaling=None, max_position_embeddings=cfg.get("max_position_embeddings", 512) - offset,
        tie_word_embeddings=False, torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"), hidden_act=act,
        causal=False, layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(cfg.get("type_vocab_size", 0)), position_offset=offset)


class _Embeddings(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings + c.position_offset, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size) if c.type_vocab_size else None
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)


class _Output(nn.Module):
    """A dense layer, then LayerNorm of its output plus the block's input."""

    def __init__(self, c: EncoderConfig, inputs: int):
        super().__init__()
        self.dense = nn.Linear(inputs, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, block_input: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + block_input)


class _Attention(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.query, self.key, self.value = (nn.Linear(c.hidden_size, c.hidden_size) for _ in range(3))
        self.output = _Output(c, c.hidden_size)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        q, k, v = (proj(x).view(-1, self.heads, self.head_dim).transpose(0, 1)
                   for proj in (self.query, self.key, self.value))
        # Each prompt attends within itself, all of it.
        out = torch.cat([F.scaled_dot_product_attention(qs, ks, vs) for qs, ks, vs in
                         zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))], dim=1)
        return self.output(out.transpose(0, 1).reshape(x.shape), x)


class _Layer(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.output = _Output(c, c.intermediate_size)
        self.act = _ACTIVATIONS[c.hidden_act]

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.attention(x, lengths)
        return self.output(self.act(self.intermediate.dense(x)), x)


class EncoderModel(nn.Module):
    """Parameter names are the checkpoint's, less a classifier's encoder
    prefix (`bert.`, `roberta.`) and with `attention.self.` as `attention.`."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.shard = ModelShard.of(config)
        self.embeddings = _Embeddings(config)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))
        self.lm_head = None
        self.compiled_decode_layer = None

    @property
    def layers(self) -> nn.ModuleList:
        return self.encoder.layer

    def forward(self, batch: ForwardBatch, attn=None, plan=None, native_layers=None, capture=None) -> torch.Tensor:
        return self.logits(self.hidden_states(batch, attn, batch.logits_indices, capture=capture))

    def hidden_states(self, batch: ForwardBatch, attn, rows: torch.Tensor, plan=None, native_layers=None,
                      capture=None) -> torch.Tensor:
        """The last layer's output [len(rows), hidden] at the token rows
        `rows`, what the pooling reads. `attn` (the KV cache's backend) is
        not used; the other arguments are the causal model's, which an
        encoder step never takes."""
        if capture is not None:
            raise ValueError("an encoder keeps no hidden states for a draft")
        lengths = list(batch.extend_lens)
        if lengths != list(batch.seq_lens):
            raise ValueError("an encoder computes whole prompts: this step has one in chunks or after a cached prefix")
        c, e = self.config, self.embeddings
        ids = batch.input_ids
        x = e.word_embeddings(ids)
        if e.token_type_embeddings is not None:
            x = x + e.token_type_embeddings(self._token_types(ids, lengths))
        x = e.LayerNorm(x + e.position_embeddings(batch.positions + c.position_offset))
        for layer in self.layers:
            x = layer(x, lengths)
        return x[rows]

    def _token_types(self, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """1 for each token after its prompt's first separator, else 0."""
        sep = self.config.separator_id
        if sep is None or self.config.type_vocab_size < 2:
            return torch.zeros_like(ids)
        marks = (ids == sep).long()
        return torch.cat([(m.cumsum(0) - m).clamp(max=1) for m in marks.split(lengths)])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """No rows: an encoder has no vocabulary projection, and an
        embedding server's steps ask for no logits."""
        if x.shape[0]:
            raise ValueError("an encoder model has no vocabulary projection")
        return x.new_zeros(0, self.config.vocab_size, dtype=torch.float32)


def separator_id(model_dir: Path) -> int | None:
    """The token tokenizer.json's post-processor puts after a pair's first
    text; None without a tokenizer.json or a pair template."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    return _separator_of(json.loads(path.read_text()).get("post_processor"))


def _separator_of(processor: dict | None) -> int | None:
    if not processor:
        return None
    kind = processor.get("type")
    if kind in ("BertProcessing", "RobertaProcessing"):
        return int(processor["sep"][1])
    if kind == "Sequence":
        return next((s for p in processor.get("processors", []) if (s := _separator_of(p)) is not None), None)
    if kind == "TemplateProcessing":
        pair = processor.get("pair") or []
        first = next((i for i, piece in enumerate(pair) if piece.get("Sequence", {}).get("id") == "A"), None)
        after = pair[first + 1] if first is not None and first + 1 < len(pair) else {}
        token = after.get("SpecialToken", {}).get("id")
        ids = processor.get("special_tokens", {}).get(token, {}).get("ids")
        return int(ids[0]) if ids else None
    return None


def _param_name(key: str, prefix: str) -> str | None:
    """The encoder's name for checkpoint tensor `key`; None for one it does not hold."""
    key = key.removeprefix(prefix)
    if key.startswith(_NOT_THE_ENCODERS) or key.endswith(("position_ids", "token_type_ids")):
        return None
    key = key.replace(".attention.self.", ".attention.")
    return key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")


def load_encoder(model_dir: Path, config: EncoderConfig, dtype: torch.dtype, device: torch.device,
                 checkpoint_files: list[Path]) -> EncoderModel:
    """The encoder with every weight read from `checkpoint_files`; ValueError
    naming a tensor that is missing, unexpected or of the wrong shape."""
    if config.type_vocab_size > 1:
        config.separator_id = separator_id(model_dir)
    with torch.device("meta"):
        model = EncoderModel(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.requires_grad_(False)
    params = dict(model.named_parameters())
    missing = set(params)
    prefix = _FAMILIES[config.architecture.removesuffix(SEQUENCE_CLASSIFIER).removesuffix("Model")]
    for path in checkpoint_files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = _param_name(key, prefix)
                if name is None:
                    continue
                if name not in missing:
                    raise ValueError(f"{path.name}: unexpected (or repeated) tensor {key} for {config.architecture}")
                tensor = f.get_tensor(key)
                if tensor.shape != params[name].shape:
                    raise ValueError(f"{path.name}: {key} has shape {tuple(tensor.shape)}, the config expects "
                                     f"{tuple(params[name].shape)}")
                params[name].data.copy_(tensor)
                missing.discard(name)
    if missing:
        raise ValueError(f"{model_dir}: {len(missing)} weights missing from the checkpoint, e.g. {sorted(missing)[:5]}")
    return model.eval()
