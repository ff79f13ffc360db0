"""The engine's record of one request: its tokens, its KV, its progress.

One object per request from `Engine.generate` to its last output,
written on the event loop only; each field has one writer, named above
its group below. The forward thread reads what a step's sampling needs
(engine/sampling_state.py says what and why it is safe). What that thread
keeps of a request (grammar matcher, generator, penalty history) is not
here: it is the request's SamplingState, which that thread alone touches.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pyserve.engine.kv.radix_cache import RadixNode
from pyserve.engine.request import GenerateOutput, SamplingParams
from pyserve.lora.registry import LoraRef

if TYPE_CHECKING:
    from pyserve._rust import NgramCursor
    from pyserve.engine.speculative.tree import DraftTree


@dataclass(eq=False)
class Sequence:
    # The request, as the engine took it; never written after.
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    batch: bool = False  # a batch job: it waits for every interactive request
    priority: int = 0  # larger runs first (with priority scheduling)
    cache_salt: str | None = None  # it shares cached prefixes only with requests of the same salt
    lora: LoraRef | None = None  # the adapter it runs under; None: the base model
    # The prompt as embeddings [len(prompt_ids), hidden] (vLLM's prompt_embeds); its ids are then placeholders.
    prompt_embeds: torch.Tensor | None = None
    arrival: float = 0.0  # time.monotonic() when the engine got it
    channel: asyncio.Queue[GenerateOutput] = field(default_factory=asyncio.Queue)  # the caller reads here

    # The output processor: the sampled tokens that came back.
    output_ids: list[int] = field(default_factory=list)

    # The KV manager.
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

    # The scheduler.
    # Steps spent in the waiting queue so far: priority scheduling raises a
    # request's priority with it, so that none waits forever.
    waited_steps: int = 0
    # Overlap scheduling: tokens sampled by launched steps whose ids have not
    # come back yet, and where the newest one sits in its step's output.
    pending: int = 0
    pending_row: int = 0
    # Draft tokens of launched steps not back yet: their KV slots stay
    # reserved until the results say how many the target kept.
    pending_drafts: int = 0
    # Next prompt position whose log-probability is still to be computed
    # (prompt_logprobs); survives retraction, so none is computed twice.
    next_prompt_logprob: int = 1
    # Next position whose hidden state is still to be returned
    # (return_hidden_states); survives retraction, so none comes twice.
    next_hidden_state: int = 0

    # Speculative decoding (engine/speculative/): the scheduler writes the
    # drafts its next step verifies; the engine counts what was accepted and
    # turns drafting off for a request whose drafts keep failing.
    draft_ids: list[int] = field(default_factory=list)
    draft_tree: DraftTree | None = None  # the drafts' tree; None: a chain
    drafting: bool = True
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    last_accepted: int | None = None  # drafts the latest verify step kept
    # STANDALONE: the leading tokens whose KV the draft model holds too (None:
    # all); a step with no drafting sequence leaves the draft model idle.
    draft_kv_len: int | None = None
    # NGRAM trees: where the request's tokens stand in the shared trie.
    ngram_cursor: NgramCursor | None = None

    # The engine.
    finished: bool = False
    first_token_at: float | None = None
    # False once a forward pass that wrote this sequence's KV failed: its
    # slots must not go into the prefix cache.
    kv_valid: bool = True

    @property
    def caches_kv(self) -> bool:
        """Whether its KV may go into the prefix cache: not once a forward
        pass that wrote it failed, nor for a prompt given as embeddings
        (the placeholder ids its KV would be filed under name no tokens)."""
        return self.kv_valid and self.prompt_embeds is None

    @property
    def prefix_namespace(self) -> str | tuple[int, str | None] | None:
        """The radix cache's tree it matches and inserts into: its salt's,
        within its adapter's load (KV computed under one adapter is not
        another's); a tuple, so no salt string can name an adapter's tree."""
        if self.lora is None:
            return self.cache_salt
        return self.lora.uid, self.cache_salt

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known so far: the prompt and the sampled tokens that came back."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_total(self) -> int:
        """Tokens including the pending ones and the drafts of steps not back yet."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending + self.pending_drafts

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is in the cache (own and shared slots)."""
        return self.slots.numel()

    @property
    def kv_kept(self) -> int:
        """KV tokens that stay whatever the steps still running accept (their
        drafts' slots may be dropped): where this sequence's next row starts,
        at the earliest."""
        return self.kv_len - self.pending_drafts

    @property
    def uncached_ids(self) -> list[int]:
        """Tokens the next forward must process (their KV is not cached yet).
        Built without copying the whole prompt: decode asks every step."""
        start = self.kv_len
        prompt_len = len(self.prompt_ids)
        if start >= prompt_len:
            return self.output_ids[start - prompt_len :]
        return self.prompt_ids[start:] + self.output_ids
