"""The MoE block (pyserve/model/layers/moe.py) against transformers' own MoE
modules, and its execution paths against each other.

Each family's tiny one-layer model is built with transformers' classes,
its MoE weights drawn at random, and saved with save_pretrained: the block
loads the checkpoint's own tensor names through load_weight, so the names
and layouts are the ones users' checkpoints have. Outputs are compared in
float32. The Triton kernels run in Triton's CPU interpreter without CUDA
(tests/conftest.py sets TRITON_INTERPRET=1 before any kernel is imported).
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from pyserve.model.layers.moe import MoEBlock, MoESpec, grouped_experts, placement, route
from pyserve.model.parallel import TensorParallel

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
MLA = dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=8, first_k_dense_replace=0, moe_intermediate_size=24, n_routed_experts=8, n_group=4,
           topk_group=2)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=5)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=6, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40, norm_topk_prob=False)),
    "qwen3_moe-norm": ("Qwen3MoeConfig", dict(num_experts=6, moe_intermediate_size=24, norm_topk_prob=True)),
    "qwen3_moe-raw": ("Qwen3MoeConfig", dict(num_experts=6, moe_intermediate_size=24, norm_topk_prob=False)),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, head_dim=8, layer_types=["full_attention"])),
    "deepseek_v2": ("DeepseekV2Config", dict(MLA, n_shared_experts=2, topk_method="group_limited_greedy",
                                             routed_scaling_factor=1.5)),
    "deepseek_v3": ("DeepseekV3Config", dict(MLA, n_shared_experts=1, routed_scaling_factor=2.5)),
}


class SimulatedRank(TensorParallel):
    """A rank of a tensor-parallel group whose all-reduce the test does by summing."""

    def all_reduce(self, x):
        return x


def tiny_checkpoint(family: str, tmp_path):
    """(transformers' MoE module of layer 0, the config, that layer's checkpoint tensors by name)."""
    config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**TINY, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    mlp = model.model.layers[0].mlp
    with torch.no_grad():
        for tensor in [*mlp.parameters(), *mlp.buffers()]:
            # Wide enough that gpt-oss's gate and up reach its clamp at 7.
            tensor.copy_(torch.randn_like(tensor) * (1.0 if family == "gpt_oss" else 0.3))
    model.save_pretrained(tmp_path)
    tensors = load_file(os.path.join(tmp_path, "model.safetensors"))
    return mlp, config, {name: t for name, t in tensors.items() if name.startswith("model.layers.0.")}


def loaded_block(spec, tensors, tp=TensorParallel()) -> MoEBlock:
    block = MoEBlock(spec, tp)
    for p in block.parameters():
        p.data.fill_(float("nan"))  # so a tensor the loader missed shows
    taken = {name for name, t in tensors.items() if block.load_weight(name, t)}
    assert taken == {name for name in tensors if ".mlp." in name or ".block_sparse_moe." in name}
    assert all(torch.isfinite(p).all() for p in block.parameters())
    return block


@pytest.mark.parametrize("family", FAMILIES)
def test_block_matches_transformers(family, tmp_path):
    hf, config, tensors = tiny_checkpoint(family, tmp_path)
    block = loaded_block(MoESpec.from_config(config), tensors)
    x = torch.randn(1, 11, config.hidden_size) * 2
    with torch.no_grad():
        expected = hf(x)
    expected = expected[0] if isinstance(expected, tuple) else expected  # gpt-oss also returns router scores
    torch.testing.assert_close(block(x[0]), expected[0], atol=1e-5, rtol=1e-5)
    if family == "gpt_oss":
        gate_up = torch.nn.functional.linear(x[0], block.w13[0], block.b13[0])
        assert gate_up.abs().max() > block.spec.swiglu_limit  # the clamp was exercised


def test_deepseek_router_stays_float32_in_a_bfloat16_block(tmp_path):
    """As transformers keeps it (_keep_in_fp32_modules_strict)."""
    _, config, tensors = tiny_checkpoint("deepseek_v3", tmp_path)
    block = loaded_block(MoESpec.from_config(config), tensors)
    router = block.router_weight.clone()
    block.to(torch.bfloat16)
    assert block.w13.dtype == torch.bfloat16
    assert block.router_weight.dtype == block.score_correction_bias.dtype == torch.float32
    assert torch.equal(block.router_weight, router)
    assert block(torch.randn(3, config.hidden_size, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_tensor_parallel_ranks_sum_to_the_whole(family, tmp_path):
    """Two ranks, each with half of every expert's intermediate rows (and of
    the shared expert's), sum to the unsharded block: biases counted once."""
    _, config, tensors = tiny_checkpoint(family, tmp_path)
    spec = MoESpec.from_config(config)
    whole = loaded_block(spec, tensors)
    ranks = [loaded_block(spec, tensors, SimulatedRank(rank, 2)) for rank in range(2)]
    assert ranks[0].w13.shape[1] == whole.w13.shape[1] // 2
    x = torch.randn(9, config.hidden_size)
    torch.testing.assert_close(ranks[0](x) + ranks[1](x), whole(x), atol=1e-5, rtol=1e-5)


def naive_experts(spec, x, weights, ids, w13, w2, b13, b2):
    """Token by token, expert by expert."""
    out = torch.zeros_like(x)
    half = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t] + (b13[e] if b13 is not None else 0)
            y = w2[e] @ _activation(spec, h[:half], h[half:]) + (b2[e] if b2 is not None else 0)
            out[t] += weights[t, j] * y
    return out


