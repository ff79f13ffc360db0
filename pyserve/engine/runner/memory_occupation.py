"""SGLang's /release_memory_occupation and /resume_memory_occupation on one
tensor-parallel rank: an RL trainer sharing the machine with the server
takes the memory of the KV cache (tag "kv_cache"), of the weights
("weights") and of the CUDA graphs ("cuda_graph") while the server idles,
and gives it back.

The KV cache and the weights give their tensors' storage back (resized to
nothing, the tensors kept, so every view and holder stays valid) and get
new storage on resume: the KV cache zeroed (the prefix cache was flushed),
the weights read again from the served checkpoint on disk, as
/update_weights_from_disk reads one (weight_swap.py), so that they are
whole before a trainer sends its own; or, released with `host_copy`
(vLLM's sleep level 1), copied back from host memory as they were. What
holds their addresses (the CUDA graphs, the CPU's native layers) is
dropped on release and rebuilt once both are back, the graphs unless
their tag stays released."""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import msgspec
import torch

from pyserve.engine.runner.weight_swap import copy_weights, model_tensors, paired_tensors

TAGS = ("kv_cache", "weights", "cuda_graph")
# A storage given back: the storage, its bytes, and their host copy (or None).
_Given = tuple[torch.UntypedStorage, int, "torch.UntypedStorage | None"]


class ReleaseMemory(msgspec.Struct, tag=True, kw_only=True):
    tags: list[str]
    host_copy: bool = False  # the weights wait in host memory (vLLM's sleep level 1) instead of on disk


class ResumeMemory(msgspec.Struct, tag=True, kw_only=True):
    tags: list[str]
    checkpoint: str  # the served checkpoint's directory, which the weights are read from again


class MemoryOccupation:
    """What this rank has released, and the storage it gave back."""

    def __init__(self, rank_model):
        self.rank_model = rank_model
        self.released: frozenset[str] = frozenset()
        self._given: dict[str, list[_Given]] = {}  # by tag

    def release(self, op: ReleaseMemory) -> None:
        rank_model = self.rank_model
        tags = set(op.tags) - self.released
        if "weights" in tags and rank_model.lora is not None:
            raise ValueError("the weights cannot be released with --enable-lora: the adapters' slots would be lost")
        rank_model.drop_address_holders()
        try:  # `released` says what is out at every point: a refusal midway leaves the rest in place
            if "kv_cache" in tags:
                buffer = rank_model.kv_buffer  # every view of its pages: a moved storage must take them all
                self._given["kv_cache"] = _give_back(buffer.k_pages + buffer.k_buffer + buffer.v_pages
                                                     + buffer.v_buffer)
                self.released |= {"kv_cache"}
            if "weights" in tags:
                self._given["weights"] = _give_back(list(model_tensors(rank_model.model).values()), op.host_copy)
                self.released |= {"weights"}
            self.released |= tags & {"cuda_graph"}
        finally:
            self._rebuild_when_whole()
            _return_freed(rank_model.device)

    def resume(self, op: ResumeMemory) -> None:
        tags = set(op.tags) & self.released
        if "weights" in tags:
            kept = any(copy is not None for _, _, copy in self._given["weights"])
            # Read before the memory is taken again (the read needs its own), and before the
            # record is dropped: a checkpoint that cannot be read leaves the weights released.
            read = None if kept else self.rank_model.read_checkpoint(Path(op.checkpoint))
            _take_back(self._given.pop("weights"))
            if read is not None:
                copy_weights(paired_tensors(self.rank_model.model, read))
                del read
                _return_freed(self.rank_model.device)  # the read's transient copy
        if "kv_cache" in tags:
            _take_back(self._given.pop("kv_cache"))
            for pages in self.rank_model.kv_buffer.k_pages + self.rank_model.kv_buffer.v_pages:
                pages.zero_()  # as at start: a padded row reads page 0
        self.released -= tags
        self._rebuild_when_whole()

    def _rebuild_when_whole(self) -> None:
        """What holds the memory's addresses, once the KV cache and the weights are both in place."""
        if not self.released & {"kv_cache", "weights"}:
            self.rank_model.rebuild_address_holders(graphs="cuda_graph" not in self.released)


def _give_back(tensors: list[torch.Tensor], host_copy: bool = False) -> list[_Given]:
    """Each distinct storage under `tensors` resized to nothing, its bytes
    first copied to host memory with `host_copy`; ValueError, with nothing
    released, where one cannot be. A storage that cannot be resized (one a
    file or numpy holds: a GGUF read, or a tensor the native layers read
    through numpy) is first moved into a new one of its own that can, by
    every tensor over it, so `tensors` must name every view there is."""
    users: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor subclass wrapping others
            raise ValueError(f"a {type(t).__name__} of the model holds no storage of its own to release") from None
        if storage.nbytes():
            users.setdefault(storage.data_ptr(), (storage, []))[1].append(t)
    given = []
    with torch.no_grad():
        for storage, over in users.values():
            copy = torch.UntypedStorage(storage.nbytes()).copy_(storage) if host_copy else None
            if not storage.resizable():
                moved = torch.UntypedStorage(storage.nbytes(), device=storage.device)
                for t in over:
                    t.set_(moved, t.storage_offset(), t.size(), t.stride())
                storage = moved
            given.append((storage, storage.nbytes(), copy))
    for storage, _, _ in given:
        storage.resize_(0)
    return given


def _return_freed(device: torch.device) -> None:
    """Hand the memory freed to the system: the CUDA allocator's cache, or
    the C heap's free pages. On a CPU, tensors of tens of MB (a layer's KV
    pages) come from glibc's heap, whose free chunks below its top stay
    resident until malloc_trim."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim by hand
        pass


def _take_back(given: list[_Given]) -> None:
    """Each storage at its size again, with its host copy's bytes where it has one."""
    for storage, nbytes, copy in given:
        storage.resize_(nbytes)
        if copy is not None:
            storage.copy_(copy)
