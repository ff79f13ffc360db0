"""The sampling settings every generation route shares, checked and turned
into the engine's SamplingParams.

Chat and completions send OpenAI's fields (SamplingFields), /generate
SGLang's sampling_params (NativeSamplingParams): the same names for the
same settings, so one function reads both, and every route rejects a bad
value with the same OpenAI-style message. Limits that depend on the prompt
and the model (context length, vocabulary of the prompt) are the engine's
to check: `Engine.validate`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from pyserve._rust import StopMatcher, Tokenizer
from pyserve.http.errors import APIError, bad_request
from pyserve.api.generation.logprobs import MAX_TOP_LOGPROBS
from pyserve.api.protocol.native import NativeSamplingParams
from pyserve.api.protocol.openai import SamplingFields
from pyserve.engine import logit_processors
from pyserve.engine.request import Constraint, SamplingParams

MAX_N = 128
# What a sampling setting a request leaves out is where the model recommends
# none: model/config.py's SAMPLING_DEFAULTS, in this order.
OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise bad_request(message, param)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    _check(all(stops), "stop strings must not be empty", "stop")
    return stops


def _stop_regexes(patterns: str | list[str] | None) -> list[str]:
    regexes = [patterns] if isinstance(patterns, str) else list(patterns or [])
    try:
        StopMatcher([], regexes)  # the matcher's own parser names what is wrong
    except ValueError as e:
        raise bad_request(str(e), "stop_regex") from None
    return regexes


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        _check(0 <= token < vocab_size, f"logit_bias token id {token} is outside the vocabulary", "logit_bias")
        _check(-100.0 <= value <= 100.0, "logit_bias values must be between -100 and 100", "logit_bias")
        out[token] = value
    return out


def _vllm_token_rules(f, vocab_size: int, tokenizer: Tokenizer | None, constraint: Constraint | None
                      ) -> tuple[tuple[int, ...] | None, tuple[tuple[int, ...], ...]]:
    """vLLM's allowed_token_ids, and its bad_words as token id sequences:
    each word alone and after a space, as the tokenizer spells them."""
    allowed, words = getattr(f, "allowed_token_ids", None), getattr(f, "bad_words", None) or []
    if allowed is not None:
        _check(bool(allowed) and all(0 <= t < vocab_size for t in allowed),
               "allowed_token_ids must be a non-empty list of ids in the vocabulary", "allowed_token_ids")
    if constraint is not None and (allowed is not None or words):
        raise bad_request("allowed_token_ids and bad_words cannot be combined with a structured output: the "
                          "grammar may need what they forbid", "allowed_token_ids" if allowed is not None
                          else "bad_words")
    _check(all(word.strip() for word in words), "bad_words must not be empty or blank", "bad_words")
    banned = {tuple(tokenizer.encode(spelling, add_special_tokens=False))
              for word in words for spelling in (word.lstrip(), " " + word.lstrip())}
    return (tuple(sorted(set(allowed))) if allowed is not None else None), tuple(sorted(banned))


def preferred_defaults(values) -> dict[str, float]:
    """--preferred-sampling-params, checked as a request's settings are:
    ValueError naming what is wrong."""
    flag = "--preferred-sampling-params"
    if not isinstance(values, dict):
        raise ValueError(f"{flag} must be a JSON object such as {{\"temperature\": 0.6}}")
    unknown = sorted(set(values) - set(OPENAI_DEFAULTS))
    if unknown:
        raise ValueError(f"{flag} sets {', '.join(unknown)}: it takes {', '.join(OPENAI_DEFAULTS)}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values()):
        raise ValueError(f"{flag} takes numbers")
    try:
        sampling_params(NativeSamplingParams(), 1, 1, defaults=values)
    except APIError as e:
        raise ValueError(f"{flag}: {e.message}") from None
    return dict(values)


def vllm_prompt_logprobs(fields: SamplingFields) -> int | None:
    """vLLM's prompt_logprobs, checked: None, or alternatives per prompt token."""
    k = fields.prompt_logprobs
    _check(k is None or 0 <= k <= MAX_TOP_LOGPROBS, f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
           "prompt_logprobs")
    _check(k is None or not fields.stream, "prompt_logprobs is not available when streaming", "prompt_logprobs")
    return k


