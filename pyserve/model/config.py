"""What pyserve reads from a model's config.json and generation_config.json.

Checkpoints written by different transformers versions spell the same thing
differently (`rope_scaling` with `type` or `rope_type`, transformers 5's
`rope_parameters` holding `rope_theta` too, `torch_dtype` or `dtype`); this
module folds them into one `ModelConfig` so the model code sees one shape.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# RoPE variants whose frequencies are fixed at load time (see llama.py).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict with a `rope_type` key, or None for plain RoPE)."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported; pyserve supports {SUPPORTED_ROPE_TYPES}")
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type", "type")}
    if kind in ("llama3", "yarn"):
        # transformers falls back to the model's own context length.
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, {"rope_type": kind, **scaling}


def _sliding_window(cfg: dict, arch: str) -> int | None:
    """The attention window the checkpoint was trained with, if any."""
    if arch == "MistralForCausalLM":
        return cfg.get("sliding_window")
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and cfg.get("use_sliding_window"):
        return cfg.get("sliding_window")
    return None


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None, or {"rope_type": "linear" | "llama3" | "yarn", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2, some Llamas)
    o_proj_bias: bool  # the attention output projection carries a bias (Llama attention_bias)
    mlp_bias: bool  # gate/up/down carry a bias (Llama mlp_bias)
    qk_norm: bool  # RMSNorm on q and k per head (Qwen3)
    torch_dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json")
        cfg = json.loads(path.read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_dicts(cfg, gen, source=str(model_dir))

    @classmethod
    def from_dicts(cls, cfg: dict, gen: dict | None = None, source: str = "config") -> ModelConfig:
        """From parsed config.json (and generation_config.json) contents."""
        gen = gen or {}
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')}; "
                f"pyserve serves {list(SUPPORTED_ARCHITECTURES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (only silu)")
        heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _rope_settings(cfg)

        max_pos = cfg.get("max_position_embeddings", 4096)
        window = _sliding_window(cfg, arch)
        if window is not None and window < max_pos:
            # Attention here is always full; within the window that is exactly
            # sliding-window attention, so cap the context rather than be wrong.
            logger.warning("%s: sliding_window %d is not implemented; context capped to it", source, window)
            max_pos = window

        eos = _as_id_list(cfg.get("eos_token_id"))
        eos += [i for i in _as_id_list(gen.get("eos_token_id")) if i not in eos]
        bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and never an o_proj bias.
            attention_bias=True if is_qwen2 else bias,
            o_proj_bias=False if is_qwen2 else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
        )
