"""DeepSeek V2 and V3 against transformers' own, on tiny random
checkpoints its classes wrote (float32, the embedded model's tokenizer):
multi-head latent attention with and without q_lora, YaRN rope with
mscale / mscale_all_dim, interleaved or rotate-half rope; a dense first
layer, then MoE layers with shared experts and grouped routing (V2's
group-limited greedy softmax, V3's sigmoid with its score correction bias).
Through the model harness (chunked prefill over a cached prefix, batched
decode), the engine (a prompt whose prefix the radix cache holds), two
tensor-parallel ranks against one, and a real `pyserve --model DIR`; and
the cache holds the latent, kv_lora_rank + qk_rope_head_dim values per
token and layer, as the engine's own figures say."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyserve.engine.engine import Engine
from pyserve.model.families import parse_config
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.layers.mla import MultiHeadLatentAttention
from pyserve.model.layers.mlp import MLP
from pyserve.model.layers.moe import MoEBlock
from pyserve.model.loader import load_model
from pyserve.server_args import ServerArgs
from tests.slow import slow, slow_test
from tests.test_families import assert_served_like_transformers
from tests.test_gpt_oss import _engine_greedy
from tests.test_engine_vs_hf import hf_greedy as hf_cached_greedy
from tests.test_model_vs_hf import hf_greedy, pyserve_greedy, random_prompts
from tests.test_tensor_parallel import _one_and_two_ranks, assert_same_generation
from tests.tiny_models import _TOKENIZER_FILES, _tokenizer_vocab_size

KV_LORA_RANK, ROPE_DIM = 32, 8
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.8, "rope_theta": 10000.0}
# Four heads over a latent of 32 (+ 8 rotated), a dense first layer, then
# 8 experts in 4 groups, top 2 from the best 2 groups, plus shared experts.
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=4, kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=16, qk_rope_head_dim=ROPE_DIM,
               v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
               first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=1.5,
               max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
               pad_token_id=None)
VARIANTS = {
    # attention_bias: biases on q_a_proj, kv_a_proj_with_mqa and o_proj
    "v2-q-lora-group-limited-yarn-bias": ("v2", dict(q_lora_rank=24, n_shared_experts=2, attention_bias=True,
                                                     topk_method="group_limited_greedy", rope_parameters=YARN)),
    "v2-lite-q-proj-greedy": ("v2", dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy", n_group=None,
                                         topk_group=None)),
    "v3-q-lora-interleaved-yarn": ("v3", dict(q_lora_rank=24, n_shared_experts=1, norm_topk_prob=True,
                                              rope_interleave=True, rope_parameters=YARN)),
    "v3-q-proj-rotate-half": ("v3", dict(q_lora_rank=None, n_shared_experts=1, norm_topk_prob=False,
                                         rope_interleave=False)),
    # GLM-4.7-Flash: V3's layers, dense where mlp_layer_types says (not first_k_dense_replace's layer 0)
    "glm4-moe-lite-layer-types": ("lite", dict(q_lora_rank=24, n_shared_experts=1, norm_topk_prob=True,
                                               mlp_layer_types=["sparse", "dense", "sparse"])),
}
_CLASSES = {"v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"), "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
            "lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM")}


def build_tiny_deepseek(out_dir, version: str, tokenizer_dir, seed: int = 0, std: float = 0.2, **overrides):
    """A tiny random DeepSeek V2 or V3 saved by transformers, with the
    tokenizer of `tokenizer_dir` (as tests/tiny_models.py builds the others);
    V3's score correction bias drawn too, so routing depends on it."""
    import shutil

    import transformers

    config = dict(_COMMON, vocab_size=_tokenizer_vocab_size(tokenizer_dir / "tokenizer.json"), **overrides)
    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[version])
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config)).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # not all ones, so a norm loaded into the wrong place shows
            else:
                p.normal_(0, std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="module", params=list(VARIANTS))
