"""Next-token selection for a batch, each row with its own settings.

Order, as in the OpenAI/vLLM semantics: repetition penalty (prompt and
output tokens), frequency and presence penalties (output tokens), logit
bias, then greedy argmax at temperature 0, else temperature, top-k, top-p
and min-p before drawing. A request with a seed draws from its own
generator, so its text does not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from pyserve.engine.request import SamplingParams
from pyserve.engine.sequence import Sequence


def _needs_logit_processing(p: SamplingParams) -> bool:
    return bool(
        p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty or p.logit_bias
    )


class Sampler:
    def __init__(self, seed: int):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: float32 [B, vocab] on any device; returns one id per row."""
        params = [s.params for s in seqs]
        if all(p.temperature == 0 and not _needs_logit_processing(p) for p in params):
            return logits.argmax(dim=-1).tolist()
        logits = logits.float().cpu()
        out = []
        for row, seq in zip(logits, seqs):
            row = self._penalize(row.clone(), seq)
            out.append(self._choose(row, seq))
        return out

    @staticmethod
    def _penalize(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        p = seq.params
        vocab = row.numel()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.all_ids)), dtype=torch.long)
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and seq.output_ids:
            counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long), minlength=vocab)[:vocab]
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        for token_id, bias in p.logit_bias.items():
            if 0 <= token_id < vocab:
                row[token_id] += bias
        return row

    def _choose(self, row: torch.Tensor, seq: Sequence) -> int:
        p = seq.params
        if p.temperature == 0:
            return int(row.argmax())
        row = row / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            before = sorted_probs.cumsum(0) - sorted_probs
            sorted_probs[before >= p.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if p.min_p > 0.0:
            probs[probs < p.min_p * probs.max()] = 0.0
        generator = seq.generator or self.generator
        return int(torch.multinomial(probs, 1, generator=generator))
