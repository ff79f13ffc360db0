"""Owns the model, the KV memory and the one thread that runs forward passes.

The asyncio loop must never wait on a forward pass, so every call into
torch for a step (forward + sampling) goes to a dedicated worker thread;
torch releases the GIL inside its kernels. `launch` queues a step there and
returns at once; `wait` gives its results once they are on the host.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from pyserve.engine.sampler import Sampler, token_logprobs, wants_logprobs
from pyserve.engine.step import ScheduledStep
from pyserve.model.attention.base import AttentionBackend
from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.loader import load_model
from pyserve.model.pooling import sum_spans
from pyserve.model.quant import resolve_quant
from pyserve.server_args import ServerArgs

logger = logging.getLogger("pyserve.engine")

# KV cache size when --max-total-tokens is not given. On CPU: room for a
# few full-length sequences, capped in slots and by the memory available.
_CPU_KV_CONTEXTS = 4
_CPU_KV_MAX_SLOTS = 65536
_CPU_KV_MEM_FRACTION = 0.25
_GPU_MEM_FRACTION = 0.85  # default --mem-fraction-static: weights + KV cache
_GPU_ACTIVATION_RESERVE = 1 << 30


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


@dataclass
class StepOutput:
    """A step's results on the host, once `ready` has fired: one sampled id
    per sampled sequence, and when any asked, their log-probabilities
    (sampler.token_logprobs: chosen [B], top values [B, K], top ids [B, K])."""

    ids: torch.Tensor  # int64
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    ready: "torch.cuda.Event | None"  # None: already complete
    # Prompt log-probabilities, in the same three parts, one row per target.
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Embedding requests: per step.embed_spans entry, the float32 sum of its
    # pooled rows' final-norm hidden states [spans, hidden].
    pooled: torch.Tensor | None = None

    def wait(self) -> None:
        """Blocks until the results are on the host; call it off the event loop."""
        if self.ready is not None:
            self.ready.synchronize()


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy that does not wait for the device: valid once an event
    recorded after it has fired."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class ModelRunner:
    def __init__(self, args: ServerArgs, model_dir: Path):
        """`args` resolved (ServerArgs.resolved): no "auto" left."""
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        if self.device.type == "cpu":
            torch.set_num_threads(usable_cpus())
        torch.manual_seed(args.random_seed)
        self.quant = resolve_quant(args.torchao_config, model_dir, self.device)
        self.model, self.config = load_model(model_dir, self.dtype, self.device, self.quant)
        self.context_len = args.context_length or self.config.max_position_embeddings
        self.kv_buffer = KVBuffer(
            self.config.num_hidden_layers,
            self._num_pages(args),
            self.config.num_key_value_heads,
            self.config.head_dim,
            self.dtype,
            self.device,
            page_size=args.page_size,
        )
        self.attention = self._make_attention(args.attention_backend)
        self.cuda_graphs = None  # replays decode steps when set
        graph_max_bs = min(args.cuda_graph_max_bs, args.max_running_requests)
        if self.device.type == "cuda" and not args.disable_cuda_graph and graph_max_bs > 0:
            from pyserve.engine.cuda_graph_runner import CudaGraphRunner
            from pyserve.model.attention.triton_backend import TritonAttention

            # The graphs read the Triton backend's static kv tables.
            if isinstance(self.attention, TritonAttention):
                self.cuda_graphs = CudaGraphRunner(self.model, self.attention, graph_max_bs, self.context_len)
        if args.enable_torch_compile:
            self._compile_decode()
        self.sampler = Sampler(args.random_seed)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyserve-forward")
        self._last_ids: torch.Tensor | None = None  # the previous step's sampled ids, on the device
        capacity = (self.kv_buffer.num_pages - 1) * args.page_size  # page 0 is never handed out
        logger.info(
            "KV cache: %d tokens in pages of %d (%.2f GiB), context length %d",
            capacity, args.page_size, capacity * self._bytes_per_token() / (1 << 30), self.context_len,
        )

    def _bytes_per_token(self) -> int:
        c = self.config
        return KVBuffer.bytes_per_token(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, self.dtype)

    def _num_pages(self, args: ServerArgs) -> int:
        """Pages in the KV buffer, the reserved padding page included."""
        return max(-(-self._kv_tokens(args) // args.page_size) + 1, 2)

    def _kv_tokens(self, args: ServerArgs) -> int:
        if args.max_total_tokens:
            return args.max_total_tokens
        if self.device.type == "cuda":
            # Weights are loaded: the KV cache gets what is left of the
            # static share, minus room for activations and CUDA graphs.
            _, total = torch.cuda.mem_get_info(self.device)
            fraction = args.mem_fraction_static or _GPU_MEM_FRACTION
            budget = int(total * fraction) - torch.cuda.memory_allocated(self.device) - _GPU_ACTIVATION_RESERVE
            if budget <= 0:
                raise ValueError(f"--mem-fraction-static {fraction} leaves no GPU memory for the KV cache")
            return budget // self._bytes_per_token()
        wanted = min(self.context_len * _CPU_KV_CONTEXTS, _CPU_KV_MAX_SLOTS)
        affordable = int(available_memory() * _CPU_KV_MEM_FRACTION) // self._bytes_per_token()
        return min(wanted, affordable)

    def _compile_decode(self) -> None:
        """--enable-torch-compile: compile the decode layers now, on dummy
        steps of batch 1 and 2 (the second makes the batch size dynamic),
        equal and unequal lengths, so no request pays for it. Dummy rows
        read and write only the padding slot 0."""
        if self.device.type != "cpu":
            logger.warning("--enable-torch-compile is for the CPU; on %s decode steps keep their kernels",
                           self.device.type)
            return
        self.model.compile_decode()
        start = time.perf_counter()
        zero = torch.zeros
        for lengths in ([2], [2, 2], [2, 3]):
            rows = len(lengths)
            batch = ForwardBatch.build([0] * rows, [n - 1 for n in lengths], zero(rows, dtype=torch.long),
                                       [1] * rows, [zero(n, dtype=torch.long) for n in lengths], list(range(rows)),
                                       True, self.device)
            with torch.inference_mode():
                self.model(batch, self.attention)
        logger.info("torch.compile: decode layers compiled in %.1f s", time.perf_counter() - start)

    def _make_attention(self, name: str) -> AttentionBackend:
        if name == "triton":
            from pyserve.model.attention.triton_backend import TritonAttention

            return TritonAttention(self.kv_buffer, self.config.num_attention_heads, self.context_len)
        return TorchAttention(self.kv_buffer)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits [B, vocab] for the rows in batch.logits_indices."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch):
            return self.cuda_graphs.replay(batch)
        return self.model(batch, self.attention)

    def launch(self, step: ScheduledStep) -> asyncio.Future:
        """Queue `step` on the worker thread; call from the event loop."""
        return asyncio.get_running_loop().run_in_executor(self.executor, self.step, step)

    @staticmethod
    async def wait(launched: asyncio.Future) -> StepOutput:
        """A launched step's results, once they are on the host."""
        output = await launched
        if output.ready is not None:
            await asyncio.to_thread(output.wait)
        return output

    def step(self, step: ScheduledStep) -> StepOutput:
        """Forward + sampling for one scheduled step; runs on the worker thread.

        Returns as soon as the work is queued on the device: on CUDA the ids
        come back through a non-blocking copy and an event, so this thread
        can launch the next step while this one computes. Decode rows whose
        input is a placeholder (-(row + 1), see step.py) read row `row` of
        the previous step's ids, which are still on the device. Logits rows
        past the sampled ones score the step's prompt targets.
        """
        seqs = step.sampled
        try:
            with torch.inference_mode():
                batch = step.batch.to(self.device)
                if step.has_placeholders:
                    batch.input_ids = self._resolve_placeholders(batch.input_ids)
                all_logits, pooled = self._forward_pooling(batch, step) if step.embed_rows \
                    else (self.forward(batch), None)
                logits = all_logits[: len(seqs)]
                next_ids = self.sampler.sample(logits, seqs)
                logprobs = prompt_logprobs = None
                if any(wants_logprobs(s.params) for s in seqs):
                    logprobs = token_logprobs(logits, next_ids.to(logits.device),
                                              max(s.params.top_logprobs for s in seqs))
                if step.prompt_targets:
                    targets = torch.tensor(step.prompt_targets, device=self.device)
                    prompt_logprobs = token_logprobs(all_logits[len(seqs) :], targets, step.prompt_top_logprobs)
                self._last_ids = next_ids.to(self.device)
                if self.device.type != "cuda":
                    return StepOutput(next_ids.cpu(), logprobs, None, prompt_logprobs, pooled)

                def to_host(parts):
                    return tuple(_pinned_copy(t) for t in parts) if parts is not None else None

                output = StepOutput(_pinned_copy(next_ids), to_host(logprobs), torch.cuda.Event(),
                                    to_host(prompt_logprobs), _pinned_copy(pooled) if pooled is not None else None)
                output.ready.record()
                return output
        except Exception:
            self._last_ids = None  # a step that reads it now gets zeros, never an invalid index
            raise

    def _forward_pooling(self, batch: ForwardBatch, step: ScheduledStep) -> tuple[torch.Tensor, torch.Tensor]:
        """A step with embedding rows, in one pass through the layers: the
        logits of the batch's logits rows, and StepOutput.pooled."""
        wanted = len(batch.logits_indices)
        rows = torch.cat([batch.logits_indices, torch.tensor(step.embed_rows, device=self.device)])
        hidden = self.model.hidden_states(batch, self.attention, rows)
        pooled = sum_spans(hidden[wanted:], [count for _, _, count in step.embed_spans])
        return self.model.logits(hidden[:wanted]), pooled

    def _resolve_placeholders(self, ids: torch.Tensor) -> torch.Tensor:
        last = self._last_ids
        if last is None or last.numel() == 0:
            last = torch.zeros(1, dtype=torch.long, device=ids.device)
        rows = (-ids - 1).clamp(0, last.numel() - 1)
        return torch.where(ids < 0, last[rows], ids)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)
