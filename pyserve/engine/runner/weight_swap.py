"""New weights for the served model, in place: every tensor the model
holds (parameters, buffers, and the tensors its layers derive from them at
load, such as packed 4-bit tiles) is copied from a model read from
another checkpoint the same way. The tensors stay where they are, so
CUDA graphs and the CPU's native layers, which hold their addresses, read
the new values."""

from __future__ import annotations

import torch
from torch import nn


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of every module, by module path and attribute name."""
    found = {}
    for path, module in model.named_modules():
        held = {**module._parameters, **module._buffers,
                **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        for name, tensor in held.items():
            if tensor is not None:
                found[f"{path}.{name}" if path else name] = tensor
    return found


def paired_tensors(served: nn.Module, read: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the served model's tensor, the read one's) for each of `read`'s;
    ValueError when they do not pair up in name, shape and dtype (another
    architecture, size or quantization). The served model may hold more
    (LoRA slots)."""
    targets, pairs = model_tensors(served), []
    for name, source in model_tensors(read).items():
        target = targets.get(name)
        if target is None:
            raise ValueError(f"the served model has no tensor {name}: the checkpoint is of another architecture")
        if target.shape != source.shape or target.dtype != source.dtype:
            raise ValueError(f"{name} is {tuple(source.shape)} {source.dtype} in the checkpoint but "
                             f"{tuple(target.shape)} {target.dtype} in the served model: another size or quantization")
        pairs.append((target, source))
    return pairs


def copy_weights(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each pair's read tensor into its served one (paired_tensors)."""
    with torch.no_grad():
        for target, source in pairs:
            target.copy_(source)
