"""The engine's state for one request."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from pyserve.engine.radix_cache import RadixNode
from pyserve.engine.request import GenerateOutput, SamplingParams


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)
    # KV slots of the tokens already in the cache, in order; they fill whole
    # pages except the last.
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    # The leading slots that belong to the radix cache, and the cache node
    # this sequence locks so they are not evicted under it.
    num_shared: int = 0
    prefix_node: RadixNode | None = None
    cached_tokens: int | None = None  # prompt tokens found in the cache at admission
    generator: torch.Generator | None = None  # set for requests with a seed
    outputs: asyncio.Queue[GenerateOutput] = field(default_factory=asyncio.Queue)
    finished: bool = False
    aborted: bool = False
    # Overlap scheduling: tokens sampled by launched steps whose ids have not
    # come back yet, and where the newest one sits in its step's output.
    pending: int = 0
    pending_row: int = 0
    # Next prompt position whose log-probability is still to be computed
    # (prompt_logprobs); survives retraction, so none is computed twice.
    next_prompt_logprob: int = 1
    arrival: float = 0.0  # time.monotonic() when the engine got it
    first_token_at: float | None = None
    # False once a forward pass that wrote this sequence's KV failed: its
    # slots must not go into the prefix cache.
    kv_valid: bool = True

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_total(self) -> int:
        """Tokens including the pending ones."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def num_cached(self) -> int:
        return self.slots.numel()

    @property
    def uncached_ids(self) -> list[int]:
        """Tokens the next forward must process (their KV is not cached yet).
        Built without copying the whole prompt: decode asks every step."""
        start = self.num_cached
        prompt_len = len(self.prompt_ids)
        if start >= prompt_len:
            return self.output_ids[start - prompt_len :]
        return self.prompt_ids[start:] + self.output_ids
