"""gpt-oss (`GptOssForCausalLM`) against transformers' own, on tiny random
checkpoints its classes wrote (float32, the embedded model's tokenizer):
attention sinks, a sliding window of 8 tokens (layer 0; layer 1 global)
under prompts up to 40, q/k/v/o biases, YaRN rope, the biased router and
the clamped SwiGLU experts. Through the model harness (chunked prefill
over a cached prefix, batched decode) in the torch and the Triton backend,
through the engine (a prompt whose prefix the radix cache holds), two
tensor-parallel ranks against one, a real `pyserve --model DIR`; and an
MXFP4 checkpoint (blocks and scales) that loads to the same tokens."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.model import mxfp4
from pyserve.model.families import parse_config
from pyserve.model.loader import load_model
from pyserve.server_args import ServerArgs
from tests.slow import slow_test
from tests.test_attention_window import triton_backend
from tests.test_engine_vs_hf import hf_greedy as hf_cached_greedy
from tests.test_families import assert_served_like_transformers
from tests.test_model_vs_hf import hf_greedy, pyserve_greedy, random_prompts
from tests.test_tensor_parallel import _one_and_two_ranks, _run, assert_same_generation
from tests.tiny_models import build_tiny_model

WINDOW = 8  # tiny_models' gpt-oss sliding_window
LENGTHS = [1, 5, 9, 17, 31, 40, 12, 24]  # most beyond the window, some past it after their first half
# YaRN as gpt-oss has it (factor 32, truncate false), over a short original context, so the ramp is not integral.
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory, default_model_dir):
    return build_tiny_model(tmp_path_factory.mktemp("gpt-oss"), "gpt_oss", tokenizer_dir=default_model_dir,
                            rope_parameters=YARN)


def assert_matches_transformers(model_dir, prompts, new_tokens, attention=None, reference_dir=None):
    """Greedy tokens and first-step logprobs of pyserve on `model_dir` as
    transformers' on `reference_dir` (default the same)."""
    ours_logits, ours = pyserve_greedy(model_dir, prompts, new_tokens, attention)
    hf_logits, theirs = hf_greedy(reference_dir or model_dir, prompts, new_tokens)
    torch.testing.assert_close(ours_logits.log_softmax(-1), hf_logits.log_softmax(-1), atol=1e-4, rtol=0)
    assert ours == theirs
    return ours_logits


def test_greedy_tokens_and_logprobs_match_transformers(gpt_oss_dir):
    config = parse_config(json.loads((gpt_oss_dir / "config.json").read_text()))
    assert config.sliding_layers == {0} and config.sliding_window == WINDOW < max(LENGTHS)
    assert_matches_transformers(gpt_oss_dir, random_prompts(512, LENGTHS), 16)


def test_sinks_are_loaded_per_head(gpt_oss_dir):
    model, _ = load_model(gpt_oss_dir, torch.float32, "cpu")
    sinks = load_file(gpt_oss_dir / "model.safetensors")["model.layers.1.self_attn.sinks"]
    assert torch.equal(model.layers[1].self_attn.sinks, sinks)


def test_triton_backend_matches_transformers(gpt_oss_dir):
    """The Triton kernels (in the interpreter without CUDA) on the same
    steps: each layer's sinks and window reach them."""
    def triton(pool, config):
        return triton_backend(pool, config.num_attention_heads)

    assert_matches_transformers(gpt_oss_dir, random_prompts(512, [3, 13, 22]), 6, triton)


async def _engine_greedy(model_dir, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], int]]:
    """(greedy tokens, prompt tokens taken from the prefix cache) of each
    prompt, one after the other, on an engine that prefills 8 tokens a step."""
    engine = Engine.from_args(ServerArgs(model_path=str(model_dir), max_total_tokens=2048, chunked_prefill_size=8,
                                         dtype="float32"))
    await engine.start()
    results = []
    try:
        for prompt in prompts:
            params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
            outs = [out async for out in engine.generate(GenerateRequest(prompt, params))]
            results.append(([t for out in outs for t in out.token_ids], outs[-1].cached_tokens))
        assert engine.integrity_problem() is None
    finally:
        await engine.shutdown()
    return results


