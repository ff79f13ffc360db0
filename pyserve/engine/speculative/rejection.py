"""Verifying a speculative step's drafts, on the forward thread.

A sequence with k drafts has k + 1 logits rows: row j is the target's
prediction after the j-th input (its last known token, then the drafts).

Greedy (temperature 0): the target's argmax at row 0 is what decoding one
token a step gives; if that equals draft 0, the argmax at row 1 next, and
so on. The run is the longest matching prefix of the drafts plus the
target's own token after it, token for token what plain decoding gives.

Sampled: speculative rejection sampling (Leviathan et al., 2023). With p_j
the target's distribution at row j after the request's own temperature,
top-k, top-p and min-p (sampler.probabilities, exactly what plain
sampling draws from) and q_j the distribution draft j was drawn from, draft
j is kept with probability min(1, p_j(d) / q_j(d)); the first one rejected
is replaced by a draw from max(0, p_j - q_j) renormalised, and the run ends
there; if all are kept, the last row's p_k gives one more token. Every
emitted token is then distributed as the target's sampling distribution.
The NGRAM drafter's drafts are a point mass (q_j(d) = 1), so the rule is
keep d with probability p_j(d), else draw from p_j without d. Each step
takes k + 1 uniform numbers from the request's own generator (the seeded
ones) whatever is accepted, so a seed gives the same text again.

Draft trees (tree.py) are verified by `walk`: at each node its children
in turn are kept with probability p(child) each, summed (one uniform u
a level: the first child whose running sum passes u), else a token is
drawn from p without the children; the walk moves to the kept child.

SGLang's relaxed acceptance (`Acceptance`, --speculative-accept-threshold-*)
keeps sampled drafts more often than the target's distribution allows:
a draft whose target probability reaches `single` is kept, and the others'
probabilities are divided by `acc` (min(1, p / (q * acc)) for a chain; a
tree's running sum over acc). At 1.0 and 1.0, the defaults, sampling is
exact; greedy requests verify exactly whatever the thresholds.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from pyserve.engine.grammar import apply_bitmask, new_bitmask
from pyserve.engine.penalties import adjust_logits, adjusts_logits
from pyserve.engine.sampler import Sampler, jumps_forward, probabilities
from pyserve.engine.sampling_state import SamplingState
from pyserve.engine.speculative.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    """How sampled requests keep drafts: SGLang's
    --speculative-accept-threshold-single and -acc, both in (0, 1]."""

    single: float = 1.0  # a draft the target gives at least this probability is kept
    acc: float = 1.0  # the others' probabilities of being kept are divided by this

    @property
    def exact(self) -> bool:
        return self.single == 1.0 and self.acc == 1.0


EXACT = Acceptance()


def verify_drafts(logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]],
                  draft_probs: list[torch.Tensor | None] | None, sampler: Sampler,
                  trees: list[DraftTree | None] | None = None, acceptance: Acceptance = EXACT
                  ) -> tuple[torch.Tensor, list[int], list[list[int]] | None, list[list[int] | None]]:
    """The token each logits row emits (rows past a sequence's run hold
    the argmax), how many tokens each sequence emits, per sequence the
    tokens its grammar forced after them (jump-forward; None when none),
    and per sequence drafted as a tree (`trees[i]`, speculative/tree.py)
    its accepted nodes (None for the others; its emitted tokens are in
    chain order, see tree.to_chain).
    `draft_probs[i]`: the [k, vocab] distributions sequence i's drafts were
    drawn from (None: a point mass). Undrafted sequences sample their one
    row as in any step."""
    firsts = first_rows(drafts)
    ids = logits.argmax(dim=-1)
    for state, draft in zip(states, drafts):
        if draft and state.grammar is not None:
            state.grammar.accept_unaccepted()
    drafts, ends_block = _until_constraints(states, drafts, trees)
    plain = [i for i, d in enumerate(drafts) if not d]
    forced: list[list[int]] = [[] for _ in drafts]
    if plain:
        rows = torch.tensor([firsts[i] for i in plain], device=ids.device)
        ids[rows] = sampler.sample(logits[rows], [states[i] for i in plain]).to(ids.device)
        for i, tokens in zip(plain, sampler.take_forced() or [[] for _ in plain]):
            forced[i] = tokens
    plain = set(plain)
    adjusted = _adjusted_rows(logits, states, drafts, trees, firsts, plain)
    host = ids.tolist()
    counts = []
    paths: list[list[int] | None] = [None] * len(drafts)
    for i, (state, draft) in enumerate(zip(states, drafts)):
        if i in plain:
            counts.append(1)
            continue
        first, k = firsts[i], len(draft)
        rows, forces = adjusted.get(i, (logits[first : first + k + 1], None))
        if trees is not None and trees[i] is not None:
            run, paths[i] = walk(rows, trees[i], draft, state, state.generator or sampler.generator, acceptance)
        elif state.params.temperature == 0:
            run = greedy_run(rows.argmax(dim=-1).tolist() if i in adjusted else host[first : first + k + 1], draft)
        else:
            q = draft_probs[i][:k] if draft_probs is not None and draft_probs[i] is not None else None
            run = rejection_run(probabilities(rows, [state.params] * (k + 1)), draft, q,
                                state.generator or sampler.generator, acceptance)
        if i in ends_block:
            run = run[:k]  # the row after the block's end needs the grammar's mask
        if forces is not None:
            run, paths[i] = _until_forced(run, paths[i], forces)
        if state.grammar is not None:
            run, forced[i] = _commit_to_grammar(state, run)
        if run != host[first : first + len(run)]:
            ids[first : first + len(run)] = torch.tensor(run, device=ids.device)
        counts.append(len(run))
        state.sampled += len(run) + len(forced[i])
    return ids, counts, (forced if any(forced) else None), paths


def _until_constraints(states: list[SamplingState], drafts: list[list[int]],
                       trees: list[DraftTree | None] | None) -> tuple[list[list[int]], set[int]]:
    """The drafts each row verifies, and the rows whose last draft would
    end a reasoning block. A constraint that starts after the block may
    start inside the drafts, where its masks are not known: a chain is
    verified up to the draft that would end the block, and if that one is
    kept the run ends with it (the next row would need the mask). Ending
    the run at a kept token leaves every emitted token distributed as
    plain decoding's, whatever the drafts were drawn from. A tree row keeps
    its first token alone until the block ends."""
    cut, ends_block = list(drafts), set()
    for i, (state, draft) in enumerate(zip(states, drafts)):
        grammar = state.grammar
        if not draft or grammar is None or not grammar.watching:
            continue
        if trees is not None and trees[i] is not None:
            cut[i] = []
            continue
        free = grammar.drafts_before_start(draft)
        if free < len(draft):
            cut[i] = draft[: free + 1]
            ends_block.add(i)
    return cut, ends_block


def _adjusted_rows(logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]],
                   trees: list[DraftTree | None] | None, firsts: list[int], plain: set[int]
                   ) -> dict[int, tuple[torch.Tensor, list[bool] | None]]:
    """The logits rows of the drafted sequences whose logits the sampler
    adjusts (a grammar's mask, penalties, logit bias, min_tokens) as plain
    decoding would sample from them, each row as if the drafts before it
    were output already; with, for a request that jumps forward, whether
    its grammar forces text after each row's drafts (else None). By
    sequence index."""
    constrained = {i for i, d in enumerate(drafts)
                   if d and i not in plain and states[i].grammar is not None and states[i].grammar.active}
    which = [i for i, d in enumerate(drafts)
             if i in constrained or (d and i not in plain and adjusts_logits(states[i]))]
    if not which:
        return {}
    prefixes, row_states, index = {}, [], []
    for i in which:
        if trees is not None and trees[i] is not None:
            prefixes[i] = trees[i].prefixes(drafts[i])
        else:
            prefixes[i] = [drafts[i][:j] for j in range(len(drafts[i]) + 1)]
        row_states += [states[i]] * len(prefixes[i])
        index += range(firsts[i], firsts[i] + len(prefixes[i]))
    rows = logits[torch.tensor(index, device=logits.device)].float()  # a copy: logprobs read the raw logits
    starts = dict(zip(which, accumulate([0] + [len(prefixes[i]) for i in which])))  # each sequence's first in `rows`
    forces: dict[int, list[bool] | None] = dict.fromkeys(which)
    if constrained:
        bitmask, masked = new_bitmask(len(index), rows.shape[-1]), []
        for i in sorted(constrained):
            jumping = _jumps(states[i])
            rows_masked, forcing = states[i].grammar.along(prefixes[i], bitmask, starts[i], jumping)
            masked += rows_masked
            forces[i] = forcing if jumping else None
        if masked:
            apply_bitmask(rows, bitmask, masked)
    if any(adjusts_logits(states[i]) for i in which):
        adjust_logits(rows, row_states, [p for i in which for p in prefixes[i]])
    return {i: (rows[starts[i] : starts[i] + len(prefixes[i])], forces[i]) for i in which}


def _jumps(state: SamplingState) -> bool:
    """Whether the request's grammar appends the text it forces (jump-forward)."""
    return jumps_forward(state.params) and state.grammar.jump_tokenizer is not None


def _until_forced(run: list[int], path: list[int] | None, forces: list[bool]) -> tuple[list[int], list[int] | None]:
    """A jump-forward request's run, cut after its first token that its
    grammar forces text after, where decoding one token a step jumps; for
    a tree, its accepted nodes cut with it. `forces`: per logits row."""
    for j in range(len(run) - 1):
        if forces[j + 1 if path is None else path[j] + 1]:
            return run[: j + 1], (path[:j] if path is not None else None)
    return run, path


def _commit_to_grammar(state: SamplingState, run: list[int]) -> tuple[list[int], list[int]]:
    """Accept a verified run into the request's grammar; a jump-forward
    request's last token may be replaced and followed by the text the
    grammar forces (GrammarState.jump_forward). Returns (the run, the
    forced tokens)."""
    grammar = state.grammar
    for token in run[:-1]:
        grammar.accept(token)
    if _jumps(state):
        tokens = grammar.jump_forward(run[-1])
        return run[:-1] + tokens[:1], tokens[1:]
    grammar.accept(run[-1])
    return run, []


def first_rows(drafts: list[list[int]]) -> list[int]:
    """Index of each sequence's first logits row."""
    rows, row = [], 0
    for draft in drafts:
        rows.append(row)
        row += len(draft) + 1
    return rows


def greedy_run(targets: list[int], draft: list[int]) -> list[int]:
    """The drafts the target's argmax agrees with, then the target's own token."""
    n = 0
    while n < len(draft) and targets[n] == draft[n]:
        n += 1
    return targets[: n + 1]


def rejection_run(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                  generator: torch.Generator, acceptance: Acceptance = EXACT) -> list[int]:
    """The tokens one verify step emits for a sampled sequence: `p` the
    target's [k + 1, vocab] distributions (unnormalised is fine), `q` the
    drafts' [k, vocab] ones or None for point masses. Only the drafts'
    probabilities and the one row drawn from are read in float64, each
    over its row's total: a float64 copy of every row cost a verify step
    of 7 rows as much as 2 ms on a CPU."""
    k = len(draft)
    u = torch.rand(k + 1, generator=generator, dtype=torch.float64)
    d = torch.tensor(draft, device=p.device)
    rows = torch.arange(k, device=p.device)
    p_total = p.sum(dim=-1, dtype=torch.float64)
    p_d = p[rows, d].double() / p_total[:k]
    if q is None:
        q_d = torch.ones(k, dtype=torch.float64, device=p.device)
    else:
        q_total = q.sum(dim=-1, dtype=torch.float64)
        q_d = q[rows, d].double() / q_total
    # u < p(d) / q(d), without dividing by a q(d) that may be tiny.
    kept = u[:k].to(p.device) * q_d * acceptance.acc < p_d
    if acceptance.single < 1.0:
        kept |= p_d >= acceptance.single
    kept = kept.tolist()
    n = kept.index(False) if False in kept else k
    p_n = p[n].double() / p_total[n]
    if n == k:
        last = p_n
    else:
        if q is None:
            last = p_n.clone()
            last[draft[n]] = 0.0
        else:
            last = (p_n - q[n].double() / q_total[n]).clamp(min=0.0)
        if float(last.sum()) <= 0.0:  # p_n == q_n: rejection had probability 0, rounding did it
            last = p_n
    return draft[:n] + [int(inverse_cdf(last[None], u[k:].to(p.device))[0])]


def walk(logits: torch.Tensor, tree: DraftTree, tokens: list[int], state: SamplingState,
         generator: torch.Generator, acceptance: Acceptance = EXACT) -> tuple[list[int], list[int]]:
    """(the tokens a tree row emits, the accepted nodes): `logits` its
    [nodes + 1, vocab] rows, the root's first; `tokens` the nodes' tokens."""
    greedy = state.params.temperature == 0
    if greedy:
        targets = logits.argmax(dim=-1).tolist()
    else:
        p = probabilities(logits, [state.params] * logits.shape[0])
        u = torch.rand(max(map(tree.depth, range(len(tokens))), default=0) + 1, generator=generator,
                       dtype=torch.float64).tolist()
    emitted, path, node = [], [], -1
    while True:
        row, children = node + 1, tree.children(node)
        if greedy:
            token = targets[row]
            child = next((c for c in children if tokens[c] == token), None)
        else:
            child, token = _sampled_child(p[row], children, [tokens[c] for c in children], u[len(path)], acceptance)
        emitted.append(token)
        if child is None:
            return emitted, path
        path.append(child)
        node = child


def _sampled_child(p: torch.Tensor, children: list[int], child_tokens: list[int], u: float,
                   acceptance: Acceptance) -> tuple[int | None, int]:
    """(the child kept, None for none; the token emitted) at a node whose
    target distribution is `p` (unnormalised), with the level's uniform `u`:
    the first child whose running sum of probabilities (over acc) passes
    u, or whose own reaches `single`; else a draw from p without the
    children, with u rescaled past the children's share."""
    total = float(p.sum(dtype=torch.float64))
    index = torch.tensor(child_tokens, dtype=torch.long, device=p.device)
    share = 0.0
    for child, token, prob in zip(children, child_tokens, (p[index].double() / total).tolist()):
        share += prob
        if u < share / acceptance.acc or prob >= acceptance.single:
            return child, token
    rest = p.clone()
    rest[index] = 0
    bound = min(share / acceptance.acc, 1.0)
    if float(rest.sum()) <= 0.0 or bound >= 1.0:  # the children hold all the mass: rounding rejected them
        rest, bound = p, 0.0
    rescaled = torch.tensor([(u - bound) / (1.0 - bound)], dtype=torch.float64, device=p.device)
    return None, int(inverse_cdf(rest[None], rescaled)[0])


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [n, vocab] (unnormalised is fine), row
    i's uniform number from generators[i]."""
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]).to(probs.device)
    return inverse_cdf(probs, u)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token whose cumulative mass first exceeds u * total, per row;
    never a token of probability 0."""
    cdf = probs.double().cumsum(dim=-1)
    ids = torch.searchsorted(cdf, (u.double() * cdf[:, -1]).unsqueeze(1), right=True)[:, 0]
    ids.clamp_(max=probs.shape[-1] - 1)
    missed = probs.gather(1, ids[:, None])[:, 0] == 0  # u * total rounded up to the total
    return torch.where(missed, probs.argmax(dim=-1), ids)
