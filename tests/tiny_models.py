"""Tiny random Llama / Qwen2 / Qwen3 models, saved with transformers itself.

Building them with transformers' own classes and `save_pretrained` means
the files have exactly the names, shapes and config keys that real
checkpoints have, so pyserve's loader is tested on the real format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    tokenizer_dir: str | Path | None = None,
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides,
) -> Path:
    """Write a tiny random model to `out_dir` and return it.

    arch: "llama", "qwen2" or "qwen3". With `tokenizer_dir`, its tokenizer
    files are copied and the vocabulary covers the tokenizer. `overrides`
    go into the transformers config (rope_scaling, tie_word_embeddings...).
    `max_shard_size` (e.g. "200KB") writes a sharded checkpoint with an index.
    """
    import torch
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = 512
    eos = 2
    if tokenizer_dir is not None:
        tokenizer_dir = Path(tokenizer_dir)
        for name in _TOKENIZER_FILES:
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, out / name)
        vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())
        vocab_size = max(
            max(vocab["model"]["vocab"].values(), default=0),
            max((t["id"] for t in vocab.get("added_tokens", [])), default=0),
        ) + 1
        config_path = tokenizer_dir / "config.json"
        if config_path.is_file():
            eos = json.loads(config_path.read_text()).get("eos_token_id", eos)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=eos,
        bos_token_id=1,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).to(torch.float32)
    # Random init is small; scale weights up so logits are not all ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    return out
