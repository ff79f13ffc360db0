"""Load Hugging Face safetensors weights into a model family's CausalLM
(or an encoder's model: model/encoders/ loads those).

The model is built on the meta device and then given uninitialised storage
on the target device in the target dtype, so no throwaway random weights
(and no float32 copy of a bf16 model) are ever allocated. Tensors are then
read one at a time from the checkpoint (one file or an index of shards) and
copied into place where the family's checkpoint names say
(checkpoint.py): q/k/v and gate/up land in row ranges of the fused
parameters. Every parameter row range must be filled exactly once. A
tensor-parallel rank reads only its slice of each tensor (safetensors'
get_slice), along the dimension its layer is split (parallel.py).

A mixture-of-experts block (layers/moe.py) places the tensors of its layer
that it claims itself, from their safetensors slices, so a rank reads
only its slice of every expert (layers/moe_weights.py): its parameters
start as NaN, so one that no tensor filled shows. In a quantized mode the
experts are quantized as the linear layers are.

With a weight quantization (quant.py) the linear layers are then replaced
by quantized ones; where the directory ships weights already quantized
that way (model.int4wo-32.safetensors), those are used as they are.

A checkpoint quantized by another tool (AWQ, GPTQ, FP8, compressed-tensors:
quantized/) has each quantized layer's tensors read together into its
dense weight, which then lands like any other tensor (sliced for this
rank, or handed to its MoE block); where the CPU's 4-bit mode can hold a
layer's codes exactly, those codes are what it is built from. A rank reads
only its part of each expert's quantized tensors (its rows of gate/up,
its inputs of down), where their packed layout can cut it (modules.py);
likewise of each dense quantized layer: its rows of q/k/v and gate/up
(each slot of a fused checkpoint tensor apart), its inputs of o_proj and
down_proj.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from tqdm import tqdm

from pyserve.model.checkpoint import CheckpointNames, expected_pieces, pieces
from pyserve.model.config import ModelConfig, read_config_files
from pyserve.model.encoders import is_encoder, load_encoder, parse_encoder_config
from pyserve.model.families import family_of, parse_config, scores_only
from pyserve.model.families.family import Family
from pyserve.model.int4_parts import piece_copy, shipped_int4, sliced_groups, stacked_groups
from pyserve.model.layers.causal_lm import CausalLM
from pyserve.model.layers.moe import MoEBlock, placement
from pyserve.model.layers.moe_weights import ExpertGroups
from pyserve.model.parallel import SINGLE, ModelShard, TensorParallel
from pyserve.model.quant import Int4Groups, Int4Linear, WeightQuant, prequantized_file, quantize_model
from pyserve.model.quantized.gpu_layers import sliced, stacked, use_gpu_layers
from pyserve.model.quantized.modules import QuantizedModules, dense_weights
from pyserve.model.quantized.weights import QuantizedWeight
from pyserve.model.quantized.scheme import detect

logger = logging.getLogger(__name__)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards an index names, or model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} lists shards that are not there: {absent}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")


class DenseTensors:
    """Dense tensors read as a safetensors handle reads its own."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def get_slice(self, key: str):
        return _TensorView(self.tensors[key])


class _Parts:
    """The rows or columns (dim, part) of a tensor `key` that were read,
    standing in for the whole tensor of `full` along dim, as a safetensors
    slice: indexing returns a part read, and nothing else."""

    def __init__(self, key: str, parts: dict[tuple[int, range], torch.Tensor], full: int):
        self.key, self.parts = key, parts
        dim, part = next(iter(parts))
        self.shape = [full if d == dim else n for d, n in enumerate(parts[dim, part].shape)]

    def get_slice(self, key: str):
        return self

    def get_shape(self) -> list[int]:
        return self.shape

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        dim = len(index) - 1
        last = index[-1]
        held = self.parts.get((dim, range(last.start, last.stop))) if isinstance(last, slice) else None
        if held is None or index[:-1] != (slice(None),) * dim:
            raise ValueError(f"{self.key}: only {list(self.parts)} (dimension, part) were read, not {index}")
        return held


