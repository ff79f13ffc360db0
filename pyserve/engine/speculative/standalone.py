"""STANDALONE drafting: a smaller model with the target's tokenizer
proposes each drafted request's next tokens, one decode step at a time.

The draft model is loaded by the same loader as the target and runs on the
forward thread, right before the target's verify pass. Its KV lives in a
buffer of its own (the draft's layers and heads) with as many pages as the
target's, addressed by the same slots: each step's batch, whose page
tables and new slots the KV manager gave for the target, is run through
the draft model too (`follow`), so every token the target computes (prompt
chunks, decode and verify rows) has the draft's KV at the same slot. What
the KV manager does to slots (prefix sharing in the radix cache, freeing,
drop_tail of rejected drafts, retraction) then holds for both models, and
no second allocator is needed. The rows of sequences that stopped
drafting are left out (Scheduler._draft_rows), and the tokens they
compute from then on stay out of the prefix cache.

On the event loop, the PlaceholderDrafter only reserves room: k
placeholder tokens per drafted row, which `DraftModel.propose` replaces
in the step's input with the draft model's tokens before the target runs.

With --speculative-eagle-topk above 1 the draft model grows a tree per
row instead (speculative/tree.py): its step at the row's newest token
gives the root's children, and each level's best candidates run as rows
of one token over the sequence's slots, their ancestors' and their own,
scratch slots past the target's pages. Once the target verified the
tree, `follow` computes the draft's KV of the row in chain order, the
accepted nodes first, as a chain's.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import replace
from itertools import accumulate
from pathlib import Path

import torch

from pyserve.engine.runner.rank_model import RankModel
from pyserve.engine.sampler import Sampler, probabilities
from pyserve.engine.sampling_state import SamplingState
from pyserve.engine.sequence import Sequence
from pyserve.engine.speculative.rejection import draw, first_rows
from pyserve.engine.speculative.tree import DraftTree, TreeShape, best_tree, grow_trees
from pyserve.engine.step import ScheduledStep
from pyserve.model.forward_batch import ForwardBatch
from pyserve.options import ModelOptions


def tokenizer_mismatch(target_dir: Path, draft_dir: Path) -> str | None:
    """Why the draft cannot draft for the target (their tokenizers differ), or None."""
    paths = [target_dir / "tokenizer.json", draft_dir / "tokenizer.json"]
    if not paths[0].is_file():
        return f"{target_dir} has no tokenizer.json to check a STANDALONE draft model's against"
    if not paths[1].is_file():
        return f"the draft model directory {draft_dir} has no tokenizer.json to compare with the target's"
    target, draft = (json.loads(p.read_text()) for p in paths)
    for key, what in (("model", "vocabulary"), ("added_tokens", "added tokens")):
        if target.get(key) != draft.get(key):
            return (f"the draft model's {what} differ from the target's: a STANDALONE draft model "
                    "must use the target's tokenizer")
    return None


class DraftModel:
    """The draft model and its KV buffer, owned by the forward thread."""

    def __init__(self, options: ModelOptions, draft_dir: Path, target: RankModel, verify_tokens: int,
                 tree: TreeShape | None = None):
        """`verify_tokens`: the longest verify row, which `follow` runs
        through the draft model too (its CUDA graphs, on a GPU, cover it).
        `tree`: draft trees of that shape; None: chains."""
        # No adapters and one rank: the draft runs whole on rank 0's device
        # (beside a target over several ranks too), over positions as long
        # as the target's context, in the CPU weight mode the target runs in
        # (auto picks per checkpoint).
        mode = options.torchao_config
        if mode == "auto" and target.device.type == "cpu":
            mode = target.quant.name if target.quant is not None else "none"
        options = replace(options, model_path=str(draft_dir), enable_lora=False, lora_paths=None,
                          context_length=target.context_len, is_embedding=False, torchao_config=mode,
                          tp_size=1, nnodes=1, node_rank=0)
        self.model = RankModel(options, draft_dir, target.device)
        page_size = target.kv_buffer.page_size
        # Slots past the target's: the draft's KV of the tree nodes it expands while drafting.
        self.scratch_start = target.kv_buffer.num_pages * page_size
        scratch_pages = -(-tree.scratch_slots // page_size) if tree is not None else 0
        self.model.allocate(target.kv_buffer.num_pages + scratch_pages, verify_tokens=verify_tokens)
        self.tree = tree
        self.vocab_size = target.config.vocab_size

    def propose(self, step: ScheduledStep, batch: ForwardBatch, states: list[SamplingState], sampler: Sampler
                ) -> tuple[list[list[int]], list[torch.Tensor | None], list[DraftTree | None] | None]:
        """Draft each drafted sequence's tokens (as many as its placeholders
        in `step.drafts`), batched one position at a time, and write them into
        `batch.input_ids` (the device copy of the step's batch).
        Returns the drafts, per sequence the [k, vocab] distributions
        sampled ones were drawn from (None for greedy or undrafted ones),
        and with trees, per sequence its tree (None for undrafted ones),
        else None."""
        host, drafts = step.batch, step.drafts
        drafted = [i for i, d in enumerate(drafts) if d]
        token_at, slots, row_starts = _drafted_rows(host, drafts, drafted)
        self._compute_known(host, batch, token_at, slots, row_starts)
        # The device batch's: a row scheduled under overlap has a placeholder
        # for its first token in the host batch, resolved on the device.
        inputs = batch.input_ids[torch.tensor(token_at, device=batch.input_ids.device)].tolist()
        out: list[list[int]] = [[] for _ in drafts]
        if self.tree is not None:
            trees = self._trees(host, drafts, drafted, token_at, slots, inputs, out)
            self._write(batch, drafted, token_at, out)
            return out, [None] * len(drafts), trees
        dists: list[list[torch.Tensor]] = [[] for _ in drafts]
        for j in range(max(len(drafts[i]) for i in drafted)):
            live = [n for n, i in enumerate(drafted) if len(drafts[i]) > j]
            positions = [int(host.positions[token_at[n]]) + j for n in live]
            step = ForwardBatch.build(
                [inputs[n] for n in live], positions, torch.stack([slots[n][p] for n, p in zip(live, positions)]),
                [1] * len(live), [slots[n][: p + 1] for n, p in zip(live, positions)], list(range(len(live))),
                True, self.model.device)
            logits = self._vocab(self.model.forward(step))
            tokens = logits.argmax(dim=-1)
            sampled = [r for r, n in enumerate(live) if states[drafted[n]].params.temperature != 0]
            if sampled:
                seqs = [drafted[live[r]] for r in sampled]
                q = probabilities(logits[sampled], [states[i].params for i in seqs])
                tokens[torch.tensor(sampled, device=tokens.device)] = draw(
                    q, [states[i].generator or sampler.generator for i in seqs])
                for r, i in enumerate(seqs):
                    dists[i].append(q[r])
            for n, token in zip(live, tokens.tolist()):
                out[drafted[n]].append(token)
                inputs[n] = token
        self._write(batch, drafted, token_at, out)
        return out, [torch.stack(d) if d else None for d in dists], None

    @staticmethod
    def _write(batch: ForwardBatch, drafted: list[int], token_at: list[int], out: list[list[int]]) -> None:
        """The drafts in place of their placeholders in `batch.input_ids`."""
        where = [t + 1 + j for n, t in enumerate(token_at) for j in range(len(out[drafted[n]]))]
        batch.input_ids[torch.tensor(where, device=batch.input_ids.device)] = torch.tensor(
            [token for i in drafted for token in out[i]], device=batch.input_ids.device)

    def _trees(self, host: ForwardBatch, drafts: list[list[int]], drafted: list[int], token_at: list[int],
               slots: list[torch.Tensor], inputs: list[int], out: list[list[int]]) -> list[DraftTree | None]:
        """Each drafted sequence's tree, its node tokens written into `out`:
        the draft's step at the newest token (its own slot) gives the root's
        children; a depth-d node is expanded at the newest token's position + d."""
        positions = [int(host.positions[t]) for t in token_at]
        contexts = [s[: p + 1] for s, p in zip(slots, positions)]

        def draft_step(tokens, at, own, tables, parents):
            batch = ForwardBatch.build(tokens, at, own, [1] * len(tokens), tables, list(range(len(tokens))), True,
                                       self.model.device)
            return self._vocab(self.model.forward(batch))

        first = draft_step(inputs, positions, torch.stack([s[p] for s, p in zip(slots, positions)]), contexts,
                           list(range(len(inputs))))
        to_target = torch.arange(self.vocab_size, device=first.device)
        candidates = grow_trees(first, [p + 1 for p in positions], contexts, self.tree, self.scratch_start,
                                to_target, draft_step)
        trees: list[DraftTree | None] = [None] * len(drafts)
        for c, i in zip(candidates, drafted):
            out[i], trees[i] = best_tree(c, len(drafts[i]))
        return trees

    def _compute_known(self, host: ForwardBatch, batch: ForwardBatch, token_at: list[int],
                       slots: list[torch.Tensor], row_starts: list[int]) -> None:
        """The draft's KV of a drafted row's known tokens before its last one
        (the text a jump-forward appended), which drafting attends; an
        extend row each. `follow` writes them again with the whole row."""
        rows = [(n, start) for n, start in enumerate(row_starts) if start < token_at[n]]
        if not rows:
            return
        index = [t for n, start in rows for t in range(start, token_at[n])]
        positions = [int(host.positions[t]) for t in index]
        tables = [slots[n][: int(host.positions[token_at[n] - 1]) + 1] for n, _ in rows]
        known = ForwardBatch.build(
            batch.input_ids[torch.tensor(index, device=batch.input_ids.device)].tolist(), positions,
            torch.cat([slots[n][int(host.positions[start]) : int(host.positions[token_at[n]])] for n, start in rows]),
            [token_at[n] - start for n, start in rows], tables, [], False, self.model.device)
        self.model.forward(known)

    @staticmethod
    def capture() -> None:
        """The draft model reads nothing of the target's forward pass."""
        return None

    def follow(self, step: ScheduledStep, batch: ForwardBatch, capture: None, next_ids: torch.Tensor,
               counts: list[int] | None) -> None:
        """Run the step's batch (drafts filled in), or its rows of drafting
        sequences (`step.draft_rows`), through the draft model: its KV at
        every slot the target just wrote there. No logits are computed; the
        step's output is not needed."""
        if step.draft_rows is not None:
            batch = self._rows(step.batch, batch, step.draft_rows)
        self.model.forward(replace(batch, logits_indices=batch.logits_indices[:0]))

    def _rows(self, host: ForwardBatch, batch: ForwardBatch, rows: list[int]) -> ForwardBatch:
        """The batch of `rows` of the step's batch (`host`; `batch`, its
        device copy, holds the drafts)."""
        starts = _row_starts(host)
        index = [t for r in rows for t in range(starts[r], starts[r + 1])]
        return ForwardBatch.build(
            batch.input_ids[torch.tensor(index, device=batch.input_ids.device)].tolist(),
            host.positions[index].tolist(), host.out_cache_loc[index], [host.extend_lens[r] for r in rows],
            [_row_slots(host, r) for r in rows], [],
            host.is_decode, self.model.device)

    def release(self, seq: Sequence) -> None:
        """Nothing is kept per request."""

    def _vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits over the target's vocabulary (the same
        tokenizer; the embedding rows past it may be padded differently)."""
        n = logits.shape[-1]
        if n >= self.vocab_size:
            return logits[:, : self.vocab_size]
        pad = logits.new_full((logits.shape[0], self.vocab_size - n), float("-inf"))
        return torch.cat([logits, pad], dim=-1)


def _drafted_rows(host: ForwardBatch, drafts: list[list[int]], drafted: list[int]
                  ) -> tuple[list[int], list[torch.Tensor], list[int]]:
    """Per drafted sequence: the index of its last known token among the
    step's tokens, its batch row's KV slots (known tokens, then the
    drafts'), and the index of its row's first token."""
    firsts = first_rows(drafts)
    starts = _row_starts(host)
    token_at = [int(host.logits_indices[firsts[i]]) for i in drafted]
    slots, row_starts = [], []
    for t in token_at:
        row = bisect.bisect_right(starts, t) - 1
        slots.append(_row_slots(host, row))
        row_starts.append(starts[row])
    return token_at, slots, row_starts


def _row_starts(host: ForwardBatch) -> list[int]:
    """Each batch row's first index among the step's tokens, then their count."""
    return list(accumulate(host.extend_lens, initial=0))


def _row_slots(host: ForwardBatch, row: int) -> torch.Tensor:
    """The KV slots of a batch row's sequence: its earlier tokens', then the new ones'."""
    return host.kv_indices[int(host.kv_indptr[row]) : int(host.kv_indptr[row + 1])]
