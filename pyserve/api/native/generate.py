"""SGLang's native POST /generate: `text`, `input_ids` or `input_embeds`, `sampling_params`,
`stream`; answers `text`, `output_ids` (the generated tokens) and
`meta_info`, with SGLang's logprob lists when `return_logprob` is set, and
its hidden states when `return_hidden_states` is: `hidden_states[0]` the
prompt's rows, then one row per output token the model read (each but the
last), as SGLang lists them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

import torch

from pyserve.api.generation.constraints import request_constraint
from pyserve.api.generation.logprobs import TokenTexts
from pyserve.api.generation.prompt_embeds import embeds_from_lists
from pyserve.api.generation.sessions import SessionStream
from pyserve.http.errors import bad_request
from pyserve.api.protocol.native import NativeGenerateRequest, NativeSamplingParams
from pyserve.api.generation.sampling import sampling_params, with_logit_processor
from pyserve.api.generation.serving import (
    ServingContext, adapter_name, collect, fan_out, merged_outputs, new_id, prompt_id_lists,
)
from pyserve.engine.request import GenerateOutput, GenerateRequest, SpeculationCounts, TokenLogprob


# SGLang switches that a gateway sends at their defaults, which are what
# pyserve does; another value asks for something it does not.
_ONLY_AT_DEFAULT = {"log_metrics": True, "background": False, "no_logs": False, "return_bytes": False,
                    "return_entropy": False}


async def generate(ctx: ServingContext, req: NativeGenerateRequest):
    for name, default in _ONLY_AT_DEFAULT.items():
        if getattr(req, name) != default:
            raise bad_request(f"{name}={getattr(req, name)} is not supported: pyserve answers as with "
                              f"{name}={default}", name, "unsupported_parameter")
    given = [name for name in ("text", "input_ids", "input_embeds") if getattr(req, name) is not None]
    if len(given) != 1:
        raise bad_request("give exactly one of text, input_ids and input_embeds", given[1] if given else "text")
    prompt_param = given[0]
    has_text = ctx.engine.tokenizer is not None  # not with --skip-tokenizer-init
    if not has_text and (req.text is not None or req.return_text_in_logprobs):
        raise bad_request("this server runs with --skip-tokenizer-init: send input_ids, and read output_ids",
                          "text" if req.text is not None else "return_text_in_logprobs")
    if req.text is not None:
        prompts, single = prompt_id_lists(ctx.engine.tokenizer, req.text, "text")
    elif req.input_embeds is not None:
        prompts, single = embeds_from_lists(req.input_embeds, "input_embeds")
    else:
        prompts, single = prompt_id_lists(ctx.engine.tokenizer, req.input_ids, "input_ids", text=False)
    batch = _Batch(req, len(prompts))
    continuations = None
    if req.session_params is not None:
        if req.input_embeds is not None:
            raise bad_request("a session continues token ids: send text or input_ids with session_params",
                              "session_params")
        bos = _bos(ctx.engine.tokenizer)
        continuations = [ctx.sessions.continuation(sp, ids, bos) for sp, ids in zip(batch.session_params, prompts)]
        prompts = [c.prompt_ids for c in continuations]
    constraints = [request_constraint(f, "sampling_params.") for f in batch.fields]
    params = [sampling_params(
        fields, fields.max_new_tokens, ctx.engine.vocab_size,
        top_logprobs=top if wanted else None, top_logprobs_param="top_logprobs_num",
        prompt_logprobs=wanted and start >= 0, constraint=constrained and constrained.constraint,
        defaults=ctx.sampling_defaults,
    ) for fields, constrained, wanted, start, top in zip(batch.fields, constraints, batch.return_logprob,
                                                          batch.logprob_start_len, batch.top_logprobs_num)]
    params = [with_logit_processor(replace(p, return_hidden_states=wanted), source, fields.custom_params,
                                   ctx.engine.served.custom_logit_processor, "sampling_params.custom_params")
              for p, wanted, source, fields in zip(params, batch.return_hidden_states, batch.custom_logit_processor,
                                                   batch.fields)]
    names = {"prompt": prompt_param, "prompt_embeds": "input_embeds",
             "max_new_tokens": "sampling_params.max_new_tokens", "n": "sampling_params.n",
             "stop": "sampling_params.stop",
             "constraint": next((c.param for c in constraints if c is not None), None)}
    n = batch.fields[0].n
    requests = await fan_out(ctx, prompts, params, n, req.rid if isinstance(req.rid, list) else req.rid or new_id(""),
                             names, priority=req.priority, cache_salt=req.cache_salt,
                             lora=[adapter_name(ctx, req.model, path) for path in batch.lora_path])
    for ids, wanted, start in zip(prompts, batch.return_logprob, batch.logprob_start_len):
        _check_logprob_start(wanted, start, ids)  # after the engine refused an empty prompt
    choice_rids = [[r.rid for r in requests[p * n:(p + 1) * n]] for p in range(len(prompts))]
    turns = ctx.sessions.join(continuations, choice_rids, ctx.engine.abort) if continuations else []
    record = (lambda i, out: turns[i].output_ids.extend(out.token_ids)) if turns else None
    started = time.perf_counter()
    texts = ctx.token_texts if req.return_text_in_logprobs else None
    logprobs = [MetaLogprobs(texts, batch.logprob_start_len[p], r.input_ids) if batch.return_logprob[p] else None
                for p, r in ((k // n, r) for k, r in enumerate(requests))]
    if req.stream:
        events = _stream(ctx, requests, started, logprobs, has_text, record)
        return SessionStream(events, lambda: ctx.sessions.ended(turns)) if turns else events
    try:
        collected = await collect(ctx.engine, requests, record)
    finally:
        ctx.sessions.ended(turns)
    results = []
    for i, result in enumerate(collected):
        if logprobs[i]:
            logprobs[i].add(result.prompt_logprobs, result.logprobs)
        meta = _meta(requests[i].rid, result.final, started, logprobs[i])
        if requests[i].params.return_hidden_states:
            rows = torch.cat(result.hidden_states).tolist() if result.hidden_states else []
            meta["hidden_states"] = _hidden_states_meta(rows, len(requests[i].input_ids))
        results.append({**({"text": result.text} if has_text else {}), "output_ids": result.token_ids,
                        "meta_info": meta})
    # As SGLang answers: one object for one text, a list for a batch or n > 1.
    return results[0] if single and n == 1 else results


class _Batch:
    """The body's per-prompt fields: SGLang takes each as one value for
    every prompt or a list of one per prompt."""

    def __init__(self, req: NativeGenerateRequest, prompts: int):
        self.prompts = prompts
        self.fields = self._each(req.sampling_params or NativeSamplingParams(), "sampling_params")
        if any(f.n != self.fields[0].n for f in self.fields):
            raise bad_request("every prompt's sampling_params must ask for the same n", "sampling_params")
        if isinstance(req.rid, list):
            self._each(req.rid, "rid")
            if len(set(req.rid)) < prompts:
                raise bad_request("the rid list names a request twice: give each prompt its own", "rid")
        self.session_params = self._each(req.session_params, "session_params")
        self.custom_logit_processor = self._each(req.custom_logit_processor, "custom_logit_processor")
        self.lora_path = self._each(req.lora_path, "lora_path")
        self.return_logprob = self._each(req.return_logprob, "return_logprob")
        self.logprob_start_len = self._each(req.logprob_start_len, "logprob_start_len")
        self.top_logprobs_num = self._each(req.top_logprobs_num, "top_logprobs_num")
        self.return_hidden_states = self._each(req.return_hidden_states, "return_hidden_states")

    def _each(self, value, name: str) -> list:
        if not isinstance(value, list):
            return [value] * self.prompts
        if len(value) != self.prompts:
            raise bad_request(f"{name} is a list of {len(value)} for {self.prompts} prompt"
                              f"{'s' if self.prompts != 1 else ''}: give one value for all, or one per prompt", name)
        return value


def _bos(tokenizer) -> int | None:
    """The token the tokenizer puts before a text (a Llama BOS), which a
    session's continuation drops, as SGLang does; None when it puts none."""
    lead = tokenizer.encode("", add_special_tokens=True) if tokenizer is not None else []
    return lead[0] if lead else None


