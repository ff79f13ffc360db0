"""EAGLE-3 heads over mixture-of-experts targets, as SGLang's lines run
them over gpt-oss and Qwen3-MoE: a head fitted to the target's hidden
states as transformers computes them gets its drafts kept, so the states
pyserve keeps for it (sliding-window and expert layers in between) are
the same ones; greedy output is plain decoding's."""

from __future__ import annotations

import pytest

from tests.eagle3_heads import (AUX_IDS, AUX_LAYERS, PROMPTS, greedy_continuations, head_accuracy, head_config,
                                hot_ids, save_head, trained_weights, vocab_size)
from tests.slow import slow
from tests.test_speculative import same, with_and_without
from tests.tiny_models import build_tiny_model

GREEDY = {"temperature": 0, "ignore_eos": True}


# Qwen3-MoE by default; gpt-oss (its sliding layers between the kept ones), slow: its tiny build alone takes 4 s.
@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("gpt_oss", marks=slow)])
def test_a_fitted_head_over_a_moe_target_gets_its_drafts_kept(tmp_path, default_model_dir, arch):
    target = build_tiny_model(tmp_path / "target", arch, tokenizer_dir=default_model_dir, num_hidden_layers=4)
    texts = [p + out for p, out in zip(PROMPTS, greedy_continuations(target, PROMPTS, 40))]
    hot = hot_ids(target, [t for text in texts for t in text])
    cfg = head_config(target, len(hot), AUX_IDS)
    fitted = trained_weights(target, cfg, texts, hot, AUX_LAYERS)
    assert min(min(head_accuracy(target, cfg, fitted, t, hot, AUX_LAYERS)) for t in texts) > 0.9
    head = save_head(tmp_path / "head", cfg, fitted, hot, vocab_size(target))
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 30}), (PROMPTS[1], {**GREEDY, "max_new_tokens": 20})]
    speculative = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head),
                   "speculative_num_steps": 3}
    plain, got, metrics = with_and_without(target, requests, speculative, {"torchao_config": "none"})
    same(plain, got)
    assert metrics.accepted_drafts() >= 0.6 * 50
