"""Quantized checkpoints (AWQ, GPTQ, FP8, compressed-tensors) served by the
real loader: greedy tokens identical to transformers running the
dequantized weights in float32 (`--torchao-config none`), and the CPU's
natural quantized mode built from the checkpoint's own codes."""

from __future__ import annotations

import json

import pytest
import torch

from pyserve.model.cpu import blocks
from pyserve.model.cpu.blocks import Q4_1Linear
from pyserve.model.loader import load_model
from pyserve.model.quant import Int4Linear, Int8Linear, parse_quant, resolve_quant
from tests.test_quant import greedy
from tests.test_quantized_formats import (
    awq_dequantized, awq_tensors, dense_copy, fp8_block_dequantized, fp8_block_tensors, fp8_tensor_dequantized,
    fp8_tensor_tensors, gptq_dequantized, gptq_tensors, write_quantized,
)
from tests.tiny_models import build_tiny_model

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [42]]
NEW_TOKENS = 8

FORMATS = {
    "gptq-int4-sym": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False},
                      lambda w: gptq_tensors(w, 4, 32, True, False), lambda t: gptq_dequantized(t, 4)),
    "gptq-int4-act-order": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": True},
                            lambda w: gptq_tensors(w, 4, 32, False, True), lambda t: gptq_dequantized(t, 4)),
    "gptq-int8": ({"quant_method": "gptq", "bits": 8, "group_size": 64, "sym": True, "desc_act": False},
                  lambda w: gptq_tensors(w, 8, 64, True, False), lambda t: gptq_dequantized(t, 8)),
    "awq-int4-g64": ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True, "version": "gemm"},
                     lambda w: awq_tensors(w, 64), lambda t: awq_dequantized(t, 64)),
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [32, 32]}, fp8_block_tensors, fp8_block_dequantized),
    "fp8-tensor": ({"quant_method": "fp8", "activation_scheme": "static"}, fp8_tensor_tensors,
                   fp8_tensor_dequantized),
}


def quantized_pair(tmp_path, default_model_dir, fmt: str, arch: str = "llama", **overrides):
    """(quantized checkpoint, its dequantized float copy)."""
    float_dir = build_tiny_model(tmp_path / "float", arch, tokenizer_dir=default_model_dir, **overrides)
    config, tensors_of, dequantize = FORMATS[fmt]
    reference = write_quantized(float_dir, tmp_path / fmt, config, tensors_of, dequantize)
    return tmp_path / fmt, dense_copy(float_dir, tmp_path / f"{fmt}-dense", reference)


def hf_greedy(model_dir) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_served_dequantized_matches_transformers(tmp_path, default_model_dir, fmt):
    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, fmt)
    model, config = load_model(quant_dir, torch.float32, "cpu")
    reference, _ = load_model(dense_dir, torch.float32, "cpu")
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(got, want), name
    assert greedy(model, config, PROMPTS, NEW_TOKENS) == hf_greedy(dense_dir)


@pytest.mark.parametrize("fmt, mode, layer", [
    ("gptq-int4-sym", "8da4w" if blocks.available() else "int4wo-32", Q4_1Linear if blocks.available() else Int4Linear),
    ("awq-int4-g64", "8da4w" if blocks.available() else "int4wo-64", Q4_1Linear if blocks.available() else Int4Linear),
    ("gptq-int8", "int8wo", Int8Linear),
    ("fp8-block", "int8wo", Int8Linear),
])
def test_auto_picks_the_natural_cpu_mode(tmp_path, default_model_dir, fmt, mode, layer):
    """4-bit checkpoints run the 4-bit kernels on their own codes (the
    layer's weight is the checkpoint's, exactly); 8-bit and FP8 ones int8wo."""
    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, fmt)
    quant = resolve_quant("auto", quant_dir, torch.device("cpu"))
    assert quant.name == mode
    model, config = load_model(quant_dir, torch.float32, "cpu", quant)
    reference, _ = load_model(dense_dir, torch.float32, "cpu")
    proj = model.layers[0].mlp.down_proj
    assert isinstance(proj, layer)
    want = reference.layers[0].mlp.down_proj.weight
    if hasattr(proj, "dense_weight"):
        assert torch.allclose(proj.dense_weight(), want, rtol=0, atol=1e-6)
    # Activations rounded by the kernels: the logits stay close to float32's.
    ids = torch.tensor(PROMPTS[0])
    from tests.test_model_vs_hf import CachedSequences
    got = CachedSequences(model, config).forward({0: PROMPTS[0]})
    exact = CachedSequences(reference, config).forward({0: PROMPTS[0]})
    assert (got - exact).abs().max() < 0.05 * exact.abs().max(), ids


def test_act_order_groups_are_requantized_in_the_4bit_mode(tmp_path, default_model_dir):
    """Act-order groups do not run along blocks of 32: the layer is
    quantized from its dense weight, and still serves."""
    quant_dir, _ = quantized_pair(tmp_path, default_model_dir, "gptq-int4-act-order")
    quant = resolve_quant("auto", quant_dir, torch.device("cpu"))
    model, config = load_model(quant_dir, torch.float32, "cpu", quant)
    assert len(greedy(model, config, PROMPTS, 4)[0]) == 4


@pytest.mark.parametrize("fmt", ["gptq-int4-sym", "fp8-block"])
def test_moe_experts_in_quantized_checkpoints(tmp_path, default_model_dir, fmt):
    """Qwen3-MoE with quantized experts, dequantized at load with
    --torchao-config none (auto's modes for them: tests/test_moe_quant.py)."""
    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, fmt, "qwen3_moe")
    from safetensors import safe_open

    with safe_open(str(quant_dir / "model.safetensors"), "pt") as f:
        marker = "qweight" if fmt.startswith("gptq") else "weight_scale_inv"
        assert f"model.layers.0.mlp.experts.3.down_proj.{marker}" in f.keys()
    model, config = load_model(quant_dir, torch.float32, "cpu")
    assert greedy(model, config, PROMPTS, NEW_TOKENS) == hf_greedy(dense_dir)


