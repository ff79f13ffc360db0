"""How a checkpoint's tensors map onto a model's parameters on one rank.

A family names its checkpoint's projections (`CheckpointNames`). Our
layers fuse q/k/v into `self_attn.qkv_proj` and gate/up into
`mlp.gate_up_proj`; a checkpoint stores them apart (Llama) or already
fused (Phi-3): either way each part (a slot) lands in its row range of
the fused parameter, this rank's share of it (parallel.py). Row-parallel
projections are split along their inputs instead. Names a family's
checkpoints spell otherwise (a norm that is ours by another name) are
renamed segment by segment first.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pyserve.model.config import ModelConfig
from pyserve.model.parallel import ModelShard


@dataclass(frozen=True)
class Fused:
    """A column-parallel parameter of ours whose rows stack slots, each the
    rank's share of a quantity split over ranks: "q" (query heads x
    head_dim), "kv" (KV heads x head_dim), "intermediate", or one of the
    family's own (CheckpointNames.head_split)."""

    module: str
    slots: tuple[str, ...]


QKV = Fused("self_attn.qkv_proj", ("q", "kv", "kv"))
GATE_UP = Fused("mlp.gate_up_proj", ("intermediate", "intermediate"))


@dataclass(frozen=True)
class Column:
    """A checkpoint tensor that stacks the slots `slots` of `into`, whole, along its rows."""

    into: Fused
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Row:
    """A row-parallel projection of ours, split along its inputs by `split`
    ("q" or "intermediate"); its bias is added once, by rank 0."""

    module: str
    split: str


