"""Reading a checkpoint tensor's part (and where it goes), and the 4-bit groups a checkpoint
brings: a shipped int4 file's, a rank's slice of a layer's groups, and a
fused module's parts stacked in row order."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from pyserve.model.checkpoint import CheckpointNames, pieces
from pyserve.model.config import ModelConfig
from pyserve.model.parallel import ModelShard
from pyserve.model.quant import Int4Groups, unpack_nibbles


def read_part(handle, key: str, dim: int | None, part: range | None, full: int | None) -> torch.Tensor:
    """The tensor `key`, or its `part` along `dim` (clipped to the tensor:
    the last vocabulary shard may run past it). ValueError when the
    checkpoint's length along `dim` is not `full`."""
    if dim is None:
        return handle.get_tensor(key)
    view = handle.get_slice(key)
    shape = view.get_shape()
    if len(shape) <= dim or shape[dim] != full:
        raise ValueError(f"{key} has shape {tuple(shape)}, the config expects {full} along dimension {dim}")
    return view[(slice(None),) * dim + (slice(part.start, min(part.stop, full)),)]


def piece_destination(target: torch.Tensor, piece) -> torch.Tensor:
    """Where in `target` (its parameter) one piece (checkpoint.Piece) of a
    checkpoint tensor lies: its rows of a fused parameter; of a vocabulary
    shard, the rows the checkpoint has (those past it are padding)."""
    if piece.row is not None:
        return target.narrow(0, piece.row, len(piece.part))
    if piece.dim == 0:
        return target[: max(0, min(piece.part.stop, piece.full) - piece.part.start)]
    return target


def piece_copy(target: torch.Tensor, piece, handle, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(where in `target` it goes, what goes there) for one piece
    (checkpoint.Piece) of the tensor `key`; ValueError where its shape is
    not the config's."""
    target = piece_destination(target, piece)
    tensor = read_part(handle, key, piece.dim, piece.part, piece.full)
    if tensor.shape != target.shape:
        raise ValueError(f"{key} has shape {tuple(tensor.shape)}, the config expects {tuple(target.shape)}")
    return target, tensor


def shipped_int4(path: Path, config: ModelConfig, shard: ModelShard, names: CheckpointNames,
                  group_size: int) -> dict[str, Int4Groups]:
    """Module name -> its 4-bit groups from a file of `<projection>.codes/.scales/.zeros`
    (codes two to a byte), this rank's part of each, the parts of a fused
    projection concatenated in row order."""
    parts: dict[str, list[tuple[int, Int4Groups]]] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for key in f.keys():
            if not key.endswith(".codes"):
                continue
            projection = key.removesuffix(".codes")
            for piece in pieces(projection + ".weight", config, shard, names):
                dim, part, full = piece.dim, piece.part, piece.full
                if dim == 1 and (part.start % group_size or len(part) % group_size):
                    raise ValueError(
                        f"{path.name}: tensor-parallel rank {shard.tp.rank} holds columns {part.start}-{part.stop} "
                        f"of {projection}, which do not begin and end on its groups of {group_size}; serve this "
                        "model with --torchao-config none or int8wo at this --tp-size")
                # Along the input dimension codes come two to a byte and scales one per group.
                per_code, per_group = (1, 1) if dim == 0 else (2, group_size)
                codes = read_part(f, key, dim, range(part.start // per_code, part.stop // per_code), full // per_code)
                scales, zeros = (
                    read_part(f, projection + suffix, dim, range(part.start // per_group, part.stop // per_group),
                          full // per_group) for suffix in (".scales", ".zeros"))
                parts.setdefault(piece.param.removesuffix(".weight"), []).append(
                    (piece.row or 0, (unpack_nibbles(codes), scales, zeros)))
    return stacked_groups(parts)


def sliced_groups(groups: Int4Groups, piece, group_size: int, module: str) -> Int4Groups:
    """This rank's part of a layer's int4 groups (codes [out, in], scales and zeros per group)."""
    if piece.dim is None:
        return groups
    part = piece.part
    if piece.dim == 0:
        return tuple(t[part.start:part.stop] for t in groups)
    if part.start % group_size or len(part) % group_size:
        raise ValueError(f"tensor-parallel rank holds columns {part.start}-{part.stop} of {module}, which do not "
                         f"begin and end on its groups of {group_size}")
    codes, scales, zeros = groups
    g = slice(part.start // group_size, part.stop // group_size)
    return codes[:, part.start:part.stop], scales[:, g], zeros[:, g]


def stacked_groups(parts: dict[str, list[tuple[int, Int4Groups]]]) -> dict[str, Int4Groups]:
    """The parts of each fused module's groups concatenated in row order."""
    groups = {}
    for module, stacked in parts.items():
        stacked.sort(key=lambda piece: piece[0])
        groups[module] = tuple(torch.cat([p[1][i] for p in stacked]) for i in range(3))
    return groups