def _expert_split(blocks: dict[int, MoEBlock], module: str) -> tuple[int, range] | None:
    """(dim, part) of the quantized layer `module` this rank holds, where
    it is one of an MoE block's experts (or its shared expert) split over
    the ranks: rows of gate/up (dim 0), inputs of down (dim 1)."""
    block = block_claiming(blocks, module + ".weight")
    if block is None:
        return None
    where = placement(block.spec, module + ".weight")
    if where.layout != "linear" or where.param not in ("w13", "w2", "shared_w13", "shared_w2"):
        return None
    shared = where.param.startswith("shared")
    part, full = (block.shared_part, block.spec.shared_intermediate) if shared else (block.part, block.spec.intermediate)
    return None if len(part) == full else (0 if where.param.endswith("w13") else 1, part)


def _dense_split(quantized: QuantizedModules, module: str, config: ModelConfig, shard: ModelShard,
                 names: CheckpointNames) -> list[tuple[int, range]]:
    """(dim, part) of each piece of the dense quantized layer
    `module` this rank holds (q/k/v, gate/up rows; o_proj, down_proj
    inputs); [] where it takes the whole layer, or a part reaches past the
    stored weight (a padded vocabulary shard) or its length is not the
    config's (read whole, where the error names it)."""
    cut = pieces(module + ".weight", config, shard, names)
    if not cut or any(p.dim is None for p in cut) or all(len(p.part) == p.full for p in cut):
        return []
    shape = quantized.shape(module)
    if shape is None or any(p.part.stop > p.full or shape[p.dim] != p.full for p in cut):
        return []
    return [(p.dim, p.part) for p in cut]


class _TensorView:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index):
        return self.tensor[index]


def _copy_piece(target: torch.Tensor, piece, handle, hf_name: str, path: Path) -> None:
    """Read one piece of the checkpoint tensor `hf_name` into its place in `target`."""
    try:
        destination, tensor = piece_copy(target, piece, handle, hf_name)
    except ValueError as e:
        raise ValueError(f"{path.name}: {e}") from None
    if piece.dim == 0 and piece.row is None:
        target[destination.shape[0]:].zero_()  # vocabulary padding rows
    destination.copy_(tensor)


_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def expert_blocks(model: CausalLM) -> dict[int, MoEBlock]:
    """The MoE blocks of `model`, by layer index."""
    return {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoEBlock)}


def block_claiming(blocks: dict[int, MoEBlock], hf_name: str) -> MoEBlock | None:
    """The MoE block whose tensor `hf_name` is, if any."""
    layer = _LAYER.match(hf_name)
    block = blocks.get(int(layer.group(1))) if layer else None
    return block if block is not None and placement(block.spec, hf_name) is not None else None


class ModelPart(Protocol):
    """Part of a checkpoint loaded as a model of its own (model/mtp_head.py)."""

    config: ModelConfig  # the part's

    def model(self, family: Family, shard: ModelShard) -> CausalLM:
        """The part's model, built on the current (meta) device."""

    def name_of(self, hf_name: str) -> str | None:
        """The name the part's model gives a checkpoint tensor; None: not the part's."""


class _Renamed:
    """A safetensors handle whose tensor `original` is read as `name`."""

    def __init__(self, handle, name: str, original: str):
        self.handle, self.name, self.original = handle, name, original

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.handle.get_tensor(self.original if key == self.name else key)

    def get_slice(self, key: str):
        return self.handle.get_slice(self.original if key == self.name else key)


