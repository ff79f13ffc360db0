"""LoRA adapters: PEFT adapters served by name over one base model, greedy
tokens identical to transformers + PEFT, adapters and the base model in the
same batch step, load and unload at run time, and a prefix cache that never
shares KV across adapters."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pyserve.engine.request import GenerateRequest, RequestError, SamplingParams
from tests.slow import slow
from tests.test_engine import started_engine

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 99, 3], [42] * 9, list(range(100, 121)), [7, 8]]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, out_dir, seed, r=4, alpha=16, targets=ALL_TARGETS, rslora=False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():  # large enough to change greedy tokens
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(out_dir)
    return str(out_dir)


def reference_tokens(model_dir, adapter_dir, prompt, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("lora")
    model_dir = tiny_llama_dir
    adapters = {
        "alpha": make_adapter(model_dir, root / "alpha", 1),
        "beta": make_adapter(model_dir, root / "beta", 2, r=8, alpha=8, targets=["q_proj", "v_proj", "down_proj"]),
        "rs": make_adapter(model_dir, root / "rs", 3, r=2, alpha=4, targets=["k_proj", "o_proj", "up_proj"],
                           rslora=True),
    }
    return model_dir, adapters


async def generate(engine, prompt, lora=None, n=8, salt=None):
    tokens, last = [], None
    req = GenerateRequest(prompt, SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True), lora=lora,
                          cache_salt=salt)
    async for out in engine.generate(req):
        tokens += out.token_ids
        last = out
    return tokens, last


def record_steps(engine):
    """Per forward pass: the adapter slots present and whether base-model tokens were in it too."""
    rank_model, seen = engine.runner.rank_model, []
    forward = rank_model.forward

    def recording(batch, *rest):  # rest: the hidden-state capture an EAGLE3 step passes
        grouped = sum(idx.numel() for _, idx in batch.lora.groups) if batch.lora else 0
        slots = frozenset(slot for slot, _ in batch.lora.groups) if batch.lora else frozenset()
        seen.append((slots, grouped < batch.input_ids.numel()))
        return forward(batch, *rest)

    rank_model.forward = recording
    return seen


def test_adapters_and_base_in_one_batch_match_transformers_peft(setup):
    model_dir, adapters = setup
    paths = ",".join(f"{name}={path}" for name, path in adapters.items())
    cases = [(p, name) for p in PROMPTS for name in (None, "alpha", "beta", "rs")]
    expected = [reference_tokens(model_dir, adapters[name] if name else None, p, 8) for p, name in cases]

    async def main():
        engine = await started_engine(model_dir, enable_lora=True, lora_paths=paths, max_lora_rank=8)
        try:
            seen = record_steps(engine)
            got = await asyncio.gather(*(generate(engine, p, name) for p, name in cases))
            return [tokens for tokens, _ in got], seen
        finally:
            await engine.shutdown()

    got, seen = asyncio.run(main())
    assert got == expected
    for p in PROMPTS:  # every adapter changes what the base model says
        base = expected[cases.index((p, None))]
        assert sum(expected[cases.index((p, name))] != base for name in ("alpha", "beta", "rs")) >= 2
    slots = {"alpha": 0, "beta": 1, "rs": 2}  # --lora-paths fills the slots in order
    assert any(s == frozenset(slots.values()) and base for s, base in seen), "never one step for all"


def test_unknown_adapter_names_those_loaded_and_lora_needs_the_flag(setup):
    model_dir, adapters = setup

    async def main():
        engine = await started_engine(model_dir, enable_lora=True, lora_paths=f"alpha={adapters['alpha']}")
        try:
            with pytest.raises(RequestError) as e:
                await generate(engine, [1, 2, 3], "gamma")
            assert e.value.code == "model_not_found" and "alpha" in e.value.message
        finally:
            await engine.shutdown()
        plain = await started_engine(model_dir)
        try:
            with pytest.raises(RequestError) as e:
                await generate(plain, [1, 2, 3], "alpha")
            assert e.value.code == "unknown_parameter" and "--enable-lora" in e.value.message
        finally:
            await plain.shutdown()

    asyncio.run(main())


def test_load_and_unload_while_requests_run(setup):
    model_dir, adapters = setup
    prompt = PROMPTS[2]
    expected_beta = reference_tokens(model_dir, adapters["beta"], prompt, 24)
    expected_alpha = reference_tokens(model_dir, adapters["alpha"], prompt, 8)

    async def main():
        engine = await started_engine(model_dir, enable_lora=True, max_loras_per_batch=1, max_lora_rank=8)
        try:
            await engine.adapters.load("beta", adapters["beta"])
            running = asyncio.create_task(generate(engine, prompt, "beta", n=24))
            while not any(s.output_ids for s in engine.scheduler.requests.values()):
                await asyncio.sleep(0.001)
            engine.adapters.unload("beta")  # the running request finishes under it
            with pytest.raises(RequestError):
                await generate(engine, prompt, "beta")
            with pytest.raises(ValueError, match="slots"):  # its slot is still in use
                await engine.adapters.load("alpha", adapters["alpha"])
            beta, _ = await running
            await engine.adapters.load("alpha", adapters["alpha"])
            alpha, _ = await generate(engine, prompt, "alpha")
            return beta, alpha
        finally:
            await engine.shutdown()

    beta, alpha = asyncio.run(main())
    assert beta == expected_beta and alpha == expected_alpha


def test_prefix_cache_never_shared_across_adapters(setup):
    model_dir, adapters = setup
    paths = f"alpha={adapters['alpha']},beta={adapters['beta']}"
    prompt = list(range(100, 140))

    async def main():
        engine = await started_engine(model_dir, enable_lora=True, lora_paths=paths, max_lora_rank=8)
        try:
            hits = []
            for name in ("alpha", "alpha", "beta", None, "beta"):
                _, last = await generate(engine, prompt, name, n=2)
                hits.append(last.cached_tokens)
            return hits
        finally:
            await engine.shutdown()

    alpha1, alpha2, beta1, base, beta2 = asyncio.run(main())
    assert alpha1 == 0 and alpha2 > 0  # the same adapter shares
    assert beta1 == 0 and base == 0  # another adapter, or the base model, does not
    assert beta2 > 0


@pytest.fixture(scope="module")
def speculative_setup(tmp_path_factory, eagle3_target, eagle3_heads):
    """Two adapters over the EAGLE3 tests' target, and its random head."""
    root = tmp_path_factory.mktemp("lora-speculative")
    adapters = {"alpha": make_adapter(eagle3_target, root / "alpha", 1),
                "beta": make_adapter(eagle3_target, root / "beta", 2, r=8, alpha=8,
                                     targets=["q_proj", "v_proj", "down_proj"])}
    return eagle3_target, adapters, eagle3_heads["random"]


