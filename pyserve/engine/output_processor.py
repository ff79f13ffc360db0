"""Turns each new token of a request into text and decides when it ends.

Per request: a Rust DecodeStream (whole UTF-8 characters only) and a Rust
StopMatcher (stop strings and stop regexes across token boundaries, never
emitted). The
log-probabilities a step computed are unpacked here too, into one
TokenLogprob per sampled token or scored prompt position.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pyserve._rust import DecodeStream, StopMatcher, Tokenizer
from pyserve.engine.request import GenerateOutput, SpeculationCounts, TokenLogprob, prompt_alternatives
from pyserve.engine.sampler import wants_logprobs
from pyserve.engine.sequence import Sequence

if TYPE_CHECKING:
    from pyserve.engine.runner.model_runner import StepOutput
    from pyserve.engine.step import ScheduledStep

# Prompt ids decoded as left context of the first generated token, so that
# tokenizers which drop a leading space decode it as it reads in the text.
_PROMPT_CONTEXT = 4


def _entries(parts: tuple[torch.Tensor, ...], token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
    """TokenLogprob per row of token_logprobs' (chosen, top values, top ids,
    ranks), row i keeping its first ks[i] alternatives."""
    chosen, top_vals, top_ids, ranks = (t.tolist() for t in parts)
    return [TokenLogprob(t, chosen[i], list(zip(top_ids[i][:k], top_vals[i][:k])), ranks[i])
            for i, (t, k) in enumerate(zip(token_ids, ks))]


def sampled_logprobs(output: StepOutput, seqs: list[Sequence], ids: list[int]) -> list[TokenLogprob | None]:
    """Per sampled sequence, its token's logprob entry if it asked for one."""
    if output.logprobs is None:
        return [None] * len(ids)
    entries = _entries(output.logprobs, ids, [s.params.top_logprobs for s in seqs])
    return [e if wants_logprobs(s.params) else None for s, e in zip(seqs, entries)]


def prompt_logprobs(output: StepOutput, step: ScheduledStep) -> list[tuple[Sequence, list[TokenLogprob]]]:
    """The step's prompt log-probabilities, split by sequence."""
    if output.prompt_logprobs is None:
        return []
    ks = [prompt_alternatives(seq.params) for seq, scored in step.prompt_spans for _ in scored]
    entries = _entries(output.prompt_logprobs, step.prompt_targets, ks)
    out, row = [], 0
    for seq, scored in step.prompt_spans:
        out.append((seq, entries[row : row + len(scored)]))
        row += len(scored)
    return out


def hidden_states(output: StepOutput, step: ScheduledStep) -> list[tuple[Sequence, torch.Tensor]]:
    """The step's returned hidden states (return_hidden_states), split by sequence."""
    if output.hidden_states is None:
        return []
    return list(zip([seq for seq, _ in step.state_spans],
                    output.hidden_states.split([len(kept) for _, kept in step.state_spans])))


class _NoText:
    """The detokenizer of a server without a tokenizer: tokens have no text."""

    def step(self, ids: list[int]) -> str:
        return ""

    def flush(self) -> str:
        return ""


_NO_TEXT = _NoText()


