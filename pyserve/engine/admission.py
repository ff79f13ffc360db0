"""What a request must be for the engine to run it: the one place these
checks live (Engine.validate calls them; the API asks before it answers).
Where SGLang's or vLLM's clients match on a phrase for the same condition,
the message carries it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pyserve.engine.request import GenerateRequest, RequestError
from pyserve.engine.sequence import Sequence

GRAMMARS_OFF = "constrained decoding is off: this server runs with --grammar-backend none"


def check_prompt(req: GenerateRequest, vocab_size: int, context_len: int, kv_capacity: int) -> None:
    """The prompt and its room: not empty, in the vocabulary, within the
    context with max_new_tokens, and within the KV cache."""
    n = len(req.input_ids)
    if n == 0:
        raise RequestError("The decoder prompt cannot be empty", "prompt")  # vLLM's wording
    bad = next((i for i in req.input_ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise RequestError(f"Token id {bad} is out of vocabulary (the vocabulary has {vocab_size} tokens)", "prompt")
    max_new = req.params.max_new_tokens
    if max_new is not None and max_new < 1:
        raise RequestError("max_new_tokens must be at least 1", "max_new_tokens")
    if n >= context_len or (max_new is not None and n + max_new > context_len):
        # vLLM's wording, then SGLang's phrase for the prompt alone.
        asked = max_new or 0
        sglang = " The input is longer than the model's context length." if n >= context_len else ""
        raise RequestError(
            f"This model's maximum context length is {context_len} tokens. However, you requested "
            f"{n + asked} tokens ({n} in the prompt, {asked} in the completion). "
            f"Please reduce the length of the messages or completion.{sglang}",
            "prompt" if n >= context_len else "max_new_tokens", "context_length_exceeded",
        )
    if n + 1 > kv_capacity:
        raise RequestError(f"the prompt has {n} tokens, but the KV cache holds {kv_capacity}", "prompt")


@dataclass(frozen=True)
class ServedFields:
    """Why this server refuses the request fields its options decide, None
    for those it serves; and the model's hidden size, which prompt
    embeddings must have."""

    hidden_states: str | None = None
    prompt_embeds: str | None = "prompt embeddings are not served here"
    hidden_size: int = 0
    custom_logit_processor: str | None = "custom logit processors are not served here"

    @classmethod
    def of(cls, options, model_config, embedding: bool) -> ServedFields:
        """For an engine of `options` (EngineOptions) over `model_config`,
        generating or (`embedding`) pooling."""
        speculative = options.speculative_algorithm
        hidden_states = prompt_embeds = None
        if not options.enable_return_hidden_states:
            hidden_states = ("return_hidden_states needs a server started with --enable-return-hidden-states "
                             "(each such request's prompt is computed whole, without the prefix cache)")
        elif speculative is not None:
            hidden_states = "return_hidden_states is not served with speculative decoding: the verify steps read drafts"
        if not options.enable_prompt_embeds:
            prompt_embeds = "prompt embeddings need a server started with --enable-prompt-embeds"
        elif embedding or speculative not in (None, "NGRAM"):
            what = ("an embedding server" if embedding
                    else f"{speculative}'s draft model, which reads the prompt's tokens")
            prompt_embeds = f"prompt embeddings are served by a generating model, not with {what}"
        processor = None if options.enable_custom_logit_processor else \
            "custom logit processors need a server started with --enable-custom-logit-processor"
        return cls(hidden_states, prompt_embeds, model_config.hidden_size, processor)


def check_prompt_embeds(embeds: torch.Tensor, served: ServedFields) -> None:
    """A prompt given as embeddings: one finite row of the model's hidden size per token."""
    if served.prompt_embeds is not None:
        raise RequestError(served.prompt_embeds, "prompt_embeds")
    if embeds.dim() != 2 or embeds.shape[1] != served.hidden_size or not embeds.is_floating_point():
        raise RequestError(f"prompt embeddings are a float tensor [tokens, {served.hidden_size}] (the model's "
                           f"hidden size), not {embeds.dtype} of shape {tuple(embeds.shape)}", "prompt_embeds")
    if not torch.isfinite(embeds).all():
        raise RequestError("prompt embeddings must be finite numbers", "prompt_embeds")


def check_fields(req: GenerateRequest, grammars_on: bool, priority_scheduling: bool, has_text: bool = True,
                 served: ServedFields = ServedFields()) -> None:
    """The request's fields that need the server's options (`has_text`:
    whether it has a tokenizer, without --skip-tokenizer-init; `served`:
    what its options serve)."""
    if req.params.return_hidden_states and served.hidden_states is not None:
        raise RequestError(served.hidden_states, "return_hidden_states")
    if req.params.logit_processor is not None:
        if served.custom_logit_processor is not None:
            raise RequestError(served.custom_logit_processor, "custom_logit_processor")
        if req.params.constraint is not None:
            raise RequestError("a custom logit processor may raise a token the grammar masks: give a request one "
                               "or the other", "custom_logit_processor")
    if req.prompt_embeds is not None:
        check_prompt_embeds(req.prompt_embeds, served)
        if req.params.prompt_logprobs:
            raise RequestError("prompt logprobs score the prompt's tokens; a prompt given as embeddings has none",
                               "prompt_embeds")
    if not has_text and (req.params.stop or req.params.stop_regex or req.params.constraint is not None):
        field = "constraint" if req.params.constraint is not None else "stop"
        raise RequestError(f"this server runs with --skip-tokenizer-init: with no text, {field}s cannot be read "
                           "(stop_token_ids can)", field)
    if req.params.constraint is not None and not grammars_on:
        raise RequestError(GRAMMARS_OFF, "constraint")
    if req.priority is not None and not priority_scheduling:
        # Refused as an unknown field is: a priority the server ignored
        # would be dropped silently.
        raise RequestError("Unrecognized request argument supplied: 'priority' (this server schedules first "
                           "come, first served: start it with --enable-priority-scheduling).", "priority",
                           "unknown_parameter")
    if req.cache_salt == "":
        raise RequestError("cache_salt must be a non-empty string", "cache_salt")


def check_queue(waiting: Iterable[Sequence], cap: int | None) -> None:
    """--max-queued-requests: an interactive API request is refused (the
    API's 503), whole, while `cap` interactive sequences wait; batch jobs,
    which --batch-concurrency bounds, neither count nor are refused."""
    if cap is None:
        return
    queued = sum(1 for seq in waiting if not seq.batch)
    if queued >= cap:
        raise RequestError(f"The request queue is full: {queued} requests are waiting (--max-queued-requests "
                           f"{cap}); retry later", "queue", "queue_full")
