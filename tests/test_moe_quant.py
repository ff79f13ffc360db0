"""Mixture-of-experts models in the CPU quantized modes (--torchao-config):
each expert (and Qwen2-MoE's shared expert) becomes one layer of the mode,
run by the grouped path, and the model answers as transformers does on the
same quantized weights.

The reference is transformers' own model with pyserve's stored expert
weights dequantized into it (int8 codes times their row scales, the 4-bit
layers' dense_weight) and its other linear layers quantized by the same
per-row functions pyserve's layers use (a row's codes do not depend on the
rows fused beside it; the test checks that on the shared expert). What is
left between the two is the kernels' rounding of activations (bf16 for
int8wo and int4wo, 8-bit blocks for 8da4w), and the odd routing flip it
causes: bounded below, with the greedy tokens equal wherever
the reference's lead is clear. That bound is the test's choice over
"identical tokens": on these tiny random models float32's own lead
between its two best tokens is often under 0.1."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from pyserve.model.cpu import blocks
from pyserve.model.cpu.blocks import Q4_1Linear, Q8_0Linear
from pyserve.model.layers.moe import MoEBlock
from pyserve.model.loader import load_model
from pyserve.model.quant import Int4Linear, Int8Linear, WeightQuant, parse_quant, resolve_quant
from tests.slow import slow, slow_test
from tests.test_model_vs_hf import CachedSequences, random_prompts
from tests.tiny_models import build_tiny_model

# Expert shapes the 4-bit kernels hold: inputs in whole blocks of 32 on either of two ranks.
SHAPES = {
    "mixtral": dict(intermediate_size=128),
    "qwen2_moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=128),
    "qwen3_moe": dict(moe_intermediate_size=64, decoder_sparse_step=2),
    "gpt_oss": dict(intermediate_size=64),
    "glm4_moe": dict(moe_intermediate_size=64),
    "minimax_m2": dict(intermediate_size=64),
}
MODES = ["int8wo", "int4wo-32", "8da4w"]
NEW_TOKENS = 8
# The median over greedy steps of a step's mean |logprob difference| to the
# reference, per mode: what the kernels' activation rounding moves
# (measured on these models: 0.01-0.03 for int8wo and int4wo-32, 0.04-0.07
# for 8da4w; against float32's weights the 4-bit modes are 0.45-0.9 off). A
# median, since a near tie in a router sends the odd step to another expert
# (one gpt-oss step in 8da4w: 0.6).
MEDIAN_ATOL = {"int8wo": 0.05, "int4wo-32": 0.05, "8da4w": 0.1}
CLEAR_LEAD = 0.6  # a reference token this far ahead of its runner-up must be pyserve's too
# Of all greedy steps, pyserve's token is the reference's in at least this
# share (measured 19 to 24 of 24; float32's own leads are often under 0.1).
AGREE = 2 / 3


def dense_of(layer: nn.Module) -> torch.Tensor:
    """The float32 weight [out, in] a (quantized) layer multiplies by."""
    if isinstance(layer, Int8Linear):
        return layer.weight.float() * layer.scales.float()[:, None]
    if isinstance(layer, (Int4Linear, Q4_1Linear, Q8_0Linear)):
        return layer.dense_weight()
    return layer.weight.float()


def requantized(weight: torch.Tensor, quant: WeightQuant, expert: bool = False) -> torch.Tensor:
    """`weight` quantized as pyserve's layers of `quant` do, dequantized
    (an int4wo expert's as its kernel multiplies: it keeps no float copy)."""
    if quant.bits == 8:
        return dense_of(Int8Linear.quantize(weight))
    if quant.int8_activations:
        return dense_of(Q4_1Linear.quantize(weight))
    return dense_of(Int4Linear.quantize(weight, quant.group_size, dense_copy=not expert))


def _head(weight: torch.Tensor, quant: WeightQuant) -> torch.Tensor:
    return dense_of(Q8_0Linear.quantize(weight) if quant.int8_activations else Int8Linear.quantize(weight))


def dequantized_transformers(model_dir, model, quant: WeightQuant, requantize: bool = True, dense: tuple = ()):
    """transformers' model of `model_dir` holding the weights pyserve's
    quantized `model` multiplies by (`requantize` False: its linear layers
    are those weights already, the vocabulary projection aside; `dense`
    names the linear layers pyserve keeps in float32)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gpt_oss = hf.config.model_type == "gpt_oss"
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name == "lm_head":
                module.weight.copy_(_head(module.weight, quant))
            elif (requantize and isinstance(module, nn.Linear) and name.rpartition(".")[2] not in dense
                  and not re.search(r"(^|\.)(gate|router|shared_expert_gate)$", name)):
                module.weight.copy_(requantized(module.weight, quant, expert="shared_expert." in name))
            if not isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
                continue
            block = model.layers[int(re.search(r"layers\.(\d+)\.", name).group(1))].mlp
            for e in range(len(block.w13)):
                w13, w2 = dense_of(block.w13[e]), dense_of(block.w2[e])
                if gpt_oss:  # [H, 2I] with gate and up interleaved; down [I, H]
                    half = w13.shape[0] // 2
                    module.gate_up_proj[e].copy_(torch.stack([w13[:half], w13[half:]], dim=1).flatten(0, 1).T)
                    module.down_proj[e].copy_(w2.T)
                else:
                    module.gate_up_proj[e].copy_(w13)
                    module.down_proj[e].copy_(w2)
    return hf


def teacher_forced_logprobs(model, config, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """pyserve's log-probabilities [len(tokens), vocab] before each of `tokens`, fed one decode step at a time."""
    seqs = CachedSequences(model, config)
    steps = [seqs.forward({0: prompt})[0]]
    steps += [seqs.forward({0: [t]})[0] for t in tokens[:-1]]
    return torch.stack(steps).log_softmax(-1)


def hf_greedy_logprobs(hf, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
        logprobs = hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
    return gen, logprobs


def assert_answers_like_reference(model, config, hf, prompts, atol: float, float_hf=None) -> None:
    """Along the reference's greedy answer to each prompt, pyserve's
    logprobs are within `atol` of it (MEDIAN_ATOL's measure), and its
    greedy token is the reference's at each step where that leads by
    CLEAR_LEAD, and in AGREE of all steps. With `float_hf` (float32's
    weights), pyserve is four times closer to the reference than to
    float32: the reference holds the weights pyserve runs."""
    agree, off, off_float = 0, [], []
    for prompt in prompts:
        tokens, want = hf_greedy_logprobs(hf, prompt, NEW_TOKENS)
        got = teacher_forced_logprobs(model, config, prompt, tokens)
        off.append((got - want).abs().mean(-1))
        if float_hf is not None:
            with torch.no_grad():
                exact = float_hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            off_float.append((got - exact).abs().mean(-1))
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > CLEAR_LEAD
        assert got.argmax(-1)[clear].tolist() == torch.tensor(tokens)[clear].tolist()
        agree += (got.argmax(-1) == torch.tensor(tokens)).sum().item()
    median = torch.cat(off).median().item()
    assert median < atol, median
    if off_float:
        assert 4 * median < torch.cat(off_float).median().item()
    assert agree >= AGREE * len(prompts) * NEW_TOKENS, agree


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", [pytest.param(arch, marks=slow) if arch in ("glm4_moe", "minimax_m2") else arch
                                  for arch in SHAPES])