def _check_logprob_start(wanted: bool, start: int, prompt: list[int]) -> None:
    """With return_logprob, the prompt's logprobs start inside the prompt
    (-1: none of it), as SGLang checks; without it the options are unused."""
    if wanted and not -1 <= start < len(prompt):
        length = f"{len(prompt)} token{'s' if len(prompt) != 1 else ''}"
        raise bad_request(f"logprob_start_len {start} is outside the prompt ({length}): give -1 "
                          f"for no prompt logprobs, or a position from 0 to {len(prompt) - 1}", "logprob_start_len")


async def _stream(ctx: ServingContext, requests: list[GenerateRequest], started: float,
                  logprobs: list[MetaLogprobs | None], has_text: bool, record) -> AsyncIterator[dict]:
    """SGLang streams the whole text (and token ids) so far in every event;
    with no tokenizer, the token ids alone."""
    texts = [""] * len(requests)
    ids: list[list[int]] = [[] for _ in requests]
    states: list[list[list[float]]] = [[] for _ in requests]  # each request's hidden-state rows so far
    async for i, out in merged_outputs(ctx.engine, requests, record):
        texts[i] += out.text
        ids[i] += out.token_ids
        if logprobs[i]:
            logprobs[i].add(out.prompt_logprobs or [], out.logprobs or [])
        meta = _meta(requests[i].rid, out, started, logprobs[i])
        if out.hidden_states is not None:
            states[i] += out.hidden_states.tolist()  # each row converted once, not at every event
        if requests[i].params.return_hidden_states:  # all so far, as the text and ids
            meta["hidden_states"] = _hidden_states_meta(states[i], len(requests[i].input_ids))
        event = {**({"text": texts[i]} if has_text else {}), "output_ids": list(ids[i]), "meta_info": meta}
        if len(requests) > 1:
            event["index"] = i
        yield event


