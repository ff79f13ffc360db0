"""The request body of SGLang's native POST /generate, as msgspec Structs.

Stricter than the OpenAI routes' bodies: an unknown field, at the top or
in sampling_params, is a 400 naming it (msgspec's forbid_unknown_fields).
SGLang's own fields that pyserve cannot honour (image_data,
custom_logit_processor...) are unknown here, so they are refused rather
than dropped. Types are strict too: no bool or int read from a string.
"""

from __future__ import annotations

from typing import Any

import msgspec


class NativeSamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's sampling_params, with its names and defaults; the sampling
    settings left None take the model's (api/generation/sampling.py)."""

    max_new_tokens: int = 128
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    min_new_tokens: int = 0  # EOS and stop token ids masked until this many tokens
    no_stop_trim: bool = False  # the matched stop string or stop token's text stays in the text
    stop_regex: str | list[str] | None = None  # stops that are regular expressions
    custom_params: dict[str, Any] | None = None  # what the request's custom logit processor reads
    # Structured outputs, as SGLang takes them: a JSON schema (JSON text, or
    # the schema itself, which stays a free object), a regex, a GBNF
    # grammar, a structural tag (JSON text or object); api/constraints.py
    # reads them.
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | dict[str, Any] | None = None


class SessionParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """/generate's `session_params` (api/generation/sessions.py): the session,
    and the request of it this one continues."""

    id: str
    rid: str | None = None  # None: a first turn (or, with replace, a fresh start)
    offset: int | None = None
    replace: bool | None = None
    drop_previous_output: bool | None = None


class OpenSessionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's /open_session body."""

    # SGLang takes it and bounds nothing with it (clients send 0 as well as 50000); so does pyserve.
    capacity_of_str_len: int
    session_id: str | None = None
    timeout: float | None = None  # idle seconds after which the session closes itself
    streaming: bool = False  # SGLang's sessions that hold their KV between turns: refused


class CloseSessionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    session_id: str


class NativeGenerateRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    text: str | list[str] | None = None
    # Token ids, or a list of token id lists. msgspec takes one array type
    # per union, so the items are typed and generate.py refuses a mix.
    input_ids: list[int | list[int]] | None = None
    # With --enable-prompt-embeds: the prompt as embeddings, [tokens][hidden]
    # floats, or a list of those (prompt_embeds.py reads the nesting).
    input_embeds: list | None = None
    # These fields take one value for every prompt, or a list of one per
    # prompt (a batch's prompts, each with its own settings).
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    rid: str | list[str] | None = None
    session_params: SessionParams | list[SessionParams] | None = None
    # With --enable-custom-logit-processor: SGLang's CustomLogitProcessor.to_str() text (engine/logit_processors.py).
    custom_logit_processor: str | list[str | None] | None = None
    lora_path: str | list[str | None] | None = None  # SGLang: the LoRA adapter, by name (with --enable-lora)
    return_logprob: bool | list[bool] = False
    # SGLang's logprob options: output tokens' logprobs, and the prompt's
    # from position logprob_start_len on (-1: none of the prompt).
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    # SGLang's: meta_info.hidden_states (with --enable-return-hidden-states).
    return_hidden_states: bool | list[bool] = False
    stream: bool = False
    # The smg gateway adds these to every /generate it routes, at SGLang's
    # defaults: the model's name (any is accepted, as on the OpenAI routes)
    # and switches pyserve accepts only at those defaults (generate.py).
    model: str | None = None
    log_metrics: bool = True
    background: bool = False
    no_logs: bool = False
    return_bytes: bool = False
    return_entropy: bool = False
    return_text_in_logprobs: bool = False
    # As on the OpenAI routes: the request's priority (with
    # --enable-priority-scheduling) and the salt of the prefixes it shares.
    priority: int | None = None
    cache_salt: str | None = None


class AbortRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's /abort_request body."""

    rid: str = ""  # a request's `rid` (its choices' and prompts' requests with it)
    abort_all: bool = False


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's /load_lora_adapter and vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang's; every adapter here stays in its slot until unloaded


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; the name alone says which


class AddExternalCorpusRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's /add_external_corpus body: a corpus file on the server (JSON
    Lines of one document a line as a JSON string), the documents
    themselves, or their token ids as SGLang's token_chunks; the id is
    made up when none is given."""

    corpus_id: str | None = None
    file_path: str | None = None
    documents: list[str] | None = None
    token_chunks: list[list[int]] | None = None


class RemoveExternalCorpusRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    corpus_id: str