def _draw_weights(model: CausalLM, seed: int) -> None:
    """--load-format dummy: every weight uniform in [-1e-3, 1e-3], as SGLang
    draws them (small enough that no activation overflows)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for p in model.parameters():
        p.data.uniform_(-1e-3, 1e-3, generator=generator)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device | str, quant: WeightQuant | None = None,
    tp: TensorParallel = SINGLE, lm_head: bool = True, quantization: str = "auto", part: ModelPart | None = None,
    config_overrides: dict | None = None, dummy: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """The model in eval mode with every weight loaded, and its config;
    its linear layers quantized as `quant` when given (CPU only). Under
    tensor parallelism (`tp`), this rank's shard: only its slice of each
    checkpoint tensor is read. `lm_head` False (embedding servers, which
    read hidden states and never logits): no vocabulary projection is
    held or read, since untied embedding checkpoints (Qwen3-Embedding-4B,
    -8B) ship none. `quantization` (`--quantization`): the checkpoint's
    own quantization, auto (as config.json says), a method insisted on, or none.
    `part`: a model made of part of the checkpoint instead (ModelPart),
    read whole on this rank. `config_overrides` (--json-model-override-args)
    replace config.json's keys. `dummy` (--load-format dummy): no
    checkpoint is read, every weight is drawn at random (the same on every
    run), for measuring speed and memory without the weights."""
    model_dir = Path(model_dir)
    device = torch.device(device)
    raw, generation = read_config_files(model_dir, config_overrides)
    what = scores_only(raw)
    if lm_head and what:
        raise ValueError(f"{model_dir} is {what}, which embeds or scores prompts and generates nothing: "
                         "serve it with --is-embedding")
    scheme = detect(raw, quantization)
    if is_encoder(raw):
        refused = [flag for flag, given in (("--tp-size above 1", tp.size > 1), ("--load-format dummy", dummy),
                                            ("a quantized mode", quant is not None or scheme is not None)) if given]
        if refused:
            raise ValueError(f"{model_dir} is an encoder model, which runs whole and in float from its checkpoint: "
                             f"not with {', '.join(refused)}")
        model = load_encoder(model_dir, parse_encoder_config(raw, model_dir), dtype, device,
                             checkpoint_files(model_dir))
        return model, model.config
    config = parse_config(raw, generation, str(model_dir)) if part is None else part.config
    if dummy and scheme is not None:
        raise ValueError(f"--load-format dummy draws float weights; {model_dir}'s config.json says its checkpoint is "
                         f"{scheme.name}-quantized (--json-model-override-args '{{\"quantization_config\": null}}' measures "
                         "the float model)")
    family = family_of(config.architecture)
    names = family.checkpoint
    shard = ModelShard.of(config, tp)
    with torch.device("meta"):
        model = family.model(config, shard) if part is None else part.model(family, shard)
    if not lm_head:
        model.lm_head = None
    blocks = expert_blocks(model)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.requires_grad_(False)
    for block in blocks.values():
        for p in block.parameters():
            p.data.fill_(float("nan"))
    block_prefixes = tuple(f"layers.{i}.mlp." for i in blocks)
    params = {name: p for name, p in model.named_parameters() if not name.startswith(block_prefixes)}
    missing = set() if dummy else expected_pieces(params, config, shard, names)
    placed = set()  # the MoE blocks' checkpoint tensors
    # A quantized checkpoint's int4 groups in the 4-bit mode's group size, by module.
    group_size = None if quant is None or quant.bits != 4 else (32 if quant.int8_activations else quant.group_size)
    group_parts: dict[str, list[tuple[int, Int4Groups]]] = {}
    expert_groups = ExpertGroups(group_size)

    # On CUDA, each checkpoint-quantized module's parts as this rank holds them, for its GPU kernel.
    gpu_parts: dict[str, list[tuple[int, QuantizedWeight | None]]] = {}

    def place(hf_name: str, handle, path_name: str, held: dict | None = None) -> None:
        """`held`: a checkpoint-quantized layer's weight as this rank read
        it, {None: the whole} or {(dim, part): each part}."""
        block = block_claiming(blocks, hf_name)
        if block is not None:
            if hf_name in placed:
                raise ValueError(f"{path_name}: repeated tensor {hf_name}")
            block.load_weight(hf_name, handle.get_slice(hf_name))
            placed.add(hf_name)
            weight = None if held is None or group_size is None else next(iter(held.values()))
            groups = None if weight is None else weight.int4_groups(group_size)
            if groups is not None:
                where = placement(block.spec, hf_name)
                part = block.shared_part if "shared" in where.param else block.part
                if None not in held:  # the groups are this rank's part already
                    part = range(len(part))
                if where.layout == "linear" and where.param.endswith(("w13", "w2")):
                    expert_groups.add(f"layers.{_LAYER.match(hf_name).group(1)}.mlp", where.param, where.expert,
                                      where.row, groups, part)
            return
        for piece in pieces(hf_name, config, shard, names):
            if piece.param == "lm_head.weight" and model.lm_head is None:
                continue
            if (piece.param, piece.row) not in missing:
                raise ValueError(f"{path_name}: unexpected (or repeated) tensor {hf_name} for {config.architecture}")
            _copy_piece(params[piece.param].data, piece, handle, hf_name, Path(path_name))
            missing.discard((piece.param, piece.row))
            if held is None:
                continue
            module = piece.param.removesuffix(".weight")
            whole = held.get(None)
            weight = held[piece.dim, piece.part] if whole is None else sliced(whole, piece.dim, piece.part)
            if group_size is not None:
                groups = (weight if whole is None else whole).int4_groups(group_size)
                if groups is not None and whole is not None:
                    groups = sliced_groups(groups, piece, group_size, hf_name)
                if groups is not None:
                    group_parts.setdefault(module, []).append((piece.row or 0, groups))
            if device.type == "cuda":
                gpu_parts.setdefault(module, []).append((piece.row or 0, weight))

    if dummy:
        _draw_weights(model, tp.rank)
    files = [] if dummy else checkpoint_files(model_dir)
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt", device="cpu")) for p in files]
        quantized = None if scheme is None else QuantizedModules(scheme, handles)
        if quantized is not None and part is not None:
            quantized.keep(lambda module: part.name_of(module + ".weight") is not None)
        total = sum(len(h.keys()) for h in handles)
        progress = stack.enter_context(tqdm(total=total, desc=f"Loading {model_dir.name}", unit="tensor",
                                            disable=tp.rank > 0))
        for path, handle in zip(files, handles):
            for hf_name in handle.keys():
                progress.update()
                name = hf_name if part is None else part.name_of(hf_name)
                if name is not None and (quantized is None or not quantized.claims(hf_name)):
                    place(name, handle if name == hf_name else _Renamed(handle, name, hf_name), path.name)
        if quantized is not None:
            def split(module: str) -> list[tuple[int, range]]:
                expert = _expert_split(blocks, module)
                if expert is not None or block_claiming(blocks, module + ".weight"):
                    return [] if expert is None else [expert]
                return _dense_split(quantized, module, config, shard, names)

            for module, read in dense_weights(quantized, dtype, split):
                key = module + ".weight" if part is None else part.name_of(module + ".weight")
                if read[0][2] is None:
                    weight, dense, _ = read[0]
                    place(key, DenseTensors({key: dense}), scheme.name, {None: weight})
                else:
                    full = quantized.shape(module)[read[0][2][0]]  # the length its parts cut
                    place(key, _Parts(key, {part: dense for _, dense, part in read}, full), scheme.name,
                          {part: weight for weight, _, part in read})
    missing |= {(f"layers.{i}.mlp.{name}", None) for i, block in blocks.items()
                for name, p in block.named_parameters() if p.isnan().any()}
    if missing:
        absent = sorted(n if first is None else f"{n} (rows from {first})" for n, first in missing)
        raise ValueError(f"{model_dir}: {len(absent)} weights missing from the checkpoint, e.g. {absent[:5]}")
    if quant is not None:
        shipped = prequantized_file(model_dir, quant)
        if shipped.is_file() and not dummy:
            own = shipped_int4(shipped, config, shard, names, quant.group_size)
        else:  # a module whose fused parts are not all int4 groups, or that the kernel cannot hold,
            # is quantized from its dense weight
            own = {module: groups for module, groups in stacked_groups(group_parts).items()
                   if groups[0].shape == params[module + ".weight"].shape
                   and (quant.int8_activations or Int4Linear.fits(groups[0], quant.group_size))}
        own.update(expert_groups.stacked())
        quantize_model(model, quant, own)
    if gpu_parts:  # int4 and FP8 kernels hold what they can; the rest keeps its dequantized weight
        use_gpu_layers(model, {module: stacked(parts) for module, parts in gpu_parts.items()}, dtype, device)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "Loaded %s (%s, %.1fM dense parameters%s%s) as %s on %s%s",
        model_dir, config.architecture, n_params / 1e6,
        f" in tensor-parallel rank {tp.rank}'s shard of {tp.size}" if tp.size > 1 else "",
        f", checkpoint {scheme.name}" if scheme else "",
        str(dtype).removeprefix("torch."), device, f", linear layers {quant.name}" if quant else "",
    )
    return model, config
