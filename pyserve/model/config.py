"""What pyserve reads from a model's config.json and generation_config.json.

Checkpoints written by different transformers versions spell the same thing
differently (`rope_scaling` with `type` or `rope_type`, transformers 5's
`rope_parameters` holding `rope_theta` too, `torch_dtype` or `dtype`); this
module folds what every family shares into one `ModelConfig`, so the model
code sees one shape. What a family adds (its biases, norms, multipliers)
its module in families/ reads, into the options the shared blocks
(layers/) follow; families/__init__.py puts the two together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


# RoPE variants whose frequencies are fixed at load time (see layers/rotary.py).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# RMSNorm roundings (layers/norms.py): Llama's, the weight applied in
# float32 (Olmo 2), and (1 + weight) in float32 (Gemma).
NORM_STYLES = ("llama", "float32", "gemma")
# The gated MLP's activations (layers/mlp.py), as transformers names them.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict with a `rope_type` key, or None for plain RoPE)."""
    parameters = cfg.get("rope_parameters") or {}
    rope = cfg.get("rope_scaling") or parameters
    # A rope_scaling given beside transformers 5's rope_parameters (an
    # override) keeps the theta those hold.
    theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or parameters.get("rope_theta") or 10000.0)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    kind = "longrope" if kind == "su" else kind  # Phi-3's first name for it
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported; pyserve supports {SUPPORTED_ROPE_TYPES}")
    if kind == "default":
        return theta, None
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type", "type", "partial_rotary_factor")}
    if kind in ("llama3", "yarn", "longrope"):
        # transformers falls back to the model's own context length; Phi-3
        # keeps the original one beside rope_scaling, and that one wins.
        original = cfg.get("original_max_position_embeddings") if kind == "longrope" else None
        scaling["original_max_position_embeddings"] = (
            original or scaling.get("original_max_position_embeddings") or cfg.get("max_position_embeddings"))
    if kind == "longrope" and scaling.get("factor") is None:
        scaling["factor"] = cfg["max_position_embeddings"] / scaling["original_max_position_embeddings"]
    return theta, {"rope_type": kind, **scaling}


def partial_rotary_factor(cfg: dict, default: float = 1.0) -> float:
    """The fraction of each head that rotates (top level or in the rope parameters)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or default)


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
    rope_scaling: dict | None  # None, or {"rope_type": "linear" | "llama3" | "yarn" | "longrope", ...}
    max_position_embeddings: int
    tie_word_embeddings: bool
    torch_dtype: str | None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    # The sampling settings generation_config.json recommends (SAMPLING_DEFAULTS
    # of them), for requests that leave them out (--sampling-defaults model).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # What the shared blocks (layers/) follow; each family sets what its checkpoints need.
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2, some Llamas)
    o_proj_bias: bool = False  # the attention output projection carries a bias (Llama attention_bias)
    mlp_bias: bool = False  # gate/up/down carry a bias (Llama mlp_bias)
    qk_norm: str | None = None  # RMSNorm of q and k: "head", per head (Qwen3); "all", over all heads (Olmo 2)
    attention_scale: float | None = None  # multiplies q.k; None: head_dim ** -0.5
    partial_rotary_factor: float = 1.0  # the fraction of each head that rotates
    rotary_interleaved: bool = False  # rotary pairs dimensions 2i, 2i + 1 (GLM) rather than i, i + half
    nope_layers: frozenset[int] = frozenset()  # layers without rotary embedding (SmolLM3)
    norm_style: str = "llama"  # one of NORM_STYLES
    pre_norms: bool = True  # norms before attention and before the MLP
    post_norms: bool = False  # norms of the attention's and the MLP's outputs (Olmo 2, GLM-4, Gemma)
    embedding_multiplier: float = 1.0  # scales the embeddings (Granite)
    # The multiplier is first rounded to the model dtype (Gemma's sqrt(hidden_size)).
    embedding_multiplier_rounded: bool = False
    hidden_act: str = "silu"  # the gated MLP's activation, one of ACTIVATIONS
    residual_multiplier: float = 1.0  # scales each sublayer's output before its residual add (Granite)
    logits_scaling: float = 1.0  # logits are divided by it (Granite)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # The attention window of the checkpoint's sliding layers: a token there
    # sees the `sliding_window` latest keys, itself included.
    sliding_window: int | None = None
    sliding_layers: frozenset[int] = frozenset()
    # Each token attends to those before it; False: to its whole prompt (an
    # encoder, model/encoders/, or a decoder trained so; its prompts are
    # computed whole, attention/bidirectional.py).
    causal: bool = True

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


# The settings of generation_config.json that requests take as defaults, as
# SGLang's and vLLM's servers take them.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def base_fields(cfg: dict, gen: dict, source: str) -> dict:
    """The ModelConfig fields every family reads the same way, from parsed
    config.json and generation_config.json contents."""
    act = cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ValueError(f"{source}: hidden_act {act!r} is not supported; pyserve supports {ACTIVATIONS}")
    heads = cfg["num_attention_heads"]
    rope_theta, rope_scaling = rope_settings(cfg)
    eos = _as_id_list(cfg.get("eos_token_id"))
    eos += [i for i in _as_id_list(gen.get("eos_token_id")) if i not in eos]
    return dict(
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
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        hidden_act=act,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id", gen.get("bos_token_id")),
        sampling_defaults={k: gen[k] for k in SAMPLING_DEFAULTS if gen.get(k) is not None},
        causal=not cfg.get("use_bidirectional_attention", False),  # EmbeddingGemma's is trained both ways
    )


def sliding_window_fields(cfg: dict, window: int | None, default_sliding) -> dict:
    """`sliding_window` and `sliding_layers` as transformers reads them: the
    config's `layer_types` where it has them, else `default_sliding(i)`, the
    family's rule for layer i; no layer slides without a window."""
    layers = cfg["num_hidden_layers"]
    if not window:
        return dict(sliding_window=None, sliding_layers=frozenset())
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        sliding = frozenset(i for i, kind in enumerate(types) if kind == "sliding_attention")
    else:
        sliding = frozenset(i for i in range(layers) if default_sliding(i))
    return dict(sliding_window=int(window), sliding_layers=sliding)


SEQUENCE_CLASSIFIER = "ForSequenceClassification"  # the architecture suffix of reward models and classifiers


def is_sequence_classifier(cfg: dict) -> bool:
    """Whether config.json names a sequence classifier (a reward model:
    its family's decoder, then a score head; model/pooling.py)."""
    return any(a.endswith(SEQUENCE_CLASSIFIER) for a in cfg.get("architectures") or [])


def read_config_files(model_dir: str | Path, overrides: dict | None = None) -> tuple[dict, dict]:
    """(config.json, generation_config.json or {}) of a model directory;
    `overrides` (--json-model-override-args) replace config.json's keys."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json")
    gen_path = model_dir / "generation_config.json"
    return {**json.loads(path.read_text()), **(overrides or {})}, \
        json.loads(gen_path.read_text()) if gen_path.is_file() else {}