class OutputProcessor:
    def __init__(self, seq: Sequence, tokenizer: Tokenizer | None, eos_token_ids: list[int], context_len: int,
                 speculative: bool = False, stream_interval: int = 1):
        self.seq = seq
        self.speculative = speculative  # outputs carry the request's SpeculationCounts
        # After the first output, one goes out once this many tokens gathered
        # (or at the end); the text of those held back waits in `held_text`.
        self.stream_interval, self.held_text = stream_interval, ""
        p = seq.params
        # --skip-tokenizer-init: no text (stop strings are refused before a request gets here).
        self.detok = _NO_TEXT if tokenizer is None else \
            DecodeStream(tokenizer, p.skip_special_tokens,
                         seq.prompt_ids[-_PROMPT_CONTEXT:] if seq.prompt_embeds is None else [])
        self.stops = StopMatcher(p.stop, p.stop_regex, p.keep_stop)
        self.stop_ids = set(p.stop_token_ids)
        # A grammar allows EOS only at its end: there the request stops.
        if not p.ignore_eos or p.constraint is not None:
            self.stop_ids.update(eos_token_ids)
        self.context_len = context_len
        self.sent_tokens = 0
        # One entry per output token when the request asked for logprobs.
        self.logprobs: list[TokenLogprob] | None = [] if p.logprobs or p.top_logprobs else None
        # The prompt's, gathered over its chunks; sent with the first output.
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if p.prompt_logprobs else None
        self.hidden_states: list[torch.Tensor] = []  # return_hidden_states: those not yet sent

    def _output(self, text: str, **finish) -> GenerateOutput:
        seq = self.seq
        text, self.held_text = self.held_text + text, ""
        new_ids = seq.output_ids[self.sent_tokens :]
        logprobs = self.logprobs[self.sent_tokens :] if self.logprobs is not None else None
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        states, self.hidden_states = torch.cat(self.hidden_states) if self.hidden_states else None, []
        self.sent_tokens = len(seq.output_ids)
        return GenerateOutput(
            rid=seq.rid,
            text=text,
            token_ids=new_ids,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            cached_tokens=seq.cache_hit or 0,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            hidden_states=states,
            speculation=SpeculationCounts(seq.verify_steps, seq.drafted, seq.accepted) if self.speculative else None,
            **finish,
        )

    def add_prompt_logprobs(self, entries: list[TokenLogprob]) -> None:
        self.prompt_logprobs += entries

    def add_hidden_states(self, rows: torch.Tensor) -> None:
        self.hidden_states.append(rows)

    def extend(self, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> GenerateOutput | None:
        """Record a step's tokens for this request (a sampled one, an
        accepted speculative run, the tokens a grammar forced) as one
        output, or None while --stream-interval holds them back. The first
        that ends the request (stop token, stop string, max_tokens,
        context) ends it there: nothing after it is kept."""
        texts = []
        for token_id, logprob in zip(token_ids, logprobs):
            text, finished = self._add(token_id, logprob)
            texts.append(text)
            if finished is not None:
                return self._finish("".join(texts), *finished)
        if self.sent_tokens and len(self.seq.output_ids) - self.sent_tokens < self.stream_interval:
            self.held_text += "".join(texts)
            return None
        return self._output("".join(texts))

    def _add(self, token_id: int, logprob: TokenLogprob | None) -> tuple[str, tuple[int | None, int | None] | None]:
        """One token in: its text, and (matched stop, stop token) when it ends the request."""
        seq = self.seq
        seq.output_ids.append(token_id)
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        if token_id in self.stop_ids:
            # The stop token's own text is emitted only when the request keeps its stop.
            text, matched = self.stops.feed(self.detok.step([token_id])) if seq.params.keep_stop else ("", None)
            if matched is None:
                rest, matched = self._flush()
                text += rest
            return text, (matched, token_id)
        text, matched = self.stops.feed(self.detok.step([token_id]))
        if matched is None and (
            len(seq.output_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.context_len
        ):
            rest, matched = self._flush()
            return text + rest, (matched, None)
        if matched is not None:
            return text, (matched, None)
        return text, None

    def _finish(self, text: str, matched: int | None, stop_token: int | None) -> GenerateOutput:
        """The last output: a stop string wins over the stop token that came
        after it; with neither, the request ran out of length."""
        if matched is not None:
            p = self.seq.params
            stop = (p.stop + p.stop_regex)[matched]
            return self._output(text, finished=True, finish_reason="stop", matched_stop=stop)
        if stop_token is not None:
            return self._output(text, finished=True, finish_reason="stop", matched_stop=stop_token)
        return self._output(text, finished=True, finish_reason="length")

    def _flush(self) -> tuple[str, int | None]:
        """Release what the detokenizer and stop matcher still hold; a stop
        may still match in the detokenizer's held-back text, or (a regex
        such as `\\.$`) at the end of the text."""
        text, matched = self.stops.feed(self.detok.flush())
        if matched is not None:
            return text, matched
        rest, matched = self.stops.flush()
        return text + rest, matched

    def out_of_memory(self) -> GenerateOutput:
        """The KV cache cannot hold this sequence's next token: end it as
        if it reached its length limit."""
        text, matched = self._flush()
        return self._finish(text, matched, None)

    def abort(self, reason: str) -> GenerateOutput:
        return self._output("", finished=True, finish_reason=reason)
