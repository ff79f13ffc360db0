"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE, Qwen3-MoE,
gpt-oss and DeepSeek V2/V3.

A router scores every expert per token, the top k run, and their outputs
are summed with the routing weights; some families add a shared expert that
every token runs. How scores become weights differs per family and must
match transformers to the bit (MoESpec.routing; see route()).

Expert weights are stacked per block: w13 [E, 2*I, H] holds each expert's
gate rows then its up rows, w2 [E, H, I] its down projection, whatever the
checkpoint's layout (placement() says where each checkpoint tensor goes).
Under tensor parallelism every rank holds a slice of every expert's
intermediate dimension (rows of gate and up, columns of down), so each rank
reads only its share of each expert and one all-reduce per block sums the
partial outputs, as the dense MLP does. gpt-oss's MXFP4 checkpoints store
the experts as `_blocks` / `_scales` pairs, dequantized into the same
parameters one expert at a time (moe_weights.py, mxfp4.py). In the CPU's
quantized modes each expert's weights become one quantized layer
(quantize_experts), the kernels the dense layers of that mode use.

On CPU the (token, expert) assignments are sorted by expert and each expert
that received tokens runs once on its contiguous rows (grouped_experts); on
CUDA one fused Triton kernel pair does the same (moe_triton.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pyserve.model import mxfp4
from pyserve.model.layers import moe_weights
from pyserve.model.parallel import SINGLE, TensorParallel

ROUTINGS = ("softmax", "topk_softmax", "grouped_sigmoid", "grouped_softmax")
ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class MoESpec:
    """One MoE block's shape and numerics, read from a family's config."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int  # per expert
    # softmax: softmax over all experts in float32, top k (Mixtral, Qwen, DeepSeek V2 greedy);
    # topk_softmax: top k of the logits, softmax over those k (gpt-oss);
    # grouped_sigmoid / grouped_softmax: DeepSeek V3 / V2's top k within the best groups.
    routing: str = "softmax"
    norm_topk_prob: bool = True
    # Mixtral and DeepSeek weigh expert outputs by float32 weights; Qwen and
    # gpt-oss round the weights to the model dtype first.
    weights_float32: bool = True
    router_float32: bool = False  # DeepSeek computes its router logits in float32
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate: int = 0  # 0: no shared expert
    shared_gate: bool = False  # Qwen2-MoE scales its shared expert by sigmoid(gate(x))
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # DeepSeek V3's (and MiniMax-M2's) e_score_correction_bias

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"unknown MoE routing {self.routing!r}; known: {', '.join(ROUTINGS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown MoE activation {self.activation!r}; known: {', '.join(ACTIVATIONS)}")
        if self.num_experts % self.n_group:
            raise ValueError(f"{self.num_experts} experts do not split into {self.n_group} groups")

    @classmethod
    def from_config(cls, config) -> MoESpec:
        """The spec of a transformers config (or anything with its attributes)."""
        kind = config.model_type
        common = dict(top_k=config.num_experts_per_tok, hidden=config.hidden_size)
        if kind == "mixtral":
            return cls(num_experts=config.num_local_experts, intermediate=config.intermediate_size, **common)
        if kind in ("qwen2_moe", "qwen3_moe"):
            shared = getattr(config, "shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
            return cls(num_experts=config.num_experts, intermediate=config.moe_intermediate_size,
                       norm_topk_prob=config.norm_topk_prob, weights_float32=False,
                       shared_intermediate=shared, shared_gate=bool(shared), **common)
        if kind == "gpt_oss":
            return cls(num_experts=config.num_local_experts, intermediate=config.intermediate_size,
                       routing="topk_softmax", weights_float32=False, router_bias=True, expert_bias=True,
                       activation="clamped_swiglu", swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
                       swiglu_limit=getattr(config, "swiglu_limit", 7.0), **common)
        if kind == "minimax_m2":  # sigmoid scores with a correction bias, over all experts in one group
            return cls(num_experts=config.num_local_experts, intermediate=config.intermediate_size,
                       routing="grouped_sigmoid", score_correction_bias=True, **common)
        if kind in ("deepseek_v2", "deepseek_v3"):
            v3 = kind == "deepseek_v3"
            grouped = v3 or config.topk_method == "group_limited_greedy"
            routing = ("grouped_sigmoid" if v3 else "grouped_softmax") if grouped else "softmax"
            return cls(num_experts=config.n_routed_experts, intermediate=config.moe_intermediate_size,
                       routing=routing, norm_topk_prob=v3 and config.norm_topk_prob, router_float32=True,
                       shared_intermediate=config.moe_intermediate_size * (config.n_shared_experts or 0),
                       n_group=(config.n_group or 1) if grouped else 1,
                       topk_group=(config.topk_group or 1) if grouped else 1,
                       routed_scaling_factor=config.routed_scaling_factor, score_correction_bias=v3, **common)
        raise ValueError(f"no MoE block for model type {kind!r}")


def route(spec: MoESpec, logits: torch.Tensor,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k], expert ids [T, k]), as the family's transformers code makes them."""
    k = spec.top_k
    if spec.routing == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        return F.softmax(top, dim=-1, dtype=top.dtype), ids
    if spec.routing == "grouped_sigmoid":
        scores = logits.float().sigmoid()
        choice = scores if correction is None else scores + correction
        per_group = choice.view(-1, spec.n_group, spec.num_experts // spec.n_group)
        allowed = _best_groups(per_group.topk(2, dim=-1)[0].sum(dim=-1), spec)
        ids = torch.topk(choice.masked_fill(~allowed, float("-inf")), k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if spec.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * spec.routed_scaling_factor, ids
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    if spec.routing == "grouped_softmax":
        per_group = probs.view(-1, spec.n_group, spec.num_experts // spec.n_group)
        probs = probs.masked_fill(~_best_groups(per_group.max(dim=-1).values, spec), 0.0)
    weights, ids = torch.topk(probs, k, dim=-1)
    if spec.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return (weights if spec.weights_float32 else weights.to(logits.dtype)), ids


def _best_groups(group_scores: torch.Tensor, spec: MoESpec) -> torch.Tensor:
    """[T, E] mask of the experts in each token's topk_group best groups."""
    best = torch.topk(group_scores, spec.topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.repeat_interleave(spec.num_experts // spec.n_group, dim=1)


def activate(spec: MoESpec, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated activation of gate and up projections."""
    if spec.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=spec.swiglu_limit)
    up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))


def grouped_experts(spec: MoESpec, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    w13: Experts, w2: Experts, b13: torch.Tensor | None = None,
                    b2: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted sum of each token's experts, on CPU: assignments sorted
    by expert, one pair of matmuls per expert that received tokens (no loop
    over tokens), outputs scattered back with index_add_. Each token's sum
    runs in ascending expert order, as transformers' does. w13 and w2 are
    the stacked weights, or one quantized layer per expert (quant.py)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=len(w13))
    active = counts.nonzero().flatten()
    starts = counts.cumsum(0)[active] - counts[active]
    rows = x[token]
    out = torch.empty_like(rows)
    for e, start, n in zip(active.tolist(), starts.tolist(), counts[active].tolist()):
        h = expert_product(w13, e, rows[start:start + n], b13)
        half = h.shape[1] // 2
        out[start:start + n] = expert_product(w2, e, activate(spec, h[:, :half], h[:, half:]), b2)
    weighted = out * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, weighted.to(x.dtype))


# The experts' stacked weight [E, out, in], or one layer per expert (a quantized mode's).
Experts = torch.Tensor | nn.ModuleList


def expert_product(w: Experts, e: int, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows @ expert e's weight.T + its bias."""
    if isinstance(w, torch.Tensor):
        return F.linear(rows, w[e], None if bias is None else bias[e])
    y = w[e](rows)
    return y if bias is None else y + bias[e]


@dataclass(frozen=True)
class Placement:
    """Where a checkpoint tensor goes in an MoEBlock (the whole tensor, before
    any tensor-parallel slicing)."""

    param: str  # the block's parameter: w13, w2, b13, b2, router_weight, ...
    expert: int | None  # the expert a per-expert tensor fills; None: every expert at once
    row: int  # first intermediate row it fills in w13 / shared_w13: 0 (gate) or the intermediate size (up)
    layout: str  # "linear": an nn.Linear's [out, in]; "stacked": transformers' [E, 2I, H] / [E, H, I];
    #              "gpt_oss": [E, H, 2I] with gate and up interleaved, [E, I, H] down, biases interleaved


# Checkpoint names below the block's own prefix ("...mlp." or "...block_sparse_moe.").
_NAMES = [
    (r"experts\.(\d+)\.(?:w1|gate_proj)\.weight", "w13", "gate"),
    (r"experts\.(\d+)\.(?:w3|up_proj)\.weight", "w13", "up"),
    (r"experts\.(\d+)\.(?:w2|down_proj)\.weight", "w2", None),
    (r"experts\.gate_up_proj", "w13", None),
    (r"experts\.gate_up_proj_bias", "b13", None),
    (r"experts\.down_proj", "w2", None),
    (r"experts\.down_proj_bias", "b2", None),
    (r"(?:gate|router)\.weight", "router_weight", None),
    (r"router\.bias", "router_bias", None),
    (r"(?:gate\.)?e_score_correction_bias", "score_correction_bias", None),  # MiniMax-M2's is the block's
    (r"shared_experts?\.gate_proj\.weight", "shared_w13", "gate"),
    (r"shared_experts?\.up_proj\.weight", "shared_w13", "up"),
    (r"shared_experts?\.down_proj\.weight", "shared_w2", None),
    (r"shared_expert_gate\.weight", "shared_gate", None),
]
_BLOCK_PREFIX = re.compile(r"(?:^|\.)(?:mlp|block_sparse_moe)\.(.+)$")


def placement(spec: MoESpec, name: str) -> Placement | None:
    """Where the checkpoint tensor `name` (a full name, e.g.
    model.layers.3.block_sparse_moe.experts.5.w3.weight) goes in the block,
    or None if it is not one of the block's tensors. Each half of an MXFP4
    pair (gpt-oss's experts.gate_up_proj_blocks, ..._scales) goes where its
    dense tensor would."""
    packed = mxfp4.packed_part(name)
    found = _BLOCK_PREFIX.search(packed[0] if packed else name)
    if not found:
        return None
    for pattern, param, half in _NAMES:
        match = re.fullmatch(pattern, found.group(1))
        if match:
            expert = int(match.group(1)) if match.groups() else None
            if packed and (param not in ("w13", "w2") or expert is not None):
                return None  # only the stacked expert weights come packed
            size = spec.shared_intermediate if param == "shared_w13" else spec.intermediate
            row = size if half == "up" else 0
            if expert is not None or param.startswith(("shared", "router", "score")):
                layout = "linear"
            else:
                layout = "gpt_oss" if spec.activation == "clamped_swiglu" else "stacked"
            return Placement(param, expert, row, layout)
    return None


class MoEBlock(nn.Module):
    """The sparse MoE block of one decoder layer: x [T, H] -> [T, H].

    `part` is the range of every expert's intermediate dimension this rank
    holds (the whole of it on one rank); the shared expert is split the
    same way over the ranks, the router is whole on every rank."""

    def __init__(self, spec: MoESpec, tp: TensorParallel = SINGLE, part: range | None = None):
        super().__init__()
        self.spec, self.tp = spec, tp
        self.part = part if part is not None else tp.shard(spec.intermediate, "the expert intermediate size")
        E, H, L = spec.num_experts, spec.hidden, len(self.part)

        def param(*shape):
            return nn.Parameter(torch.empty(*shape), requires_grad=False)

        self.router_weight = param(E, H)
        self.router_bias = param(E) if spec.router_bias else None
        self.score_correction_bias = param(E) if spec.score_correction_bias else None
        self.w13 = param(E, 2 * L, H)
        self.w2 = param(E, H, L)
        self.b13 = param(E, 2 * L) if spec.expert_bias else None
        # The down bias is added once over the ranks, by rank 0.
        self.b2 = param(E, H) if spec.expert_bias and tp.rank == 0 else None
        self.shared_part = tp.shard(spec.shared_intermediate, "the shared expert intermediate size")
        S = len(self.shared_part)
        self.shared_w13 = param(2 * S, H) if S else None
        self.shared_w2 = param(H, S) if S else None
        self.shared_gate = param(1, H) if spec.shared_gate else None
        self._packed = mxfp4.PairedHalves()  # MXFP4 halves waiting for their other half

    def load_weight(self, name: str, source) -> bool:
        """Copies this rank's part of checkpoint tensor `name` into the block;
        False if the name is not the block's. `source` is the tensor, or a
        safetensors slice of it, from which only that part is read (moe_weights.py)."""
        where = placement(self.spec, name)
        if where is None:
            return False
        target = getattr(self, where.param)
        if target is None:  # b2 on ranks other than 0
            return True
        if mxfp4.packed_part(name):
            pair = self._packed.add(name, source)
            if pair is not None:
                moe_weights.copy_mxfp4_part(target, where.param, *pair, self.part, self.spec.hidden,
                                            self.spec.intermediate)
            return True
        moe_weights.copy_part(self._destination(where), source, where.param, "up" if where.row else None,
                              where.layout, *self._part_of(where))
        return True

    def weight_copies(self, name: str, tensor: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination, source view) pairs that put this rank's part of
        the dense checkpoint tensor `name` in the block (moe_weights.part_copies),
        for a caller that checks every tensor of an update before copying
        any; [] for b2 on ranks other than 0. ValueError where it is not
        the block's, comes packed, or does not fit."""
        where = placement(self.spec, name)
        if where is None or mxfp4.packed_part(name):
            raise ValueError(f"{name} is not one of the MoE block's dense tensors")
        if getattr(self, where.param) is None:
            return []
        if not isinstance(getattr(self, where.param), nn.Parameter):
            raise ValueError(f"{name}: the experts are held quantized")
        return moe_weights.part_copies(self._destination(where), tensor, where.param, "up" if where.row else None,
                                       where.layout, *self._part_of(where))

    def _destination(self, where: Placement) -> torch.Tensor:
        target = getattr(self, where.param).data
        return target if where.expert is None else target[where.expert]

    def _part_of(self, where: Placement) -> tuple[range, int]:
        """This rank's part of the intermediate dimension `where` splits, and its whole length."""
        if where.param.startswith("shared_w"):
            return self.shared_part, self.spec.shared_intermediate
        return self.part, self.spec.intermediate

    def quantize_experts(self, layer) -> None:
        """Replace each expert's weights (and the shared expert's) by
        `layer(param, expert, weight)`, a quantized layer of that weight
        (quant.py), which grouped_experts then calls; CPU only."""
        for name in ("w13", "w2", "shared_w13", "shared_w2"):
            stacked = getattr(self, name)
            if stacked is None:
                continue
            delattr(self, name)
            if name.startswith("shared"):
                setattr(self, name, layer(name, None, stacked.data))
            else:
                setattr(self, name, nn.ModuleList(layer(name, e, w) for e, w in enumerate(stacked.data)))

    def _apply(self, fn, recurse=True):
        # DeepSeek keeps its router in float32 in a bfloat16 model, as
        # transformers does (_keep_in_fp32_modules_strict): a cast of the
        # block moves those two tensors to the new device only.
        kept = {name: getattr(self, name).data for name in ("router_weight", "score_correction_bias")
                if self.spec.router_float32 and getattr(self, name) is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            device = getattr(self, name).device
            # A meta tensor (a model built on the meta device, then given storage) has no values to keep.
            getattr(self, name).data = (torch.empty_like(before, dtype=torch.float32, device=device) if before.is_meta
                                        else before.to(device=device, dtype=torch.float32))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if spec.router_float32:
            logits = F.linear(x.float(), self.router_weight)
        else:
            logits = F.linear(x, self.router_weight, self.router_bias)
        weights, ids = route(spec, logits, self.score_correction_bias)
        if x.is_cuda:
            from pyserve.model.layers import moe_triton  # Triton is imported on CUDA only

            out = moe_triton.fused_experts(spec, x, weights, ids, self.w13, self.w2, self.b13, self.b2)
        else:
            out = grouped_experts(spec, x, weights, ids, self.w13, self.w2, self.b13, self.b2)
        if self.shared_w13 is not None:
            shared = _project(self.shared_w13, x)
            S = len(self.shared_part)
            shared = _project(self.shared_w2, F.silu(shared[:, :S]) * shared[:, S:])
            if self.shared_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_gate)) * shared
            out = out + shared
        return self.tp.all_reduce(out)


def _project(weight: torch.Tensor | nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ weight.T: a dense weight, or the quantized layer that replaced it."""
    return F.linear(x, weight) if isinstance(weight, torch.Tensor) else weight(x)
