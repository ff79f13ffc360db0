"""Next-token selection for a batch, each row with its own settings.

Order, as in the OpenAI/vLLM semantics: the grammar's token mask of a
constrained request (engine/grammar.py), repetition penalty (prompt and
output tokens), frequency and presence penalties (output tokens), logit
bias, then greedy argmax at temperature 0, else temperature, top-k, top-p
and min-p before drawing. The filters run on the whole batch at once with
per-row parameters. A request with a seed draws from its own generator, so
its text does not depend on what else is in the batch; the others share
one generator seeded from --random-seed.
"""

from __future__ import annotations

import torch

from pyserve.engine.grammar import apply_bitmask, note_sampled, token_bitmask
from pyserve.engine.request import SamplingParams
from pyserve.engine.sequence import Sequence


def wants_logprobs(p: SamplingParams) -> bool:
    return p.logprobs or p.top_logprobs > 0


def reads_history(p: SamplingParams) -> bool:
    """Penalties depend on every token generated so far."""
    return bool(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty)


def _adjusts_logits(p: SamplingParams) -> bool:
    return reads_history(p) or bool(p.logit_bias)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(log-probability of ids[i] under row i [B], top-k values [B, k], top-k
    ids [B, k]) from raw logits, on their device (no wait for it)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, ids[:, None])[:, 0]
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    return chosen, top_vals, top_ids


class Sampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: float32 [B, vocab] on any device; returns one int64 id per
        row, on the logits' device when every row is greedy (no wait for the
        device), on the CPU otherwise. The caller's logits are left as they
        are (log-probabilities are reported from them)."""
        # Read once: the event loop drops the state of a request that ended.
        grammars = [s.grammar for s in seqs]
        if all(g is None for g in grammars):
            return self._sample(logits, seqs, None)
        ids = self._sample(logits, seqs, token_bitmask(grammars, logits.shape[-1]))
        note_sampled(grammars, ids)
        return ids

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                mask: tuple[torch.Tensor, list[int]] | None) -> torch.Tensor:
        params = [s.params for s in seqs]
        if all(p.temperature == 0 and not _adjusts_logits(p) for p in params):
            if mask is None:
                return logits.argmax(dim=-1)
            logits = logits.clone()
            apply_bitmask(logits, *mask)
            return logits.argmax(dim=-1)
        # Generators live on the CPU; one [B, vocab] copy is cheap next to a
        # forward pass. The copy also leaves the caller's tensor untouched.
        logits = logits.to("cpu", torch.float32, copy=True)
        if mask is not None:
            apply_bitmask(logits, *mask)
        for row, seq in zip(logits, seqs):
            if _adjusts_logits(seq.params):
                apply_penalties(row, seq)
        ids = torch.empty(len(seqs), dtype=torch.long)
        greedy = [i for i, p in enumerate(params) if p.temperature == 0]
        drawn = [i for i, p in enumerate(params) if p.temperature != 0]
        if greedy:
            ids[greedy] = logits[greedy].argmax(dim=-1)
        if drawn:
            rows = logits if len(drawn) == len(seqs) else logits[drawn]
            probs = probabilities(rows, [params[i] for i in drawn])
            ids[drawn] = self._draw(probs, [seqs[i] for i in drawn])
        return ids

    def _draw(self, probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Inverse-CDF sampling: one uniform number per row, found in the
        row's cumulative sum (torch.multinomial is ~40x slower on CPU at
        vocabulary sizes). Rows need not be normalised."""
        u = torch.empty(len(seqs))
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                u[i] = torch.rand(1, generator=seq.generator)
        cdf = probs.cumsum(dim=-1)
        # right=True: the first token whose cdf exceeds the draw, which is
        # never a token of probability 0.
        ids = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)[:, 0]
        ids.clamp_(max=probs.shape[-1] - 1)
        # u * total can round up to total: then take the likeliest token.
        missed = (probs.gather(1, ids[:, None])[:, 0] == 0).nonzero()[:, 0]
        if missed.numel():
            ids[missed] = probs[missed].argmax(dim=-1)
        return ids


def apply_penalties(row: torch.Tensor, seq: Sequence) -> None:
    """Repetition, frequency and presence penalties and logit bias, in place."""
    p = seq.params
    vocab = row.numel()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.all_ids)), dtype=torch.long)
        seen = seen[seen < vocab]
        vals = row[seen]
        # Shrink toward "less likely" whatever the sign (CTRL / HF semantics).
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.output_ids:
        counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long), minlength=vocab)[:vocab]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    for token_id, bias in p.logit_bias.items():
        if 0 <= token_id < vocab:
            row[token_id] += bias


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[n, vocab] logits -> the distributions to draw from: temperature,
    then top-k, top-p and min-p cuts (every row keeps its best token)."""
    vocab = logits.shape[-1]
    logits = logits / torch.tensor([[p.temperature] for p in params])
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    cut = [i for i, k in enumerate(top_k) if k < vocab]
    if cut:
        rows = logits[cut]
        k = torch.tensor([[top_k[i]] for i in cut])
        kth = rows.topk(int(k.max()), dim=-1).values.gather(1, k - 1)
        logits[cut] = rows.masked_fill(rows < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([[p.top_p] for p in params])
    if (top_p < 1.0).any():
        probs = _top_p(probs, top_p)
    min_p = torch.tensor([[p.min_p] for p in params])
    if (min_p > 0.0).any():
        probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of likeliest tokens whose mass reaches
    its top_p (rows with top_p = 1 keep everything). Instead of sorting the
    whole vocabulary, look at the top k tokens, growing k until they hold
    the mass: real next-token distributions are peaked, so k stays small."""
    vocab = probs.shape[-1]
    uncut = top_p >= 1.0
    k = min(64, vocab)
    while True:
        top, order = probs.topk(k, dim=-1)  # sorted, descending
        if k == vocab or bool(((top.sum(dim=-1, keepdim=True) >= top_p) | uncut).all()):
            break
        k = min(k * 8, vocab)
    before = top.cumsum(dim=-1) - top
    keep = (before < top_p) | uncut
    return (probs * uncut).scatter_(-1, order, top * keep)