def sampling_params(
    fields: SamplingFields | NativeSamplingParams,
    max_new_tokens: int | None,
    vocab_size: int,
    *,
    top_logprobs: int | None = None,
    top_logprobs_param: str = "top_logprobs",
    prompt_logprobs: bool = False,
    prompt_top_logprobs: int | None = None,
    constraint: Constraint | None = None,
    defaults: Mapping[str, float] = OPENAI_DEFAULTS,
    tokenizer: Tokenizer | None = None,
) -> SamplingParams:
    """`max_new_tokens`: the route's own limit field (None leaves it to the
    engine: --default-max-tokens, else up to the context). `top_logprobs`:
    None for no logprobs, else how many alternatives per token, named
    `top_logprobs_param` in errors; `prompt_logprobs` scores the prompt too,
    with `prompt_top_logprobs` alternatives (None: as many as top_logprobs).
    `constraint`: what the output must match (api/constraints.py).
    `defaults`: the model's settings (ModelConfig.sampling_defaults) for
    those of OPENAI_DEFAULTS the request leaves out, else OpenAI's.
    `tokenizer` spells vLLM's bad_words (the OpenAI routes' field)."""
    f = fields

    def setting(name: str):  # the request's, else the model's recommendation, else OpenAI's default
        value = getattr(f, name)
        return value if value is not None else defaults.get(name, OPENAI_DEFAULTS[name])

    temperature, top_p, top_k, min_p, repetition_penalty = map(setting, OPENAI_DEFAULTS)
    _check(0.0 <= temperature <= 2.0, "temperature must be between 0 and 2", "temperature")
    _check(0.0 < top_p <= 1.0, "top_p must be in (0, 1]", "top_p")
    _check(1 <= f.n <= MAX_N, f"n must be between 1 and {MAX_N}", "n")
    _check(-2.0 <= f.presence_penalty <= 2.0, "presence_penalty must be between -2 and 2", "presence_penalty")
    _check(-2.0 <= f.frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2", "frequency_penalty")
    _check(top_k == -1 or top_k >= 0, "top_k must be -1 (disabled) or a positive integer", "top_k")
    _check(0.0 <= min_p <= 1.0, "min_p must be between 0 and 1", "min_p")
    _check(0.0 < repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]", "repetition_penalty")
    # Choice i uses seed + i, and torch generators take a signed 64-bit seed.
    _check(f.seed is None or -(1 << 63) <= f.seed <= (1 << 63) - f.n, "seed must be a signed 64-bit integer: "
           f"Input should be greater than or equal to {-(1 << 63)} and less than or equal to {(1 << 63) - f.n}",
           "seed")
    bias = _logit_bias(f.logit_bias, vocab_size)
    _check(top_logprobs is None or 0 <= top_logprobs <= MAX_TOP_LOGPROBS,
           f"{top_logprobs_param} must be between 0 and {MAX_TOP_LOGPROBS}", top_logprobs_param)
    stop_ids = list(f.stop_token_ids or [])
    _check(all(0 <= t < vocab_size for t in stop_ids), "stop_token_ids must be in the vocabulary", "stop_token_ids")
    stops = _stop_list(f.stop)
    # SGLang's sampling_params name it min_new_tokens; vLLM's and SGLang's OpenAI bodies, min_tokens.
    min_name = "min_new_tokens" if isinstance(f, NativeSamplingParams) else "min_tokens"
    min_tokens = getattr(f, min_name)
    _check(min_tokens == 0 or (min_tokens > 0 and (max_new_tokens is None or min_tokens <= max_new_tokens)),
           f"{min_name} must be between 0 and the most new tokens", min_name)
    allowed, banned = _vllm_token_rules(f, vocab_size, tokenizer, constraint)
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if top_k == 0 else top_k,
        min_p=min_p,
        presence_penalty=f.presence_penalty,
        frequency_penalty=f.frequency_penalty,
        repetition_penalty=repetition_penalty,
        seed=f.seed,
        stop=stops,
        stop_regex=_stop_regexes(f.stop_regex),
        stop_token_ids=stop_ids,
        min_new_tokens=min_tokens,
        keep_stop=f.no_stop_trim or getattr(f, "include_stop_str_in_output", False),
        ignore_eos=f.ignore_eos,
        skip_special_tokens=f.skip_special_tokens,
        logit_bias=bias,
        allowed_token_ids=allowed,
        banned_sequences=banned,
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs or 0,
        prompt_logprobs=prompt_logprobs,
        prompt_top_logprobs=prompt_top_logprobs,
        constraint=constraint,
        return_hidden_states=getattr(f, "return_hidden_states", False),
    )


def with_logit_processor(params: SamplingParams, source: str | None, custom_params: dict | None,
                         refusal: str | None, params_param: str = "custom_params") -> SamplingParams:
    """`params` with SGLang's custom logit processor `source` and the
    `custom_params` it reads (engine/logit_processors.py). `refusal`: why
    this server runs none (the engine's ServedFields), checked before
    anything is unpickled, since unpickling runs the client's code."""
    if source is None:
        if custom_params is not None:
            raise bad_request("custom_params is what a custom logit processor reads: send the processor in "
                              "custom_logit_processor", params_param)
        return params
    if refusal is not None:
        raise bad_request(refusal, "custom_logit_processor")
    try:
        processor = logit_processors.load(source)
    except ValueError as e:
        raise bad_request(str(e), "custom_logit_processor") from None
    return replace(params, logit_processor=processor, custom_params=custom_params)