def test_engine_with_a_cached_prefix_matches_transformers(gpt_oss_dir):
    """A second prompt that extends the first: its first 30 tokens come
    from the radix cache, the rest prefill in chunks over them."""
    import transformers

    first = random_prompts(512, [30], seed=1)[0]
    prompts = [first, first + random_prompts(512, [14], seed=2)[0]]
    got = asyncio.run(_engine_greedy(gpt_oss_dir, prompts, 8))
    assert got[1][1] >= 24  # the cache held (at least) the first prompt's whole pages
    hf = transformers.AutoModelForCausalLM.from_pretrained(gpt_oss_dir, dtype=torch.float32, attn_implementation="eager")
    assert [tokens for tokens, _ in got] == [hf_cached_greedy(hf, p, 8) for p in prompts]


@slow_test  # two ranks by default: the MXFP4 checkpoint's test below
def test_two_ranks_generate_what_one_does(gpt_oss_dir):
    """Each rank holds half the heads (and their sinks) and half of every expert."""
    assert_same_generation(*_one_and_two_ranks(gpt_oss_dir))


@slow_test
def test_served_to_the_openai_client(gpt_oss_dir):
    """`pyserve --model DIR` with its defaults (float32 for an MoE model)."""
    assert_served_like_transformers(gpt_oss_dir, random_prompts(400, [5, 20], seed=3))


# MXFP4, written here from the format (OCP Microscaling): e2m1 elements,
# a sign bit, two exponent bits (bias 1) and one mantissa bit, subnormal
# at exponent 0; e8m0 scales, 2 ** (byte - 127); 32 elements a block; the
# element of even index in a byte's low nibble.


