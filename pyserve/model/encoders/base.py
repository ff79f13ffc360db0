"""What every encoder shares: its config, the model's interface to the
runner (whole prompts in, final hidden states out, no logits), attention
over each prompt's own rows, and the family record the registry keeps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.attention.bidirectional import whole_prompt_lengths
from pyserve.model.config import ModelConfig
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.parallel import ModelShard

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass
class EncoderConfig(ModelConfig):
    """ModelConfig (what the runner sizes the KV cache and batches by) plus
    what every encoder reads."""

    layer_norm_eps: float = 1e-12


@dataclass(frozen=True)
class HeadNames:
    """Where a sequence classifier's head is in its checkpoint and how it
    runs (model/pooling.py ScoreHead): the pooled row through the dense
    layer and the activation, then the LayerNorm where there is one, then
    the labels' projection."""

    dense: str
    projection: str
    activation: str = "tanh"
    norm: str | None = None
    norm_eps: float = 1e-5
    pooling: str = "cls"  # the rows it reads: the first ("cls") or all ("mean")


@dataclass(frozen=True)
class EncoderFamily:
    names: tuple[str, ...]  # config.json architectures, less their Model / ForSequenceClassification suffix
    # (config.json contents, architecture, source) -> the family's config; ValueError for what it cannot serve.
    parse: Callable[[dict, str, str], EncoderConfig]
    model: type[Encoder]
    # A checkpoint tensor's name -> the model's parameter; None: not the encoder's (a head, a buffer).
    param_name: Callable[[str], str | None]
    head: Callable[[dict], HeadNames]  # a classifier's head, from config.json contents


class Encoder(nn.Module):
    """An encoder as the runner sees a model: `hidden_states` of whole
    prompts, and `logits` of no rows. A family implements `encode`."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.shard = ModelShard.of(config)
        self.lm_head = None
        self.compiled_decode_layer = None

    def encode(self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """The last hidden states [tokens, hidden] of whole prompts, concatenated, `lengths` long each."""
        raise NotImplementedError

    def forward(self, batch: ForwardBatch, attn=None, plan=None, native_layers=None, capture=None) -> torch.Tensor:
        return self.logits(self.hidden_states(batch, attn, batch.logits_indices, capture=capture))

    def hidden_states(self, batch: ForwardBatch, attn, rows: torch.Tensor, plan=None, native_layers=None,
                      capture=None) -> torch.Tensor:
        """The last hidden states [len(rows), hidden] at the token rows
        `rows`, what the pooling reads. `attn` (the KV cache's backend) is
        not used; the other arguments are the causal model's, which an
        encoder step never takes."""
        if capture is not None:
            raise ValueError("an encoder keeps no hidden states for a draft")
        return self.encode(batch.input_ids, batch.positions, whole_prompt_lengths(batch))[rows]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """No rows: an encoder has no vocabulary projection, and an
        embedding server's steps ask for no logits."""
        if x.shape[0]:
            raise ValueError("an encoder model has no vocabulary projection")
        return x.new_zeros(0, self.config.vocab_size, dtype=torch.float32)

