"""--enable-torch-compile: compiled decode steps compute what eager ones do."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.model.loader import load_model
from pyserve.model.step_plan import TORCH_STEP, Layers, StepPlan
from tests.slow import slow_test
from tests.test_model_vs_hf import CachedSequences, random_prompts
from tests.tiny_models import build_tiny_model


def greedy_with_logits(model, config, prompts, n, decode_plan: StepPlan = TORCH_STEP):
    seqs = CachedSequences(model, config, decode_plan=decode_plan)
    seqs.attn.compiled_decode = decode_plan.layers is Layers.COMPILED_DECODE
    logits = [seqs.forward(dict(enumerate(prompts)))]
    outputs = [[t] for t in logits[-1].argmax(-1).tolist()]
    for _ in range(n - 1):
        logits.append(seqs.forward({i: [o[-1]] for i, o in enumerate(outputs)}))
        for out, t in zip(outputs, logits[-1].argmax(-1).tolist()):
            out.append(t)
    return outputs, torch.stack(logits)


@slow_test  # inductor compiles on 2 cores: about a minute
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # Gemma 3: sliding layers, two rotary tables
def test_compiled_decode_gives_the_eager_tokens(tmp_path, arch):
    """Decode batches of different lengths (padded attention) and batch
    sizes 1 and several: same greedy tokens, logits equal to float32 rounding."""
    model_dir = build_tiny_model(tmp_path, arch)
    model, config = load_model(model_dir, torch.float32, "cpu")
    for prompts in (random_prompts(512, [5]), random_prompts(512, [3, 9, 4])):
        eager, eager_logits = greedy_with_logits(model, config, prompts, 8)
        model.compile_decode(TorchAttention.attend_decode)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        compiled, compiled_logits = greedy_with_logits(model, config, prompts, 8, StepPlan(Layers.COMPILED_DECODE))
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs  # the compiled layer ran
        assert compiled == eager
        torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4, rtol=1e-4)


@slow_test  # the first compile in a process warms inductor up: 20 to 35 s on 2 cores
@pytest.mark.parametrize("quant, arch", [("none", "llama"), ("8da4w", "qwen3")])
def test_engine_with_compiled_decode_gives_the_eager_tokens(tmp_path, default_model_dir, quant, arch):
    """--enable-torch-compile through the engine: requests alone and batched
    (unequal lengths, page size 4) give eager's greedy tokens, and the
    compiled layer is what ran; in float32 and with the block kernels
    (8da4w), which the graph calls as opaque ops (on Qwen3, whose q/k norms
    the native decode layer leaves to torch)."""
    from tests.test_engine import PROMPTS, collect, run, started_engine

    model_dir = build_tiny_model(tmp_path, arch, tokenizer_dir=default_model_dir)

    async def tokens(**options):
        engine = await started_engine(model_dir, page_size=4, torchao_config=quant, **options)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        alone = [await collect(engine, p, max_new_tokens=6, temperature=0, ignore_eos=True) for p in PROMPTS[:2]]
        together = await asyncio.gather(
            *[collect(engine, p, max_new_tokens=6, temperature=0, ignore_eos=True) for p in PROMPTS])
        compiled_now = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        await engine.shutdown()
        return [t[1] for t in alone] + [t[1] for t in together], compiled_now

    eager, _ = run(tokens())
    torch._dynamo.reset()  # the other parametrization's graphs would count against the recompile limit
    compiled, compiled_during_requests = run(tokens(enable_torch_compile=True))
    assert compiled == eager
    assert compiled_during_requests == 0  # start-up compiled every shape the requests needed


@slow_test  # two engines started in a fresh interpreter
def test_eager_decode_steps_leave_torch_dynamo_unimported(default_model_dir):
    """Without --enable-torch-compile nothing marks dynamic sizes, so the
    first request does not pay for importing torch._dynamo (about 1.5 s
    on these cores)."""
    script = f"""
import asyncio, sys
from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.server_args import ServerArgs

async def main():
    for quant in ("none", "8da4w"):
        engine = Engine.from_args(ServerArgs(model_path={str(default_model_dir)!r}, torchao_config=quant))
        await engine.start()
        async for _ in engine.generate(GenerateRequest([100, 101, 102], SamplingParams(max_new_tokens=4))):
            pass
        await engine.shutdown()
    print("torch._dynamo" in sys.modules)

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