def test_quantized_experts_answer_like_transformers_on_the_same_weights(tmp_path, arch, mode):
    model_dir = build_tiny_model(tmp_path, arch, **SHAPES[arch])
    quant = parse_quant(mode)
    model, config = load_model(model_dir, torch.float32, "cpu", quant)
    kind = {"int8wo": Int8Linear, "int4wo-32": Int4Linear, "8da4w": Q4_1Linear}[mode]
    moe = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoEBlock)]
    assert moe and all(isinstance(w, kind) for block in moe for w in [*block.w13, *block.w2])
    assert not any(isinstance(m, nn.Linear) for m in model.layers.modules())  # nothing left dense
    hf = dequantized_transformers(model_dir, model, quant)
    if arch == "qwen2_moe":  # the shared expert: pyserve's own fused layer is the reference's rows
        shared = moe[0].shared_w13
        assert isinstance(shared, kind)
        reference = hf.model.layers[0].mlp.shared_expert
        want = torch.cat([reference.gate_proj.weight, reference.up_proj.weight])
        assert torch.equal(dense_of(shared), want)
    float_hf = None
    if quant.bits == 4:
        import transformers

        float_hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(config.vocab_size, [3, 17, 9])
    assert_answers_like_reference(model, config, hf, prompts, MEDIAN_ATOL[mode], float_hf)


FOUR_BIT = "8da4w" if blocks.available() else "int4wo-32"


@pytest.mark.parametrize("fmt, mode", [("gptq-int4-sym", FOUR_BIT),
                                       ("awq-int4-g64", "8da4w" if blocks.available() else "int4wo-64"),
                                       ("fp8-block", "int8wo")])
