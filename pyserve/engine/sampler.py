"""Next-token selection for a batch, each row with its own settings.

Order, as in the OpenAI/vLLM semantics: the grammar's token mask of a
constrained request (engine/grammar.py), the penalties, logit bias and
masked stops of engine/penalties.py, then greedy argmax at temperature 0,
else temperature, top-k, top-p and min-p before drawing. Every step is one
batched operation over the rows that need it, on the logits' device: no
row is handled on its own. A
request with a seed draws from its own generator, so its text does not
depend on what else is in the batch; the others share one generator
seeded from --random-seed.

The sampler lives on the forward thread, with each request's
SamplingState (engine/sampling_state.py): the model runner hands states
to it and takes them back through that thread's queue.
"""

from __future__ import annotations

import torch

from pyserve.engine.grammar import apply_bitmask, note_sampled, token_bitmask
from pyserve.engine.ownership import ThreadOwned
from pyserve.engine.penalties import adjust_logits, adjusts_logits
from pyserve.engine.request import SamplingParams
from pyserve.engine.sampling_state import SamplingState
from pyserve.engine.sequence import Sequence


def wants_logprobs(p: SamplingParams) -> bool:
    return p.logprobs or p.top_logprobs > 0


def jumps_forward(p: SamplingParams) -> bool:
    """Whether a request's grammar may append the text it forces at once
    (engine/grammar.py), when the server has jump-forward on. Not for
    requests that ask for logprobs: forced tokens are not sampled and have
    none, and theirs stay exactly those of decoding token by token."""
    return p.constraint is not None and not wants_logprobs(p)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(log-probability of ids[i] under row i [B], top-k values [B, k], top-k
    ids [B, k], rank of ids[i] in row i [B], 1 for the likeliest) from raw
    logits, on their device (no wait for it)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, ids[:, None])[:, 0]
    top_vals, top_ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
    rank = (logp > chosen[:, None]).sum(dim=-1) + 1
    return chosen, top_vals, top_ids, rank


class Sampler(ThreadOwned):
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self._states: dict[Sequence, SamplingState] = {}  # the requests that may be sampled
        # Per row of the last `sample`, the tokens its grammar forced after
        # the sampled one (jump-forward); None when nothing was forced.
        self._forced: list[list[int]] | None = None

    def admit(self, state: SamplingState) -> None:
        """Take a request's state; the calling thread owns both from now on."""
        self.claim()
        state.claim()
        self._states[state.seq] = state

    def release(self, seq: Sequence) -> None:
        """Forget a request that ended (its grammar matcher goes with it)."""
        self._states.pop(seq, None)

    def states_of(self, seqs: list[Sequence]) -> list[SamplingState]:
        return [self._states[s] for s in seqs]

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """logits: float32 [B, vocab] on any device; returns one int64 id per
        row, on the logits' device. The caller's logits are left as they are
        (log-probabilities are reported from them)."""
        grammars = [s.grammar for s in states]
        constrained = any(g is not None for g in grammars)
        mask = token_bitmask(grammars, logits.shape[-1]) if constrained else None
        ids = self._sample(logits, states, mask)
        forced = note_sampled(grammars, ids, [jumps_forward(s.params) for s in states]) if constrained else None
        self._forced = forced if forced is not None and any(forced) else None
        for i, state in enumerate(states):
            state.sampled += 1 + (len(self._forced[i]) if self._forced else 0)
        return ids

    def take_forced(self) -> list[list[int]] | None:
        """The forced tokens of the last `sample` call's rows (each after
        its row's id), once; None when none were forced."""
        forced, self._forced = self._forced, None
        return forced

    def _sample(self, logits: torch.Tensor, states: list[SamplingState],
                mask: tuple[torch.Tensor, list[int]] | None) -> torch.Tensor:
        params = [s.params for s in states]
        adjusted = any(adjusts_logits(s) for s in states)
        if mask is None and not adjusted and all(p.temperature == 0 for p in params):
            return logits.argmax(dim=-1)
        logits = logits.to(torch.float32, copy=True)
        if mask is not None:
            apply_bitmask(logits, *mask)
        if adjusted:
            adjust_logits(logits, states)
        drawn = [i for i, p in enumerate(params) if p.temperature != 0]
        if not drawn:
            return logits.argmax(dim=-1)
        if len(drawn) == len(states):
            return self._draw(probabilities(logits, params), states)
        ids = logits.argmax(dim=-1)
        ids[torch.tensor(drawn, device=ids.device)] = self._draw(
            probabilities(logits[drawn], [params[i] for i in drawn]), [states[i] for i in drawn])
        return ids

    def _draw(self, probs: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Inverse-CDF sampling: one uniform number per row, found in the
        row's cumulative sum (torch.multinomial is ~40x slower on CPU at
        vocabulary sizes). Rows need not be normalised. The numbers come
        from CPU generators, one per seeded request."""
        u = torch.empty(len(states))
        shared = [i for i, s in enumerate(states) if s.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self.generator)
        for i, state in enumerate(states):
            if state.generator is not None:
                u[i] = torch.rand(1, generator=state.generator)
        u = u.to(probs.device)
        cdf = probs.cumsum(dim=-1)
        # right=True: the first token whose cdf exceeds the draw, which is
        # never a token of probability 0.
        ids = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True)[:, 0]
        ids.clamp_(max=probs.shape[-1] - 1)
        # u * total can round up to total: then take the likeliest token.
        missed = probs.gather(1, ids[:, None])[:, 0] == 0
        return torch.where(missed, probs.argmax(dim=-1), ids)


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[n, vocab] logits -> the distributions to draw from: temperature,
    then top-k, top-p and min-p cuts (every row keeps its best token)."""
    vocab, device = logits.shape[-1], logits.device
    logits = logits / _column([p.temperature for p in params], device)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    cut = [k for k in top_k if k < vocab]
    if cut:
        # One topk as deep as the deepest cut; uncut rows keep everything.
        k = torch.tensor(top_k, device=device)[:, None]
        kth = logits.topk(max(cut), dim=-1).values.gather(1, k.clamp(max=max(cut)) - 1)
        kth = kth.masked_fill(k >= vocab, float("-inf"))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if any(p.top_p < 1.0 for p in params):
        probs = _top_p(probs, _column([p.top_p for p in params], device))
    if any(p.min_p > 0.0 for p in params):
        min_p = _column([p.min_p for p in params], device)
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


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """One value per row, as a [n, 1] float32 column on `device`."""
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]
