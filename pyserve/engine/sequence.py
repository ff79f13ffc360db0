"""The engine's record of one request: its tokens, its KV, its output.

One object per request from `Engine.generate` to its last output. Who
writes what: the scheduler moves it between queues and counts its tokens in
flight; the KV manager alone sets its KV fields (`slots`, `shared_len`,
`prefix_node`, `cache_hit`); the output processor appends the sampled
tokens and turns them into text; the sampler, on the forward thread,
advances `grammar`, counts `sampled` and keeps `token_history`; the
caller reads `channel`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pyserve.engine.kv.radix_cache import RadixNode
from pyserve.engine.request import GenerateOutput, SamplingParams

if TYPE_CHECKING:
    from pyserve.engine.grammar import GrammarState
    from pyserve.engine.output_processor import OutputProcessor
    from pyserve.engine.penalties import TokenHistory


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    output_ids: list[int] = field(default_factory=list)
    # KV slots of the tokens whose KV is in the cache, in order; they fill
    # whole pages except the last.
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    # How many leading slots belong to the radix cache (shared with other
    # requests), and the cache node locked so they are not evicted.
    shared_len: int = 0
    prefix_node: RadixNode | None = None
    # Prompt tokens found in the prefix cache at the first admission: the
    # usage's `cached_tokens`. None until admitted.
    cache_hit: int | None = None
    generator: torch.Generator | None = None  # set for requests with a seed
    # Tokens to text, stop conditions, logprobs; set by the engine.
    output: OutputProcessor | None = None
    channel: asyncio.Queue[GenerateOutput] = field(default_factory=asyncio.Queue)  # the caller reads here
    # A constrained request's place in its grammar; set by the engine when it
    # takes the request, dropped when the request ends.
    grammar: GrammarState | None = None
    finished: bool = False
    # Overlap scheduling: tokens sampled by launched steps whose ids have not
    # come back yet, and where the newest one sits in its step's output.
    pending: int = 0
    pending_row: int = 0
    # Tokens the sampler has drawn for it so far (in flight or not), and
    # its tokens as penalties read them; the forward thread alone keeps both.
    sampled: int = 0
    token_history: TokenHistory | None = None
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
        """Tokens known so far: the prompt and the sampled tokens that came back."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_total(self) -> int:
        """Tokens including the pending ones."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is in the cache (own and shared slots)."""
        return self.slots.numel()

    @property
    def uncached_ids(self) -> list[int]:
        """Tokens the next forward must process (their KV is not cached yet).
        Built without copying the whole prompt: decode asks every step."""
        start = self.kv_len
        prompt_len = len(self.prompt_ids)
        if start >= prompt_len:
            return self.output_ids[start - prompt_len :]
        return self.prompt_ids[start:] + self.output_ids