def test_quantized_checkpoint_experts_run_in_its_natural_mode(tmp_path, default_model_dir, fmt, mode):
    """`auto` on a Qwen3-MoE whose experts are quantized: 4-bit experts are
    built from the checkpoint's own codes (each expert's weight is the
    checkpoint's, exactly), FP8 ones dequantized into int8wo; the model
    answers as transformers does on those weights."""
    from tests.test_quantized_checkpoints import quantized_pair

    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, fmt, "qwen3_moe", **SHAPES["qwen3_moe"])
    quant = resolve_quant("auto", quant_dir, torch.device("cpu"))
    assert quant.name == mode
    model, config = load_model(quant_dir, torch.float32, "cpu", quant)
    reference, _ = load_model(dense_dir, torch.float32, "cpu")
    block, want = model.layers[1].mlp, reference.layers[1].mlp
    for e in range(len(block.w13)):
        for got, dense in ((block.w13[e], want.w13[e]), (block.w2[e], want.w2[e])):
            if quant.bits == 4:
                assert torch.allclose(dense_of(got), dense, rtol=0, atol=1e-6)
            else:
                assert isinstance(got, Int8Linear) and torch.equal(dense_of(got), requantized(dense, quant))
    # The checkpoint's own 4-bit weights are the reference's as they are.
    hf = dequantized_transformers(dense_dir, model, quant, requantize=quant.bits == 8)
    prompts = random_prompts(config.vocab_size, [3, 17, 9])
    atol = MEDIAN_ATOL["8da4w" if quant.int8_activations else "int8wo"]
    assert_answers_like_reference(model, config, hf, prompts, atol)


@slow_test
def test_auto_serves_a_gptq_qwen3_moe_to_the_openai_client(tmp_path, default_model_dir):
    """`pyserve --model DIR` with its defaults on a GPTQ-int4 Qwen3-MoE: auto
    runs its experts in the 4-bit mode from their codes; greedy completions
    and their logprobs are what the same quantized model gives in process."""
    import openai
    import transformers
    from tests.conftest import ServerProcess
    from tests.test_quantized_checkpoints import quantized_pair

    quant_dir, _ = quantized_pair(tmp_path, default_model_dir, "gptq-int4-sym", "qwen3_moe", **SHAPES["qwen3_moe"])
    model, config = load_model(quant_dir, torch.float32, "cpu", resolve_quant("auto", quant_dir, torch.device("cpu")))
    prompts = random_prompts(config.vocab_size, [4, 11], seed=3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(quant_dir)
    srv = ServerProcess("--model", str(quant_dir), "--max-total-tokens", "2048")
    try:
        client = openai.OpenAI(api_key="EMPTY", base_url=f"{srv.base_url}/v1", timeout=120)
        name = client.models.list().data[0].id
        for prompt in prompts:
            choice = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                               logprobs=1, extra_body={"ignore_eos": True}).choices[0]
            expected = _greedy(model, config, prompt, NEW_TOKENS)
            logprobs = teacher_forced_logprobs(model, config, prompt, expected)
            assert choice.text == tokenizer.decode(expected)
            want = [logprobs[i, t].item() for i, t in enumerate(expected)]
            assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-3)
    finally:
        srv.stop()


def _greedy(model, config, prompt: list[int], n: int) -> list[int]:
    seqs = CachedSequences(model, config)
    tokens = [int(seqs.forward({0: prompt})[0].argmax())]
    while len(tokens) < n:
        tokens.append(int(seqs.forward({0: [tokens[-1]]})[0].argmax()))
    return tokens


def expert_bytes(block: MoEBlock) -> int:
    """What a block's experts (and shared expert) hold in memory."""
    held = [block.w13, block.w2, block.shared_w13, block.shared_w2]
    return sum(t.nbytes for w in held if w is not None
               for t in ([w] if isinstance(w, torch.Tensor) else [*w.parameters(), *w.buffers()]))


@pytest.mark.parametrize("mode, share", [("int8wo", 0.26), ("int4wo-32", 0.17), ("8da4w", 0.19)])
def test_quantized_experts_take_a_fraction_of_float32s_memory(mode, share):
    """An expert layer of 8 experts, hidden 512, intermediate 256, and a
    shared expert: int8 codes with a scale per row (a quarter of float32's
    bytes), 4-bit codes with their group scales (int4wo keeps only its
    kernel's copy for an expert), Q4_1's 20 bytes per 32 weights."""
    from pyserve.model.layers.moe import MoESpec
    from pyserve.model.quant import quantize_model

    spec = MoESpec(num_experts=8, top_k=2, hidden=512, intermediate=256, shared_intermediate=256, shared_gate=True)
    block = MoEBlock(spec)
    for p in block.parameters():
        p.data.normal_()
    before = expert_bytes(block)
    holder = nn.Module()
    holder.block, holder.embed_tokens, holder.lm_head = block, nn.Embedding(64, 512), None
    x = torch.randn(5, 512)
    dense = block(x)
    quantize_model(holder, parse_quant(mode))
    assert expert_bytes(block) <= share * before
    assert ((block(x) - dense).norm() / dense.norm()).item() < 0.15  # the same block, to 4 or 8 bits
