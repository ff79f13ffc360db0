"""--enable-torch-compile: compiled decode steps compute what eager ones do."""

from __future__ import annotations

import pytest
import torch

from pyserve.model.loader import load_model
from tests.test_model_vs_hf import CachedSequences, random_prompts
from tests.tiny_models import build_tiny_model


def greedy_with_logits(model, config, prompts, n):
    seqs = CachedSequences(model, config)
    logits = [seqs.forward(dict(enumerate(prompts)))]
    outputs = [[t] for t in logits[-1].argmax(-1).tolist()]
    for _ in range(n - 1):
        logits.append(seqs.forward({i: [o[-1]] for i, o in enumerate(outputs)}))
        for out, t in zip(outputs, logits[-1].argmax(-1).tolist()):
            out.append(t)
    return outputs, torch.stack(logits)


@pytest.mark.slow  # inductor compiles on 2 cores: about a minute
def test_compiled_decode_gives_the_eager_tokens(tmp_path):
    """Decode batches of different lengths (padded attention) and batch
    sizes 1 and several: same greedy tokens, logits equal to float32 rounding."""
    model_dir = build_tiny_model(tmp_path, "llama")
    model, config = load_model(model_dir, torch.float32, "cpu")
    for prompts in (random_prompts(512, [5]), random_prompts(512, [3, 9, 4])):
        eager, eager_logits = greedy_with_logits(model, config, prompts, 8)
        model.compile_decode()
        compiled, compiled_logits = greedy_with_logits(model, config, prompts, 8)
        model._compiled_halves = None
        assert compiled == eager
        torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4)