def _meta(rid: str, out: GenerateOutput, started: float, logprobs: MetaLogprobs | None = None) -> dict:
    if out.finish_reason == "stop":
        reason = {"type": "stop", "matched": out.matched_stop}
    elif out.finish_reason == "length":
        reason = {"type": "length", "length": out.completion_tokens}
    elif out.finish_reason == "abort":  # /abort_request or /pause_generation stopped it
        reason = {"type": "abort", "message": "aborted by the server's operator"}
    else:
        reason = None
    return {
        "id": rid,
        "finish_reason": reason,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "cached_tokens": out.cached_tokens,
        "e2e_latency": time.perf_counter() - started,
        **(logprobs.meta() if logprobs else {}),
        **(_speculation_meta(out.speculation) if out.speculation is not None else {}),
    }


def _hidden_states_meta(rows: list[list[float]], prompt_tokens: int) -> list:
    """SGLang's meta_info.hidden_states: the prompt's rows as one list, then
    each output token's row, from the rows the outputs brought, in order."""
    return [rows[:prompt_tokens], *rows[prompt_tokens:]] if rows else []


def _speculation_meta(c: SpeculationCounts) -> dict:
    """SGLang's per-request speculative fields. The accept length is the
    tokens a verify step emitted on average (a request that stopped
    drafting decodes its other tokens one a step), as /metrics reports it."""
    return {"spec_verify_ct": c.verify_steps, "spec_draft_token_num": c.drafted, "spec_accept_token_num": c.accepted,
            "spec_accept_rate": c.accepted / c.drafted if c.drafted else 0.0,
            "spec_accept_length": (c.verify_steps + c.accepted) / c.verify_steps if c.verify_steps else 0.0}


class MetaLogprobs:
    """SGLang's meta_info logprob lists for one request, built up as its
    outputs arrive: entries are [logprob, token_id, text or None]."""

    def __init__(self, texts: TokenTexts | None, start: int, prompt_ids: list[int]):
        self.texts = texts  # None: entries carry no text
        self.start = start
        self.prompt_ids = prompt_ids
        self.input: list = []
        self.input_top: list = []
        self.output: list = []
        self.output_top: list = []

    def _entry(self, logprob: float | None, token_id: int) -> list:
        return [logprob, token_id, self.texts.text(token_id) if self.texts else None]

    def add(self, prompt_logprobs: list[TokenLogprob | None], logprobs: list[TokenLogprob]) -> None:
        for pos, e in enumerate(prompt_logprobs[self.start :], start=self.start):
            if e is None:  # the first prompt token: nothing scores it
                self.input.append(self._entry(None, self.prompt_ids[pos]))
                self.input_top.append(None)
            else:
                self.input.append(self._entry(e.logprob, e.token_id))
                self.input_top.append([self._entry(lp, i) for i, lp in e.top])
        for e in logprobs:
            self.output.append(self._entry(e.logprob, e.token_id))
            self.output_top.append([self._entry(lp, i) for i, lp in e.top])

    def meta(self) -> dict:
        return {"input_token_logprobs": self.input, "output_token_logprobs": self.output,
                "input_top_logprobs": self.input_top, "output_top_logprobs": self.output_top}
