"""What a model family declares: the architectures it serves, how it reads
its config.json into the config the shared blocks follow, how its
checkpoints name their tensors, and its model class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pyserve.model.checkpoint import SEPARATE_PROJECTIONS, CheckpointNames
from pyserve.model.config import ModelConfig
from pyserve.model.layers.causal_lm import CausalLM


@dataclass(frozen=True)
class Family:
    architectures: tuple[str, ...]  # config.json's `architectures` names it serves
    # (config.json contents, the architecture) -> the ModelConfig fields this
    # family sets beyond config.base_fields; ValueError for what it cannot serve.
    config_fields: Callable[[dict, str], dict]
    checkpoint: CheckpointNames = SEPARATE_PROJECTIONS
    # Built as model(config, shard); a subclass of CausalLM where its layers differ.
    model: type[CausalLM] = CausalLM
    # A subclass of ModelConfig where the family's model reads fields of its own.
    config_class: type[ModelConfig] = ModelConfig
    # config.json contents -> the part that configures the language model
    # (a multimodal checkpoint's `text_config`), which everything else reads.
    text_config: Callable[[dict], dict] = lambda cfg: cfg