# NGRAM chains and EAGLE3 trees verify under adapters as the other two do: those are slow.
@pytest.mark.parametrize("algorithm", ["NGRAM", pytest.param("NGRAM-tree", marks=slow),
                                       pytest.param("STANDALONE", marks=slow), "EAGLE3-tree"])
def test_speculative_decoding_verifies_under_each_requests_adapter(speculative_setup, algorithm):
    """Adapters and the base model in one batch, drafted: greedy tokens and
    logprobs as without speculation. The drafts come from the base model
    (STANDALONE's draft model, here the target itself) or a head over the
    adapted hidden states (EAGLE3, a tree); the verify rows run under each
    request's adapter."""
    from tests.test_speculative import repetitive, same, with_and_without

    model_dir, adapters, head = speculative_setup
    options = {
        "NGRAM": {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1},
        "NGRAM-tree": {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1,
                       "speculative_ngram_max_bfs_breadth": 4, "speculative_num_draft_tokens": 6},
        "STANDALONE": {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(model_dir),
                       "speculative_num_draft_tokens": 3},
        "EAGLE3-tree": {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head),
                        "speculative_num_draft_tokens": 6, "speculative_eagle_topk": 2,
                        "speculative_num_steps": 3},
    }[algorithm]
    greedy = {"temperature": 0, "ignore_eos": True}
    requests = [(prompt, {**greedy, **params, "lora": name}) for name in (None, "alpha", "beta")
                for prompt, params in ((repetitive(), {"max_new_tokens": 24}),
                                       ([5, 17, 99] * 3, {"max_new_tokens": 12, "logprobs": True, "top_logprobs": 2}))]
    paths = ",".join(f"{name}={path}" for name, path in adapters.items())
    plain, drafted, metrics = with_and_without(model_dir, requests, options,
                                               {"enable_lora": True, "lora_paths": paths, "max_lora_rank": 8})
    same(plain, drafted)
    assert metrics.spec_verify_steps > 0
    by_adapter = [[tokens for _, tokens, _, _ in plain[i::2]] for i in range(2)]
    assert all(len({tuple(t) for t in outputs}) == 3 for outputs in by_adapter)  # each adapter changes the output


