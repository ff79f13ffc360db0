"""The gated MLP, down(act(gate(x)) * up(x)), act SiLU or GELU-tanh
(Gemma), with gate and up fused into one column-parallel matmul and down
row-parallel (parallel.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model.config import ModelConfig
from pyserve.model.layers.norms import fused_ops
from pyserve.model.parallel import ModelShard


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: ModelShard, fused_kernels: bool = True):
        super().__init__()
        self.tp = shard.tp
        self.fused_kernels = fused_kernels
        self.intermediate_size = len(shard.intermediate)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate_size, bias=config.mlp_bias)
        # Row-parallel: the ranks' partial outputs are summed, so only rank 0 adds the bias.
        self.down_proj = nn.Linear(self.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias and self.tp.rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_kernels and gate_up.is_cuda and not self.gelu:
            return self.tp.all_reduce(self.down_proj(fused_ops().silu_and_mul(gate_up)))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.tp.all_reduce(self.down_proj(act * up))
