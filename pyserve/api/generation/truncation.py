"""Prompts longer than the model's context, cut instead of refused where
the client or the server asks: vLLM's per-request `truncate_prompt_tokens`
(the prompt's last tokens are kept) and SGLang's --allow-auto-truncate
(its first are)."""

from __future__ import annotations

import logging
from dataclasses import replace

from pyserve.engine.request import SamplingParams
from pyserve.http.errors import bad_request

logger = logging.getLogger(__name__)


def keep_last_tokens(prompts: list[list[int]], k: int | None, context_len: int) -> list[list[int]]:
    """truncate_prompt_tokens: each prompt's last `k` tokens (-1: the
    context length's worth); None leaves the prompts whole."""
    if k is None:
        return prompts
    if k == -1:
        k = context_len
    if k < 1:
        raise bad_request("truncate_prompt_tokens must be -1 or a positive integer", "truncate_prompt_tokens")
    if k > context_len:
        raise bad_request(f"truncate_prompt_tokens value ({k}) is greater than max_model_len ({context_len}). "
                          "Please, select a smaller truncation size.", "truncate_prompt_tokens")
    return [ids[-k:] for ids in prompts]


def fit_context(ids: list[int], params: SamplingParams, context_len: int) -> tuple[list[int], SamplingParams]:
    """--allow-auto-truncate: a prompt that leaves no room for a new token
    keeps its first context_len - 1 tokens, and a max_new_tokens beyond
    the room left is lowered to it (min_new_tokens with it)."""
    if len(ids) >= context_len:
        logger.warning("The input (%d tokens) is longer than the model's context length (%d tokens). "
                       "Truncating the input.", len(ids), context_len)
        ids = ids[:context_len - 1]
    room = context_len - len(ids)
    if params.max_new_tokens is not None and params.max_new_tokens > room:
        params = replace(params, max_new_tokens=room, min_new_tokens=min(params.min_new_tokens, room))
    return ids, params
