"""The model families pyserve serves, by architecture name.

A family is one module here declaring a `Family` (family.py): the
architectures it serves, its config fields, its checkpoint names and its
model class, built from the shared blocks (layers/). Adding one is that
module, its line in FAMILIES and its tests (docs/model-families.md).
"""

from __future__ import annotations

from pathlib import Path

from pyserve.model.config import (SEQUENCE_CLASSIFIER, ModelConfig, base_fields, is_sequence_classifier,
                                  read_config_files)
from pyserve.model.encoders import ENCODER_ARCHITECTURES, is_encoder
from pyserve.model.families import (deepseek, gemma, glm4, glm4_moe, gpt_oss, granite, llama, minimax_m2, mixtral,
                                   olmo2, phi3, qwen, qwen_moe, smollm3)
from pyserve.model.families.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen.FAMILY, phi3.FAMILY, granite.FAMILY, olmo2.FAMILY, glm4.FAMILY,
                                smollm3.FAMILY, mixtral.FAMILY, qwen_moe.FAMILY, gemma.FAMILY, gpt_oss.FAMILY,
                                deepseek.FAMILY, glm4_moe.FAMILY, minimax_m2.FAMILY)
_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
SERVED_ARCHITECTURES = tuple(_BY_ARCHITECTURE)


def family_of(architecture: str) -> Family:
    return _BY_ARCHITECTURE[architecture]


# Base-model names that are not <name>Model beside <name>ForCausalLM.
_BASE_MODELS = {"Gemma3TextModel": "Gemma3ForCausalLM"}


def causal_architecture(architecture: str) -> str:
    """The causal LM whose decoder a sequence classifier (a reward model,
    LlamaForSequenceClassification) or a base model (an embedding model
    saved without its vocabulary projection: MistralModel, Gemma3TextModel)
    runs: its config is that model's."""
    if architecture.endswith(SEQUENCE_CLASSIFIER):
        return architecture.replace(SEQUENCE_CLASSIFIER, "ForCausalLM")
    if architecture in _BASE_MODELS:
        return _BASE_MODELS[architecture]
    return architecture.removesuffix("Model") + "ForCausalLM" if architecture.endswith("Model") else architecture


def _is_base_model(cfg: dict) -> bool:
    """Whether config.json names a served family's base model."""
    archs = cfg.get("architectures") or []
    return any(a.endswith("Model") and causal_architecture(a) in _BY_ARCHITECTURE for a in archs)


def scores_only(cfg: dict) -> str | None:
    """What the model in config.json is when it embeds or scores and cannot
    generate, as SGLang and vLLM tell by the architecture (it is served as
    --is-embedding asks); None for a model that generates."""
    if is_sequence_classifier(cfg):
        return "a sequence classifier (a reward model)"
    if is_encoder(cfg):
        return "an encoder model"
    if _is_base_model(cfg):
        return "a base model, without a vocabulary projection"
    if cfg.get("use_bidirectional_attention"):
        return "a model attending both ways"
    return None


def parse_config(cfg: dict, gen: dict | None = None, source: str = "config") -> ModelConfig:
    """The config of a served architecture, from parsed config.json (and
    generation_config.json) contents; ValueError naming what is served otherwise."""
    archs = [causal_architecture(a) for a in cfg.get("architectures") or []]
    arch = next((a for a in archs if a in _BY_ARCHITECTURE), None)
    if arch is None:
        raise ValueError(f"{source}: unsupported architecture {archs or cfg.get('model_type')}; "
                         f"pyserve serves {list(SERVED_ARCHITECTURES)}, and with --is-embedding their base models "
                         f"(<name>Model), their ForSequenceClassification reward models and the encoders "
                         f"{list(ENCODER_ARCHITECTURES)}")
    family = _BY_ARCHITECTURE[arch]
    cfg = family.text_config(cfg)
    fields = base_fields(cfg, gen or {}, source)
    try:
        fields.update(family.config_fields(cfg, arch))
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None
    return family.config_class(architecture=arch, **fields)


def read_config(model_dir: str | Path, overrides: dict | None = None) -> ModelConfig:
    """The config of the model in `model_dir` (config.json, generation_config.json,
    `overrides` replacing config.json's keys)."""
    cfg, gen = read_config_files(model_dir, overrides)
    return parse_config(cfg, gen, source=str(model_dir))