def test_a_quantized_base_stays_quantized_and_adds_the_float_adapter(setup):
    """8da4w on a CPU: the torch layers run (the native ones have no
    adapter hooks), each projection still 4-bit, and its output under an
    adapter is the quantized base's plus x A^T B^T * scaling in float."""
    from safetensors.torch import load_file

    from pyserve.lora.batch import LoraBatch
    from pyserve.model.cpu.blocks import Q4_1Linear

    model_dir, adapters = setup

    async def main():
        engine = await started_engine(model_dir, torchao_config="8da4w", enable_lora=True,
                                      lora_paths=f"alpha={adapters['alpha']}")
        try:
            tokens, _ = await generate(engine, PROMPTS[0], "alpha")
            return engine.runner.rank_model, tokens
        finally:
            await engine.shutdown()

    rank_model, tokens = asyncio.run(main())
    assert len(tokens) == 8 and rank_model.native_layers is None
    layer = rank_model.model.layers[1]
    weights = load_file(f"{adapters['alpha']}/adapter_model.safetensors")
    scaling = 16 / 4  # make_adapter's lora_alpha / r

    def pair(target, block):
        prefix = f"base_model.model.model.layers.1.{block}.{target}"
        return weights[f"{prefix}.lora_A.weight"], weights[f"{prefix}.lora_B.weight"] * scaling

    torch.manual_seed(0)
    for module, targets, block in ((layer.mlp.down_proj, ["down_proj"], "mlp"),
                                   (layer.self_attn.qkv_proj, ["q_proj", "k_proj", "v_proj"], "self_attn")):
        assert isinstance(module, Q4_1Linear)  # 8da4w's 4-bit blocks
        x = torch.randn(5, pair(targets[0], block)[0].shape[1])
        for per_token in ([0, 0, -1, 0, -1], [0] * 70):  # the padded path and the grouped one
            xs = x.repeat(len(per_token) // 5 + 1, 1)[: len(per_token)]
            lora = rank_model.lora
            with torch.inference_mode():
                lora.current = None
                base = module(xs)
                lora.current = LoraBatch.of_tokens(torch.tensor(per_token))
                adapted = module(xs)
                lora.current = None
            want = torch.cat([xs @ a.T @ b.T for a, b in (pair(t, block) for t in targets)], dim=1)
            want[torch.tensor(per_token) < 0] = 0
            torch.testing.assert_close(adapted - base, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("per_token", [[2, -1, 2, 3, -1], [3] * 5, [2, 0, -1, 2, 0] * 14], ids=["gaps", "one-slot",
                                                                                                 "grouped"])
def test_each_token_gets_its_own_adapters_product(per_token):
    """Padded (short steps) or group by group (long ones): token t's output
    gains x_t A_s^T B_s^T for its slot s, base tokens nothing."""
    from pyserve.lora.batch import LoraBatch
    from pyserve.lora.slots import _Projection

    torch.manual_seed(0)
    projection = _Projection(4, 3, 2, 8, 10, torch.float32, "cpu")
    projection.A.normal_()
    projection.B.normal_()
    x, out = torch.randn(len(per_token), 8), torch.randn(len(per_token), 10)
    want = out.clone()
    for t, slot in enumerate(per_token):
        if slot >= 0:
            want[t] += projection.B[slot] @ (projection.A[slot] @ x[t])
    projection.add_delta(x, out, LoraBatch.of_tokens(torch.tensor(per_token)))
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("argv", [["a=/p", "b=/q"], ["a=/p,b=/q"], ["a=/p,", "b=/q"]],
                         ids=["sglang-spaces", "commas", "both"])
def test_lora_paths_take_sglangs_space_separated_form(argv):
    from pyserve.engine.adapters import parse_lora_paths
    from pyserve.server_args import ServerArgs

    args = ServerArgs.from_cli(["--model-path", "m", "--enable-lora", "--lora-paths", *argv, "--max-lora-rank", "8"])
    assert parse_lora_paths(args.lora_paths) == {"a": "/p", "b": "/q"} and args.max_lora_rank == 8
