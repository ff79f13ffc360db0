"""Gemma 2 and Gemma 3 (and Gemma 3's image-text checkpoint served as
text) against transformers, on tiny checkpoints its own classes wrote: a
sliding window of 8 tokens under prompts up to 40, chunked prefill over a
cached prefix and batched decode, in the torch backend and in Triton's
(its interpreter without CUDA); two ranks against one; the config
spellings published checkpoints use."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyserve.model.cpu import native_layers
from pyserve.model.families import parse_config
from pyserve.model.loader import load_model
from pyserve.model.quant import parse_quant
from tests.test_attention_window import triton_backend
from tests.test_model_vs_hf import hf_greedy, pyserve_greedy, random_prompts
from tests.slow import slow
from tests.test_tensor_parallel import _one_and_two_ranks, assert_same_generation
from tests.tiny_models import build_tiny_model

ARCHS = ("gemma2", "gemma3", "gemma3-multimodal")
WINDOW = 8  # tiny_models' Gemma sliding_window
LENGTHS = [1, 5, 9, 17, 31, 40, 12, 24]  # most beyond the window, some past it after their first half


@pytest.fixture(scope="module", params=ARCHS)
def gemma_dir(request, tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def assert_matches_transformers(model_dir, prompts, new_tokens, attention=None):
    ours_logits, ours = pyserve_greedy(model_dir, prompts, new_tokens, attention)
    hf_logits, theirs = hf_greedy(model_dir, prompts, new_tokens)
    # logprobs within 1e-4: the same logits up to a shift per row, and the logits themselves
    torch.testing.assert_close(ours_logits.log_softmax(-1), hf_logits.log_softmax(-1), atol=1e-4, rtol=0)
    torch.testing.assert_close(ours_logits, hf_logits, atol=1e-4, rtol=1e-4)
    assert ours == theirs


def test_greedy_tokens_and_logprobs_match_transformers(gemma_dir):
    assert max(LENGTHS) > WINDOW
    assert_matches_transformers(gemma_dir, random_prompts(512, LENGTHS), 16)


# Gemma 2 by default (window and soft-cap per layer); Gemma 3 (local and
# global rope bases, as the torch backend checks by default) and the
# image-text checkpoint, whose text model is Gemma 3's, slow.
@pytest.mark.parametrize("arch", ["gemma2", pytest.param("gemma3", marks=slow),
                                  pytest.param("gemma3-multimodal", marks=slow)])
def test_triton_backend_matches_transformers(tmp_path, arch):
    """The Triton kernels (in the interpreter without CUDA) on the same
    steps: the window and soft-cap passed per layer reach them too."""
    def triton(pool, config):
        return triton_backend(pool, config.num_attention_heads)

    assert_matches_transformers(build_tiny_model(tmp_path, arch), random_prompts(512, [3, 13, 22]), 6, triton)


# Slow: Gemma 3 (its layers split as a Llama's, which test_tensor_parallel
# runs by default), Gemma 2 (its soft caps act on whole rows, which no rank
# splits) and the image-text checkpoint, whose text model is Gemma 3's.
@pytest.mark.parametrize("arch", [pytest.param("gemma2", marks=slow), pytest.param("gemma3", marks=slow),
                                  pytest.param("gemma3-multimodal", marks=slow)])
def test_two_ranks_generate_what_one_does(tmp_path, default_model_dir, arch):
    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir)
    assert_same_generation(*_one_and_two_ranks(model_dir))


def test_multimodal_checkpoint_as_transformers_5_names_it(tmp_path):
    """The image-text checkpoint with its tensors named `model.language_model.`
    and `model.vision_tower.` (transformers 5's layout) serves the same text."""
    model_dir = build_tiny_model(tmp_path, "gemma3-multimodal")
    prompts = random_prompts(512, [4, 20])
    _, published = pyserve_greedy(model_dir, prompts, 8)
    tensors = load_file(model_dir / "model.safetensors")
    renamed = {"model." + name.replace("language_model.model.", "language_model."): t for name, t in tensors.items()}
    assert any(name.startswith("model.vision_tower.") for name in renamed)
    save_file(renamed, model_dir / "model.safetensors", metadata={"format": "pt"})
    assert pyserve_greedy(model_dir, prompts, 8)[1] == published


def test_native_cpu_layer_refuses_gemma(gemma_dir):
    model, _ = load_model(gemma_dir, torch.float32, "cpu", parse_quant("8da4w"))
    assert "norms" in native_layers.unfit_reason(model)


BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 16, "hidden_act": "gelu_pytorch_tanh", "sliding_window": 512}


def test_gemma2_published_config():
    """Gemma 2 as published: no layer_types (even layers slide), both soft-caps, tied embeddings."""
    config = parse_config({**BASE, "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4,
                           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 144,
                           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert config.sliding_layers == {0, 2} and config.sliding_window == 512
    assert (config.attention_softcap, config.final_logit_softcap) == (50.0, 30.0)
    assert config.attention_scale == 144**-0.5 and config.embedding_multiplier == 8.0
    assert config.tie_word_embeddings and config.max_position_embeddings == 4096  # not capped to the window


def test_gemma3_published_multimodal_config():
    """Gemma 3 4B's config.json: a sparse text_config over Gemma3TextConfig's
    defaults, rope_local_base_freq beside the global rope_scaling, five
    sliding layers per global one."""
    config = parse_config({
        "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 12,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152}})
    assert (config.vocab_size, config.num_attention_heads, config.head_dim) == (262_208, 8, 256)
    assert config.eos_token_ids == [1, 106] and config.torch_dtype == "bfloat16"
    assert config.sliding_layers == {0, 1, 2, 3, 4, 6, 7, 8, 9, 10} and config.sliding_window == 1024
    assert (config.rope_theta, config.rope_scaling) == (1_000_000.0, {"rope_type": "linear", "factor": 8.0})
    assert config.local_rope == (10_000.0, None) and config.qk_norm == "head"


def test_gemma3_sliding_window_pattern_and_refusals():
    base = {**BASE, "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 6}
    assert parse_config({**base, "sliding_window_pattern": 3}).sliding_layers == {0, 1, 3, 4}
    # EmbeddingGemma's: attending both ways (tests/test_encoder_models.py serves one).
    assert parse_config({**base, "use_bidirectional_attention": True}).causal is False
    assert parse_config(base).causal is True
    with pytest.raises(ValueError, match="layer_types"):
        parse_config({**base, "layer_types": ["sliding_attention"] * 5})
