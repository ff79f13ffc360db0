"""8da4w decode and prefill steps through rust/kernels/decode_layer.rs
(pyserve/model/cpu/native_layers.py): the same logits as the torch layers, the
embedded model's answers through the engine, and the layouts it leaves to
torch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.model.cpu import native_layers
from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.layers.causal_lm import AuxCapture
from pyserve.model.loader import load_model
from pyserve.model.quant import parse_quant
from pyserve.model.step_plan import Layers, StepPlan
from pyserve.server_args import ServerArgs
from tests.test_quant import ANSWER_TOKENS, PLAIN_PROMPTS, assert_answers_start_as_float32
from tests.tiny_models import build_tiny_model

PROMPT_LENGTHS = (5, 11, 8)  # unequal: the decode step pads the shorter rows' slots


def _decode_logits(model, config, native: bool, capture: AuxCapture | None = None) -> torch.Tensor:
    """Logits of one decode step over three sequences prefilled by the torch
    layers, the step's layers native or not (filling `capture`)."""
    kv = KVBuffer(config.num_hidden_layers, 64, config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
    attn = TorchAttention(kv)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    slots, next_slot = [], 1  # slot 0 pads
    ids, positions, fresh = [], [], []
    for p in prompts:
        new = torch.arange(next_slot, next_slot + len(p))
        next_slot += len(p)
        slots.append(new)
        fresh.append(new)
        ids += p
        positions += range(len(p))
    ends = torch.tensor(PROMPT_LENGTHS).cumsum(0) - 1
    with torch.inference_mode():
        prefill = model(ForwardBatch.build(ids, positions, torch.cat(fresh), list(PROMPT_LENGTHS), slots,
                                           ends.tolist(), False, "cpu"), attn)
        new = torch.arange(next_slot, next_slot + len(prompts))
        slots = [torch.cat([s, new[i : i + 1]]) for i, s in enumerate(slots)]
        step = ForwardBatch.build(prefill.argmax(-1).tolist(), list(PROMPT_LENGTHS), new, [1] * len(prompts),
                                  slots, list(range(len(prompts))), True, "cpu")
        if not native:
            return model(step, attn, capture=capture)
        return model(step, attn, StepPlan(Layers.NATIVE_DECODE), native_layers.NativeDecode(model), capture)


@pytest.mark.parametrize("arch, overrides", [
    pytest.param("llama", {}, id="llama-gqa"),
    pytest.param("qwen2", {"num_key_value_heads": 1}, id="qwen2-qkv-bias"),
    pytest.param("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, id="llama-scaled-rope"),
])
def test_native_decode_step_gives_the_torch_layers_logits(tmp_path, default_model_dir, arch, overrides):
    """Norms, rotary, grouped KV heads, the q/k/v bias, the KV write and each
    row's own slots: a wrong one moves the logits far past the tolerance.
    Not bit-exact: the two paths sum floats in other orders (measured:
    3e-7 of the largest logit)."""
    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir, **overrides)
    model, config = load_model(model_dir, torch.float32, "cpu", parse_quant("8da4w"))
    assert native_layers.unfit_reason(model) is None
    # The hidden states entering the first and the last layer, as an EAGLE-3 head reads them.
    kept = frozenset([0, config.num_hidden_layers - 1])
    torch_kept, native_kept = AuxCapture(kept), AuxCapture(kept)
    torch_logits = _decode_logits(model, config, native=False, capture=torch_kept)
    native_logits = _decode_logits(model, config, native=True, capture=native_kept)
    assert native_logits.shape == torch_logits.shape == (len(PROMPT_LENGTHS), config.vocab_size)
    scale = torch_logits.abs().max()
    assert (native_logits - torch_logits).abs().max() < 1e-4 * scale
    assert (native_logits.argmax(-1) == torch_logits.argmax(-1)).all()
    assert len(native_kept.states) == len(torch_kept.states) == 2
    for native_state, torch_state in zip(native_kept.states, torch_kept.states):
        assert native_state.shape == torch_state.shape == (len(PROMPT_LENGTHS), config.hidden_size)
        assert (native_state - torch_state).abs().max() < 1e-4 * torch_state.abs().max()


def _extend_logits(model, config, native: bool) -> tuple[torch.Tensor, int]:
    """Logits at every new token of one prefill step (a fresh 9-token prompt,
    and 6 tokens after a cached prefix of 20 that the torch layers wrote
    first), its layers native or not; and how many times the native
    prefill layers ran. Both attend with the native extend kernel, as
    RankModel plans 8da4w prefill chunks."""
    kv = KVBuffer(config.num_hidden_layers, 64, config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
    attn = TorchAttention(kv)
    generator = torch.Generator().manual_seed(1)
    prefix, chunk, fresh = (torch.randint(3, 400, (n,), generator=generator).tolist() for n in (20, 6, 9))
    prefix_slots, chunk_slots, fresh_slots = torch.arange(1, 21), torch.arange(21, 27), torch.arange(27, 36)
    ran = []
    runner = native_layers.NativeDecode(model)
    run_extends = runner.run_extends
    runner.run_extends = lambda *a: ran.append(1) or run_extends(*a)
    with torch.inference_mode():
        model(ForwardBatch.build(prefix, list(range(20)), prefix_slots, [20], [prefix_slots], [19], False, "cpu"),
              attn)
        step = ForwardBatch.build(chunk + fresh, list(range(20, 26)) + list(range(9)),
                                  torch.cat([chunk_slots, fresh_slots]), [6, 9],
                                  [torch.cat([prefix_slots, chunk_slots]), fresh_slots], list(range(15)), False, "cpu")
        plan = StepPlan(Layers.NATIVE_EXTENDS if native else Layers.TORCH, native_extend_attention=True)
        return model(step, attn, plan, runner), len(ran)


@pytest.mark.parametrize("arch, overrides", [
    pytest.param("llama", {}, id="llama-gqa"),
    pytest.param("qwen2", {"num_key_value_heads": 1}, id="qwen2-qkv-bias"),
])
def test_native_prefill_step_gives_the_torch_layers_logits(tmp_path, default_model_dir, arch, overrides):
    """A prefill chunk over a cached prefix beside a fresh prompt: each new
    token's logits as the torch layers give them (the same kernels for the
    products and the attention; norms, rotary and the rest in other orders)."""
    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir, **overrides)
    model, config = load_model(model_dir, torch.float32, "cpu", parse_quant("8da4w"))
    torch_logits, ran = _extend_logits(model, config, native=False)
    assert ran == 0
    native_logits, ran = _extend_logits(model, config, native=True)
    assert ran == 1, "the native prefill layers did not run"
    assert native_logits.shape == torch_logits.shape == (15, config.vocab_size)
    scale = torch_logits.abs().max()
    assert (native_logits - torch_logits).abs().max() < 1e-4 * scale
    assert (native_logits.argmax(-1) == torch_logits.argmax(-1)).all()


def _verify_logits(model, config, plan: StepPlan, rows: list[int]) -> torch.Tensor:
    """Two sequences prefilled by the torch layers (lengths 12 and 17),
    then one step with `rows` new tokens each (a verify step's: a known
    token and drafts; 1 is a plain decode row) run as `plan` says; the
    logits at every new token."""
    kv = KVBuffer(config.num_hidden_layers, 64, config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
    attn = TorchAttention(kv)
    generator = torch.Generator().manual_seed(2)
    lengths = (12, 17)
    ids = torch.randint(3, 400, (sum(lengths) + sum(rows),), generator=generator).tolist()
    slots = [torch.arange(1, 13), torch.arange(13, 30)]
    with torch.inference_mode():
        model(ForwardBatch.build(ids[:29], list(range(12)) + list(range(17)), torch.arange(1, 30), list(lengths),
                                 slots, [11, 28], False, "cpu"), attn)
        new = [torch.arange(30, 30 + rows[0]), torch.arange(30 + rows[0], 30 + sum(rows))]
        positions = list(range(12, 12 + rows[0])) + list(range(17, 17 + rows[1]))
        step = ForwardBatch.build(ids[29:], positions, torch.cat(new), list(rows),
                                  [torch.cat([s, n]) for s, n in zip(slots, new)], list(range(sum(rows))),
                                  rows == [1, 1], "cpu")
        return model(step, attn, plan, native_layers.NativeDecode(model))


def test_native_verify_step_with_a_decode_row_gives_the_torch_layers_logits(tmp_path, default_model_dir):
    """A verify step of one drafted sequence (a token and 5 drafts) beside
    an undrafted one, natively: every row's logits as the torch layers give
    them, and the undrafted row's exactly what a decode step gives it (the
    same attention kernel, products that do not depend on the rows beside
    them), so a request's tokens do not depend on its neighbour's drafts."""
    model_dir = build_tiny_model(tmp_path, "llama", tokenizer_dir=default_model_dir)
    model, config = load_model(model_dir, torch.float32, "cpu", parse_quant("8da4w"))
    native = _verify_logits(model, config, StepPlan(Layers.NATIVE_EXTENDS, native_extend_attention=True), [1, 6])
    torch_logits = _verify_logits(model, config, StepPlan(Layers.TORCH, native_extend_attention=True), [1, 6])
    assert native.shape == torch_logits.shape == (7, config.vocab_size)
    assert (native - torch_logits).abs().max() < 1e-4 * torch_logits.abs().max()
    assert (native.argmax(-1) == torch_logits.argmax(-1)).all()
    decode = _verify_logits(model, config, StepPlan(Layers.NATIVE_DECODE), [1, 1])
    assert torch.equal(native[0], decode[0])


def test_layouts_the_native_layer_does_not_run_keep_torch(tmp_path, default_model_dir):
    qwen3 = build_tiny_model(tmp_path / "qwen3", "qwen3", tokenizer_dir=default_model_dir)
    assert "q and k" in native_layers.unfit_reason(load_model(qwen3, torch.float32, "cpu", parse_quant("8da4w"))[0])
    llama = build_tiny_model(tmp_path / "llama", "llama", tokenizer_dir=default_model_dir)
    assert "Q4_1" in native_layers.unfit_reason(load_model(llama, torch.float32, "cpu", parse_quant("int4wo-32"))[0])
    assert "bfloat16" in native_layers.unfit_reason(load_model(llama, torch.bfloat16, "cpu", parse_quant("8da4w"))[0])


def test_engine_decodes_the_embedded_model_natively_and_answers_like_float32(default_model_dir):
    """Through the engine (--enable-torch-compile too: nothing is left to
    compile), greedy answers start as float32's (see
    assert_answers_start_as_float32 for how far)."""
    from pyserve._rust import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    prompts = [tok.encode(t) for t in PLAIN_PROMPTS]

    async def answers(**options):
        engine = Engine.from_args(ServerArgs(model_path=str(default_model_dir), max_total_tokens=2048, **options))
        await engine.start()
        try:
            params = SamplingParams(max_new_tokens=ANSWER_TOKENS, temperature=0, ignore_eos=True)

            async def one(ids):
                return [t async for out in engine.generate(GenerateRequest(ids, params)) for t in out.token_ids]

            return await asyncio.gather(*[one(p) for p in prompts]), engine.runner.rank_model
        finally:
            await engine.shutdown()

    reference, _ = asyncio.run(answers(torchao_config="none"))
    native, rank = asyncio.run(answers(torchao_config="8da4w", enable_torch_compile=True))
    assert rank.native_layers is not None and rank.model.compiled_decode_layer is None
    assert_answers_start_as_float32(reference, native)
