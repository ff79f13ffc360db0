"""Gemma 2 and Gemma 3 text (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`, and
`Gemma3ForConditionalGeneration` served as text).

Their layers: (1 + w) RMSNorms before and after both sublayers, the
embeddings scaled by sqrt(hidden_size) rounded to the model dtype, the
softmax scale `query_pre_attn_scalar ** -0.5`, a GELU-tanh gated MLP, and
logits soft-capped. Sliding-window layers interleave with global ones
(`layer_types`; else Gemma 2 alternates, Gemma 3 puts a global layer after
every `sliding_window_pattern - 1` sliding ones). Gemma 2 soft-caps the
attention scores; Gemma 3 normalizes q and k per head and rotates its
sliding layers by their own rope base (`rope_local_base_freq`), its global
layers by `rope_theta` with its scaling.

A Gemma 3 trained to attend both ways (`use_bidirectional_attention`:
EmbeddingGemma, saved as `Gemma3TextModel`) is an embedding model whose
prompts attend both ways (attention/bidirectional.py).

Gemma 3's multimodal checkpoint nests the language model's config under
`text_config` and prefixes its tensors (`language_model.model.` as
published, `model.language_model.` as transformers 5 saves it): the
language model is served, the vision tower's and the projector's tensors
are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pyserve.model.checkpoint import SEPARATE_PROJECTIONS
from pyserve.model.config import ACTIVATIONS, ModelConfig, rope_settings
from pyserve.model.families.family import Family
from pyserve.model.layers.causal_lm import CausalLM
from pyserve.model.layers.rotary import RotaryTables
from pyserve.model.parallel import ModelShard

MULTIMODAL = "Gemma3ForConditionalGeneration"
# transformers' defaults where a config.json leaves them out.
_SLIDING_WINDOW_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, MULTIMODAL: 6}
_ROPE_THETA = {"global": 1_000_000.0, "local": 10_000.0}  # Gemma 3
# Gemma3TextConfig's defaults, which a published multimodal config's
# text_config leaves out (it sets only what differs).
_GEMMA3_TEXT = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
                    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096, bos_token_id=2,
                    eos_token_id=1, tie_word_embeddings=True)


@dataclass
class GemmaConfig(ModelConfig):
    attention_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    # The sliding layers' rope base and scaling where they differ from the
    # global layers' (Gemma 3); None: every layer rotates by rope_theta.
    local_rope: tuple[float, dict | None] | None = None


class Gemma(CausalLM):
    """CausalLM with each layer's attention soft-cap and (Gemma 3) its
    rotary table; CausalLM gives the sliding layers their window."""

    def __init__(self, config: GemmaConfig, shard: ModelShard | None = None, fused_kernels: bool = True):
        super().__init__(config, shard, fused_kernels)
        if config.local_rope is not None:
            theta, scaling = config.local_rope
            self.rotary = RotaryTables([config, replace(config, rope_theta=theta, rope_scaling=scaling)])
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            attn.softcap = config.attention_softcap
            if config.local_rope is not None:
                attn.rotary_table = int(i in config.sliding_layers)


def _text_config(cfg: dict) -> dict:
    """The multimodal checkpoint's text_config, with the ids and dtype its top level gives."""
    if MULTIMODAL not in (cfg.get("architectures") or []):
        return cfg
    top = {key: cfg[key] for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype") if key in cfg}
    return {**_GEMMA3_TEXT, **cfg["text_config"], **top, "architectures": [MULTIMODAL]}


def _layer_types(cfg: dict, arch: str) -> list[str]:
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        pattern = cfg.get("sliding_window_pattern") or _SLIDING_WINDOW_PATTERN[arch]
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types} does not give sliding_attention or full_attention for {layers} layers")
    return types


def _rope(cfg: dict, params: dict | None, default_theta: float) -> tuple[float, dict | None]:
    """(rope_theta, scaling) of one layer type's rope parameters."""
    params = {"rope_theta": default_theta, **(params or {})}
    return rope_settings({"rope_parameters": params, "max_position_embeddings": cfg.get("max_position_embeddings")})


def _gemma3_ropes(cfg: dict) -> dict:
    """rope_theta, rope_scaling (global layers) and local_rope (sliding layers)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one set per layer type
        global_, local = params["full_attention"], params.get("sliding_attention")
    else:  # as published: the global layers' rope_theta and rope_scaling, the local base beside them
        global_ = {**(cfg.get("rope_scaling") or params), "rope_theta": cfg.get("rope_theta", _ROPE_THETA["global"])}
        local = {"rope_theta": cfg.get("rope_local_base_freq", _ROPE_THETA["local"])}
    theta, scaling = _rope(cfg, global_, _ROPE_THETA["global"])
    return dict(rope_theta=theta, rope_scaling=scaling, local_rope=_rope(cfg, local, _ROPE_THETA["local"]))


def _config_fields(cfg: dict, arch: str) -> dict:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden_activation {act!r} is not supported; pyserve supports {ACTIVATIONS}")
    window = cfg.get("sliding_window")
    types = _layer_types(cfg, arch)
    fields = dict(
        attention_bias=bool(cfg.get("attention_bias", False)),
        o_proj_bias=bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        norm_style="gemma",
        post_norms=True,
        hidden_act=act,
        embedding_multiplier=cfg["hidden_size"] ** 0.5,
        embedding_multiplier_rounded=True,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        final_logit_softcap=cfg.get("final_logit_softcapping"),
        attention_softcap=cfg.get("attn_logit_softcapping"),
        sliding_window=window if window else None,
        sliding_layers=frozenset(i for i, t in enumerate(types) if t == "sliding_attention" and window),
    )
    if arch != "Gemma2ForCausalLM":
        fields.update(qk_norm="head", **_gemma3_ropes(cfg))
    return fields


FAMILY = Family(
    ("Gemma2ForCausalLM", "Gemma3ForCausalLM", MULTIMODAL),
    _config_fields,
    replace(
        SEPARATE_PROJECTIONS.with_changes(renames={
            # Gemma's post_attention_layernorm normalizes the attention's output;
            # its pre_feedforward_layernorm is our norm before the MLP.
            "post_attention_layernorm": "attention_out_norm",
            "pre_feedforward_layernorm": "post_attention_layernorm",
            "post_feedforward_layernorm": "mlp_out_norm",
        }),
        language_model_prefixes=("language_model.model.", "model.language_model.", "language_model."),
        skipped_prefixes=("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                          "model.multi_modal_projector."),
    ),
    model=Gemma,
    config_class=GemmaConfig,
    text_config=_text_config,
)
