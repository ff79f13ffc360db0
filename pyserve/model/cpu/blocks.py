"""Linear layers over ggml's weight blocks, multiplied by pyserve's Rust
kernels: the `8da4w` mode of `--torchao-config`.

Weights keep llama.cpp's formats, blocks of 32 inputs: Q4_1 for the
decoder layers (4-bit codes q with a scale d and a minimum m per block,
w = d * q + m: the embedded model's GGUF groups as they are) and Q8_0 for
the vocabulary projection (8-bit codes with a scale per block; the GGUF
stores its embedding so). Each call quantizes its activations to 8 bits
per block of 32 ("8-bit dynamic activations"), so a block's dot product is
integer arithmetic, 32 byte products per AVX2 instruction: on a CPU
without AVX-512 that is what makes a decode step fast, where torch's int4
kernel widens the codes to floats. bench/quality.py measures what the
activation rounding costs.

A Q4_1 layer packs its weight once, when it is built, into
rust/kernels/block_gemm.rs's tiles (8 weight rows interleaved, the same 4 bits a
code), which every product reads as they lie: prefills, mixed steps and the
native decode layer (rust/kernels/decode_layer.rs) alike, at any row count. So a
row's product does not depend on how many rows share the call, nor on
whether a prefill or a decode step computes it. The vocabulary projection
(Q8_0, rust/kernels/q8_0/) sees only the last rows of a prefill and keeps
its kernel up to VOCAB_DENSE_FROM_ROWS rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve import _rust

BLOCK = 32  # inputs per block, in weights and activations alike
# The vocabulary projection's own crossover: its dense weight is the whole
# vocabulary (113 MB for the embedded model) in a fresh buffer each call.
# Prefill steps hand it only their last rows; a decode step of 160 rows
# ran 5% slower with it dense than on the block kernel.
VOCAB_DENSE_FROM_ROWS = 512


def available() -> bool:
    """Whether the kernels run their AVX2 code here (else a slow plain loop)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).to(torch.float32).contiguous()


def _q4_1_product(x: torch.Tensor, tiles: torch.Tensor, out_features: int, threads: int) -> torch.Tensor:
    """x [rows, k] float32 @ the Q4_1 weight [out_features, k].T, from its tiles"""
    out = x.new_empty(x.shape[0], out_features)
    _rust.matmul_q4_1(_view(x), tiles.numpy(), out.numpy(), threads)
    return out


def _q8_0_product(x: torch.Tensor, tiles: torch.Tensor, out_features: int, threads: int) -> torch.Tensor:
    """x [rows, k] float32 @ the Q8_0 weight [out_features, k].T, from its tiles"""
    out = x.new_empty(x.shape[0], out_features)
    _rust.matmul_q8_0(_view(x), tiles.numpy(), out.numpy(), threads)
    return out


def _q8_0_dense(tiles: torch.Tensor, out_features: int, in_features: int, threads: int) -> torch.Tensor:
    """The Q8_0 weight as float32 [out_features, in_features], from its tiles."""
    w = torch.empty(out_features, in_features)
    _rust.dequantize_q8_0(tiles.numpy(), w.numpy(), threads)
    return w


def _view(x: torch.Tensor):
    """The numpy view the kernels borrow (they check its dtype, shape and
    layout); detached, as the kernels have no gradient."""
    return x.detach().numpy()


# The same products and dequantizers as torch ops, so that a compiled decode
# layer (--enable-torch-compile) calls them as opaque steps instead of
# breaking its graph; eager calls skip the op's dispatch (~20 µs a call).
_LIBRARY = torch.library.Library("pyserve", "DEF")
_LIBRARY.define("matmul_q4_1(Tensor x, Tensor tiles, int out_features, int threads) -> Tensor")
_LIBRARY.define("matmul_q8_0(Tensor x, Tensor tiles, int out_features, int threads) -> Tensor")
_LIBRARY.define("dense_q8_0(Tensor tiles, int out_features, int in_features, int threads) -> Tensor")
_LIBRARY.impl("matmul_q4_1", _q4_1_product, "CPU")
_LIBRARY.impl("matmul_q8_0", _q8_0_product, "CPU")
_LIBRARY.impl("dense_q8_0", _q8_0_dense, "CPU")


@torch.library.register_fake("pyserve::matmul_q4_1")
def _(x, tiles, out_features, threads):
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("pyserve::matmul_q8_0")
def _(x, tiles, out_features, threads):
    return x.new_empty(x.shape[0], out_features)


@torch.library.register_fake("pyserve::dense_q8_0")
def _(tiles, out_features, in_features, threads):
    return tiles.new_empty(out_features, in_features, dtype=torch.float32)


