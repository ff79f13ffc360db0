"""Owns the model, the KV pool and the one thread that runs forward passes.

The asyncio loop must never wait on a forward pass, so every call into
torch for a step (forward + sampling) goes to a dedicated worker thread;
torch releases the GIL inside its kernels.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pyserve.engine.attention.base import AttentionBackend
from pyserve.engine.attention.torch_backend import TorchAttention
from pyserve.engine.kv_pool import KVPool
from pyserve.engine.sampler import Sampler
from pyserve.engine.sequence import Sequence
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.loader import load_model
from pyserve.server_args import ServerArgs

logger = logging.getLogger("pyserve.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV cache size when --max-total-tokens is not given. On CPU: room for a
# few full-length sequences, capped in slots and by the memory available.
_CPU_KV_CONTEXTS = 4
_CPU_KV_MAX_SLOTS = 65536
_CPU_KV_MEM_FRACTION = 0.25
_GPU_MEM_FRACTION = 0.85


def usable_cpus() -> int:
    """CPUs this process may really use: its affinity mask, further capped by
    a cgroup v2 CPU quota (containers often allow fewer CPUs than they show,
    and torch would otherwise start one thread per visible core)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def available_memory() -> int:
    """Bytes of RAM that can be taken without swapping others out."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but CUDA is not available")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, args: ServerArgs, model_dir: Path):
        self.device = pick_device(args.device)
        self.dtype = pick_dtype(args.dtype, self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(usable_cpus())
        torch.manual_seed(args.random_seed)
        self.model, self.config = load_model(model_dir, self.dtype, self.device)
        self.context_len = args.context_length or self.config.max_position_embeddings
        self.kv_pool = KVPool(
            self.config.num_hidden_layers,
            self._num_slots(args),
            self.config.num_key_value_heads,
            self.config.head_dim,
            self.dtype,
            self.device,
        )
        self.attention = self._make_attention(args.attention_backend)
        self.cuda_graphs = None  # replays decode steps when set
        graph_max_bs = min(args.cuda_graph_max_bs, args.max_running_requests)
        if self.device.type == "cuda" and not args.disable_cuda_graph and graph_max_bs > 0:
            from pyserve.engine.attention.triton_backend import TritonAttention
            from pyserve.engine.cuda_graph_runner import CudaGraphRunner

            # The graphs read the Triton backend's static kv tables.
            if isinstance(self.attention, TritonAttention):
                self.cuda_graphs = CudaGraphRunner(self.model, self.attention, graph_max_bs, self.context_len)
        self.sampler = Sampler(args.random_seed)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyserve-forward")
        logger.info(
            "KV cache: %d tokens (%.2f GiB), context length %d",
            self.kv_pool.capacity,
            self.kv_pool.capacity * self._bytes_per_slot() / (1 << 30),
            self.context_len,
        )

    def _bytes_per_slot(self) -> int:
        c = self.config
        return KVPool.bytes_per_slot(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype)

    def _num_slots(self, args: ServerArgs) -> int:
        if args.max_total_tokens:
            return args.max_total_tokens + 1  # + the padding slot
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(int(free * _GPU_MEM_FRACTION) // self._bytes_per_slot(), 2)
        wanted = min(self.context_len * _CPU_KV_CONTEXTS, _CPU_KV_MAX_SLOTS) + 1
        affordable = int(available_memory() * _CPU_KV_MEM_FRACTION) // self._bytes_per_slot()
        return max(min(wanted, affordable), 2)

    def _make_attention(self, name: str) -> AttentionBackend:
        if name == "auto":
            name = "triton" if self.device.type == "cuda" else "torch"
        if name == "triton":
            from pyserve.engine.attention.triton_backend import TritonAttention

            return TritonAttention(self.kv_pool, self.config.num_attention_heads, self.context_len)
        return TorchAttention(self.kv_pool)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [B, vocab] for the rows in batch.logits_indices."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.replay(batch)
        return self.model(batch, self.attention)

    def step(self, batch: ForwardBatch, seqs: list[Sequence]) -> list[int]:
        """Forward + sampling; runs on the worker thread."""
        with torch.inference_mode():
            logits = self.forward(batch)
            return self.sampler.sample(logits, seqs)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)