def reference_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([blocks & 0xF, blocks >> 4], dim=-1).flatten(-2).double()  # [..., groups, 32]
    sign = 1 - 2 * (codes // 8)
    exponent, mantissa = (codes // 2) % 4, codes % 2
    magnitude = torch.where(exponent == 0, mantissa / 2, 2 ** (exponent - 1) * (1 + mantissa / 2))
    return (sign * magnitude * 2 ** (scales.double() - 127)[..., None]).flatten(-2)


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator, exponents=(-5, -3)):
    """(blocks, scales) of a random MXFP4 tensor of `shape` [..., rows, cols]."""
    *lead, cols = shape
    groups = cols // 32
    blocks = torch.randint(0, 256, (*lead, groups, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(127 + exponents[0], 127 + exponents[1] + 1, (*lead, groups), generator=generator,
                           dtype=torch.uint8)
    return blocks, scales


def test_dequantize_follows_the_format():
    g = torch.Generator().manual_seed(0)
    blocks, scales = random_mxfp4((3, 5, 96), g, exponents=(-60, 60))
    got = mxfp4.dequantize(blocks, scales, torch.float32)
    assert got.shape == (3, 5, 96)
    assert torch.equal(got.double(), reference_dequantize(blocks, scales))
    # every code, each in both nibbles
    every = torch.arange(16, dtype=torch.uint8)
    blocks = (every[:, None] | (every[:, None] << 4)).expand(16, 16).contiguous()[:, None, :]
    values = mxfp4.dequantize(blocks, torch.full((16, 1), 127, dtype=torch.uint8), torch.bfloat16)
    assert torch.equal(values.double(), reference_dequantize(blocks, torch.full((16, 1), 127, dtype=torch.uint8)))
    assert sorted(set(values[:8, 0].tolist())) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(blocks[:, :, :8], torch.zeros(16, 1, dtype=torch.uint8), torch.float32)


def write_mxfp4_pair(tmp_path, model_dir):
    """(a float checkpoint whose experts hold MXFP4-representable values,
    the same model as an MXFP4 checkpoint): copies of `model_dir`, the
    experts' weights drawn as random blocks and scales."""
    g = torch.Generator().manual_seed(7)
    tensors = load_file(model_dir / "model.safetensors")
    dense, packed = dict(tensors), dict(tensors)
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue
        # Stored as [experts, in, out]; MXFP4 holds [experts, out, in], blocks along the inputs.
        blocks, scales = random_mxfp4(tuple(t.transpose(1, 2).shape), g)
        dense[name] = reference_dequantize(blocks, scales).float().transpose(1, 2).contiguous()
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    dirs = []
    for kind, contents, cfg in [("float", dense, None), ("mxfp4", packed, config)]:
        out = shutil.copytree(model_dir, tmp_path / kind)
        save_file(contents, out / "model.safetensors", metadata={"format": "pt"})
        if cfg is not None:
            (out / "config.json").write_text(json.dumps(cfg, indent=2))
        dirs.append(out)
    return dirs


def test_mxfp4_checkpoint_loads_to_the_same_tokens(tmp_path, gpt_oss_dir):
    import transformers

    float_dir, mxfp4_dir = write_mxfp4_pair(tmp_path, gpt_oss_dir)
    names = load_file(mxfp4_dir / "model.safetensors")
    assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in names and not any(
        name.endswith("experts.down_proj") for name in names)
    # transformers reads the pair the test wrote as the float weights: the writer follows the real layout.
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_dir, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
    reference = load_file(float_dir / "model.safetensors")
    experts = theirs.model.layers[1].mlp.experts
    assert torch.equal(experts.gate_up_proj.float(), reference["model.layers.1.mlp.experts.gate_up_proj"])
    assert torch.equal(experts.down_proj.float(), reference["model.layers.1.mlp.experts.down_proj"])

    prompts = random_prompts(512, [4, 19, 33])
    ours_from_mxfp4 = assert_matches_transformers(mxfp4_dir, prompts, 10, reference_dir=float_dir)
    ours_from_float, _ = pyserve_greedy(float_dir, prompts, 10)
    assert torch.equal(ours_from_mxfp4, ours_from_float)  # the dequantized weights are exactly the float ones


@slow_test  # the experts' slices on two ranks run by default in test_moe_families (qwen3_moe)
def test_mxfp4_checkpoint_on_two_ranks_generates_what_the_float_one_does_on_one(tmp_path, gpt_oss_dir):
    """Each rank dequantizes every expert and keeps its half of it."""
    float_dir, mxfp4_dir = write_mxfp4_pair(tmp_path, gpt_oss_dir)
    assert_same_generation(asyncio.run(_run(float_dir, 1)), asyncio.run(_run(mxfp4_dir, 2)))


def test_mxfp4_checkpoint_without_its_scales_is_refused(tmp_path, gpt_oss_dir):
    _, mxfp4_dir = write_mxfp4_pair(tmp_path, gpt_oss_dir)
    tensors = load_file(mxfp4_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, mxfp4_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.mlp\.w2"):
        load_model(mxfp4_dir, torch.float32, "cpu")


# gpt-oss-20b's config.json as published.
PUBLISHED = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}


def test_published_config():
    config = parse_config(PUBLISHED)
    assert config.sliding_window == 128 and config.sliding_layers == set(range(0, 24, 2))
    assert config.rope_theta == 150000.0 and config.rope_scaling == {
        "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}
    assert config.attention_bias and config.o_proj_bias and not config.tie_word_embeddings
    assert config.norm_style == "float32" and config.dense_layers == frozenset()
    spec = config.moe
    assert (spec.num_experts, spec.top_k, spec.intermediate, spec.routing) == (32, 4, 2880, "topk_softmax")
    assert (spec.router_bias, spec.expert_bias, spec.activation) == (True, True, "clamped_swiglu")
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, 7.0)


def test_config_defaults_are_gpt_oss_configs():
    """Without layer_types, rope or window, GptOssConfig's: even layers
    slide over 128 tokens, YaRN over 4096 by 32, rope base 150000."""
    sparse = {k: v for k, v in PUBLISHED.items()
              if k not in ("layer_types", "rope_scaling", "rope_theta", "sliding_window")}
    config = parse_config({**sparse, "num_hidden_layers": 4})
    assert config.sliding_layers == {0, 2} and config.sliding_window == 128
    assert config.rope_theta == 150000.0 and config.rope_scaling["factor"] == 32.0
    assert config.rope_scaling["truncate"] is False
    with pytest.raises(ValueError, match="layer_types"):
        parse_config({**PUBLISHED, "layer_types": ["chunked_attention"] * 24})
