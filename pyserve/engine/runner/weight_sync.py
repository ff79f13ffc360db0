"""A trainer's weights into the served model, as SGLang's RL integrations
(verl, OpenRLHF, slime) send them, on one tensor-parallel rank.

/init_weights_update_group has every rank of the server join a process
group with the trainer, which is its rank 0 (it broadcasts) while the
server's ranks are rank_offset + their tensor-parallel rank; the group
meets at the trainer's TCP store (master_address:master_port) under
`group_name`, as torch.distributed's own groups do, so a trainer builds
its side with the same torch calls (SGLang's init_custom_process_group).
/update_weights_from_distributed then receives each named tensor the
trainer broadcasts, in the order named, and writes them all by their
checkpoint names (model/named_weights.py). /update_weights_from_tensor
instead hands each rank tensors a process on the same machine shares
(CUDA IPC, or shared memory), pickled as torch.multiprocessing pickles
them; only torch's rebuilding functions are unpickled. /get_weights_by_name
reads a weight back. Either update may bring its tensors as SGLang's
"flattened_bucket": one uint8 tensor holding every tensor's bytes back to
back (a trainer's FlattenedTensorBucket), cut apart here. Rank 0 sends
each operation to the other ranks (tp/broadcast.py), every rank performs
it, and rank 0 gathers their results.
"""

from __future__ import annotations

import base64
import io
import pickle
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

from pyserve.engine.runner.memory_occupation import MemoryOccupation, ReleaseMemory, ResumeMemory
from pyserve.model.named_weights import NamedWeights

# How long a rank waits for the trainer to join a group, or to send a tensor.
GROUP_TIMEOUT = timedelta(minutes=10)
BACKENDS = ("gloo", "nccl")


class JoinGroup(msgspec.Struct, tag=True, kw_only=True):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


class LeaveGroup(msgspec.Struct, tag=True, kw_only=True):
    group_name: str


class ReceiveWeights(msgspec.Struct, tag=True, kw_only=True):
    group_name: str
    names: list[str]
    dtypes: list[str]  # torch dtype names: bfloat16 (or torch.bfloat16)
    shapes: list[list[int]]
    flattened: bool = False  # one broadcast of all their bytes


class SharedWeights(msgspec.Struct, tag=True, kw_only=True):
    payloads: list[str]  # one per tensor-parallel rank: base64 of the pickled [(name, tensor)]


class ReadWeight(msgspec.Struct, tag=True, kw_only=True):
    name: str
    rows: int


# The memory release ops (memory_occupation.py) travel the same way: they
# must be in this union, and a weight must not be written while released.
Operation = JoinGroup | LeaveGroup | ReceiveWeights | SharedWeights | ReadWeight | ReleaseMemory | ResumeMemory


class Outcome(msgspec.Struct):
    """One rank's result: an error message, or what it read."""

    error: str | None = None
    parts: list | None = None  # ReadWeight's: this rank's HeldParts


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a trainer names ("bfloat16", "torch.bfloat16"); ValueError for another word."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


