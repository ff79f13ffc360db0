"""Weight-only quantized linear layers for the CPU (`--torchao-config`).

On a CPU a small model's decode step reads every weight once per token,
so it is bound by memory bandwidth: 4-bit weights read an eighth of what
float32 does. The matmuls are torch's own packed CPU ops,
`_weight_int8pack_mm` (int8, one scale per output row) and
`_weight_int4pack_mm_for_cpu` (int4 in groups along the input dimension,
a scale and a zero per group). torchao's int8/int4 weight-only CPU
layouts call these same ops; using them directly avoids its tensor
subclasses (see README, "CPU speed"). Both ops are fast only with
bfloat16 activations (float32 ones take a slow generic path), so each
quantized layer casts its input to bfloat16 and its output back: the
rest of the model keeps its dtype.

Modes: `int8wo`, `int4wo-<group>` (group 32, 64, 128 or 256), `8da4w`
(4-bit weights in blocks of 32 with 8-bit dynamic activations, ggml's
Q4_1 x Q8 products by pyserve's Rust kernels: blocks.py), `none`,
and `auto`: on the CPU, the 4-bit weights a model directory ships already
(the embedded model's, converted once from its GGUF file,
default_model.py) as 8da4w where the CPU has AVX2 (else int4wo-32); a
checkpoint quantized by another tool (quantized/) in its natural mode:
4-bit ones as 8da4w (else int4wo with their group size), 8-bit and FP8
ones as int8wo; none otherwise. Every mode applies to mixture-of-experts
models' experts as well: each expert's gate/up and down weights become
one layer of the mode (and the shared expert's), which the MoE block's
grouped path calls on the rows routed to it (layers/moe.py). The vocabulary projection (lm_head, or the tied
embedding matrix) is int8 in every mode (Q8_0 blocks in 8da4w): it is the
largest matmul and the most sensitive to rounding; the embedding lookup
stays dense.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.cpu import blocks
from pyserve.model.config import read_config_files
from pyserve.model.cpu.blocks import Q4_1Linear, Q8_0Linear, int4_groups
from pyserve.model.layers.moe import MoEBlock
from pyserve.model.quantized.scheme import Scheme, detect

logger = logging.getLogger(__name__)

INT4_GROUP_SIZES = (32, 64, 128, 256)
_ACT_DTYPE = torch.bfloat16  # the activations the packed CPU kernels are fast with
_INT4_ROW_MULTIPLE = 16  # the int4 packing needs output rows in multiples of this


@dataclass(frozen=True)
class WeightQuant:
    bits: int  # 8 or 4
    group_size: int | None = None  # int4: input columns sharing a scale and zero
    int8_activations: bool = False  # 8da4w: blocks.py's kernels
    # 8da4w: the threads its kernels split their work among (the caller's
    # included), which RankModel, the owner of the CPU's threads, gives.
    kernel_threads: int = field(default=1, compare=False)

    @property
    def name(self) -> str:
        if self.int8_activations:
            return "8da4w"
        return "int8wo" if self.bits == 8 else f"int4wo-{self.group_size}"

    @property
    def stored_as(self) -> str:
        """The name of the prequantized file this mode reads (8da4w's weights are int4wo-32's)."""
        return f"int4wo-{self.group_size}" if self.bits == 4 else self.name


BLOCK_INT4 = WeightQuant(4, blocks.BLOCK, int8_activations=True)


def parse_quant(text: str) -> WeightQuant | None | str:
    """`--torchao-config` as a WeightQuant, None for none, or "auto"."""
    text = (text or "none").strip().lower()
    if text in ("none", "auto"):
        return None if text == "none" else "auto"
    if text == "int8wo":
        return WeightQuant(8)
    if text == "8da4w":
        return BLOCK_INT4
    match = re.fullmatch(r"int4wo-(\d+)", text)
    if match and int(match.group(1)) in INT4_GROUP_SIZES:
        return WeightQuant(4, int(match.group(1)))
    raise ValueError(
        f"--torchao-config {text!r}: expected none, auto, int8wo, 8da4w or int4wo-<group> "
        f"with group in {INT4_GROUP_SIZES}"
    )


def prequantized_file(model_dir: Path, quant: WeightQuant) -> Path:
    """Where a model directory keeps weights already quantized as `quant`."""
    return Path(model_dir) / f"model.{quant.stored_as}.safetensors"


def natural_quant(scheme: Scheme) -> WeightQuant:
    """The CPU mode a quantized checkpoint's weights fit, experts and all:
    its 4-bit codes as they are, 8-bit and FP8 weights dequantized at load
    and held as int8wo."""
    if scheme.kind == "int" and scheme.bits == 4:
        if blocks.available():
            return BLOCK_INT4
        return WeightQuant(4, scheme.group_size if scheme.group_size in INT4_GROUP_SIZES else 32)
    return WeightQuant(8)


def resolve_quant(text: str, model_dir: Path, device: torch.device, kernel_threads: int = 1,
                  quantization: str = "auto", config_overrides: dict | None = None) -> WeightQuant | None:
    """The quantization to load with: `auto` made concrete, CPU only; an
    8da4w one's kernels on `kernel_threads` threads. `quantization` is
    `--quantization`, the checkpoint's own (quantized/scheme.py), as
    config.json with `config_overrides` (--json-model-override-args) says it."""
    quant = parse_quant(text)
    if quant == "auto":
        has_config = (Path(model_dir) / "config.json").is_file()
        config = read_config_files(model_dir, config_overrides)[0] if has_config else {}
        scheme = detect(config, quantization)
        shipped = BLOCK_INT4 if blocks.available() else WeightQuant(4, 32)
        if device.type != "cpu":
            quant = None
        elif scheme is not None:
            quant = natural_quant(scheme)
        else:
            quant = shipped if prequantized_file(model_dir, shipped).is_file() else None
    if quant is not None and device.type != "cpu":
        raise ValueError(f"--torchao-config {quant.name} runs on the CPU only (the GPU path keeps its kernels)")
    if quant is not None and quant.int8_activations:
        quant = replace(quant, kernel_threads=kernel_threads)
    return quant


class Int8Linear(nn.Module):
    """y = x @ (w_int8 * scale).T + bias, with one scale per output row."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.register_buffer("weight", weight)  # int8 [out, in]
        self.register_buffer("scales", scales.to(_ACT_DTYPE))  # [out]
        self.register_buffer("bias", bias)

    @staticmethod
    def fits(weight: torch.Tensor) -> bool:
        # torch's CPU int8pack_mm reads the inputs 16 at a time: other widths crash it.
        return weight.shape[1] % 16 == 0

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        q = (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
        return cls(q, scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).to(_ACT_DTYPE), self.weight, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.weight.shape[0])  # shaped for 0 rows too
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """y = x @ w.T + bias with w[n, k] = (q[n, k] - 8) * scale[g, n] + zero[g, n]
    for the group g = k // group_size; q in 0..15, packed by torch.

    torch's int4 CPU kernel is quick for a few rows (decode) but its cost
    grows with every row, where a float32 GEMM's barely does: from
    DENSE_FROM_ROWS rows on (long prefills), the layer dequantizes its
    weight to float32 for that one call and multiplies densely (on this
    2-core AVX2 machine, 512 rows through all of the embedded model's
    layers: 1.75 s in int4 against 0.9 s dense plus 0.4 s dequantizing).
    The codes are kept two to a byte for that, as much again as the
    kernel's own copy: an expert's layer (`dense_copy` False), whose rows
    are a share of a step's, keeps only the kernel's and always runs it."""

    DENSE_FROM_ROWS = 512

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bias: torch.Tensor | None, dense_copy: bool = True):
        """codes: uint8 [out, in] (0..15); scales, zeros: [out, in / group_size]."""
        super().__init__()
        self.group_size = group_size
        self.out_features, self.in_features = codes.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        self.register_buffer("weight", packed)
        # The kernel's layout: [in / group_size, out, (scale, zero)].
        self.register_buffer("scales_and_zeros",
                             torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(_ACT_DTYPE))
        self.register_buffer("bias", bias)
        # For dense_weight: scales and zeros again, in float32 (the kernel's copy
        # above is bfloat16-rounded), shaped [out, in / group_size, 1] to broadcast over a group.
        self.register_buffer("nibbles", pack_nibbles(codes.to(torch.uint8)) if dense_copy else None)
        self.register_buffer("group_scales", scales.float()[..., None] if dense_copy else None)
        self.register_buffer("group_zeros", zeros.float()[..., None] if dense_copy else None)

    def dense_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer multiplies by; without a
        dense copy, as the kernel gives it (bf16 scales, outputs rounded to bf16)."""
        if self.nibbles is None:
            identity = torch.eye(self.in_features, dtype=_ACT_DTYPE)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                identity, self.weight, self.group_size, self.scales_and_zeros).float().T.contiguous()
        w = unpack_nibbles(self.nibbles).float().view(self.out_features, -1, self.group_size)
        return w.sub_(8).mul_(self.group_scales).add_(self.group_zeros).view(self.out_features, -1)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int, bias: torch.Tensor | None = None,
                 dense_copy: bool = True) -> Int4Linear:
        """Asymmetric min/max quantization of each group of `group_size` inputs."""
        codes, scales, mins = int4_groups(weight, group_size)
        return cls(codes, scales, mins + 8 * scales, group_size, bias, dense_copy)

    @staticmethod
    def fits(weight: torch.Tensor, group_size: int) -> bool:
        out, cols = weight.shape
        return out % _INT4_ROW_MULTIPLE == 0 and cols % group_size == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] >= self.DENSE_FROM_ROWS and self.nibbles is not None:
            y = F.linear(rows.float(), self.dense_weight())
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(_ACT_DTYPE), self.weight, self.group_size, self.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [out, in] -> [out, in / 2], even columns in the low nibbles."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


Int4Groups = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes [out, in], scales, zeros


def _from_groups(quant: WeightQuant, groups: Int4Groups, bias: torch.Tensor | None,
                 dense_copy: bool = True) -> nn.Module:
    """A 4-bit layer of `quant` from int4wo's codes, scales and zeros."""
    codes, scales, zeros = groups
    if quant.int8_activations:
        return Q4_1Linear(codes, scales, zeros - 8 * scales, bias, quant.kernel_threads)
    return Int4Linear(codes, scales, zeros, quant.group_size, bias, dense_copy)


