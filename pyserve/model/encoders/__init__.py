"""Encoder models: the bidirectional transformers behind most
sentence-embedding models (all-MiniLM, bge, e5, bge-m3, gte-modernbert)
and cross-encoder rerankers (bge-reranker, ms-marco-MiniLM), served as
--is-embedding serves a model (on by itself for them).

Every token attends to every token of its own prompt, those after it
too, so an encoder's prompt is computed whole in one step and never
starts from a cached prefix: the engine runs it unchunked and without the
prefix cache (ModelConfig.causal). Its KV slots are held for that step as
any prompt's are, but hold no memory (the cache keeps no layer of an
encoder): attention runs over the step's own rows, one prompt at a time.

A family is one module here (bert.py, modernbert.py) declaring an
EncoderFamily: the architectures it serves (`<name>Model` and
`<name>ForSequenceClassification`), its config, its model and checkpoint
names, and its classifier head, which the pooling applies (model/pooling.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from pyserve.model.config import SEQUENCE_CLASSIFIER
from pyserve.model.encoders import bert, modernbert
from pyserve.model.encoders.base import Encoder, EncoderConfig, EncoderFamily, HeadNames

FAMILIES = (bert.BERT, bert.ROBERTA, modernbert.FAMILY)
_BY_ARCHITECTURE = {name + suffix: family for family in FAMILIES for name in family.names
                    for suffix in ("Model", SEQUENCE_CLASSIFIER)}
ENCODER_ARCHITECTURES = tuple(_BY_ARCHITECTURE)


def _architecture(cfg: dict) -> str | None:
    return next((a for a in cfg.get("architectures") or [] if a in _BY_ARCHITECTURE), None)


def is_encoder(cfg: dict) -> bool:
    """Whether config.json names an encoder model pyserve serves."""
    return _architecture(cfg) is not None


def classifier_head(cfg: dict) -> HeadNames:
    """An encoder classifier's head, as its family names it."""
    return _BY_ARCHITECTURE[_architecture(cfg)].head(cfg)


def parse_encoder_config(cfg: dict, model_dir: Path) -> EncoderConfig:
    arch = _architecture(cfg)
    return _BY_ARCHITECTURE[arch].parse(cfg, arch, model_dir)


def load_encoder(model_dir: Path, config: EncoderConfig, dtype: torch.dtype, device: torch.device,
                 checkpoint_files: list[Path]) -> Encoder:
    """The encoder with every weight read from `checkpoint_files`; ValueError
    naming a tensor that is missing, unexpected or of the wrong shape."""
    family: EncoderFamily = _BY_ARCHITECTURE[config.architecture]
    with torch.device("meta"):
        model = family.model(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.requires_grad_(False)
    params = dict(model.named_parameters())
    missing = set(params)
    for path in checkpoint_files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                name = family.param_name(key)
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
