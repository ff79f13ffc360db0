"""Adapter weights in fixed slots beside the model, and the hooks that add
their low-rank products to the projections' outputs.

Every adapted projection holds, per target, A [slots, max rank, in] and
B [slots, out, max rank]; an adapter of lower rank is zero-padded, which
adds nothing. The targets of a fused projection (q/k/v in qkv_proj,
gate/up in gate_up_proj) are blocks of one A and one B, so each projection
adds one low-rank product per step (see _Projection.add_delta); base-model
tokens get none and keep the base output exactly.

Tensor parallelism: a rank holds its shard of each projection, so it
holds the matching shard of each adapter. Column-parallel projections
(q/k/v, gate/up) take the whole A and their rows of B; row-parallel ones
(o, down) take their columns of A and the whole B: each rank's partial
x_shard A_shard^T B^T is summed by the all-reduce the base output already
goes through.
"""

from __future__ import annotations

import torch
from torch import nn

from pyserve.lora.adapter import Adapter, AdapterError
from pyserve.lora.batch import LoraBatch
from pyserve.model.config import ModelConfig
from pyserve.model.parallel import ModelShard

# On CUDA the segmented Triton kernel (triton_kernel.py) adds every
# group's delta in two launches. In torch, steps of fewer tokens run every
# adapter group at once, as one padded batched matmul (few ops: decode);
# longer ones multiply group by group, so no row is padded.
PAD_BELOW_TOKENS = 64


class _Projection:
    """The adapters of one (fused) projection: each target it feeds owns a
    block of `rank` rows of A and the matching columns of B, at its output
    offset, so one product covers q, k and v (or gate and up)."""

    def __init__(self, slots: int, rank: int, targets: int, in_size: int, out_size: int, dtype, device):
        self.rank = rank
        self.A = torch.zeros(slots, targets * rank, in_size, dtype=dtype, device=device)
        self.B = torch.zeros(slots, out_size, targets * rank, dtype=dtype, device=device)

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
        if x.is_cuda and out.is_contiguous():
            from pyserve.lora.triton_kernel import add_lora_delta

            add_lora_delta(x.contiguous(), out, self.A, self.B, batch.tokens, batch.segments, batch.width)
        else:
            self.add_delta_torch(x, out, batch)

    def add_delta_torch(self, x: torch.Tensor, out: torch.Tensor, batch: LoraBatch) -> None:
        if x.shape[0] < PAD_BELOW_TOKENS:
            # Slots below `blocks` that the step does not use get zero rows:
            # cheaper than copying the used slots' weights out of the stacks.
            blocks = batch.blocks
            rows = x.new_zeros(blocks * batch.width, x.shape[1])
            rows.index_copy_(0, batch.padded, x.index_select(0, batch.tokens))
            low = torch.bmm(rows.view(blocks, batch.width, -1), self.A[:blocks].transpose(1, 2))
            delta = torch.bmm(low, self.B[:blocks].transpose(1, 2))
            out.index_add_(0, batch.tokens, delta.view(blocks * batch.width, -1).index_select(0, batch.padded)
                           .to(out.dtype))
            return
        for slot, idx in batch.groups:
            delta = (x.index_select(0, idx) @ self.A[slot].T) @ self.B[slot].T
            out.index_add_(0, idx, delta.to(out.dtype))


class _Target:
    """Where a target's shard sits: its block in the projection, and this
    rank's rows (output) and columns (input) of the checkpoint's matrix."""

    def __init__(self, projection: _Projection, block: int, rows: range, cols: range, offset: int):
        self.projection, self.block, self.rows, self.cols, self.offset = projection, block, rows, cols, offset


class LoraSlots:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, dtype, device):
        config: ModelConfig = model.config
        shard: ModelShard = model.shard
        self.num_slots, self.max_rank = num_slots, max_rank
        self.current: LoraBatch | None = None  # the running step's, set by the forward thread
        hd, hidden = range(config.head_dim), range(config.hidden_size)
        q = range(shard.q_heads.start * len(hd), shard.q_heads.stop * len(hd))
        kv = range(shard.kv_heads.start * len(hd), shard.kv_heads.stop * len(hd))
        inter = shard.intermediate
        self.targets: dict[tuple[int, str], _Target] = {}
        self._hooks = []

        def adapt(layer_id: int, module: nn.Module, names: list[str], rows: list[range], cols: range) -> None:
            offsets = [sum(len(r) for r in rows[:i]) for i in range(len(rows))]
            projection = _Projection(num_slots, max_rank, len(names), len(cols), offsets[-1] + len(rows[-1]),
                                     dtype, device)
            for block, (name, r, offset) in enumerate(zip(names, rows, offsets)):
                self.targets[layer_id, name] = _Target(projection, block, r, cols, offset)
            self._hooks.append(module.register_forward_hook(self._hook(projection)))

        for layer_id, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not hasattr(attn, "qkv_proj"):  # DeepSeek's latent attention has other projections
                raise ValueError(f"--enable-lora: {config.architecture}'s attention takes no LoRA adapters")
            adapt(layer_id, attn.qkv_proj, ["q_proj", "k_proj", "v_proj"], [q, kv, kv], hidden)
            adapt(layer_id, attn.o_proj, ["o_proj"], [hidden], q)
            if hasattr(mlp, "gate_up_proj"):  # a dense MLP; a mixture of experts takes no adapter
                adapt(layer_id, mlp.gate_up_proj, ["gate_proj", "up_proj"], [inter, inter], hidden)
                adapt(layer_id, mlp.down_proj, ["down_proj"], [hidden], inter)

    def _hook(self, projection: _Projection):
        def add_delta(module, inputs, out):
            if self.current is not None:
                projection.add_delta(inputs[0], out, self.current)
            return out
        return add_delta

    def load(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter` in `slot`, this rank's shard of it; what it does not
        adapt is zeroed."""
        unknown = sorted(f"layer {layer} {name}" for layer, name in adapter.weights
                         if (layer, name) not in self.targets)
        if unknown:
            raise AdapterError(f"the adapter adapts {', '.join(unknown)}, which this model does not have")
        for t in self.targets.values():
            t.projection.A[slot].zero_()
            t.projection.B[slot].zero_()
        for where, (a, b) in adapter.weights.items():
            t = self.targets[where]
            if a.shape[1] < t.cols.stop or b.shape[0] < t.rows.stop:
                raise AdapterError(f"layer {where[0]} {where[1]}: A {tuple(a.shape)}, B {tuple(b.shape)} do not "
                                   "fit the model")
            p, r = t.projection, a.shape[0]
            first = t.block * p.rank
            p.A[slot, first : first + r] = a[:, t.cols.start : t.cols.stop].to(p.A.dtype)
            p.B[slot, t.offset : t.offset + len(t.rows), first : first + r] = \
                b[t.rows.start : t.rows.stop].to(p.B.dtype)