def test_quantization_flag_forces_or_refuses(tmp_path, default_model_dir):
    quant_dir, _ = quantized_pair(tmp_path, default_model_dir, "awq-int4-g64")
    load_model(quant_dir, torch.float32, "cpu", quantization="awq")
    with pytest.raises(ValueError, match="says awq"):
        load_model(quant_dir, torch.float32, "cpu", quantization="gptq")
    with pytest.raises(ValueError, match="--quantization none"):
        resolve_quant("auto", quant_dir, torch.device("cpu"), quantization="none")
    config = json.loads((quant_dir / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "hqq"
    (quant_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'hqq' is not served"):
        load_model(quant_dir, torch.float32, "cpu")


# compressed-tensors checkpoints written by llm-compressor itself (data-free
# schemes: round-to-nearest weights, no calibration set needed). Tiny shapes
# its 128-wide groups and blocks divide.
CT_SCHEMES = ["W4A16", "W4A16_ASYM", "W8A8", "FP8_DYNAMIC", "FP8_BLOCK"]
CT_SHAPE = dict(hidden_size=128, intermediate_size=256, head_dim=32)


def compressed_pair(tmp_path, default_model_dir, scheme: str, arch: str = "llama"):
    """(llm-compressor's checkpoint, the weights compressed-tensors decompresses it to, as a float copy)."""
    pytest.importorskip("llmcompressor")
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    float_dir = build_tiny_model(tmp_path / "float", arch, tokenizer_dir=default_model_dir, **CT_SHAPE)
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head", "re:.*mlp.gate$"]))
    out = tmp_path / scheme
    model.save_pretrained(out, save_compressed=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (float_dir / name).is_file():
            (out / name).write_bytes((float_dir / name).read_bytes())
    decompressed = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)).state_dict()
    original = load_file(float_dir / "model.safetensors")
    down = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(decompressed[down], original[down])  # the reference is the quantized weight
    names = original.keys()
    return out, dense_copy(float_dir, tmp_path / f"{scheme}-dense", {k: decompressed[k] for k in names})


@pytest.mark.parametrize("scheme", CT_SCHEMES)
def test_llm_compressor_checkpoints_match_transformers(tmp_path, default_model_dir, scheme):
    quant_dir, dense_dir = compressed_pair(tmp_path, default_model_dir, scheme)
    model, config = load_model(quant_dir, torch.float32, "cpu")
    reference, _ = load_model(dense_dir, torch.float32, "cpu")
    for (name, got), (_, want) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.allclose(got, want, rtol=0, atol=1e-6), name
    assert greedy(model, config, PROMPTS, NEW_TOKENS) == hf_greedy(dense_dir)
    quant = resolve_quant("auto", quant_dir, torch.device("cpu"))
    assert quant.bits == (4 if scheme.startswith("W4") else 8)
    assert len(greedy(*load_model(quant_dir, torch.float32, "cpu", quant), PROMPTS, 4)[0]) == 4


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3", "gemma2", "olmo2", "glm4", "granite", "smollm3",
                                  "mistral", "gemma3", "mixtral", "qwen2_moe"])
def test_every_family_serves_a_gptq_checkpoint(tmp_path, default_model_dir, arch):
    """q/k/v bias, fused qkv and gate_up (Phi-3), post-norms, experts: the
    quantized layers land where each family's float ones do."""
    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, "gptq-int4-sym", arch)
    model, config = load_model(quant_dir, torch.float32, "cpu")
    assert greedy(model, config, PROMPTS, NEW_TOKENS) == hf_greedy(dense_dir)


@pytest.mark.parametrize("mode", ["int4wo-64", "int4wo-32", "8da4w"])
def test_forced_4bit_modes_hold_the_checkpoints_codes(tmp_path, default_model_dir, mode):
    """AWQ groups of 64 in int4wo-64 as they are, in int4wo-32 and 8da4w as two groups each."""
    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, "awq-int4-g64")
    model, _ = load_model(quant_dir, torch.float32, "cpu", parse_quant(mode))
    reference, _ = load_model(dense_dir, torch.float32, "cpu")
    for name in ("self_attn.qkv_proj", "mlp.down_proj"):
        proj = model.layers[1].get_submodule(name)
        assert isinstance(proj, Q4_1Linear if mode == "8da4w" else Int4Linear)
        want = reference.layers[1].get_submodule(name).weight
        assert torch.allclose(proj.dense_weight(), want, rtol=0, atol=1e-6), name


@pytest.mark.parametrize("fmt", ["fp8-block", "fp8-tensor"])
@pytest.mark.parametrize("mode", ["int4wo-32", "8da4w"])
def test_forced_4bit_modes_quantize_an_fp8_checkpoints_values(tmp_path, default_model_dir, fmt, mode):
    """FP8 values are no 4-bit codes: a 4-bit mode (asked for, or inherited
    by a STANDALONE draft from its target) quantizes the checkpoint's dense
    weight, as it would the same weight in float."""
    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, fmt)
    model, _ = load_model(quant_dir, torch.float32, "cpu", parse_quant(mode))
    reference, _ = load_model(dense_dir, torch.float32, "cpu", parse_quant(mode))
    for name in ("self_attn.qkv_proj", "mlp.down_proj"):
        proj, want = model.layers[1].get_submodule(name), reference.layers[1].get_submodule(name)
        assert isinstance(proj, Q4_1Linear if mode == "8da4w" else Int4Linear)
        assert torch.equal(proj.dense_weight(), want.dense_weight()), name
