"""Adapter weights in fixed slots beside the model, and the hooks that add
their low-rank products to the projections' outputs.

Every adapted projection holds, per target, A [slots, max rank, in] and
B [slots, out, max rank]; an adapter of lower rank is zero-padded, which
adds nothing. A step's tokens come grouped by slot (batch.LoraBatch): per
group one gather, two matmuls and one index_add into the output slice of
the fused projection the target feeds (q/k/v in qkv_proj, gate/up in
gate_up_proj). Base-model tokens are in no group and keep the base output.

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

# projection -> its targets, each with (output offset, output size) in the projection's output.
_COLUMN = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ROW = {"o_proj": "o_proj", "down_proj": "down_proj"}


class _Target:
    def __init__(self, slots: int, rank: int, rows: range, cols: range, offset: int, dtype, device):
        self.rows, self.cols, self.offset = rows, cols, offset  # this rank's shard of the target
        self.A = torch.zeros(slots, rank, len(cols), dtype=dtype, device=device)
        self.B = torch.zeros(slots, len(rows), rank, dtype=dtype, device=device)


class LoraSlots:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, dtype, device):
        config: ModelConfig = model.config
        shard: ModelShard = model.shard
        self.num_slots, self.max_rank = num_slots, max_rank
        self.current: LoraBatch | None = None  # the running step's, set by the forward thread
        hd, hidden = config.head_dim, config.hidden_size
        q = range(shard.q_heads.start * hd, shard.q_heads.stop * hd)
        kv = range(shard.kv_heads.start * hd, shard.kv_heads.stop * hd)
        inter = shard.intermediate
        full_hidden = range(hidden)
        self.targets: dict[tuple[int, str], _Target] = {}
        self._hooks = []
        for layer_id, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            new = {
                "q_proj": (attn.qkv_proj, q, full_hidden, 0),
                "k_proj": (attn.qkv_proj, kv, full_hidden, len(q)),
                "v_proj": (attn.qkv_proj, kv, full_hidden, len(q) + len(kv)),
                "o_proj": (attn.o_proj, full_hidden, q, 0),
            }
            if hasattr(mlp, "gate_up_proj"):  # a dense MLP; a mixture of experts takes no adapter
                new.update({"gate_proj": (mlp.gate_up_proj, inter, full_hidden, 0),
                            "up_proj": (mlp.gate_up_proj, inter, full_hidden, len(inter)),
                            "down_proj": (mlp.down_proj, full_hidden, inter, 0)})
            by_module: dict[nn.Module, list[_Target]] = {}
            for name, (module, rows, cols, offset) in new.items():
                target = _Target(num_slots, max_rank, rows, cols, offset, dtype, device)
                self.targets[layer_id, name] = target
                by_module.setdefault(module, []).append(target)
            for module, targets in by_module.items():
                self._hooks.append(module.register_forward_hook(self._hook(targets)))

    def _hook(self, targets: list[_Target]):
        def add_deltas(module, inputs, out):
            batch = self.current
            if batch is None:
                return None
            x = inputs[0]
            for slot, idx in batch.groups:
                xs = x.index_select(0, idx)
                for t in targets:
                    delta = (xs @ t.A[slot].T) @ t.B[slot].T
                    out[:, t.offset : t.offset + t.B.shape[1]].index_add_(0, idx, delta.to(out.dtype))
            return out
        return add_deltas

    def load(self, slot: int, adapter: Adapter) -> None:
        """Put `adapter` in `slot`, this rank's shard of it; what it does not
        adapt is zeroed."""
        missing = {name for _, name in adapter.weights} - {name for _, name in self.targets}
        if missing or any(where not in self.targets for where in adapter.weights):
            raise AdapterError(f"the adapter adapts {sorted(missing) or 'layers'} this model does not have")
        for t in self.targets.values():
            t.A[slot].zero_()
            t.B[slot].zero_()
        for where, (a, b) in adapter.weights.items():
            t = self.targets[where]
            if a.shape[1] < t.cols.stop or b.shape[0] < t.rows.stop:
                raise AdapterError(f"layer {where[0]} {where[1]}: A {tuple(a.shape)}, B {tuple(b.shape)} do not "
                                   "fit the model")
            r = a.shape[0]
            t.A[slot, :r] = a[:, t.cols.start : t.cols.stop].to(t.A.dtype)
            t.B[slot, :, :r] = b[t.rows.start : t.rows.stop].to(t.B.dtype)
