"""Tree drafting (--speculative-eagle-topk above 1: EAGLE3, EAGLE, NEXTN,
STANDALONE), on the forward thread: a drafted row verifies a tree of
draft tokens instead of a chain.

The drafter grows each row's tree best first (`grow_trees`): level by
level, the `topk` best candidates so far (by the drafter's log-probability
of their path) are expanded, each by its `topk` likeliest next tokens,
their KV written to scratch slots past the target's; the tree is the best
of all candidates, as many as the row has placeholders (`best_tree`).

The row's tokens are its newest known token (the root) and the tree's
nodes, in an order where every node comes after its parent (the root or an
earlier node). The scheduler gave the row one KV slot per token, in that
order. For the target's pass each token becomes a row of its own of one
token (`expand`): its position is the root's plus its depth, and its kv
table is the sequence's slots up to the root, then its ancestors', then
its own, so plain attention sees exactly its path (no tree mask).

Verification (rejection.walk) starts at the root: the target's token at a node
(its argmax, or for a sampled request a draw from its distribution after
the request's temperature, top-k, top-p and min-p) is emitted, and if a
child of the node carries that token the walk moves there and goes on;
else it ends. Every emitted token is the target's own choice given the
tokens before it, so greedy output is what plain decoding gives and
sampled output keeps the target's distribution, whatever the drafts were.
A sampled walk takes depth + 1 uniform numbers from the request's
generator whatever it accepts.

After the walk the accepted nodes' K/V are copied to the row's first
slots after the root's (`accepted_kv_copies`, in every tensor-parallel
rank's cache), where a chain's accepted run would have left them: the
sequence's slots stay in position order, and the KV manager keeps the
run and frees the rest as for a chain. The logits rows and captured
hidden states are reordered the same way (`chain_order`),
so that what follows (log-probabilities, the head's follow-up) reads a
chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pyserve.engine.step import ScheduledStep
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import SlotCopies


@dataclass(frozen=True)
class TreeShape:
    """--speculative-eagle-topk, --speculative-num-steps (the deepest
    node), and the head slots drafting needs at most (every expanded
    candidate of every running request)."""

    topk: int
    depth: int
    scratch_slots: int


@dataclass
class DraftTree:
    parents: list[int]  # per node, its parent's node index; -1: the root

    def depth(self, node: int) -> int:
        """1 for the root's children."""
        d = 1
        while self.parents[node] >= 0:
            node = self.parents[node]
            d += 1
        return d

    def ancestors(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`'s parent."""
        path = []
        while self.parents[node] >= 0:
            node = self.parents[node]
            path.append(node)
        return path[::-1]

    def prefixes(self, tokens: list[int]) -> list[list[int]]:
        """Per logits row (the root's, then each node's), the draft tokens on
        the way to it: `tokens` the nodes' tokens."""
        return [[]] + [[tokens[a] for a in self.ancestors(n)] + [tokens[n]] for n in range(len(self.parents))]

    def children(self, node: int) -> list[int]:
        """Node `node`'s children (-1: the root's)."""
        return [c for c, p in enumerate(self.parents) if p == node]


@dataclass
class Candidates:
    """One row's candidate nodes, parents first: per candidate its token
    (a target id), its parent candidate (-1: the root) and its path's score."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]


# One step of the drafter over a level's frontier: (tokens, positions, the
# slots they write, their kv tables, per row the row of the previous step
# (of `first_logits` for the first) it descends from) -> logits [rows, draft vocab].
LevelStep = Callable[[list[int], list[int], torch.Tensor, list[torch.Tensor], list[int]], torch.Tensor]


def grow_trees(first_logits: torch.Tensor, positions: list[int], contexts: list[torch.Tensor], shape: TreeShape,
               scratch_start: int, to_target: torch.Tensor, step: LevelStep) -> list[Candidates]:
    """Each row's candidates. `first_logits` [rows, draft vocab] give the
    root's children; a depth-d candidate is expanded by `step` at
    positions[row] + d - 1, attending the row's `contexts` slots, then its
    ancestors' scratch slots, then its own; `to_target` maps draft ids to
    target ids. Cumulative scores never grow down a path, so `best_tree`
    keeps a chosen node's parent too."""
    k, n = shape.topk, first_logits.shape[0]
    scores, ids = torch.log_softmax(first_logits.float(), dim=-1).topk(k, dim=-1)  # [n, k]: the root's children
    tokens = to_target[ids].tolist()
    parents = [[-1] * k for _ in range(n)]
    level_scores = [scores]
    frontier = [list(range(k)) for _ in range(n)]  # the candidates expanded next
    paths = [[[] for _ in range(k)] for _ in range(n)]  # the scratch slots of each one's expanded ancestors
    rows = [r for r in range(n) for _ in range(k)]  # the frontier's rows of the previous step
    for level in range(1, shape.depth):
        own = [scratch_start + (r * (shape.depth - 1) + level - 1) * k + f for r in range(n) for f in range(k)]
        tables = [torch.cat([contexts[r], torch.tensor(paths[r][f] + [own[r * k + f]])])
                  for r in range(n) for f in range(k)]
        logits = step([tokens[r][c] for r in range(n) for c in frontier[r]],
                      [positions[r] + level - 1 for r in range(n) for _ in range(k)], torch.tensor(own), tables, rows)
        child_scores, child_ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        total = (scores.reshape(-1, 1) + child_scores).reshape(n, k * k)
        children = to_target[child_ids].reshape(n, k * k).tolist()
        first = len(tokens[0])
        for r in range(n):
            tokens[r] += children[r]
            parents[r] += [frontier[r][j // k] for j in range(k * k)]
        level_scores.append(total)
        scores, best = total.topk(k, dim=-1)
        best = best.tolist()
        rows = [r * k + j // k for r in range(n) for j in best[r]]
        paths = [[paths[r][j // k] + [own[r * k + j // k]] for j in best[r]] for r in range(n)]
        frontier = [[first + j for j in best[r]] for r in range(n)]
    all_scores = torch.cat(level_scores, dim=-1).tolist()
    return [Candidates(tokens[r], parents[r], all_scores[r]) for r in range(n)]


def best_tree(candidates: Candidates, size: int) -> tuple[list[int], DraftTree]:
    """The `size` best candidates as a tree: its nodes' tokens, and the tree."""
    ranked = sorted(range(len(candidates.tokens)), key=lambda c: -candidates.scores[c])  # stable: parents first
    chosen = sorted(ranked[:size])
    index = {c: node for node, c in enumerate(chosen)}
    return ([candidates.tokens[c] for c in chosen],
            DraftTree([index.get(candidates.parents[c], -1) for c in chosen]))


def expand(step: ScheduledStep, device_batch: ForwardBatch, trees: list[DraftTree | None]) -> ForwardBatch:
    """`device_batch` (the step's, drafts in place) with each tree row
    (`trees`: per sampled sequence) split into rows of one token whose kv
    tables follow the tree. Token order, and so the logits rows, stay the step's."""
    host = step.batch
    tree_of = {seq: t for seq, t in zip(step.sampled, trees) if t is not None}
    row_of = {r: tree_of[seq] for r, seq in enumerate(step.seqs) if seq in tree_of}
    positions = host.positions.clone()
    extend_lens, tables, window_tables = [], [], []
    windowed = host.window_kv_indices is not None
    start = 0
    for r, (n, length) in enumerate(zip(host.extend_lens, host.seq_lens)):
        lo, hi = int(host.kv_indptr[r]), int(host.kv_indptr[r + 1])
        own = [host.kv_indices[lo:hi]] + ([host.window_kv_indices[lo:hi]] if windowed else [])
        tree = row_of.get(r)
        if tree is None:
            extend_lens.append(n)
            tables.append(own[0])
            if windowed:
                window_tables.append(own[1])
        else:
            root = length - n  # the root's index in its kv table
            extend_lens += [1] * n
            for node in range(-1, n - 1):
                path = [] if node < 0 else [root + 1 + a for a in tree.ancestors(node)] + [root + 1 + node]
                index = torch.tensor(list(range(root + 1)) + path, dtype=torch.long)
                tables.append(own[0][index])
                if windowed:
                    window_tables.append(own[1][index])
                if node >= 0:
                    positions[start + 1 + node] = positions[start] + len(path)  # its depth
        start += n
    seq_lens = [t.numel() for t in tables]
    indptr = torch.tensor([0] + seq_lens).cumsum(0)
    device = device_batch.input_ids.device

    def to_dev(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    return replace(device_batch, positions=to_dev(positions), extend_lens=extend_lens, seq_lens=seq_lens,
                   kv_indptr=to_dev(indptr), kv_indices=to_dev(torch.cat(tables)),
                   window_kv_indices=to_dev(torch.cat(window_tables)) if windowed else None,
                   is_decode=all(n == 1 for n in extend_lens), qo_indptr=None)


def chain_order(first_row: int, path: list[int], nodes: int) -> list[int]:
    """The row's rows (logits rows, or tokens from its first) in the order
    a chain that accepted `path` would have them: the root's, the
    accepted nodes', then the rest."""
    accepted = [first_row] + [first_row + 1 + node for node in path]
    return accepted + [r for r in range(first_row, first_row + nodes + 1) if r not in accepted]


def accepted_kv_copies(batch: ForwardBatch, moves: list[tuple[int, int]]) -> SlotCopies | None:
    """The cache slots of each (from, to) pair of the batch's token rows,
    the sliding layers' by their sliding slots; None for no pair."""
    if not moves:
        return None
    device = batch.out_cache_loc.device
    src = torch.tensor([a for a, _ in moves], device=device)
    dst = torch.tensor([b for _, b in moves], device=device)
    if batch.window_out_cache_loc is None:
        return SlotCopies(batch.out_cache_loc[src], batch.out_cache_loc[dst])
    window = batch.window_out_cache_loc
    return SlotCopies(batch.out_cache_loc[src], batch.out_cache_loc[dst], window[src], window[dst])


def to_chain(host: ForwardBatch, batch: ForwardBatch, logits: torch.Tensor, capture,
             drafts: list[list[int]], paths: list[list[int] | None]
             ) -> tuple[torch.Tensor, SlotCopies | None, ForwardBatch]:
    """After verification: each tree row's logits rows (returned) and
    captured hidden states (in `capture`, when given) in chain order, the
    K/V copies that move its accepted nodes to its first slots (for every
    rank's cache), and `batch` with its tokens in chain order (what a
    draft model then computes its own KV from). `paths[i]`: sequence i's
    accepted nodes, None for a chain or plain row."""
    rows, tokens = list(range(logits.shape[0])), list(range(batch.input_ids.numel()))
    moves = []
    first = 0
    for draft, path in zip(drafts, paths):
        if path is not None:
            start = int(host.logits_indices[first])  # the root's token row
            rows[first : first + len(draft) + 1] = chain_order(first, path, len(draft))
            tokens[start : start + len(draft) + 1] = chain_order(start, path, len(draft))
            moves += [(start + 1 + node, start + 1 + j) for j, node in enumerate(path) if node != j]
        first += len(draft) + 1
    order = torch.tensor(tokens, device=batch.input_ids.device)
    if capture is not None:
        capture.states[:] = [state[order.to(state.device)] for state in capture.states]
    return (logits[torch.tensor(rows, device=logits.device)], accepted_kv_copies(batch, moves),
            replace(batch, input_ids=batch.input_ids[order]))