class WeightSync:
    """This rank's update groups, by name, and the model they write."""

    def __init__(self, rank_model):
        self.rank_model = rank_model
        self.groups: dict[str, tuple[dist.ProcessGroup, str]] = {}  # name -> (group, backend)
        self.memory = MemoryOccupation(rank_model)

    def perform(self, op: Operation) -> Outcome:
        try:
            if isinstance(op, (ReceiveWeights, SharedWeights, ReadWeight)) and "weights" in self.memory.released:
                raise ValueError("the weights are released: /resume_memory_occupation with the tag weights first")
            if isinstance(op, ReadWeight):
                return Outcome(parts=self._weights().read(op.name, op.rows))
            {JoinGroup: self._join, LeaveGroup: self._leave, ReceiveWeights: self._receive,
             SharedWeights: self._shared, ReleaseMemory: self.memory.release,
             ResumeMemory: self.memory.resume}[type(op)](op)
        except Exception as e:  # reported to the caller as a 400; the rank serves on (a worker must not die here)
            return Outcome(error=str(e) or type(e).__name__)
        return Outcome()

    @property
    def _tp(self):
        return self.rank_model.model.shard.tp

    def _weights(self) -> NamedWeights:
        return NamedWeights(self.rank_model.model, self.rank_model.config)

    def _join(self, op: JoinGroup) -> None:
        if op.group_name in self.groups:
            raise ValueError(f"group {op.group_name!r} is already joined: /destroy_weights_update_group first")
        rank = op.rank_offset + self._tp.rank
        store, _, _ = next(rendezvous(f"tcp://{op.master_address}:{op.master_port}", rank, op.world_size,
                                      timeout=GROUP_TIMEOUT))
        store.set_timeout(GROUP_TIMEOUT)
        group, _ = _new_process_group_helper(op.world_size, rank, [], op.backend, PrefixStore(op.group_name, store),
                                             group_name=op.group_name, timeout=GROUP_TIMEOUT)
        _world.pg_group_ranks[group] = {i: i for i in range(op.world_size)}
        self.groups[op.group_name] = (group, op.backend)

    def _leave(self, op: LeaveGroup) -> None:
        group, _ = self._group(op.group_name)
        dist.destroy_process_group(group)
        del self.groups[op.group_name]

    def _group(self, name: str) -> tuple[dist.ProcessGroup, str]:
        if name not in self.groups:
            raise ValueError(f"no update group {name!r}: /init_weights_update_group first")
        return self.groups[name]

    def _receive(self, op: ReceiveWeights) -> None:
        """Every tensor the trainer broadcasts, then all of them written:
        the broadcasts are received whatever they hold, so that the trainer
        is never left waiting in one."""
        group, backend = self._group(op.group_name)
        device = self.rank_model.device if backend == "nccl" else torch.device("cpu")
        if op.flattened:
            entries, offset = [], 0
            for name, dtype, shape in zip(op.names, op.dtypes, op.shapes):
                size = torch.Size(shape).numel() * dtype_of(dtype).itemsize
                entries.append(BucketEntry(name, shape, dtype_of(dtype), offset, offset + size, size))
                offset += size
            flat = torch.empty(offset, dtype=torch.uint8, device=device)
            dist.broadcast(flat, group=group, group_src=0)
            self._weights().write(unflattened(flat, entries))
            return
        received = []
        for name, dtype, shape in zip(op.names, op.dtypes, op.shapes):
            tensor = torch.empty(shape, dtype=dtype_of(dtype), device=device)
            dist.broadcast(tensor, group=group, group_src=0)
            received.append((name, tensor))
        self._weights().write(received)

    def _shared(self, op: SharedWeights) -> None:
        named = _unpickle(base64.b64decode(op.payloads[self._tp.rank]))
        if _is_bucket(named):
            named = unflattened(named["flattened_tensor"], named["metadata"])
        if not isinstance(named, list) or not all(
                isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor) for item in named):
            raise ValueError("a payload is a pickled list of (name, tensor) pairs, or a flattened bucket "
                             "({'flattened_tensor', 'metadata'})")
        self._weights().write(named)


def _is_bucket(payload) -> bool:
    """A flattened bucket: {"flattened_tensor": uint8 tensor, "metadata": [BucketEntry]}."""
    return (isinstance(payload, dict) and isinstance(payload.get("flattened_tensor"), torch.Tensor)
            and isinstance(payload.get("metadata"), list)
            and all(isinstance(e, BucketEntry) for e in payload["metadata"]))


@dataclass
class BucketEntry:
    """Where one tensor's bytes lie in a flattened bucket; a trainer's
    pickled FlattenedTensorMetadata is read as one."""

    name: str
    shape: list[int]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes


def unflattened(flat: torch.Tensor, entries: list[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """Each entry's tensor, a view of the bucket's bytes; ValueError where they do not fit it."""
    named = []
    for e in entries:
        size = torch.Size(e.shape).numel() * e.dtype.itemsize
        if flat.dtype != torch.uint8 or flat.dim() != 1 or not 0 <= e.start_idx <= e.start_idx + size == e.end_idx \
                or e.end_idx > flat.numel():
            raise ValueError(f"{e.name}: {tuple(e.shape)} {e.dtype} is not bytes {e.start_idx}..{e.end_idx} of the "
                             f"bucket's {flat.numel()}")
        part = flat[e.start_idx:e.end_idx]
        if e.start_idx % e.dtype.itemsize:  # a view as wider elements starts on one
            part = part.clone()
        named.append((e.name, part.view(e.dtype).view(e.shape)))
    return named


class _TorchTensors(pickle.Unpickler):
    """Unpickles what torch.multiprocessing's pickler writes for tensors,
    and nothing else: any other global is refused."""

    # Not torch.storage._load_from_bytes, which would torch.load a pickle within.
    _ALLOWED = {
        "torch.multiprocessing.reductions": {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd",
                                             "rebuild_storage_filename", "rebuild_typed_storage",
                                             "rebuild_typed_storage_child", "rebuild_storage_empty"},
        "torch.storage": {"UntypedStorage"},
        "torch": {"Tensor", "Size", "UntypedStorage", *(n for n in dir(torch)
                                                         if isinstance(getattr(torch, n), torch.dtype))},
        "torch.nn.parameter": {"Parameter"},
        "multiprocessing.resource_sharer": {"DupFd"},
    }

    def find_class(self, module: str, name: str):
        if name == "FlattenedTensorMetadata":  # SGLang's, or a trainer's copy of it
            return BucketEntry
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a payload may hold only tensors; it names {module}.{name}")


def _unpickle(data: bytes):
    try:
        return _TorchTensors(io.BytesIO(data)).load()
    except (EOFError, AttributeError, TypeError, OSError) as e:
        raise ValueError(f"a payload is not a pickle of shared tensors: {e} (a trainer sharing CPU tensors "
                         "sets torch.multiprocessing.set_sharing_strategy('file_system'))") from None
