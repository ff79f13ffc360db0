"""Tiny random models of every served family, saved by transformers.

Building them with transformers' own classes and `save_pretrained` means the
files have exactly the names, shapes and config keys that real checkpoints
have, so pyserve's loader is tested on the real format. They load in well
under a second, which makes them the model of choice for engine and API
tests that need *a* model rather than a good one:

    from tests.tiny_models import build_tiny_model
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer_dir=default_model_dir)

The same (arch, seed, overrides) always gives the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# arch -> (transformers config class, model class): names, as transformers spells them.
_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    # Sequence classifiers (reward models): the decoder and a score head.
    "llama-classifier": ("LlamaConfig", "LlamaForSequenceClassification"),
    "qwen3-classifier": ("Qwen3Config", "Qwen3ForSequenceClassification"),
    # Gemma 3's image-text checkpoint: the text model's config nested with a tiny vision tower.
    "gemma3-multimodal": ("Gemma3Config", "Gemma3ForConditionalGeneration"),
}
ARCHS = tuple(_CLASSES)
# Per-arch defaults that make the tiny model exercise what sets its family
# apart (values of the real checkpoints' order).
_ARCH_DEFAULTS = {
    "granite": dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625,
                    logits_scaling=8.0),
    "smollm3": dict(no_rope_layer_interval=2),  # layer 1 of 2 without rotary embedding
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # a shared expert with its gate; layer 1 of 2 the dense MLP
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    # GLM-4.5's layout: layer 0 dense, then experts in 2 groups (the best 1 taken) beside a shared one,
    # q/k norms, q/k/v bias, half of each head rotated.
    "glm4_moe": dict(num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
                     num_nextn_predict_layers=0),
    # MiniMax-M2's layout: every layer sparse, q/k norms over all heads, half of each head rotated
    # (the released configs' rotary_dim).
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, rotary_dim=8),
    # A window shorter than the test prompts; scales and caps that bite.
    "gemma2": dict(sliding_window=8, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                   final_logit_softcapping=10.0),
    # Gemma 3's layout: five sliding layers, then a global one, each type with its rope base.
    "gemma3": dict(num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=24, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}}),
    # A window shorter than the test prompts (layer 0 slides, layer 1 is
    # global); the real checkpoints' YaRN rope (GptOssConfig's default).
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
}
_ARCH_DEFAULTS["gemma3-multimodal"] = dict(_ARCH_DEFAULTS["gemma3"], tie_word_embeddings=True)
_TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                    patch_size=14)
# Copied from `tokenizer_dir`; generation_config.json last, so its eos/bos win.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def _tokenizer_vocab_size(tokenizer_json: Path) -> int:
    """One more than the largest token id in a tokenizer.json."""
    tok = json.loads(tokenizer_json.read_text())
    vocab = tok["model"]["vocab"]
    # BPE/WordPiece store {token: id}; Unigram stores [[token, score], ...] in id order.
    largest = max(vocab.values(), default=-1) if isinstance(vocab, dict) else len(vocab) - 1
    largest = max([largest] + [t["id"] for t in tok.get("added_tokens", [])])
    return largest + 1


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    tokenizer_dir: str | Path | None = None,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Write a tiny random model to `out_dir` (created if needed) and return it.

    arch: one of ARCHS, e.g. "llama", "qwen2" (q/k/v bias), "qwen3" (q/k norm).
      Defaults: hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads,
      head_dim 16, vocab 512, bos 1, eos 2, untied embeddings, float32.
    tokenizer_dir: a model directory whose tokenizer.json,
      tokenizer_config.json, special_tokens_map.json and generation_config.json
      (those present) are copied; the vocabulary then covers the tokenizer and
      bos/eos come from its config.json when it has one.
    seed: weights are drawn from torch.manual_seed(seed).
    max_shard_size: e.g. "100KB" writes several shards plus
      model.safetensors.index.json instead of one model.safetensors.
    overrides: any transformers config field, e.g. num_hidden_layers=4,
      tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", ...}.
    """
    import torch
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        pad_token_id=None,  # some families' defaults lie beyond the tiny vocabulary
    )
    config.update(_ARCH_DEFAULTS.get(arch, {}))
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        config["vocab_size"] = _tokenizer_vocab_size(tokenizer_dir / "tokenizer.json")
        if (tokenizer_dir / "config.json").is_file():
            source = json.loads((tokenizer_dir / "config.json").read_text())
            for key in ("bos_token_id", "eos_token_id"):
                if source.get(key) is not None:
                    config[key] = source[key]
    config.update(overrides)
    if arch == "gemma3-multimodal":
        config = dict(text_config=config, vision_config=_TINY_VISION, mm_tokens_per_image=4,
                      tie_word_embeddings=config["tie_word_embeddings"], bos_token_id=config["bos_token_id"],
                      eos_token_id=config["eos_token_id"])

    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[arch])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                # Not all ones, so a norm weight loaded into the wrong place shows.
                p.uniform_(0.5, 1.5)
            else:
                # transformers' init is small; larger weights keep logits from tying.
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: drawn, so that routing reads it
                b.normal_(0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    if tokenizer_dir is not None:
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, out / name)
    return out


# sentence-transformers' names of the poolings pyserve applies.
ST_POOLINGS = ("lasttoken", "mean", "cls")


def build_tiny_embedding_model(
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    pooling: str = "lasttoken",
    normalize: bool = True,
    seed: int = 0,
    tied: bool = True,
    **overrides,
) -> Path:
    """A tiny Qwen3 embedding model laid out as Qwen3-Embedding is: the
    decoder saved without its LM head (tied embeddings as the 0.6B, or
    untied as the 4B and 8B with `tied` False; tensor names
    without `model.`, config.json naming Qwen3ForCausalLM) plus the
    sentence-transformers files: modules.json, the Pooling module's
    config (`pooling`, one of ST_POOLINGS) and, when `normalize`, a
    Normalize module. `overrides` go to config.json, e.g.
    is_matryoshka=True or matryoshka_dimensions=[16, 32]."""
    import transformers

    if pooling not in ST_POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; choose from {ST_POOLINGS}")
    out = build_tiny_model(out_dir, "qwen3", tokenizer_dir, seed, tie_word_embeddings=tied)
    transformers.AutoModel.from_pretrained(out).save_pretrained(out, safe_serialization=True)
    config = json.loads((out / "config.json").read_text())
    config.update(architectures=["Qwen3ForCausalLM"], **overrides)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    # The older one-boolean-per-mode spelling, as Qwen3-Embedding ships it.
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "lasttoken": "pooling_mode_lasttoken"}
    pooling_config = {key: mode == pooling for mode, key in keys.items()}
    pooling_config.update(word_embedding_dimension=config["hidden_size"], include_prompt=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048, "do_lower_case": False}))
    (out / "config_sentence_transformers.json").write_text(json.dumps({"similarity_fn_name": "cosine"}))
    return out
