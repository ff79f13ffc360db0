"""What the draft heads share: reading a head's checkpoint into its
parameters, the target's whole matrices it borrows, placing logits over a
reduced draft vocabulary at their target ids, and (`OverTargetHead`) the
reading of the target's last hidden state and vocabulary projection that
EAGLE-1/2 heads and multi-token-prediction layers have in common."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def in_target_vocabulary(logits: torch.Tensor, draft_to_target: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits [n, draft vocab] placed at their target ids
    (`draft_to_target`) in [n, vocab_size]; -inf at the tokens the head
    never proposes."""
    full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
    full[:, draft_to_target] = logits
    return full


class OverTargetConfig:
    """The config side of an OverTargetHead."""

    def aux_layers(self, target_layers: int) -> frozenset[int]:
        """What the target keeps for the head: its residual stream after
        its last layer (layers/causal_lm.AuxCapture), which the head turns
        into the hidden state it reads with the target's final norm."""
        return frozenset({target_layers})


class OverTargetHead(nn.Module):
    """A head that reads the target's last hidden state (its stream after
    the last layer through its final norm) and projects with the target's
    vocabulary matrix: `embed_tokens`, `lm_head` the target's whole
    matrices, `target_norm` its final norm; `hot_tokens` a token map's ids
    (None: every token), the rows of `lm_head` the head keeps."""

    def __init__(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor, target_norm: nn.Module,
                 hot_tokens: torch.Tensor | None = None):
        super().__init__()
        # Plain tensors and the target's own module: not among the head's parameters.
        self.embed_tokens = embed_tokens.detach()
        self.lm_head = lm_head.detach() if hot_tokens is None else lm_head.detach()[hot_tokens]
        self.target_norm = [target_norm]  # in a list, so that it is not one of the head's modules
        self.reduced = hot_tokens is not None
        self.register_buffer("draft_to_target", torch.arange(lm_head.shape[0]) if hot_tokens is None
                             else hot_tokens.clone(), persistent=False)

    def target_features(self, states: list[torch.Tensor]) -> torch.Tensor:
        """The hidden state the head reads from what the target kept (its
        residual stream after the last layer): that stream through the
        target's final norm."""
        (stream,) = states
        return self.target_norm[0](stream)

    def target_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Without a token map the head's logits are over the target's vocabulary already."""
        return in_target_vocabulary(logits, self.draft_to_target, vocab_size) if self.reduced else logits


def whole_target_embedding(target_dir: Path) -> torch.Tensor:
    """The target checkpoint's embedding matrix, every row of it (a
    tensor-parallel rank holds a share)."""
    return whole_target_matrix(target_dir, ("model.embed_tokens.weight",))


def whole_target_matrix(target_dir: Path, names: tuple[str, ...]) -> torch.Tensor:
    """The first of the target checkpoint's tensors `names` that it has, whole."""
    from safetensors import safe_open

    from pyserve.model.loader import checkpoint_files

    for name in names:
        for path in checkpoint_files(target_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                if name in f.keys():
                    return f.get_tensor(name)
    raise ValueError(f"the target checkpoint {target_dir} has none of {list(names)} for the draft head to read")


def head_config(head_dir: Path, name: str) -> tuple[Path, dict]:
    """The path and contents of the `name` head's config.json in
    `head_dir`. ValueError without one, or for a quantized head: its
    weights load as they are stored, unquantized."""
    path = head_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"the {name} directory {head_dir} has no config.json")
    cfg = json.loads(path.read_text())
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method is not None:
        raise ValueError(f"{path}: the {name} is quantized ({method}); pyserve loads draft heads unquantized")
    return path, cfg


def checkpoint_tensors(head_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head's checkpoint, names without a leading `model.`."""
    from safetensors.torch import load_file

    files = sorted(head_dir.glob("*.safetensors"))
    if files:
        tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    elif (head_dir / "pytorch_model.bin").is_file():
        tensors = torch.load(head_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"the draft head directory {head_dir} has no *.safetensors nor pytorch_model.bin")
    return {k.removeprefix("model."): v for k, v in tensors.items()}


# A head's fused projections and the checkpoint's parts of each, in order.
_FUSED_PROJECTIONS = {"self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
          "mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}


def fill_head(head: nn.Module, tensors: dict[str, torch.Tensor], layer_prefix: str, outside: tuple[str, ...],
              what: str) -> None:
    """Copy a checkpoint's `tensors` into the head's parameters: those
    whose names start with `outside` by their own names, the decoder
    layer's under `layer_prefix`, its q/k/v and gate/up fused as the head
    holds them. ValueError, naming `what`, for a missing or misshapen one."""
    wanted = {(n if n.startswith(outside) else layer_prefix + n): p for n, p in head.named_parameters()}
    for fused, parts in _FUSED_PROJECTIONS.items():
        names = [f"{layer_prefix}{fused.replace(fused.split('.')[1], p)}" for p in parts]
        if all(n in tensors for n in names):
            tensors[layer_prefix + fused] = torch.cat([tensors.pop(n) for n in names])
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise ValueError(f"{what} lacks {missing}")
    with torch.no_grad():
        for name, param in wanted.items():
            t = tensors[name]
            if t.shape != param.shape:
                raise ValueError(f"{what}: its {name} is {list(t.shape)}, expected {list(param.shape)} from its "
                                 "config.json")
            param.copy_(t)
