"""What the model families add beyond the shared tests (test_model_vs_hf.py,
test_tensor_parallel.py run every family): LongRoPE on both sides of the
original context, which families the native CPU layer takes, and a family
served by a real `pyserve` to the official openai client."""

from __future__ import annotations

import pytest
import torch

from pyserve.model.cpu import native_layers
from pyserve.model.families import parse_config
from pyserve.model.loader import load_model
from pyserve.model.quant import parse_quant
from tests.conftest import app_of_cli
from tests.slow import slow
from tests.test_engine_vs_hf import hf_greedy as hf_cached_greedy
from tests.test_model_vs_hf import hf_greedy, pyserve_greedy, random_prompts
from tests.tiny_models import build_tiny_model

ORIGINAL_CONTEXT = 64
# Phi-3's layout: factors per rotating dimension pair (partial rotary: 12 of 16 dimensions).
LONGROPE = dict(
    max_position_embeddings=512, original_max_position_embeddings=ORIGINAL_CONTEXT, partial_rotary_factor=0.75,
    rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(6)],
                  "long_factor": [3.0 + 2.0 * i for i in range(6)]})


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("phi3-longrope"), "phi3", **LONGROPE)


def test_longrope_within_and_beyond_the_original_context_matches_transformers(longrope_dir):
    """Prompts that stay within the original context with their new tokens
    (short factors throughout), and prompts beyond it, each prefill chunk
    too (long factors throughout): transformers' generate, token for token."""
    prompts = random_prompts(512, [3, 20, 40, 140, 200])
    ours_logits, ours = pyserve_greedy(longrope_dir, prompts, 16)
    hf_logits, theirs = hf_greedy(longrope_dir, prompts, 16)
    torch.testing.assert_close(ours_logits, hf_logits, atol=1e-4, rtol=1e-4)
    assert ours == theirs


def test_longrope_switches_factors_as_a_sequence_outgrows_the_original_context(longrope_dir):
    """A sequence that crosses the original context while decoding: its new
    tokens rotate by the long factors from then on, the keys cached before
    keep theirs, as transformers' model does step by step over its cache.
    (transformers' generate differs here: at the crossing it drops its
    cache and recomputes the whole sequence with the long factors.)"""
    import transformers

    prompts = random_prompts(512, [ORIGINAL_CONTEXT - 6, ORIGINAL_CONTEXT - 1])
    _, ours = pyserve_greedy(longrope_dir, prompts, 12)
    hf = transformers.AutoModelForCausalLM.from_pretrained(longrope_dir, dtype=torch.float32, attn_implementation="eager")
    assert ours == [hf_cached_greedy(hf, p, 12) for p in prompts]


def test_longrope_config_spellings():
    base = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 4096,
            "original_max_position_embeddings": 1024}
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    for kind in ("su", "longrope", "yarn"):  # transformers reads all three as LongRoPE for Phi-3
        config = parse_config({**base, "rope_scaling": {"type": kind, **factors}})
        assert config.rope_scaling == {"rope_type": "longrope", **factors, "original_max_position_embeddings": 1024,
                                       "factor": 4.0}


def test_smollm3_nope_layers_from_either_spelling():
    base = {"architectures": ["SmolLM3ForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4}
    assert parse_config(base).nope_layers == {3, 7}  # every 4th layer by default
    assert parse_config({**base, "no_rope_layers": [1, 0, 1, 1, 1, 1, 0, 1]}).nope_layers == {1, 6}
    with pytest.raises(ValueError, match="no_rope_layers"):
        parse_config({**base, "no_rope_layers": [1, 0]})


def test_sliding_layers_as_transformers_reads_them():
    """Without layer_types (checkpoints of older transformers), each family's
    own rule says which layers slide; with them, they do; no window, none."""
    base = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 4, "max_position_embeddings": 4096}
    mistral = {**base, "architectures": ["MistralForCausalLM"], "sliding_window": 16}
    assert parse_config(mistral).sliding_layers == {0, 1, 2, 3}
    assert parse_config(mistral).sliding_window == 16 and parse_config(mistral).max_position_embeddings == 4096
    assert parse_config({**mistral, "sliding_window": None}).sliding_layers == set()
    qwen2 = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16, "max_window_layers": 3}
    assert parse_config(qwen2).sliding_layers == set()  # use_sliding_window is off
    assert parse_config({**qwen2, "use_sliding_window": True}).sliding_layers == {3}
    types = ["full_attention", "sliding_attention"] * 2
    assert parse_config({**qwen2, "use_sliding_window": True, "layer_types": types}).sliding_layers == {1, 3}
    with pytest.raises(ValueError, match="layer_types"):
        parse_config({**qwen2, "use_sliding_window": True, "layer_types": types[:3]})


@pytest.mark.parametrize("arch, reason", [
    ("phi3", None),  # Llama's layer, fused in its checkpoint
    ("granite", "scales the sublayers' outputs"),
    ("olmo2", "Llama's pre-norms"),
    ("glm4", "outputs"),
    ("smollm3", "no rotary embedding"),
])
def test_native_cpu_layer_takes_llama_shaped_families_only(tmp_path, arch, reason):
    model, _ = load_model(build_tiny_model(tmp_path, arch), torch.float32, "cpu", parse_quant("8da4w"))
    found = native_layers.unfit_reason(model)
    assert found is None if reason is None else reason in found


def assert_served_like_transformers(model_dir, prompts: list[list[int]], *options: str) -> None:
    """The app of `pyserve --model model_dir` (plus `options`), in process
    (app_of_cli): greedy completions of `prompts` and their logprobs,
    through the official openai client, as transformers' on the same
    weights."""
    import openai
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with app_of_cli("--model", str(model_dir), "--max-total-tokens", "2048", "--dtype", "float32", *options) as srv:
        client = openai.OpenAI(api_key="EMPTY", base_url=f"{srv.base_url}/v1", http_client=srv, timeout=120)
        model = client.models.list().data[0].id
        for prompt in prompts:
            expected = hf_cached_greedy(hf, prompt, 8)
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + expected])).logits[0].log_softmax(-1)
            expected_logprobs = [logits[len(prompt) - 1 + i, t].item() for i, t in enumerate(expected)]
            choice = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                               logprobs=1, extra_body={"ignore_eos": True}).choices[0]
            assert choice.text == tokenizer.decode(expected)
            assert choice.logprobs.token_logprobs == pytest.approx(expected_logprobs, abs=1e-4)


@pytest.mark.parametrize("arch", ["olmo2", pytest.param("gemma3-multimodal", marks=slow)])
def test_family_served_to_the_openai_client(tmp_path, default_model_dir, arch):
    """`pyserve --model DIR` on a tiny OLMo 2 (its post-norms and all-heads
    q/k norms) and a tiny Gemma 3 image-text checkpoint (served as text,
    its sliding layers): greedy completions and their logprobs as transformers'."""
    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir)
    assert_served_like_transformers(model_dir, random_prompts(400, [4, 11], seed=3),
                                    "--torchao-config", "none")
