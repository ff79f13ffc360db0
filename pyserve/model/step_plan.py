"""How one forward step runs, decided once by the step's owner (RankModel)
and handed to the model and the attention backend, which follow it.

On a CPU in the 8da4w mode pyserve's block kernels and torch share the
cores: the kernels' threads spin between their calls, torch's after each
of its ops, so where both pools are awake each waits for the other. A
step's plan says which layers run it and how many threads torch gets, and
`TorchThreads` is the one place that count changes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum

import torch


class Layers(Enum):
    """Which code runs a step's decoder layers."""

    TORCH = "torch"  # the model's modules, op by op: any step
    COMPILED_DECODE = "compiled decode"  # the torch.compile'd layer (CausalLM.compile_decode, layers/causal_lm.py): decode steps
    NATIVE_DECODE = "native decode"  # one Rust call per layer (cpu/native_layers.py): decode steps
    NATIVE_EXTENDS = "native extends"  # the same for steps of several tokens a row (prefill chunks, verify rows), decode rows among them


@dataclass(frozen=True)
class StepPlan:
    layers: Layers = Layers.TORCH
    # torch's intra-op threads for the step's torch ops; None: as they are.
    torch_threads: int | None = None
    # Extends (rows of several new tokens) attend with cpu/extend_attention.py's
    # kernel rather than SDPA.
    native_extend_attention: bool = False
    # Threads for an SDPA long enough to pay for waking them (the backend
    # judges the length); None: the step's own.
    long_attention_threads: int | None = None


# A step as the model runs it by default: its torch layers, threads untouched.
TORCH_STEP = StepPlan()


def adds_one_token(num_new: int, seq_len: int) -> bool:
    """Whether a sequence's rows in a step are one token after a cached past:
    such rows attend as a decode step's do, in one batched call."""
    return num_new == 1 and seq_len > 1


class TorchThreads:
    """torch's intra-op thread count for one process, set only through this
    object: by the owner of the steps around each step, and by attention
    for the long stretches its plan gives more threads."""

    def __init__(self, count: int):
        self._current = count
        torch.set_num_threads(count)

    @contextmanager
    def using(self, count: int | None):
        """torch on `count` threads for the scope (None: unchanged)."""
        before = self._current
        if count is None or count == before:
            yield
            return
        torch.set_num_threads(count)
        self._current = count
        try:
            yield
        finally:
            torch.set_num_threads(before)
            self._current = before
