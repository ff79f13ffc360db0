"""What a caller hands the engine and what it gets back."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pyserve.engine.logit_processors import LogitProcessor


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match (engine/grammar.py compiles it).

    `kind` is "json_schema" (`text` a JSON schema), "regex", "ebnf" (GBNF
    with a `root` rule), "lark" or "structural_tag" (xgrammar's structural
    tag JSON). With `after` set, the output is free until it contains that
    text (the end of a reasoning block) and constrained from there on."""

    kind: str
    text: str
    after: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        """What its compiled grammar is cached by."""
        return self.kind, self.text


@dataclass
class SamplingParams:
    """Per-request generation settings, already validated by the caller."""

    # None: the server's --default-max-tokens, else up to the context length.
    # A number is what the client asked for: the engine refuses a prompt +
    # max_new_tokens beyond the context instead of cutting it short.
    max_new_tokens: int | None = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 means no top-k cut
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # Regular expressions that stop it like stop strings (rust/text/stop_regex.rs).
    stop_regex: list[str] = field(default_factory=list)
    # Ids that stop it (ids outside the vocabulary never occur); with EOS,
    # masked until min_new_tokens tokens are out.
    stop_token_ids: list[int] = field(default_factory=list)
    min_new_tokens: int = 0
    # The stop string, or the stop token's text, that ended it stays in the
    # output (SGLang's no_stop_trim, vLLM's include_stop_str_in_output).
    keep_stop: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's allowed_token_ids: only these may be sampled (None: any).
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words, as token id sequences: the last id of each is masked
    # where the output so far ends with the ids before it.
    banned_sequences: tuple[tuple[int, ...], ...] = ()
    logprobs: bool = False  # report each sampled token's log-probability
    top_logprobs: int = 0  # ... and this many most likely alternatives
    # Also the log-probability of every prompt token after the first (the
    # prompt is then computed whole: its cached prefix is not reused).
    prompt_logprobs: bool = False
    prompt_top_logprobs: int | None = None  # alternatives per prompt token; None: top_logprobs
    # The output must match this grammar; the request then ends with "stop"
    # when the grammar does (at its EOS), whatever ignore_eos says.
    constraint: Constraint | None = None
    # Set by the engine on an embedding request: how its prompt's hidden
    # states are pooled (model/pooling.py); it ends after its prefill.
    pooling: str | None = None
    # SGLang's: the final-norm hidden state of every token the model reads
    # (the prompt's, then each output token's but the last) comes back with
    # the outputs (GenerateOutput.hidden_states). The prompt is then
    # computed whole, as with prompt_logprobs.
    return_hidden_states: bool = False
    # SGLang's custom logit processor (engine/logit_processors.py), and the
    # request's parameters it reads.
    logit_processor: LogitProcessor | None = None
    custom_params: dict | None = None


def prompt_alternatives(p: SamplingParams) -> int:
    """How many alternatives each scored prompt token reports."""
    return p.top_logprobs if p.prompt_top_logprobs is None else p.prompt_top_logprobs


@dataclass
class GenerateRequest:
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    # A batch job (batches/runner.py): it runs after every interactive request.
    batch: bool = False
    # The client's priority, on a server with priority scheduling: larger
    # runs first, as SGLang orders them. None: not given (0). A server
    # without priority scheduling refuses one, as it would an unknown field.
    priority: int | None = None
    # Cached prefixes are shared only between requests with equal salts
    # (None with None): a tenant cannot probe another's prompts by timing.
    cache_salt: str | None = None
    # The LoRA adapter it runs under, by name (an --enable-lora server); None: the base model.
    lora: str | None = None
    # An embedding (an --is-embedding server): the pooled vector of the
    # prompt instead of generated tokens.
    embedding: bool = False
    # The prompt as embeddings [tokens, hidden] (vLLM's prompt_embeds,
    # SGLang's input_embeds); input_ids are then placeholders of its length.
    prompt_embeds: torch.Tensor | None = None



class RequestError(ValueError):
    """A request the engine cannot run, and why. `field` names what is
    wrong in engine terms ("prompt", "max_new_tokens" or "constraint"), for
    the API to translate into its own parameter name; `code` is OpenAI's
    error code."""

    def __init__(self, message: str, field: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code


@dataclass
class TokenLogprob:
    """A sampled (or prompt) token's log-probability under the model's
    distribution (raw logits, before penalties, bias and temperature, as
    vLLM reports by default), its rank there (1: the likeliest), and the
    `top_logprobs` most likely tokens, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int = 1


@dataclass(frozen=True)
class SpeculationCounts:
    """A request's speculative decoding so far: its verify steps, the draft
    tokens they verified, and the drafts the target kept."""

    verify_steps: int
    drafted: int
    accepted: int


@dataclass
class GenerateOutput:
    """One step's worth of progress for one request.

    `text` and `token_ids` are deltas since the previous output (the ids of
    every token sampled, the stop token's included, though its text is
    not). The last output of a request has `finished=True` and a
    `finish_reason`: "stop" (EOS, stop token, stop string or stop regex),
    "length" (max_new_tokens or the context limit), "abort" (a client
    stopped it: it went away, or /abort_request named it) or "error" (the
    server could not go on: a failed step, a grammar's refusal, shutdown).
    `matched_stop` is the stop token id, the stop string or the stop
    regex's pattern that ended it, None otherwise.
    """

    rid: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for
    # On the first output, when asked for: one per prompt token, None for the first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: torch.Tensor | None = None  # an embedding request's vector (float32, CPU), on its last output
    # With return_hidden_states: the hidden states [tokens, hidden] (float32,
    # CPU) computed since the previous output, in position order.
    hidden_states: torch.Tensor | None = None
    speculation: SpeculationCounts | None = None  # with --speculative-algorithm
