"""Rotary position embeddings: the inverse frequencies of each scaling
(linear, llama3, yarn, LongRoPE), the cos/sin cache, and the rotation of
q and k in the layouts checkpoints use: rotate-half (Llama) or
interleaved pairs (GLM), over the whole head or its first `rotary_dim`
dimensions (the rest pass through).

The arithmetic follows transformers': frequencies in float32, cos/sin
scaled then cast to the model dtype, so greedy tokens match it.
"""

from __future__ import annotations

import math

import torch

from pyserve.model.config import ModelConfig
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.layers.norms import fused_ops


def rope_frequencies(config: ModelConfig, long: bool = False) -> tuple[torch.Tensor, float]:
    """Float32 inverse frequencies [rotary_dim / 2] with the checkpoint's
    scaling applied, and the factor cos/sin are multiplied by (yarn's and
    LongRoPE's attention scale). `long`: LongRoPE's long factors."""
    dim = config.rotary_dim
    # An explicit CPU device: the model may be built under torch.device("meta").
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    wave = config.rope_theta**exponents  # positions per radian, per dimension pair
    inv_freq = 1.0 / wave
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, factor, scaling), 1.0
    if kind == "yarn":
        return _yarn_frequencies(wave, factor, scaling, config)
    if kind == "longrope":
        return _longrope_frequencies(wave, factor, scaling, long)
    raise ValueError(f"rope scaling type {kind!r} is not supported")


def _llama3_frequencies(inv_freq: torch.Tensor, factor: float, scaling: dict) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, and the
    # band between the two is blended linearly in 1/wavelength.
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_frequencies(
    wave: torch.Tensor, factor: float, scaling: dict, config: ModelConfig
) -> tuple[torch.Tensor, float]:
    # Dimensions that rotate many times within the original context keep their
    # frequency (extrapolate), slow ones are divided by `factor`
    # (interpolate), with a linear ramp between; cos/sin get a magnitude fix.
    dim = config.rotary_dim
    base = config.rope_theta
    old_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # weight of the original (extrapolated) frequency
    inv_freq = 1.0 / (factor * wave) * (1 - keep) + 1.0 / wave * keep

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return inv_freq, float(attention_factor)


def _longrope_frequencies(wave: torch.Tensor, factor: float, scaling: dict, long: bool) -> tuple[torch.Tensor, float]:
    # Each dimension pair's wavelength is stretched by its own factor, one
    # set for sequences within the original context, one beyond it.
    factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        old_len = scaling["original_max_position_embeddings"]
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return 1.0 / (factors * wave), float(attention_factor)


class RotaryEmbedding:
    """cos/sin per position, cached and grown on demand.

    A plain object rather than a module: casting the model to bf16 must not
    round the frequencies, and the cache lives wherever the positions are.
    The cache holds cos/sin already cast to the model dtype, exactly as
    transformers computes them (float32, scaled, then cast). It grows from
    the batch's longest sequence, a host-side int, so checking it never
    waits on the device; CUDA-graph capture should run at the longest length.

    LongRoPE keeps a second table, of its long factors: as in transformers,
    a sequence's new tokens use it once the sequence (its tokens up to the
    step's last) is longer than the original context. The keys already
    cached keep the rotation they were written with.
    """

    def __init__(self, config: ModelConfig):
        self.inv_freq, self.attention_scaling = rope_frequencies(config)
        scaling = config.rope_scaling or {}
        self.long_from = None  # LongRoPE: sequences longer than this use the long table
        if scaling.get("rope_type") == "longrope":
            self.long_from = int(scaling["original_max_position_embeddings"])
            self.long_inv_freq, _ = rope_frequencies(config, long=True)
        self._tables = None  # (cos, sin) of each set of frequencies

    def _grow(self, length: int, device: torch.device, dtype: torch.dtype) -> None:
        # Powers of two: a long-running server rebuilds the cache a few times at most.
        length = 1 << max(length - 1, 1).bit_length()
        positions = torch.arange(length, dtype=torch.float32, device=device)
        sets = [self.inv_freq] if self.long_from is None else [self.inv_freq, self.long_inv_freq]
        self._tables = []
        for inv_freq in sets:
            freqs = positions[:, None] * inv_freq.to(device)[None, :]
            self._tables.append(((freqs.cos() * self.attention_scaling).to(dtype),
                                 (freqs.sin() * self.attention_scaling).to(dtype)))

    def cos_sin(self, positions: torch.Tensor, max_len: int, dtype: torch.dtype,
                long_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin as [T, 1, rotary_dim / 2] for positions that are all <
        max_len; `long_rows` (bool [T], LongRoPE only): rows of the long table."""
        c = self._tables[0][0] if self._tables else None
        if c is None or c.shape[0] < max_len or c.device != positions.device or c.dtype != dtype:
            self._grow(max_len, positions.device, dtype)
        cos, sin = self._tables[0]
        cos, sin = cos[positions][:, None, :], sin[positions][:, None, :]
        if long_rows is None:
            return cos, sin
        long_cos, long_sin = self._tables[1]
        wanted = long_rows[:, None, None]
        return (torch.where(wanted, long_cos[positions][:, None, :], cos),
                torch.where(wanted, long_sin[positions][:, None, :], sin))

    def of_batch(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of the batch's new tokens."""
        return self.cos_sin(batch.positions, max(batch.seq_lens), dtype, self._long_rows(batch))

    def _long_rows(self, batch: ForwardBatch) -> torch.Tensor | None:
        if self.long_from is None:
            return None
        if batch.is_decode:
            # A decode row is its sequence's last token: computed on the
            # device, so a captured CUDA graph replays it for any length.
            return batch.positions >= self.long_from
        flags = torch.tensor([n > self.long_from for n in batch.seq_lens])
        return flags.repeat_interleave(torch.tensor(batch.extend_lens)).to(batch.positions.device)


class RotaryTables:
    """RotaryEmbeddings of several rope bases, for models whose layers
    rotate differently (Gemma 3: local layers by one base, global layers by
    another with its scaling). cos/sin come stacked as
    [T, tables, 1, rotary_dim / 2]; each layer takes its table
    (Attention.rotary_table)."""

    def __init__(self, configs: list[ModelConfig]):
        self.tables = [RotaryEmbedding(config) for config in configs]

    def cos_sin(self, positions: torch.Tensor, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _stacked([table.cos_sin(positions, max_len, dtype) for table in self.tables])

    def of_batch(self, batch: ForwardBatch, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return _stacked([table.of_batch(batch, dtype) for table in self.tables])


def _stacked(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([cos for cos, _ in pairs], 1), torch.stack([sin for _, sin in pairs], 1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE on [T, heads, head_dim] over the first 2 * cos.shape[-1]
    dimensions (the rest pass through), the same arithmetic as
    transformers' `x * cos + rotate_half(x) * sin`. Rotate-half pairs
    dimension i with i + half; `interleaved` pairs 2i with 2i + 1."""
    rotary_dim = 2 * cos.shape[-1]
    rot, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2 :]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated if passed.shape[-1] == 0 else torch.cat((rotated, passed), dim=-1)


def apply_rotary_qk(q, k, cos, sin, fused_kernels: bool = True,
                    interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q and k; on CUDA with `fused_kernels` one fused
    kernel, in place (rotate-half over the whole head only)."""
    whole_head = 2 * cos.shape[-1] == q.shape[-1]
    if fused_kernels and q.is_cuda and whole_head and not interleaved:
        fused_ops().rotary_(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin, interleaved), apply_rotary(k, cos, sin, interleaved)