def deepseek_dir(request, tmp_path_factory, default_model_dir):
    version, overrides = VARIANTS[request.param]
    return build_tiny_deepseek(tmp_path_factory.mktemp(request.param), version, default_model_dir, **overrides)


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory, default_model_dir):
    version, overrides = VARIANTS["v3-q-lora-interleaved-yarn"]
    return build_tiny_deepseek(tmp_path_factory.mktemp("v3"), version, default_model_dir, **overrides)


def assert_matches_transformers(model_dir, prompts, new_tokens, reference_dir=None):
    ours_logits, ours = pyserve_greedy(model_dir, prompts, new_tokens)
    hf_logits, theirs = hf_greedy(reference_dir or model_dir, prompts, new_tokens)
    torch.testing.assert_close(ours_logits.log_softmax(-1), hf_logits.log_softmax(-1), atol=1e-4, rtol=0)
    assert ours == theirs


def test_greedy_tokens_and_logprobs_match_transformers(deepseek_dir):
    assert_matches_transformers(deepseek_dir, random_prompts(512, [1, 5, 17, 40, 12, 90]), 16)


def test_layers_as_the_config_lays_them_out(v3_dir):
    model, config = load_model(v3_dir, torch.float32, "cpu")
    assert [type(layer.mlp) for layer in model.layers] == [MLP, MoEBlock, MoEBlock]
    assert all(isinstance(layer.self_attn, MultiHeadLatentAttention) for layer in model.layers)
    moe = config.moe
    assert (moe.routing, moe.n_group, moe.topk_group, moe.norm_topk_prob) == ("grouped_sigmoid", 4, 2, True)
    assert moe.shared_intermediate == 32 and moe.routed_scaling_factor == 1.5
    tensors = load_file(v3_dir / "model.safetensors")
    assert torch.equal(model.layers[1].mlp.score_correction_bias, tensors["model.layers.1.mlp.gate.e_score_correction_bias"])


def test_the_cache_holds_the_latent(v3_dir):
    """Per token and layer the engine's KV cache holds kv_lora_rank +
    qk_rope_head_dim values, V a view of K's first kv_lora_rank: what its
    own figures (bytes per token, the buffers' storage) say."""
    layers = _COMMON["num_hidden_layers"]
    expanded = layers * 2 * _COMMON["num_attention_heads"] * (_COMMON["qk_nope_head_dim"] + ROPE_DIM) * 4

    async def figures():
        engine = Engine.from_args(ServerArgs(model_path=str(v3_dir), max_total_tokens=256, dtype="float32"))
        await engine.start()
        try:
            rank = engine.runner.rank_model
            kv = rank.kv_buffer
            storage = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kv.k_pages + kv.v_pages}
            return rank.kv_bytes_per_token(), sum(storage.values()), kv.num_pages * kv.page_size
        finally:
            await engine.shutdown()

    per_token, held, slots = asyncio.run(figures())
    assert per_token == layers * (KV_LORA_RANK + ROPE_DIM) * 4 < expanded
    assert held == slots * per_token


def test_engine_with_a_cached_prefix_matches_transformers(v3_dir):
    """A second prompt that extends the first: its first 30 tokens come
    from the radix cache (latent entries written by the first), the rest
    prefill in chunks of 8 over them."""
    import transformers

    first = random_prompts(512, [30], seed=1)[0]
    prompts = [first, first + random_prompts(512, [14], seed=2)[0]]
    got = asyncio.run(_engine_greedy(v3_dir, prompts, 8))
    assert got[1][1] >= 24
    hf = transformers.AutoModelForCausalLM.from_pretrained(v3_dir, dtype=torch.float32, attn_implementation="eager")
    assert [tokens for tokens, _ in got] == [hf_cached_greedy(hf, p, 8) for p in prompts]


# V3 by default; V2's variant (its routing is every rank's alike) slow.
@pytest.mark.parametrize("variant", [pytest.param("v2-q-lora-group-limited-yarn-bias", marks=slow),
                                     "v3-q-proj-rotate-half"])