@dataclass(frozen=True)
class CheckpointNames:
    # A layer's checkpoint projections by module name, e.g. "self_attn.q_proj".
    projections: dict[str, Column | Row]
    # A checkpoint's name segment -> ours, e.g. Olmo 2's post_attention_layernorm,
    # a norm of the attention's output, is our attention_out_norm.
    renames: dict[str, str] = field(default_factory=dict)
    # A multimodal checkpoint served as text: the prefixes of its language
    # model's tensor names, stripped, and those of its other modalities'
    # tensors (vision tower, projector), skipped.
    language_model_prefixes: tuple[str, ...] = ()
    skipped_prefixes: tuple[str, ...] = ()
    # (config) -> {quantity: values per query head}: the family's own
    # quantities split over ranks by query head, named in its Fused slots
    # and Row splits (DeepSeek's q, kv_b and o_proj heads, each its own width).
    head_split: Callable[[ModelConfig], dict[str, int]] | None = None
    # (config) -> the checkpoint's layers that are skipped on purpose
    # (DeepSeek V3's multi-token-prediction layers after the model's own).
    skipped_layers: Callable[[ModelConfig], range] | None = None

    def with_changes(self, projections: dict[str, Column | Row] | None = None,
                     renames: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> CheckpointNames:
        """These names, with `drop` left out and `projections` and `renames` added."""
        kept = {name: spec for name, spec in self.projections.items() if name not in drop}
        return replace(self, projections={**kept, **(projections or {})}, renames={**self.renames, **(renames or {})})

    def language_model_name(self, hf_name: str) -> str | None:
        """`hf_name` without its language model prefix; None for another modality's tensor."""
        if hf_name.startswith(self.skipped_prefixes):
            return None
        prefix = next((p for p in self.language_model_prefixes if hf_name.startswith(p)), "")
        return hf_name[len(prefix):]


_ROW_PARALLEL = {
    "self_attn.o_proj": Row("self_attn.o_proj", "q"),
    "mlp.down_proj": Row("mlp.down_proj", "intermediate"),
}
# q, k, v, gate and up stored apart, as Llama's checkpoints do.
SEPARATE_PROJECTIONS = CheckpointNames({
    "self_attn.q_proj": Column(QKV, (0,)),
    "self_attn.k_proj": Column(QKV, (1,)),
    "self_attn.v_proj": Column(QKV, (2,)),
    "mlp.gate_proj": Column(GATE_UP, (0,)),
    "mlp.up_proj": Column(GATE_UP, (1,)),
    **_ROW_PARALLEL,
})
# RMSNorms of q and k over all heads (qk_norm "all"): a tensor-parallel
# rank holds its heads' slice of each weight.
ALL_HEADS_QK_NORMS = {"self_attn.q_norm": Column(Fused("self_attn.q_norm", ("q",)), (0,)),
                      "self_attn.k_norm": Column(Fused("self_attn.k_norm", ("kv",)), (0,))}


@dataclass(frozen=True)
class Piece:
    """Where one stretch of a checkpoint tensor goes: into `param` from row
    `row` (None: an unfused parameter), the checkpoint's `part` along `dim`
    (None: all of it), whose whole length there is `full`."""

    param: str
    row: int | None = None
    dim: int | None = None
    part: range | None = None
    full: int | None = None


def _shares(config: ModelConfig, shard: ModelShard, names: CheckpointNames) -> dict[str, tuple[range, int]]:
    """Each split quantity: (this rank's range of it, its whole length)."""
    hd = config.head_dim
    per_head = {"q": hd, **(names.head_split(config) if names.head_split else {})}
    return {
        **{kind: (range(shard.q_heads.start * n, shard.q_heads.stop * n), config.num_attention_heads * n)
           for kind, n in per_head.items()},
        "kv": (range(shard.kv_heads.start * hd, shard.kv_heads.stop * hd), config.num_key_value_heads * hd),
        "intermediate": (shard.intermediate, config.intermediate_size),
    }


_LAYER = re.compile(r"layers\.(\d+)\.")


def _slot_rows(fused: Fused, shares: dict[str, tuple[range, int]]) -> list[int]:
    """The first row of each slot in this rank's fused parameter."""
    rows, row = [], 0
    for kind in fused.slots:
        rows.append(row)
        row += len(shares[kind][0])
    return rows


def pieces(hf_name: str, config: ModelConfig, shard: ModelShard, names: CheckpointNames) -> list[Piece]:
    """Where a checkpoint tensor goes on this rank; [] for tensors skipped on purpose."""
    hf_name = names.language_model_name(hf_name)
    if hf_name is None:
        return []
    name = ".".join(names.renames.get(part, part) for part in hf_name.removeprefix("model.").split("."))
    if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved the RoPE buffer
        return []
    if name == "score.weight":  # a sequence classifier's head, which its pooling applies (model/pooling.py)
        return []
    layer = _LAYER.match(name)
    if layer and names.skipped_layers and int(layer.group(1)) in names.skipped_layers(config):
        return []
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return []  # some tied checkpoints store the copy anyway
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return [Piece(name, None, 0, shard.vocab, config.vocab_size)]
    shares = _shares(config, shard, names)
    for proj, spec in names.projections.items():
        if f".{proj}." not in name:
            continue
        if isinstance(spec, Row):
            param = name.replace(proj, spec.module)
            if not name.endswith(".weight"):
                # A row-parallel bias is added once, after the all-reduce: rank 0 holds it.
                return [Piece(param)] if shard.tp.rank == 0 else []
            return [Piece(param, None, 1, *shares[spec.split])]
        param = name.replace(proj, spec.into.module)
        kinds = [spec.into.slots[s] for s in spec.slots]
        full = sum(shares[kind][1] for kind in kinds)
        rows = _slot_rows(spec.into, shares)
        out, start = [], 0  # start: the slot's first row in the checkpoint tensor
        for slot, kind in zip(spec.slots, kinds):
            part, length = shares[kind]
            out.append(Piece(param, rows[slot], 0, range(start + part.start, start + part.stop), full))
            start += length
        return out
    return [Piece(name)]


def expected_pieces(params, config: ModelConfig, shard: ModelShard,
                    names: CheckpointNames) -> set[tuple[str, int | None]]:
    """Every (parameter, first row) of `params` (names) the checkpoint must fill exactly once."""
    shares = _shares(config, shard, names)
    rows_of = {spec.into.module: _slot_rows(spec.into, shares)
               for spec in names.projections.values() if isinstance(spec, Column)}
    expected = set()
    for name in params:
        fused = next((m for m in rows_of if f".{m}." in name), None)
        expected.update([(name, None)] if fused is None else [(name, row) for row in rows_of[fused]])
    return expected
