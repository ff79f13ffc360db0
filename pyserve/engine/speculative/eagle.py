"""EAGLE3, EAGLE and NEXTN drafting: an EAGLE-3 head (model/eagle3_head.py),
an EAGLE-1/2 head (model/eagle_head.py) or the checkpoint's own
multi-token-prediction layer (model/mtp_head.py) proposes each drafted
request's next tokens from the target's own hidden states. What follows
says EAGLE-3's three hidden states; an EAGLE head and an MTP layer read
one, the target's last, through its final norm.

The head's one decoder layer has a KV buffer of its own, with as many
pages as the target's and addressed by the same slots (as STANDALONE's
draft model, speculative/standalone.py), so what the KV manager does to
slots holds for it too. Its KV at the slot of position i is computed from
the pair (token i + 1, the target's hidden states at i): the head at
position i predicts token i + 2.

Every step, on the forward thread:
1. `propose`, before the target runs: for each drafted row (its newest
   token x at position m, k placeholders), the first draft comes from the
   head's logits kept at position m - 1 by the step before; the next ones
   from chained head steps at positions m, m + 1, ..., each reading the
   previous draft and the head's own output hidden state. They write the
   head's KV into the verify row's slots.
2. The target runs, keeping the hidden states entering the head's three
   layers for every token (layers/causal_lm.AuxCapture).
3. `follow`, once the accepted runs are known: the head runs over every
   pair whose next token is now known (prompt chunks, decode rows, a
   verify row's accepted positions), overwriting the KV the drafting
   wrote; its output at each sampled sequence's last pair gives that
   sequence's first draft of the next step. A prompt chunk's last hidden
   state waits for the next chunk's first token.

Greedy requests draft the head's argmax; sampled ones draw from the head's
distribution after the request's temperature, top-k, top-p and min-p,
placed in the target's vocabulary through d2t, and verification
(rejection.py) keeps the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pyserve.engine.runner.rank_model import RankModel
from pyserve.engine.sampler import Sampler, probabilities
from pyserve.engine.sampling_state import SamplingState
from pyserve.engine.sequence import Sequence
from pyserve.engine.speculative.rejection import draw, first_rows
from pyserve.engine.speculative.tree import DraftTree, TreeShape, best_tree, grow_trees
from pyserve.engine.step import ScheduledStep
from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.model.draft_heads import whole_target_embedding, whole_target_matrix
from pyserve.model.eagle3_head import Eagle3Config, load_eagle3_head
from pyserve.model.eagle_head import EagleConfig, load_eagle_head
from pyserve.model.mtp_head import MtpConfig, load_mtp_head
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.layers.causal_lm import AuxCapture
from pyserve.options import ModelOptions


@dataclass
class _Next:
    """What the head computed at a sequence's last pair: its logits for
    the token after the sequence's newest one, and its hidden state there."""

    position: int
    logits: torch.Tensor  # [draft vocab]
    hidden: torch.Tensor  # [head hidden]


@dataclass
class _Pairs:
    """The head's input for one batch row: pairs at positions first.. (consecutive)."""

    seq: Sequence
    first: int
    tokens: list[int]  # the next token of each position
    hidden_rows: list[int]  # per pair, its row of the step's hidden states
    slots: torch.Tensor  # the sequence's slots up to its last pair
    sampled: bool