def _activation(spec, gate, up):
    if spec.activation == "silu":
        return gate * torch.sigmoid(gate) * up
    gate, up = gate.clamp(max=spec.swiglu_limit), up.clamp(-spec.swiglu_limit, spec.swiglu_limit)
    return (up + 1) * gate * torch.sigmoid(spec.swiglu_alpha * gate)


def random_experts(spec, tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, H, I2 = spec.num_experts, spec.hidden, 2 * spec.intermediate
    x = torch.randn(tokens, H, generator=g)
    w13 = torch.randn(E, I2, H, generator=g) * 0.3
    w2 = torch.randn(E, H, I2 // 2, generator=g) * 0.3
    b13 = torch.randn(E, I2, generator=g) if spec.expert_bias else None
    b2 = torch.randn(E, H, generator=g) if spec.expert_bias else None
    weights, ids = route(spec, torch.randn(tokens, E, generator=g))
    return x, weights, ids, w13, w2, b13, b2


SPECS = [
    MoESpec(num_experts=8, top_k=3, hidden=40, intermediate=24),
    MoESpec(num_experts=5, top_k=2, hidden=48, intermediate=40, routing="topk_softmax", expert_bias=True,
            activation="clamped_swiglu", weights_float32=False),
]


@pytest.mark.parametrize("spec", SPECS, ids=["silu", "clamped_swiglu"])
@pytest.mark.parametrize("tokens", [1, 2, 13])
def test_grouped_path_equals_token_by_token(spec, tokens):
    args = random_experts(spec, tokens)
    torch.testing.assert_close(grouped_experts(spec, *args), naive_experts(spec, *args), atol=1e-5, rtol=1e-5)


def test_placement_of_checkpoint_names():
    spec = MoESpec(num_experts=8, top_k=2, hidden=16, intermediate=24, shared_intermediate=40, shared_gate=True)
    up = placement(spec, "model.layers.3.block_sparse_moe.experts.5.w3.weight")
    assert (up.param, up.expert, up.row) == ("w13", 5, 24)
    gate = placement(spec, "model.layers.0.mlp.experts.7.gate_proj.weight")
    assert (gate.param, gate.expert, gate.row) == ("w13", 7, 0)
    assert placement(spec, "model.layers.0.mlp.shared_expert.up_proj.weight").row == 40
    assert placement(spec, "model.layers.0.mlp.experts.gate_up_proj").layout == "stacked"
    gpt_oss = MoESpec(num_experts=8, top_k=2, hidden=16, intermediate=24, activation="clamped_swiglu")
    assert placement(gpt_oss, "model.layers.0.mlp.experts.gate_up_proj").layout == "gpt_oss"
    for other in ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.weight",
                  "model.embed_tokens.weight"]:
        assert placement(spec, other) is None


def _interpreted_kernels():
    """moe_triton, if its kernels run here: on CUDA, or interpreted on CPU."""
    pytest.importorskip("triton")
    from pyserve.model.layers import moe_triton

    if not torch.cuda.is_available():
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(moe_triton._w13_kernel, InterpretedFunction):
            pytest.skip("Triton kernels were imported before TRITON_INTERPRET=1 was set")
    return moe_triton


@pytest.mark.parametrize("spec", SPECS, ids=["silu", "clamped_swiglu"])
@pytest.mark.parametrize("tokens", [1, 7, 70])
def test_triton_kernels_equal_torch_path(spec, tokens):
    moe_triton = _interpreted_kernels()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = random_experts(spec, tokens)
    expected = grouped_experts(spec, *args)
    on_device = [a.to(device) if a is not None else None for a in args]
    got = moe_triton.fused_experts(spec, *on_device)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_align_blocks_pads_each_expert_to_whole_blocks():
    moe_triton = _interpreted_kernels()
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    sorted_ids, block_expert, total = moe_triton.align_blocks(ids, num_experts=4, block_m=4)
    assert int(total) == 12  # experts 0, 1, 3: one block of 4 each
    used = sorted_ids[:12].view(3, 4)
    assert block_expert[:3].tolist() == [0, 1, 3]
    for block, expert in zip(used, [0, 1, 3]):
        real = block[block < ids.numel()]
        assert (ids.flatten()[real.long()] == expert).all()
    assert sorted(sorted_ids[sorted_ids < ids.numel()].tolist()) == list(range(6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_block_on_cuda_matches_cpu(family, tmp_path):
    _, config, tensors = tiny_checkpoint(family, tmp_path)
    block = loaded_block(MoESpec.from_config(config), tensors)
    x = torch.randn(33, config.hidden_size)
    expected = block(x)
    torch.testing.assert_close(block.cuda()(x.cuda()).cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", SPECS, ids=["silu", "clamped_swiglu"])
def test_bfloat16_kernels_on_cuda_match_torch_path(spec):
    """The same routing in bfloat16 (routing ties could pick other experts)."""
    from pyserve.model.layers import moe_triton

    x, weights, ids, *params = random_experts(spec, 300)
    bf16 = [p.bfloat16() if p is not None else None for p in params]
    expected = grouped_experts(spec, x.bfloat16(), weights, ids, *bf16).float()
    cuda = [p.cuda() if p is not None else None for p in bf16]
    got = moe_triton.fused_experts(spec, x.bfloat16().cuda(), weights.cuda(), ids.cuda(), *cuda).float().cpu()
    torch.testing.assert_close(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0.02)
