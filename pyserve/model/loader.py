"""Load Hugging Face safetensors weights into LlamaForCausalLM.

Weights are read shard by shard (single file or an index) and copied into
the fused q/k/v and gate/up parameters. The model is built on the meta
device first, so no throwaway random initialisation is ever allocated.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pyserve.model.config import ModelConfig
from pyserve.model.llama import LlamaForCausalLM, rope_inv_freq

logger = logging.getLogger(__name__)


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ValueError(f"{model_dir} has no .safetensors weights")
    return found


def _target(hf_name: str, config: ModelConfig) -> tuple[str, int | None] | None:
    """Map a checkpoint name to (our parameter name, shard index in a fused
    parameter or None). None means the tensor is not used."""
    name = hf_name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    for proj, shard in (("q_proj", 0), ("k_proj", 1), ("v_proj", 2)):
        if f".self_attn.{proj}." in name:
            return name.replace(f"self_attn.{proj}", "self_attn.qkv_proj"), shard
    for proj, shard in (("gate_proj", 0), ("up_proj", 1)):
        if f".mlp.{proj}." in name:
            return name.replace(f"mlp.{proj}", "mlp.gate_up_proj"), shard
    return name, None


def _shard_offsets(model: LlamaForCausalLM, param_name: str) -> list[int]:
    """Row offsets of the shards inside a fused parameter."""
    cfg = model.config
    if ".qkv_proj." in param_name:
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [0, q, q + kv]
    return [0, cfg.intermediate_size]


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str
) -> tuple[LlamaForCausalLM, ModelConfig]:
    model_dir = Path(model_dir)
    device = torch.device(device)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.inv_freq = rope_inv_freq(config).to(device)
    params = dict(model.named_parameters())

    # Every fused parameter expects each of its shards once.
    expected = {
        (name, shard)
        for name in params
        for shard in (range(3) if ".qkv_proj." in name else range(2) if ".gate_up_proj." in name else [None])
    }
    loaded: set[tuple[str, int | None]] = set()
    files = _shard_files(model_dir)
    for path in tqdm(files, desc="Loading safetensors shards", unit="shard"):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                target = _target(hf_name, config)
                if target is None:
                    continue
                name, shard = target
                if name not in params:
                    raise ValueError(f"{path.name}: unexpected tensor {hf_name}")
                tensor = f.get_tensor(hf_name)
                param = params[name]
                if shard is None:
                    dest = param.data
                else:
                    start = _shard_offsets(model, name)[shard]
                    dest = param.data.narrow(0, start, tensor.shape[0])
                if dest.shape != tensor.shape:
                    raise ValueError(
                        f"{hf_name}: checkpoint shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add(target)
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if missing:
        raise ValueError(f"{model_dir}: weights missing from the checkpoint: {missing[:8]}")
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "Loaded %s (%s, %.1fM parameters) as %s on %s",
        model_dir, config.architecture, n_params / 1e6, str(dtype).removeprefix("torch."), device,
    )
    return model, config