def _quantized(weight: torch.Tensor, bias: torch.Tensor | None, quant: WeightQuant,
               dense_copy: bool = True) -> nn.Module | None:
    if quant.bits == 8:
        return Int8Linear.quantize(weight, bias) if Int8Linear.fits(weight) else None
    if quant.int8_activations and weight.shape[1] % blocks.BLOCK == 0:
        return Q4_1Linear.quantize(weight, bias, quant.kernel_threads)
    if not quant.int8_activations and Int4Linear.fits(weight, quant.group_size):
        return Int4Linear.quantize(weight, quant.group_size, bias, dense_copy)
    return None


def _expert_layer(quant: WeightQuant, weight: torch.Tensor, groups: Int4Groups | None, kept_dense: list[str],
                  name: str) -> nn.Module:
    """One expert weight [out, in] as a `quant` layer: from the checkpoint's
    own 4-bit `groups` where they fit, else quantized; a weight the kernel
    cannot hold stays dense (an nn.Linear), as a dense layer would."""
    if groups is not None and groups[0].shape == weight.shape and (
            quant.int8_activations or Int4Linear.fits(weight, quant.group_size)):
        return _from_groups(quant, groups, None, dense_copy=False)
    layer = _quantized(weight, None, quant, dense_copy=False)
    if layer is None:
        kept_dense.append(name)
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return layer