def _call(op, eager, *args) -> torch.Tensor:
    return op(*args) if torch.compiler.is_compiling() else eager(*args)


def _check(cols: int) -> None:
    if cols % BLOCK:
        raise ValueError(f"block-quantized layers need inputs in multiples of {BLOCK}, not {cols}")


def int4_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes 0..15 [out, in], and a scale and a minimum [out, in / group_size]
    per group: its minimum and 15 equal steps up to its maximum (Q4_1's
    rounding, and int4wo's)."""
    out, cols = weight.shape
    w = weight.float().reshape(out, cols // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    codes = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8)
    return codes.reshape(out, cols), scales, low


class _BlockLinear(nn.Module):
    """y = x @ w.T + bias over 2-D rows of x, the kernels' work split among
    `threads` threads (the caller's included), given when the layer is built."""

    out_features: int
    bias: torch.Tensor | None
    threads: int

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.product(_rows(x)).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Q4_1Linear(_BlockLinear):
    """y = x @ w.T + bias, w[n, k] = scale[n, b] * q[n, k] + min[n, b] for
    the block b = k // 32, q in 0..15."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias: torch.Tensor | None,
                 threads: int = 1):
        """codes: [out, in], 0..15; scales, mins: [out, in / 32]."""
        super().__init__()
        out, cols = codes.shape
        _check(cols)
        if scales.shape != mins.shape or scales.shape != (out, cols // BLOCK):
            raise ValueError(f"a [{out}, {cols}] Q4_1 weight has [{out}, {cols // BLOCK}] scales and minimums")
        if codes.numel() and not 0 <= int(codes.min()) <= int(codes.max()) <= 15:
            raise ValueError("Q4_1 codes are 0..15")
        codes = codes.to(torch.uint8).contiguous()
        scales, mins = scales.float().contiguous(), mins.float().contiguous()
        tiles = torch.empty(_rust.q4_1_tiles_size(out, cols), dtype=torch.uint8)
        _rust.pack_q4_1(_view(codes), _view(scales), _view(mins), tiles.numpy())
        # The weight as block_gemm's tiles read it; nothing else keeps a copy.
        self.register_buffer("tiles", tiles)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = cols, out
        self.threads = threads

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, threads: int = 1) -> Q4_1Linear:
        """Each block's minimum and 15 equal steps up to its maximum."""
        _check(weight.shape[1])
        return cls(*int4_groups(weight, BLOCK), bias, threads)

    def dense_weight(self) -> torch.Tensor:
        """The float32 weight [out, in] this layer multiplies by."""
        w = torch.empty(self.out_features, self.in_features)
        _rust.dequantize_q4_1(self.tiles.numpy(), w.numpy())
        return w

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return _call(torch.ops.pyserve.matmul_q4_1, _q4_1_product, rows, self.tiles, self.out_features, self.threads)


class Q8_0Linear(_BlockLinear):
    """y = x @ w.T + bias, w[n, k] = scale[n, k // 32] * q[n, k], q int8:
    the vocabulary projection."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, threads: int = 1):
        super().__init__()
        out, cols = codes.shape
        _check(cols)
        # pack_q8_0 refuses scales that are not [out, cols / 32].
        tiles = torch.empty(_rust.q8_0_tiles_size(out, cols), dtype=torch.uint8)
        _rust.pack_q8_0(_view(codes.to(torch.int8).contiguous()), _view(scales.float().contiguous()), tiles.numpy())
        # The weight as rust/kernels/q8_0's tiles read it; nothing else keeps a copy.
        self.register_buffer("tiles", tiles)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = cols, out
        self.threads = threads

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, threads: int = 1) -> Q8_0Linear:
        """ggml's Q8_0: each block scaled so that its largest magnitude is 127
        (a Q8_0 tensor dequantized comes back with its own codes)."""
        out, cols = weight.shape
        _check(cols)
        w = weight.float().reshape(out, cols // BLOCK, BLOCK)
        scales = w.abs().amax(dim=-1) / 127
        codes = (w / scales.clamp(min=1e-30)[..., None]).round().clamp(-127, 127).to(torch.int8)
        return cls(codes.reshape(out, cols), scales, bias, threads)

    def dense_weight(self) -> torch.Tensor:
        return _call(torch.ops.pyserve.dense_q8_0, _q8_0_dense, self.tiles, self.out_features, self.in_features,
                     self.threads)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """The decode kernel below VOCAB_DENSE_FROM_ROWS rows, the dense weight from there on."""
        if rows.shape[0] >= VOCAB_DENSE_FROM_ROWS:
            return F.linear(rows, self.dense_weight())
        return _call(torch.ops.pyserve.matmul_q8_0, _q8_0_product, rows, self.tiles, self.out_features, self.threads)
