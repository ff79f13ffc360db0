"""What every tensor-parallel rank holds and runs: its shard of the weights
and of the KV cache, the attention backend over that cache, the CUDA
graphs that replay decode steps, the native layers of 8da4w CPU steps, and
each step's plan (step_plan.py: which layers run it, on how many of
torch's threads). On one rank, the whole model.

Rank 0's ModelRunner and the other ranks' worker loop (tp/worker.py) each
own one and call `forward` on the same batches in the same order.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

from pyserve.lora.slots import LoraSlots
from pyserve.model.cpu import blocks, extend_attention
from pyserve.model.cpu.native_layers import NativeDecode, unfit_reason
from pyserve.model.attention.base import AttentionBackend
from pyserve.model.attention.bidirectional import BidirectionalAttention
from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.encoders.base import Encoder
from pyserve.model.kv_buffer import KV_CACHE_DTYPES, KVBuffer
from pyserve.model.layers.causal_lm import AuxCapture
from pyserve.model.loader import load_model
from pyserve.model.parallel import SINGLE, TensorParallel, largest_kv_share
from pyserve.model.quant import resolve_quant
from pyserve.model.step_plan import Layers, StepPlan, TorchThreads, adds_one_token
from pyserve.options import ModelOptions

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


# 8da4w steps of this many rows and more (long prefill chunks) keep all of
# torch's threads: their norms, rotary and SiLU over every row cost more
# on one thread than the two pools' contention, and their attention is
# torch's SDPA on all threads.
ONE_THREAD_BELOW_ROWS = 128


class RankModel:
    def __init__(self, options: ModelOptions, model_dir: Path, device: torch.device, tp: TensorParallel = SINGLE,
                 ranks_on_this_node: int = 1):
        """Load this rank's shard. `options` resolved (ServerArgs.resolved).
        The KV cache comes later (`allocate`), once rank 0 has sized it."""
        self.options = options
        self.device = device
        self.dtype = getattr(torch, options.dtype)
        self.kv_dtype = KV_CACHE_DTYPES.get(options.kv_cache_dtype, self.dtype)  # what the KV cache stores
        if (self.kv_dtype != self.dtype and options.attention_backend == "triton" and device.type == "cuda"
                and torch.cuda.get_device_capability(device) < (8, 9)):
            raise ValueError(f"--kv-cache-dtype {options.kv_cache_dtype}: the Triton kernels read FP8 on GPUs of "
                             "compute capability 8.9 or newer (Ada, Hopper); the torch backend (--attention-backend, or a "
                             "draft's --speculative-draft-attention-backend) reads it anywhere")
        self.ranks_on_this_node = ranks_on_this_node
        # The ranks of one machine share its cores.
        self.cpu_threads = max(1, usable_cpus() // ranks_on_this_node)
        # torch's thread count, changed only through this object (see `plan`).
        self.threads = TorchThreads(self.cpu_threads) if device.type == "cpu" else None
        overrides = options.config_overrides
        self.quant = resolve_quant(options.torchao_config, model_dir, device, self.cpu_threads,
                                   options.quantization, overrides)
        self.model, self.config = load_model(model_dir, self.dtype, device, self.quant, tp,
                                              lm_head=not options.is_embedding, quantization=options.quantization,
                                              config_overrides=overrides,
                                              dummy=options.load_format == "dummy")
        self.context_len = options.context_length or self.config.max_position_embeddings
        if isinstance(self.model, Encoder) and options.enable_lora:
            raise ValueError("--enable-lora: adapters attach to decoder models; this is an encoder")
        # --enable-lora: adapter slots on every adapted projection (lora/slots.py).
        self.lora = LoraSlots(self.model, options.max_loras_per_batch, options.max_lora_rank, self.dtype, device) \
            if options.enable_lora else None
        self.kv_buffer: KVBuffer | None = None
        self.attention: AttentionBackend | None = None
        self.cuda_graphs = None  # replays decode (and verify) steps when set: capture_graphs
        # 8da4w on a CPU, set by `allocate` where they fit: decode (and some
        # prefill) steps' layers as one Rust call each, and extends' attention
        # as extend_attention.py's kernel.
        self.native_layers: NativeDecode | None = None
        self.native_extend_fits = False

    def read_checkpoint(self, model_dir: Path):
        """Another checkpoint's model, built as this one was (its dtype,
        device, quantized mode and tensor-parallel shard), for weight_swap.paired_tensors."""
        options = self.options
        model, _ = load_model(model_dir, self.dtype, self.device, self.quant, self.model.shard.tp,
                              lm_head=not options.is_embedding, quantization=options.quantization,
                              config_overrides=options.config_overrides)
        return model

    # -- the KV cache ----------------------------------------------------------

    def kv_bytes_per_token(self, kv_heads: int | None = None) -> int:
        """K and V of one token over all layers, for this rank's KV heads (or
        `kv_heads`); the sliding pool's layers at its share of the tokens."""
        c = self.config
        heads = len(self.model.shard.kv_heads) if kv_heads is None else kv_heads
        sliding = len(self.window_layers())
        per_layer = KVBuffer.bytes_per_token(1, heads, c.head_dim, self.kv_dtype)
        return int(per_layer * (self.kv_layers - sliding + sliding * self.options.swa_full_tokens_ratio))

    @property
    def kv_layers(self) -> int:
        """Layers whose K/V the cache holds: none for a model attending both
        ways (an encoder), whose attention reads its step's own rows
        (attention/bidirectional.py); its slots only count the tokens a step holds."""
        return self.config.num_hidden_layers if self.config.causal else 0

    def window_layers(self) -> frozenset[int]:
        """The sliding layers that get a pool of their own: those of a window
        shorter than the context (a longer one never leaves a page behind)."""
        c = self.config
        if c.sliding_window is None or c.sliding_window >= self.context_len or not self.kv_layers:
            return frozenset()
        return frozenset(c.sliding_layers)

    def window_pages(self, num_pages: int) -> int | None:
        """Pages of the sliding pool beside a full pool of `num_pages`
        (--swa-full-tokens-ratio of its tokens, the padding page apart);
        None without one."""
        if not self.window_layers():
            return None
        return max(round((num_pages - 1) * self.options.swa_full_tokens_ratio), 1) + 1

    def num_pages(self) -> int:
        """Pages every rank's KV buffer gets, the reserved padding page
        included: decided on rank 0 and sent to the others."""
        return max(-(-self._kv_tokens() // self.options.page_size) + 1, 2)

    def _kv_tokens(self) -> int:
        if self.options.max_total_tokens:
            return self.options.max_total_tokens
        # What the rank with the most KV heads needs per token (shares may be uneven).
        per_rank = self.kv_bytes_per_token(largest_kv_share(self.config, self.model.shard.tp.size))
        if per_rank == 0:  # an encoder's slots have no memory behind them: the steps' token budget decides
            return _CPU_KV_MAX_SLOTS
        if self.device.type == "cuda":
            # Weights are loaded: the KV cache gets what is left of the
            # static share, minus room for activations and CUDA graphs.
            _, total = torch.cuda.mem_get_info(self.device)
            fraction = self.options.mem_fraction_static or _GPU_MEM_FRACTION
            budget = int(total * fraction) - torch.cuda.memory_allocated(self.device) - _GPU_ACTIVATION_RESERVE
            if budget <= 0:
                raise ValueError(f"--mem-fraction-static {fraction} leaves no GPU memory for the KV cache")
            return budget // per_rank
        wanted = min(self.context_len * _CPU_KV_CONTEXTS, _CPU_KV_MAX_SLOTS)
        # This machine's ranks share its memory.
        affordable = int(available_memory() * _CPU_KV_MEM_FRACTION) // (per_rank * self.ranks_on_this_node)
        return min(wanted, affordable)

    def allocate(self, num_pages: int, window_pool: bool = False, verify_tokens: int = 0,
                 aux_layers: frozenset[int] | None = None) -> None:
        """The KV buffer of `num_pages` pages (and the sliding pool, with
        `window_pool`, where the model has sliding layers: the engine's
        KV manager then gives their pages back; `verify_tokens` and
        `aux_layers`: capture_graphs'), the attention backend over
        it, the CUDA graphs, the native layers and the compiled decode step
        as the options and the machine allow."""
        options = self.options
        window_pages = self.window_pages(num_pages) if window_pool else None
        self.kv_buffer = KVBuffer(self.kv_layers, num_pages, len(self.model.shard.kv_heads),
                                  self.config.head_dim, self.dtype, self.device, page_size=options.page_size,
                                  window_layers=self.window_layers() if window_pages else frozenset(),
                                  window_pages=window_pages, cache_dtype=self.kv_dtype)
        self.attention = self._make_attention(options.attention_backend)
        self._graph_rows = (verify_tokens, aux_layers)  # what capture_graphs takes again after a memory release
        self.capture_graphs(verify_tokens, aux_layers)
        self.native_extend_fits = (self._block_kernels() and isinstance(self.attention, TorchAttention)
                                   and extend_attention.fits(self.kv_buffer, self.model.layers))
        self.native_layers = self._native_layers()
        if self.lora is not None:
            if options.enable_torch_compile:
                logger.info("torch.compile: off, LoRA adapters run eagerly")
        elif self.native_layers is not None:
            if options.enable_torch_compile:
                logger.info("torch.compile: not needed, decode steps run natively")
        elif options.enable_torch_compile:
            self._compile_decode()

    def _graphs_fit(self) -> bool:
        """Whether steps replay CUDA graphs: on CUDA with the Triton backend
        (the graphs read its static kv tables), unless turned off; LoRA
        adapters run eagerly (their hooks pick their tokens on the host each step)."""
        options = self.options  # cuda_graph_max_bs resolved: at most --max-running-requests
        if (self.device.type != "cuda" or options.disable_cuda_graph or options.cuda_graph_max_bs <= 0
                or self.lora is not None):
            return False
        # Imported here: a CPU server never loads Triton (whose bindings report leaks at exit).
        from pyserve.model.attention.triton_backend import TritonAttention

        return isinstance(self.attention, TritonAttention)

    def capture_graphs(self, verify_tokens: int = 0, aux_layers: frozenset[int] | None = None) -> None:
        """Capture the CUDA graphs (where they fit) for decode steps and, with
        `verify_tokens`, speculative verify rows of up to that many tokens;
        every graph keeps the hidden states entering `aux_layers` when given
        (an EAGLE-3 head reads them). Replaces the graphs captured before."""
        if not self._graphs_fit():
            return
        from pyserve.engine.runner.cuda_graph_runner import CudaGraphRunner

        if verify_tokens > 1 and getattr(self.model.rotary, "long_from", None) is not None:
            # LongRoPE picks a table per sequence length on the host for rows of several tokens.
            logger.info("Verify steps run without CUDA graphs: LongRoPE chooses its tables on the host")
            verify_tokens = 0
        self.cuda_graphs = None  # the old graphs' memory goes back first
        self.cuda_graphs = CudaGraphRunner(self.model, self.attention, self.options.cuda_graph_max_bs,
                                           self.context_len, verify_tokens, aux_layers)

    def drop_address_holders(self) -> None:
        """Drop the CUDA graphs and native layers, which hold the addresses
        of the KV cache and the weights (runner/memory_occupation.py)."""
        self.cuda_graphs = None
        self.native_layers = None

    def rebuild_address_holders(self, graphs: bool) -> None:
        """The attention backend, the native layers, and the CUDA graphs when
        `graphs`, over the KV cache and weights as they lie now."""
        self.attention = self._make_attention(self.options.attention_backend)
        if graphs:
            self.capture_graphs(*self._graph_rows)
        self.native_layers = self._native_layers()

    def _native_layers(self) -> NativeDecode | None:
        """8da4w on a CPU: decode steps' layers as one Rust call each (native_layers.py)."""
        if not self._block_kernels() or not isinstance(self.attention, TorchAttention):
            return None
        if self.lora is not None:  # the native layers have no adapter hooks; the quantized torch layers do
            logger.info("Decode steps keep the torch layers: LoRA adapters are on")
            return None
        reason = unfit_reason(self.model) or (f"the KV cache is {self.options.kv_cache_dtype}, the native layer "
                                              "reads float32" if self.kv_dtype != self.dtype else None)
        if reason is not None:
            logger.info("Decode steps keep the torch layers: %s", reason)
            return None
        logger.info("Decode steps run natively, one Rust call per layer")
        return NativeDecode(self.model)

    def _block_kernels(self) -> bool:
        """Whether the layers' products run pyserve's block kernels (8da4w on a CPU)."""
        return self.device.type == "cpu" and self.quant is not None and self.quant.int8_activations

    def _make_attention(self, name: str) -> AttentionBackend:
        if not self.config.causal:
            return BidirectionalAttention(self.kv_buffer)
        if name == "triton":
            from pyserve.model.attention.triton_backend import TritonAttention

            return TritonAttention(self.kv_buffer, len(self.model.shard.q_heads), self.context_len)
        return TorchAttention(self.kv_buffer, self.threads)

    def _compile_decode(self) -> None:
        """--enable-torch-compile: compile the decode layers now, on dummy
        steps of batch 1 and 2 (the second makes the batch size dynamic),
        equal and unequal lengths, so no request pays for it. Dummy rows
        read and write only the padding slot 0 (of both pools, with a sliding one)."""
        if self.device.type != "cpu":
            logger.warning("--enable-torch-compile is for the CPU; on %s decode steps keep their kernels",
                           self.device.type)
            return
        if self.attention.attend_decode is None:
            logger.warning("--enable-torch-compile: the %s attention backend has no compilable decode step",
                           type(self.attention).__name__)
            return
        self.model.compile_decode(self.attention.attend_decode)
        self.attention.compiled_decode = True
        start = time.perf_counter()
        zero = torch.zeros
        windowed = bool(self.kv_buffer.window_layers)
        for lengths in ([2], [2, 2], [2, 3]):
            rows = len(lengths)
            batch = ForwardBatch.build([0] * rows, [n - 1 for n in lengths], zero(rows, dtype=torch.long),
                                       [1] * rows, [zero(n, dtype=torch.long) for n in lengths], list(range(rows)),
                                       True, self.device, window_slots=torch.zeros_like if windowed else None)
            with torch.inference_mode():
                self.forward(batch)
        logger.info("torch.compile: decode layers compiled in %.1f s", time.perf_counter() - start)

    # -- steps -----------------------------------------------------------------

    def forward(self, batch: ForwardBatch, capture: AuxCapture | None = None) -> torch.Tensor:
        """Float32 logits [B, vocab] for the rows in batch.logits_indices.
        `capture`: also keep hidden states (CausalLM.hidden_states), which
        the torch and native layers and the graphs capturing them do."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(batch, capture):
            return self.cuda_graphs.replay(batch, capture)
        if self.lora is not None:
            self.lora.current = batch.lora
        plan = self.plan(batch)
        if capture is not None and plan.layers == Layers.COMPILED_DECODE:
            plan = replace(plan, layers=Layers.TORCH)
        threads = self.threads.using(plan.torch_threads) if self.threads is not None else nullcontext()
        with threads:
            return self.model(batch, self.attention, plan, self.native_layers, capture)

    def hidden_states(self, batch: ForwardBatch, rows: torch.Tensor, capture: AuxCapture | None = None) -> torch.Tensor:
        """Final-norm hidden states of the token rows `rows`
        (CausalLM.hidden_states), by the torch layers, under the batch's adapters."""
        if self.lora is not None:
            self.lora.current = batch.lora
        return self.model.hidden_states(batch, self.attention, rows, capture=capture)

    def plan(self, batch: ForwardBatch) -> StepPlan:
        """How `batch` runs: which layers, on how many torch threads, with
        which attention kernel. The block kernels' threads spin between
        their calls, torch's after each of its ops, and on a busy core each
        pool waits for the other; so steps whose products all run the
        kernels leave the cores to them and run torch's ops (small at these
        sizes) on the forward thread. Attention over a long cached prefix
        still takes all the threads back, unless the extend kernel (which
        shares the block kernels' threads) attends instead."""
        one_token = [adds_one_token(n, s) for n, s in zip(batch.extend_lens, batch.seq_lens)]
        decode = batch.is_decode and all(one_token)
        threads = self._step_threads(batch)
        native_extend = self.native_extend_fits and threads == 1
        if self.native_layers is not None and decode:
            layers = Layers.NATIVE_DECODE
        elif self.native_layers is not None and native_extend:
            # Prefill chunks and verify rows, decode rows among them or not.
            layers = Layers.NATIVE_EXTENDS
        elif self.model.compiled_decode_layer is not None and decode:
            layers = Layers.COMPILED_DECODE
        else:
            layers = Layers.TORCH
        long_attention = self.cpu_threads if threads is not None and threads < self.cpu_threads else None
        return StepPlan(layers, threads, native_extend, long_attention)

    def _step_threads(self, batch: ForwardBatch) -> int | None:
        """torch's threads for the step (None off the CPU): one for 8da4w
        steps under ONE_THREAD_BELOW_ROWS rows, and for the native layers'
        decode steps, whose products all run the kernels (the vocabulary
        projection's too, under VOCAB_DENSE_FROM_ROWS rows); else all."""
        if self.threads is None:
            return None
        rows = batch.input_ids.numel()
        native_decode = batch.is_decode and self.native_layers is not None
        kernels_only = rows < ONE_THREAD_BELOW_ROWS or (native_decode and rows < blocks.VOCAB_DENSE_FROM_ROWS)
        return 1 if self._block_kernels() and kernels_only else self.cpu_threads
