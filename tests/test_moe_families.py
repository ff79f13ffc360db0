"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, MiniMax-M2) on tiny
random checkpoints that transformers' own classes write, with the embedded
model's tokenizer: greedy tokens and logprobs against transformers'
generate through the KV-cached harness (chunked prefill over a cached
prefix, batched decode), two tensor-parallel ranks against one, what the
config's dense layers and the quantized CPU modes do, and one family served
by a real `pyserve` to the openai client."""

from __future__ import annotations

import pytest
import torch

from pyserve.model.cpu import native_layers
from pyserve.model.families import parse_config
from pyserve.model.layers.mlp import MLP
from pyserve.model.layers.moe import MoEBlock
from pyserve.model.loader import load_model
from pyserve.model.quant import resolve_quant
from tests.slow import slow
from tests.test_families import assert_served_like_transformers
from tests.test_model_vs_hf import NEW_TOKENS, hf_greedy, pyserve_greedy, random_prompts
from tests.test_tensor_parallel import _one_and_two_ranks, assert_same_generation
from tests.tiny_models import build_tiny_model

VARIANTS = {
    "mixtral": ("mixtral", {}),
    # a shared expert with its sigmoid gate; layer 1 the dense MLP (mlp_only_layers)
    "qwen2_moe-shared-expert-dense-layer": ("qwen2_moe", {}),
    # weights renormalized over the top 2; layer 0 dense by decoder_sparse_step
    "qwen3_moe-norm-topk-sparse-step": ("qwen3_moe", {"decoder_sparse_step": 2}),
    "qwen3_moe-raw-topk": ("qwen3_moe", {"norm_topk_prob": False}),
    # GLM-4.5: layer 0 dense, grouped sigmoid routing with its correction bias, a shared expert, q/k norms
    "glm4_moe-grouped-qk-norm": ("glm4_moe", {}),
    # GLM-4.5-Air's kind: one group, no q/k norms, two dense layers, scores not renormalised
    "glm4_moe-one-group": ("glm4_moe", {"n_group": 1, "use_qk_norm": False, "first_k_dense_replace": 2,
                                        "norm_topk_prob": False}),
    # MiniMax-M2: sigmoid routing with the block's correction bias, q/k norms over all heads, rotary_dim
    "minimax_m2": ("minimax_m2", {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moe_family_matches_transformers(tmp_path, default_model_dir, variant):
    arch, overrides = VARIANTS[variant]
    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir, **overrides)
    prompts = random_prompts(512)
    ours_logits, ours = pyserve_greedy(model_dir, prompts, NEW_TOKENS)
    hf_logits, theirs = hf_greedy(model_dir, prompts, NEW_TOKENS)
    torch.testing.assert_close(ours_logits.log_softmax(-1), hf_logits.log_softmax(-1), atol=1e-4, rtol=0)
    assert ours == theirs


# Qwen3-MoE's plain experts and Qwen2-MoE's shared one by default; the others slow.
@pytest.mark.parametrize("arch", [pytest.param("mixtral", marks=slow), pytest.param("qwen2_moe", marks=slow), "qwen3_moe",
                                  pytest.param("glm4_moe", marks=slow), pytest.param("minimax_m2", marks=slow)])
def test_two_ranks_generate_what_one_does(tmp_path, default_model_dir, arch):
    """Each rank holds half of every expert's intermediate dimension (and of
    the shared expert's, and of the dense layers')."""
    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir)
    assert_same_generation(*_one_and_two_ranks(model_dir))


def _config(**fields) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, **fields}


def test_dense_layers_and_expert_count_spellings():
    config = parse_config(_config(num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert config.dense_layers == {0, 2, 3, 4}
    assert (config.moe.num_experts, config.moe.norm_topk_prob) == (8, False)  # transformers' default
    # transformers 5 writes Qwen3-MoE's count as num_local_experts
    config = parse_config(_config(num_local_experts=4, norm_topk_prob=True))
    assert (config.moe.num_experts, config.moe.norm_topk_prob, config.dense_layers) == (4, True, frozenset())


def test_glm4_moe_config_reads_a_glm45_shaped_config():
    config = parse_config({
        "architectures": ["Glm4MoeForCausalLM"], "vocab_size": 151552, "hidden_size": 5120,
        "intermediate_size": 12288, "num_hidden_layers": 92, "num_attention_heads": 96, "num_key_value_heads": 8,
        "head_dim": 128, "partial_rotary_factor": 0.5, "attention_bias": True, "use_qk_norm": True,
        "n_routed_experts": 160, "num_experts_per_tok": 8, "moe_intermediate_size": 1536, "n_shared_experts": 1,
        "first_k_dense_replace": 3, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "n_group": 1,
        "topk_group": 1, "num_nextn_predict_layers": 1, "rope_theta": 1000000})
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate, moe.shared_intermediate) == (160, 8, 1536, 1536)
    assert (moe.routing, moe.score_correction_bias, moe.routed_scaling_factor, moe.norm_topk_prob) == (
        "grouped_sigmoid", True, 2.5, True)
    assert config.dense_layers == {0, 1, 2} and config.mtp_layers == 1
    assert (config.qk_norm, config.attention_bias, config.o_proj_bias) == ("head", True, False)
    assert (config.rotary_dim, config.rotary_interleaved) == (64, False)


def test_minimax_m2_config_reads_a_released_config():
    """The released configs name the rotated part `rotary_dim`."""
    config = parse_config({
        "architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 200064, "hidden_size": 3072,
        "intermediate_size": 1536, "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8,
        "head_dim": 128, "rotary_dim": 64, "num_local_experts": 256, "num_experts_per_tok": 8,
        "rope_theta": 5000000, "rms_norm_eps": 1e-06})
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate, moe.shared_intermediate) == (256, 8, 1536, 0)
    assert (moe.routing, moe.score_correction_bias, moe.norm_topk_prob, moe.routed_scaling_factor) == (
        "grouped_sigmoid", True, True, 1.0)
    assert config.dense_layers == frozenset() and config.qk_norm == "all"
    assert (config.rotary_dim, config.rotary_interleaved) == (64, False)


def test_glm4_moe_multi_token_prediction_layers_are_skipped(tmp_path, default_model_dir):
    """A GLM-4.5 checkpoint with its MTP layer (layer 3 of a 3-layer model,
    with its eh_proj, norms and shared head) loads to the same tokens."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = build_tiny_model(tmp_path / "plain", "glm4_moe", tokenizer_dir=default_model_dir)
    mtp_dir = tmp_path / "mtp"
    shutil.copytree(model_dir, mtp_dir)
    tensors = load_file(mtp_dir / "model.safetensors")
    tensors.update({k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k})
    tensors.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight":
                    torch.ones(64), "model.layers.3.hnorm.weight": torch.ones(64),
                    "model.layers.3.shared_head.norm.weight": torch.ones(64)})
    save_file(tensors, mtp_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mtp_dir / "config.json").read_text())
    (mtp_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    prompts = random_prompts(512, [7, 19])
    assert pyserve_greedy(mtp_dir, prompts, 6)[1] == hf_greedy(model_dir, prompts, 6)[1]
    (mtp_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"unexpected .*layers\.3\."):
        load_model(mtp_dir, torch.float32, "cpu")


def test_a_checkpoint_without_an_experts_tensor_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = build_tiny_model(tmp_path, "mixtral")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.w13"):
        load_model(model_dir, torch.float32, "cpu")


def test_auto_keeps_a_float_checkpoint_in_its_dtype(tmp_path):
    """`auto` gives an MoE checkpoint that ships no quantized weights the
    model's dtype, as it does a dense one (the quantized modes on MoE
    models: tests/test_moe_quant.py); the native CPU layer is for dense MLPs."""
    model_dir = build_tiny_model(tmp_path, "qwen2_moe")
    assert resolve_quant("auto", model_dir, torch.device("cpu")) is None
    model, _ = load_model(model_dir, torch.float32, "cpu")
    assert [type(layer.mlp) for layer in model.layers] == [MoEBlock, MLP]
    assert "mixture of experts" in native_layers.unfit_reason(model)


def test_qwen3_moe_served_to_the_openai_client(tmp_path, default_model_dir):
    """`pyserve --model DIR` with its defaults (dtype and --torchao-config
    auto: float32 for an MoE model) on a tiny Qwen3-MoE."""
    model_dir = build_tiny_model(tmp_path, "qwen3_moe", tokenizer_dir=default_model_dir, decoder_sparse_step=2)
    assert_served_like_transformers(model_dir, random_prompts(400, [4, 11], seed=3))