def test_two_ranks_generate_what_one_does(tmp_path, default_model_dir, variant):
    """Each rank holds two of the four heads (their rows of q / q_b and
    kv_b, their columns of o_proj), the whole latent path and cache, and
    half of every expert."""
    version, overrides = VARIANTS[variant]
    model_dir = build_tiny_deepseek(tmp_path, version, default_model_dir, **overrides)
    assert_same_generation(*_one_and_two_ranks(model_dir))


@slow_test
def test_served_to_the_openai_client(v3_dir):
    """`pyserve --model DIR` with its defaults (float32 for an MoE model)."""
    assert_served_like_transformers(v3_dir, random_prompts(400, [5, 20], seed=3))


def test_multi_token_prediction_layers_are_skipped(tmp_path, v3_dir):
    """A V3 checkpoint with its MTP layer (layer 3 of a 3-layer model)
    loads to the same tokens, skipped as num_nextn_predict_layers says;
    one without a layer's tensor is refused."""
    import shutil

    mtp_dir = tmp_path / "mtp"
    shutil.copytree(v3_dir, mtp_dir)
    tensors = load_file(mtp_dir / "model.safetensors")
    tensors.update({k.replace("layers.2.", "layers.3."): v.clone() for k, v in tensors.items() if ".layers.2." in k})
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, mtp_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mtp_dir / "config.json").read_text())
    (mtp_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert parse_config(json.loads((mtp_dir / "config.json").read_text())).mtp_layers == 1
    assert_matches_transformers(mtp_dir, random_prompts(512, [7, 19]), 6, reference_dir=v3_dir)
    # Without num_nextn_predict_layers, layer 3 is no layer of the model.
    (mtp_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"unexpected .*layers\.3\."):
        load_model(mtp_dir, torch.float32, "cpu")
    (mtp_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    save_file(tensors, mtp_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*layers\.2\.self_attn\.kv_b_proj"):
        load_model(mtp_dir, torch.float32, "cpu")


def test_config_reads_the_published_fields():
    """DeepSeek-V2-Lite's config.json fields: q_proj (q_lora_rank null),
    YaRN with mscale 0.707 both ways, greedy routing over 64 experts."""
    published = {
        "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400, "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
        "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512,
        "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
        "max_position_embeddings": 163840, "rope_theta": 10000, "rope_scaling": {
            "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096, "type": "yarn"}}
    config = parse_config(published)
    assert config.mla.q_lora_rank is None and config.mla.latent_dim == 576
    assert (config.num_key_value_heads, config.head_dim, config.head_dim.value_dim) == (1, 576, 512)
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1
    assert config.attention_scale == pytest.approx(192**-0.5 * mscale**2)
    assert config.moe.routing == "softmax" and config.dense_layers == {0}
    # DeepSeek's rule: experts from first_k_dense_replace on, every moe_layer_freq-th layer.
    assert parse_config({**published, "moe_layer_freq": 2, "num_hidden_layers": 5}).dense_layers == {0, 1, 3}
    # A token's cache: 27 layers x 576 values, against 27 x 16 heads x (192 + 128) expanded.
    assert KVBuffer.bytes_per_token(27, 1, config.head_dim, torch.bfloat16) == 27 * 576 * 2


@pytest.mark.parametrize("latent", [None, (256, 32)], ids=["tiny-latent", "latent-wider-than-256"])
def test_triton_backend_matches_transformers(tmp_path, default_model_dir, v3_dir, latent):
    """The Triton kernels (in the interpreter without CUDA) over the latent
    cache: K the latent and rotated key part, V its first kv_lora_rank
    values, the output as wide as V; extend over a cached prefix and decode.
    A latent of 256 + 32 takes the kernels' smaller tiles for wide heads."""
    from tests.test_attention_window import triton_backend

    model_dir = v3_dir
    if latent is not None:
        version, overrides = VARIANTS["v3-q-lora-interleaved-yarn"]
        overrides = dict(overrides, kv_lora_rank=latent[0], qk_rope_head_dim=latent[1])
        model_dir = build_tiny_deepseek(tmp_path, version, default_model_dir, **overrides)
    rank = latent[0] if latent else KV_LORA_RANK

    def triton(pool, config):
        assert pool.v_buffer[0].shape[2] == rank < pool.k_buffer[0].shape[2]
        return triton_backend(pool, config.num_attention_heads)

    prompts = random_prompts(512, [3, 13, 22])
    ours_logits, ours = pyserve_greedy(model_dir, prompts, 6, triton)
    hf_logits, theirs = hf_greedy(model_dir, prompts, 6)
    torch.testing.assert_close(ours_logits.log_softmax(-1), hf_logits.log_softmax(-1), atol=1e-4, rtol=0)
    assert ours == theirs


@slow_test  # inductor compiles on 2 cores: about a minute
def test_compiled_decode_gives_the_eager_tokens(v3_dir):
    """--enable-torch-compile's decode layer takes the latent attention (the
    absorbed query, the latent cache write, V narrower than K) into its graph."""
    from pyserve.model.attention.torch_backend import TorchAttention
    from pyserve.model.step_plan import Layers, StepPlan
    from tests.test_compile import greedy_with_logits

    model, config = load_model(v3_dir, torch.float32, "cpu")
    prompts = random_prompts(512, [3, 9, 4])
    eager, eager_logits = greedy_with_logits(model, config, prompts, 8)
    model.compile_decode(TorchAttention.attend_decode)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled, compiled_logits = greedy_with_logits(model, config, prompts, 8, StepPlan(Layers.COMPILED_DECODE))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
    assert compiled == eager
    torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4)


def test_lora_is_refused_at_start_with_the_reason(v3_dir):
    """Adapters hook fused q/k/v projections, which latent attention has not."""
    with pytest.raises(ValueError, match="--enable-lora: DeepseekV3ForCausalLM's attention takes no LoRA adapters"):
        Engine.from_args(ServerArgs(model_path=str(v3_dir), enable_lora=True, max_total_tokens=1024))



@pytest.mark.parametrize("mode", ["int8wo", "int4wo-32", "8da4w"])
def test_the_quantized_cpu_modes_run_the_weights_they_hold(tmp_path, default_model_dir, mode):
    """Every projection but kv_b_proj (read as the absorbed weights, kept
    dense) and every expert in the mode; the latent cache bypasses the
    native extend kernel. Against transformers holding the weights pyserve
    multiplies by, bounded as tests/test_moe_quant.py bounds the other
    mixtures of experts."""
    from pyserve.model.quant import parse_quant
    from tests.test_moe_quant import MEDIAN_ATOL, assert_answers_like_reference, dequantized_transformers

    # Widths the 4-bit kernels hold: the projections' inputs multiples of 32.
    version, overrides = VARIANTS["v3-q-lora-interleaved-yarn"]
    # Weights of 0.1: at 0.2 the tiny model's activations are spiky enough
    # that 8da4w's 8-bit activation blocks move its logprobs by 0.3-1.0.
    model_dir = build_tiny_deepseek(tmp_path, version, default_model_dir, std=0.1,
                                    **{**overrides, "q_lora_rank": 32, "v_head_dim": 16})
    quant = parse_quant(mode)
    model, config = load_model(model_dir, torch.float32, "cpu", quant)
    attn, moe = model.layers[1].self_attn, model.layers[1].mlp
    assert isinstance(attn.kv_b_proj, torch.nn.Linear)
    assert not any(isinstance(m, torch.nn.Linear) for m in (attn.q_a_proj, attn.q_b_proj, attn.o_proj,
                                                             *moe.w13, *moe.w2, moe.shared_w13, moe.shared_w2))
    # kv_b_proj, and kv_a_proj_with_mqa whose 40 rows the int4 packing cannot hold.
    dense = {name.rpartition(".")[2] for name, m in model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    hf = dequantized_transformers(model_dir, model, quant, dense=tuple(dense))
    assert_answers_like_reference(model, config, hf, random_prompts(config.vocab_size, [3, 17, 9]),
                                  MEDIAN_ATOL[mode])
