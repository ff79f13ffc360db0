"""Checks request settings and turns them into the engine's SamplingParams.

Every range check lives here, so chat, completions, /generate and batches
reject the same bad values with the same OpenAI-style message.
"""

from __future__ import annotations

from pyserve.api.errors import bad_request
from pyserve.api.logprobs import MAX_TOP_LOGPROBS
from pyserve.engine.request import SamplingParams

MAX_N = 128


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise bad_request(message, param)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    _check(all(stops), "stop strings must not be empty", "stop")
    return stops


def build_params(
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    n: int,
    stop,
    presence_penalty: float,
    frequency_penalty: float,
    logit_bias: dict[str, float] | None,
    seed: int | None,
    top_k: int,
    min_p: float,
    repetition_penalty: float,
    stop_token_ids: list[int] | None,
    ignore_eos: bool,
    skip_special_tokens: bool,
    vocab_size: int,
    max_tokens_param: str = "max_tokens",
    logprobs: bool = False,
    top_logprobs: int = 0,
    top_logprobs_param: str = "top_logprobs",
) -> SamplingParams:
    """max_tokens None leaves the limit to the engine: the server's
    --default-max-tokens, or else up to the context length."""
    _check(max_tokens is None or max_tokens >= 1, f"{max_tokens_param} must be at least 1", max_tokens_param)
    temperature = 1.0 if temperature is None else temperature
    _check(0.0 <= temperature <= 2.0, "temperature must be between 0 and 2", "temperature")
    top_p = 1.0 if top_p is None else top_p
    _check(0.0 < top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
    _check(1 <= n <= MAX_N, f"n must be between 1 and {MAX_N}", "n")
    _check(-2.0 <= presence_penalty <= 2.0, "presence_penalty must be between -2 and 2", "presence_penalty")
    _check(-2.0 <= frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2", "frequency_penalty")
    _check(top_k == -1 or top_k >= 0, "top_k must be -1 (disabled) or a positive integer", "top_k")
    _check(0.0 <= min_p <= 1.0, "min_p must be between 0 and 1", "min_p")
    _check(0.0 < repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]", "repetition_penalty")
    # Choice i uses seed + i, and torch generators take a signed 64-bit seed.
    _check(seed is None or -(1 << 63) <= seed <= (1 << 63) - n, "seed must be a signed 64-bit integer", "seed")
    bias: dict[int, float] = {}
    for key, value in (logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        _check(0 <= token < vocab_size, f"logit_bias token id {token} is outside the vocabulary", "logit_bias")
        _check(-100.0 <= value <= 100.0, "logit_bias values must be between -100 and 100", "logit_bias")
        bias[token] = value
    _check(0 <= top_logprobs <= MAX_TOP_LOGPROBS, f"{top_logprobs_param} must be between 0 and {MAX_TOP_LOGPROBS}",
           top_logprobs_param)
    stop_ids = list(stop_token_ids or [])
    _check(all(0 <= t < vocab_size for t in stop_ids), "stop_token_ids must be in the vocabulary", "stop_token_ids")
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k == 0 else top_k,
        min_p=min_p,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        seed=seed,
        stop=_stop_list(stop),
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        skip_special_tokens=skip_special_tokens,
        logit_bias=bias,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def check_context(prompt_len: int, max_tokens: int | None, context_len: int, where: str = "messages") -> None:
    """vLLM's wording, which clients already know how to read."""
    if prompt_len >= context_len or (max_tokens is not None and prompt_len + max_tokens > context_len):
        completion = max_tokens if max_tokens is not None else 0
        raise bad_request(
            f"This model's maximum context length is {context_len} tokens. However, you requested "
            f"{prompt_len + completion} tokens ({prompt_len} in the {where}, {completion} in the completion). "
            "Please reduce the length of the messages or completion.",
            "max_tokens" if prompt_len < context_len else where,
            "context_length_exceeded",
        )