class EagleDraft:
    """The head and its KV buffer, owned by the forward thread."""

    def __init__(self, head_dir: Path, config: Eagle3Config | EagleConfig | MtpConfig, target: RankModel,
                 target_dir: Path, options: ModelOptions, tree: TreeShape | None = None,
                 hot_tokens: torch.Tensor | None = None):
        """`options`: the draft's (its attention backend; an MTP layer's quantization).
        `tree`: draft trees of that shape (--speculative-eagle-topk above 1); None: chains.
        `hot_tokens`: an EAGLE head's token map (None: the whole vocabulary).
        `target_dir`: the target's checkpoint, whose whole embedding (and
        vocabulary projection, for an EAGLE head or an MTP layer) the head
        reads where tensor parallelism left rank 0 a share of it."""
        model = target.model
        self.aux_layers = config.aux_layers(model.config.num_hidden_layers)
        embed, lm_head = model.embed_tokens.weight, None
        if model.shard.tp.size == 1:
            lm_head = getattr(model.lm_head if model.lm_head is not None else model.embed_tokens, "weight", None)
        else:
            embed = whole_target_embedding(target_dir).to(target.device, target.dtype)
        if isinstance(config, (EagleConfig, MtpConfig)):  # heads projecting with the target's whole lm_head
            shape = (model.config.vocab_size, model.config.hidden_size)
            if not (isinstance(lm_head, torch.Tensor) and lm_head.is_floating_point() and lm_head.shape == shape):
                # A share of it, or quantized: the checkpoint's, whole.
                lm_head = whole_target_matrix(target_dir, ("lm_head.weight", "model.embed_tokens.weight")
                                              ).to(target.device, target.dtype)
        if isinstance(config, MtpConfig):
            self.head = load_mtp_head(head_dir, config, embed, lm_head, model.norm, target.dtype, target.device,
                                      options.quantization, dummy=options.load_format == "dummy")
        elif isinstance(config, EagleConfig):
            self.head = load_eagle_head(head_dir, config, embed, lm_head, model.norm, target.dtype, target.device,
                                        hot_tokens)
        else:
            self.head = load_eagle3_head(head_dir, config, embed, lm_head, target.dtype, target.device)
        c = config.model
        self.tree = tree
        page_size = target.kv_buffer.page_size
        # Slots past the target's: the head's KV for the tree nodes it expands while drafting.
        self.scratch_start = target.kv_buffer.num_pages * page_size
        scratch_pages = -(-tree.scratch_slots // page_size) if tree is not None else 0
        self.kv_buffer = KVBuffer(1, target.kv_buffer.num_pages + scratch_pages, c.num_key_value_heads, c.head_dim,
                                  target.dtype, target.device, page_size=page_size)
        if options.attention_backend == "triton":
            from pyserve.model.attention.triton_backend import TritonAttention

            self.attention = TritonAttention(self.kv_buffer, c.num_attention_heads, target.context_len)
        else:
            self.attention = TorchAttention(self.kv_buffer, target.threads)
        self.vocab_size = model.config.vocab_size
        self.device = target.device
        self._next: dict[Sequence, _Next] = {}
        # A prompt chunk's last position and hidden states, until the next chunk gives its next token.
        self._pending: dict[Sequence, tuple[int, torch.Tensor]] = {}

    def capture(self) -> AuxCapture:
        """What the target's forward pass must keep for `follow`."""
        return AuxCapture(self.aux_layers)

    def release(self, seq: Sequence) -> None:
        self._next.pop(seq, None)
        self._pending.pop(seq, None)

    # -- drafting, before the target ---------------------------------------------

    def propose(self, step: ScheduledStep, batch: ForwardBatch, states: list[SamplingState], sampler: Sampler
                ) -> tuple[list[list[int]], list[torch.Tensor | None], list[DraftTree | None] | None]:
        """Each drafted sequence's drafts (as many as its placeholders),
        written into `batch.input_ids`; per sequence the [k, vocab]
        distributions sampled ones were drawn from (None for greedy or
        undrafted ones); and with trees, per sequence its tree (None for
        undrafted ones), else None. A sequence the head has no state for
        keeps its placeholders (drafts the target will most likely reject)."""
        host, drafts = step.batch, step.drafts
        firsts = first_rows(drafts)
        row_slots = dict(zip(step.seqs, host.kv_indices.split(host.seq_lens)))
        out = [list(d) for d in drafts]
        dists: list[list[torch.Tensor]] = [[] for _ in drafts]
        live, token_at = [], []
        for i, (seq, draft) in enumerate(zip(step.sampled, drafts)):
            at = int(host.logits_indices[firsts[i]])
            known = self._next.get(seq)
            if draft and known is not None and known.position == int(host.positions[at]) - 1:
                live.append(i)
                token_at.append(at)
        if not live:
            return out, [None] * len(drafts), None
        if self.tree is not None:
            trees = self._trees(step, live, token_at, row_slots, out)
            self._write(step, batch, out)
            return out, [None] * len(drafts), trees
        logits = torch.stack([self._next[step.sampled[i]].logits for i in live])
        hidden = torch.stack([self._next[step.sampled[i]].hidden for i in live])
        for j in range(max(len(drafts[i]) for i in live)):
            tokens = self._choose(logits, [states[i] for i in live], sampler, [dists[i] for i in live])
            for i, token in zip(live, tokens.tolist()):
                out[i][j] = token
            going_on = [n for n, i in enumerate(live) if len(drafts[i]) > j + 1]
            if not going_on:
                break
            # The head's step at the position of draft j's input: the row's newest token's + j.
            positions = [int(host.positions[token_at[n]]) + j for n in going_on]
            slots = [row_slots[step.sampled[live[n]]][: p + 1] for n, p in zip(going_on, positions)]
            pick = torch.tensor(going_on, device=tokens.device)
            step_batch = ForwardBatch.build(tokens[pick].tolist(), positions, torch.stack([s[-1] for s in slots]),
                                            [1] * len(going_on), slots, list(range(len(going_on))), True, self.device)
            logits, hidden = self.head(step_batch.input_ids, hidden[pick.to(hidden.device)], step_batch, self.attention)
            live = [live[n] for n in going_on]
            token_at = [token_at[n] for n in going_on]
        self._write(step, batch, out)
        return out, [torch.stack(d) if d else None for d in dists], None

    @staticmethod
    def _write(step: ScheduledStep, batch: ForwardBatch, out: list[list[int]]) -> None:
        """The drafts in place of their placeholders in `batch.input_ids`."""
        firsts = first_rows(step.drafts)
        drafted = [i for i, d in enumerate(step.drafts) if d]
        where = [int(step.batch.logits_indices[firsts[i]]) + 1 + j for i in drafted for j in range(len(out[i]))]
        batch.input_ids[torch.tensor(where, device=batch.input_ids.device)] = torch.tensor(
            [t for i in drafted for t in out[i]], device=batch.input_ids.device)

    def _trees(self, step: ScheduledStep, live: list[int], token_at: list[int], row_slots: dict,
               out: list[list[int]]) -> list[DraftTree | None]:
        """Each live sequence's draft tree, its node tokens written into
        `out` (speculative/tree.py). The root's children come from the
        head's logits kept at the pair before the root; a depth-d node is
        expanded by the head at the root's position + d - 1, reading its
        parent's output hidden state."""
        host = step.batch
        seqs = [step.sampled[i] for i in live]
        roots = [int(host.positions[t]) for t in token_at]
        outputs = [torch.stack([self._next[s].hidden for s in seqs])]  # the previous step's output hidden states

        def head_step(tokens, positions, own, tables, parents):
            batch = ForwardBatch.build(tokens, positions, own, [1] * len(tokens), tables, list(range(len(tokens))),
                                       True, self.device)
            hidden = outputs[0][torch.tensor(parents, device=outputs[0].device)]
            logits, outputs[0] = self.head(batch.input_ids, hidden, batch, self.attention)
            return logits

        candidates = grow_trees(torch.stack([self._next[s].logits for s in seqs]), roots,
                                [row_slots[s][:root] for s, root in zip(seqs, roots)], self.tree, self.scratch_start,
                                self.head.draft_to_target, head_step)
        trees: list[DraftTree | None] = [None] * len(step.sampled)
        for c, i in zip(candidates, live):
            out[i], trees[i] = best_tree(c, len(step.drafts[i]))
        return trees

    def _choose(self, draft_logits: torch.Tensor, states: list[SamplingState], sampler: Sampler,
                dists: list[list[torch.Tensor]]) -> torch.Tensor:
        """One draft token (a target id) per row: the argmax for greedy
        requests, a draw for sampled ones, whose distribution is kept."""
        logits = self.head.target_logits(draft_logits, self.vocab_size)
        tokens = logits.argmax(dim=-1)
        sampled = [r for r, s in enumerate(states) if s.params.temperature != 0]
        if sampled:
            q = probabilities(logits[sampled], [states[r].params for r in sampled])
            tokens[torch.tensor(sampled, device=tokens.device)] = draw(
                q, [states[r].generator or sampler.generator for r in sampled])
            for n, r in enumerate(sampled):
                dists[r].append(q[n])
        return tokens

    # -- following the target ------------------------------------------------------

    def follow(self, step: ScheduledStep, batch: ForwardBatch, capture: AuxCapture, next_ids: torch.Tensor,
               counts: list[int] | None) -> None:
        """Run the head over the step's pairs whose next token is known
        (`next_ids`, `counts`: the step's verified output, as
        verify_drafts or the sampler give it; `capture`: the target's
        hidden states of every token of the step's `batch`), and keep each
        sampled sequence's state for its next drafts."""
        aux = self.head.target_features(capture.states)
        carried: list[torch.Tensor] = []
        pairs = self._pairs(step, aux, next_ids.tolist(), counts, carried)
        if not pairs:
            return
        if carried:
            aux = torch.cat([aux, torch.stack(carried)])
        tokens, positions, logits_at = [], [], []
        for r in pairs:
            tokens += r.tokens
            positions += range(r.first, r.first + len(r.tokens))
            if r.sampled:
                logits_at.append(len(tokens) - 1)
        new = torch.cat([r.slots[-len(r.tokens):] for r in pairs])
        head_batch = ForwardBatch.build(tokens, positions, new, [len(r.tokens) for r in pairs],
                                        [r.slots for r in pairs], logits_at, all(len(r.tokens) == 1 for r in pairs),
                                        self.device)
        hidden_rows = torch.tensor([h for r in pairs for h in r.hidden_rows], device=aux.device)
        logits, hidden = self.head(head_batch.input_ids, aux[hidden_rows], head_batch, self.attention)
        for n, r in enumerate(r for r in pairs if r.sampled):
            self._next[r.seq] = _Next(r.first + len(r.tokens) - 1, logits[n], hidden[n])

    def _pairs(self, step: ScheduledStep, aux: torch.Tensor, next_ids: list[int], counts: list[int] | None,
               carried: list[torch.Tensor]) -> list[_Pairs]:
        """Per batch row, the pairs whose next token is known. A carried
        hidden state (a prompt chunk's last) is appended to `carried` and
        read as row len(aux) + its index; a chunk's own last hidden state
        is carried to its next step."""
        host = step.batch
        ids = host.input_ids.tolist()
        sampled = {seq: i for i, seq in enumerate(step.sampled)}
        firsts = first_rows(step.drafts) if step.drafts else list(range(len(step.sampled)))
        out = []
        start = 0
        for seq, n, slots in zip(step.seqs, host.extend_lens, host.kv_indices.split(host.seq_lens)):
            o, start = start, start + n
            if seq.params.pooling:
                continue
            p = int(host.positions[o])
            tokens, hidden_rows, first = [], [], p
            pending = self._pending.pop(seq, None)
            if pending is not None and pending[0] == p - 1:
                tokens, hidden_rows, first = [ids[o]], [aux.shape[0] + len(carried)], p - 1
                carried.append(pending[1])
            i = sampled.get(seq)
            if i is None:  # a prompt chunk: its last token's next one comes with the next chunk
                tokens += ids[o + 1 : o + n]
                hidden_rows += range(o, o + n - 1)
                self._pending[seq] = (p + n - 1, aux[o + n - 1].clone())
            elif step.drafts and step.drafts[i]:  # a verify row: its accepted positions
                count = counts[i]
                tokens += next_ids[firsts[i] : firsts[i] + count]
                hidden_rows += range(o, o + count)
            else:
                tokens += ids[o + 1 : o + n] + [next_ids[firsts[i]]]
                hidden_rows += range(o, o + n)
            if tokens:
                out.append(_Pairs(seq, first, tokens, hidden_rows, slots[: first + len(tokens)], i is not None))
        return out