def quantize_model(model: nn.Module, quant: WeightQuant, shipped: dict[str, Int4Groups] | None = None) -> None:
    """Replace the decoder layers' linear layers by `quant` ones, in place,
    built from `shipped` (module name -> a checkpoint's own 4-bit groups)
    where it has them, and give the model an int8 vocabulary projection."""
    shipped = shipped or {}
    kept_dense = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name == "lm_head":
            continue
        parent_name, _, attr = name.rpartition(".")
        if attr in getattr(model.get_submodule(parent_name), "dense_linears", ()):
            continue
        bias = None if module.bias is None else module.bias.data
        replacement = (_from_groups(quant, shipped[name], bias) if name in shipped
                       else _quantized(module.weight.data, bias, quant))
        if replacement is None:
            kept_dense.append(name)
            continue
        setattr(model.get_submodule(parent_name), attr, replacement)
    # Experts' products are small and follow one another with torch ops
    # between them, where 8da4w's helper threads would spin against those
    # ops: each expert runs its kernel on the calling thread (on CPU-2, a
    # 16-expert block's decode step 0.3 ms so, 7 ms on two threads).
    expert_quant = replace(quant, kernel_threads=1)
    for name, module in model.named_modules():
        if isinstance(module, MoEBlock):
            module.quantize_experts(lambda param, expert, weight, prefix=name: _expert_layer(
                expert_quant, weight, shipped.get(prefix + f".{param}" + ("" if expert is None else f".{expert}")),
                kept_dense, f"{prefix}.{param}"))
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.lm_head = (Q8_0Linear.quantize(head.data, threads=quant.kernel_threads) if quant.int8_activations
                     else Int8Linear.quantize(head.data))
    if kept_dense:
        logger.warning("%s: %d linear layers stay dense (their shape does not fit the kernel), e.g. %s",
                       quant.name, len(kept_dense), kept_dense[0])
    logger.info("Weights quantized as %s (%d from the checkpoint's own 4-bit weights), lm_head %s",
                quant.name, len(shipped), "Q8_0" if quant.int8_activations else "int8")
