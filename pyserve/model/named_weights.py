"""A served model's weights by their checkpoint names, in place, on one
rank: what a trainer's weight sync writes (engine/runner/weight_sync.py)
and what /get_weights_by_name reads.

A name lands where the loader puts that checkpoint tensor (checkpoint.py's
pieces, an MoE block's placement): a tensor-parallel rank takes its shard
of it, q/k/v and gate/up their rows of the fused parameters. Every tensor
of an update is checked (its name, its shape) before any is copied, so an
update that does not fit leaves the weights as they were. The copies go
into the tensors the model holds, so CUDA graphs read the new values.
Layers held quantized (the CPU's 4-bit modes, a quantized checkpoint's
kernels) hold no float weight to write, and their names are refused."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pyserve.model.checkpoint import Piece, pieces
from pyserve.model.config import ModelConfig
from pyserve.model.families import family_of
from pyserve.model.int4_parts import piece_copy, piece_destination
from pyserve.model.layers.causal_lm import CausalLM
from pyserve.model.loader import DenseTensors, block_claiming, expert_blocks

# A part of a checkpoint tensor a rank holds: (dim, part, full, values), as checkpoint.Piece cuts it.
HeldPart = tuple[int | None, range | None, int | None, torch.Tensor]


class NamedWeights:
    def __init__(self, model: torch.nn.Module, config: ModelConfig):
        if not isinstance(model, CausalLM):
            raise ValueError(f"{config.architecture} is an encoder model, whose weights are replaced from a "
                             "checkpoint on disk (/update_weights_from_disk), not by name")
        self.config = config
        self.names = family_of(config.architecture).checkpoint
        self.shard = model.shard
        self.has_lm_head = model.lm_head is not None
        self.blocks = expert_blocks(model)
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())

    def write(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each (checkpoint name, tensor) into the model, this rank's
        part of it (cast to the model's dtype); ValueError, with nothing
        copied, where one does not fit."""
        copies = []
        for name, tensor in named:
            block = block_claiming(self.blocks, name)
            if block is not None:
                copies += block.weight_copies(name, tensor)
                continue
            handle = DenseTensors({name: tensor})
            copies += [piece_copy(self.params[p.param].data, p, handle, name) for p in self._pieces(name)]
        with torch.no_grad():
            for destination, source in copies:
                destination.copy_(source)

    def read(self, name: str, rows: int) -> list[HeldPart]:
        """The parts of checkpoint tensor `name` this rank holds, as float32
        on the CPU, cut to the whole tensor's first `rows` rows (assemble
        joins the ranks' parts)."""
        if block_claiming(self.blocks, name) is not None:
            raise ValueError(f"{name} is held in its MoE block's stacked experts, which are not read back by name")
        if name.endswith("lm_head.weight") and self.config.tie_word_embeddings:
            name = name.replace("lm_head.weight", "model.embed_tokens.weight")  # the same tensor
        held = []
        for p in self._pieces(name):
            start = p.part.start if p.dim == 0 else 0
            values = piece_destination(self.params[p.param].data, p)[: max(0, rows - start)]
            held.append((p.dim, p.part, p.full, values.float().cpu().clone()))
        return held

    def _pieces(self, name: str) -> list[Piece]:
        found = [p for p in pieces(name, self.config, self.shard, self.names)
                 if p.param != "lm_head.weight" or self.has_lm_head]
        for p in found:
            if p.param == "embed_tokens.weight" and self.config.tie_word_embeddings and self.has_lm_head:
                raise ValueError(f"{name}: the output projection holds a quantized copy of this tied matrix, "
                                 "which a float write would leave behind (--torchao-config none)")
            if p.param not in self.params:
                module = self.modules.get(p.param.rpartition(".")[0])
                if module is None:
                    raise ValueError(f"{name} is not a weight of this {self.config.architecture} model")
                raise ValueError(f"{name}: the served model holds it quantized ({type(module).__name__}); weights "
                                 "are written by name into a float model (--torchao-config none)")
        return found


def assemble(parts: list[HeldPart], rows: int) -> torch.Tensor:
    """The checkpoint tensor's first `rows` rows from every rank's parts
    (NamedWeights.read); ValueError where no rank holds it."""
    if not parts:
        raise ValueError("no rank holds it: the model reads it from no weight")
    dim, _, full, first = parts[0]
    if dim is None:
        return first
    shape = list(first.shape)
    shape[dim] = full
    shape[0] = min(shape[0], rows)
    whole = torch.empty(shape)
    for d, part, _, values in parts:
        if values.numel():
            whole.narrow(d, part.start, values.shape[d]).copy_(values)
    return whole
