"""Load Hugging Face safetensors weights into LlamaForCausalLM.

The model is built on the meta device and then given uninitialised storage
on the target device in the target dtype, so no throwaway random weights
(and no float32 copy of a bf16 model) are ever allocated. Tensors are then
read one at a time from the checkpoint (one file or an index of shards) and
copied into place; q/k/v and gate/up land in row ranges of the fused
parameters. Every parameter row range must be filled exactly once.

With a weight quantization (quant.py) the linear layers are then replaced
by quantized ones; where the directory ships weights already quantized
that way (model.int4wo-32.safetensors), those are used as they are.
"""

from __future__ import annotations

import json
import logging
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from pyserve.model.config import ModelConfig
from pyserve.model.llama import LlamaForCausalLM
from pyserve.model.quant import Int4Linear, WeightQuant, prequantized_file, quantize_model, unpack_nibbles

logger = logging.getLogger(__name__)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, or model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} lists shards that are not there: {absent}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


def _fusions(config: ModelConfig) -> dict[str, list[tuple[str, int, int]]]:
    """Fused parameter -> its parts: (checkpoint projection, first row, rows)."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "self_attn.qkv_proj": [
            ("self_attn.q_proj", 0, q),
            ("self_attn.k_proj", q, kv),
            ("self_attn.v_proj", q + kv, kv),
        ],
        "mlp.gate_up_proj": [("mlp.gate_proj", 0, inter), ("mlp.up_proj", inter, inter)],
    }


def _destination(hf_name: str, config: ModelConfig) -> tuple[str, int | None, int | None] | None:
    """(our parameter name, first row, rows) for a checkpoint tensor; rows
    are None for an unfused parameter. None for tensors skipped on purpose."""
    name = hf_name.removeprefix("model.")
    if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved the RoPE buffer
        return None
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # some tied checkpoints store the copy anyway
    for fused, parts in _fusions(config).items():
        for proj, first, rows in parts:
            if f".{proj}." in name:
                return name.replace(proj, fused), first, rows
    return name, None, None


def _expected_pieces(params: dict, config: ModelConfig) -> set[tuple[str, int | None]]:
    """Every (parameter, first row) the checkpoint must fill exactly once."""
    pieces = set()
    for name in params:
        fused = next((f for f in _fusions(config) if f".{f}." in name), None)
        if fused is None:
            pieces.add((name, None))
        else:
            pieces.update((name, first) for _, first, _ in _fusions(config)[fused])
    return pieces


def _shipped_int4(path: Path, config: ModelConfig, group_size: int) -> dict[str, Int4Linear]:
    """Module name -> Int4Linear from a file of `<projection>.codes/.scales/.zeros`,
    the parts of a fused projection concatenated in row order."""
    parts: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key in f.keys():
            if not key.endswith(".codes"):
                continue
            projection = key.removesuffix(".codes")
            name, first, _ = _destination(projection + ".weight", config)
            parts.setdefault(name.removesuffix(".weight"), []).append((
                first or 0, unpack_nibbles(f.get_tensor(key)),
                f.get_tensor(projection + ".scales"), f.get_tensor(projection + ".zeros"),
            ))
    layers = {}
    for module, pieces in parts.items():
        pieces.sort(key=lambda piece: piece[0])
        codes, scales, zeros = (torch.cat([p[i] for p in pieces]) for i in (1, 2, 3))
        layers[module] = Int4Linear(codes, scales, zeros, group_size, None)
    return layers


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str, quant: WeightQuant | None = None
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model in eval mode with every weight loaded, and its config;
    its linear layers quantized as `quant` when given (CPU only)."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    config = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.requires_grad_(False)
    params = dict(model.named_parameters())
    missing = _expected_pieces(params, config)

    files = checkpoint_files(model_dir)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt", device="cpu")) for p in files]
        total = sum(len(h.keys()) for h in handles)
        progress = stack.enter_context(tqdm(total=total, desc=f"Loading {model_dir.name}", unit="tensor"))
        for path, handle in zip(files, handles):
            for hf_name in handle.keys():
                progress.update()
                dest = _destination(hf_name, config)
                if dest is None:
                    continue
                name, first, rows = dest
                if (name, first) not in missing:
                    raise ValueError(
                        f"{path.name}: unexpected (or repeated) tensor {hf_name} for {config.architecture}"
                    )
                target = params[name].data
                if rows is not None:
                    target = target.narrow(0, first, rows)
                tensor = handle.get_tensor(hf_name)
                if tensor.shape != target.shape:
                    raise ValueError(
                        f"{path.name}: {hf_name} has shape {tuple(tensor.shape)}, "
                        f"the config expects {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                missing.discard((name, first))
    if missing:
        names = sorted(n if first is None else f"{n} (rows from {first})" for n, first in missing)
        raise ValueError(f"{model_dir}: {len(names)} weights missing from the checkpoint, e.g. {names[:5]}")
    if quant is not None:
        shipped = prequantized_file(model_dir, quant)
        quantize_model(model, quant, _shipped_int4(shipped, config, quant.group_size) if shipped.is_file() else None)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "Loaded %s (%s, %.1fM dense parameters) as %s on %s%s",
        model_dir, config.architecture, n_params / 1e6, str(dtype).removeprefix("torch."), device,
        f", linear layers {quant.name}" if quant else "",
    )
    return model, config
