"""STANDALONE speculative decoding: a draft model with the target's
tokenizer. Greedy output identical to decoding without speculation,
whatever lands inside an accepted run; the draft model sees every token
the target sees (prompt chunks, prefixes from the radix cache), and every
KV page is back after."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.server_args import ServerArgs
from tests.slow import slow, slow_test
from tests.test_speculative import collect, repetitive, same, started, with_and_without
from tests.tiny_models import build_tiny_model

K = 4


def noisy_copy(target_dir: Path, out: Path, noise: float, seed: int = 0) -> Path:
    """The target's weights plus Gaussian noise (saved by transformers, with
    its tokenizer): a draft that agrees with the target often but not always."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (target_dir / name).is_file():
            shutil.copy(target_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def drafts(tiny_llama_dir, tmp_path_factory, default_model_dir) -> dict[str, Path]:
    """Three draft models for the tiny target: its own weights (every draft
    kept), a noisy copy (some kept), and a smaller model of other shapes
    (one layer, two heads, one KV head; its drafts mostly fail)."""
    root = tmp_path_factory.mktemp("drafts")
    small = build_tiny_model(root / "small", "llama", tokenizer_dir=default_model_dir, seed=7, num_hidden_layers=1,
                             hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    return {"same": tiny_llama_dir, "noisy": noisy_copy(tiny_llama_dir, root / "noisy", noise=0.02),
            "small": small}


def spec(draft: Path, **extra) -> dict:
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft),
            "speculative_num_draft_tokens": K, **extra}


def run_both(model_dir, requests, draft, engine_args=None, sequential=False):
    """with_and_without in float32, speculating with the draft model."""
    return with_and_without(model_dir, requests, spec(draft), {"torchao_config": "none", **(engine_args or {})},
                            sequential)


GREEDY = {"temperature": 0, "ignore_eos": True}


# Pages of 4 by default (rejected drafts cut inside a page); pages of 1, slow.
@pytest.mark.parametrize("page_size", [pytest.param(1, marks=slow), 4])
@pytest.mark.parametrize("draft", ["noisy", "small"])
def test_greedy_identical_with_a_draft_model(tiny_llama_dir, drafts, page_size, draft):
    from pyserve._rust import Tokenizer

    plain_run = asyncio.run(_plain_tokens(tiny_llama_dir, repetitive(), 30))
    stop_token = plain_run[9]  # emitted as the 10th token: inside a run when drafts are kept
    stop_text = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")).decode(plain_run[12:14])
    requests = [
        (repetitive(), {**GREEDY, "max_new_tokens": 30}),
        (repetitive(33), {**GREEDY, "max_new_tokens": 7, "logprobs": True, "top_logprobs": 3}),
        ([5, 17, 99], {**GREEDY, "max_new_tokens": 13}),
        (repetitive(), {**GREEDY, "max_new_tokens": 30, "stop_token_ids": [stop_token]}),
        (repetitive(), {**GREEDY, "max_new_tokens": 20, "presence_penalty": 0.5}),
        (repetitive(), {**GREEDY, "max_new_tokens": 30, "stop": [stop_text]}),
    ]
    plain, got, metrics = run_both(tiny_llama_dir, requests, drafts[draft], {"page_size": page_size})
    same(plain, got)
    assert metrics.spec_verify_steps > 0
    assert got[3][3].finish_reason == "stop" and got[3][1][-1] == stop_token
    assert len(got[1][1]) == 7
    assert got[5][3].finish_reason == "stop" and stop_text not in got[5][0]
    if draft == "noisy":
        assert metrics.spec_emitted_tokens > 1.5 * metrics.spec_verify_steps  # runs of several tokens happened


# SGLang's STANDALONE launch line's tree: top 2 per step, 4 steps deep, 7 tokens verified.
TREE = {"speculative_eagle_topk": 2, "speculative_num_steps": 4, "speculative_num_draft_tokens": 7}


@pytest.mark.parametrize("draft, page_size", [pytest.param("same", 1, marks=slow), ("noisy", 4), ("small", 1),
                                              pytest.param("same", 4, marks=slow), pytest.param("noisy", 1, marks=slow),
                                              pytest.param("small", 4, marks=slow)])
def test_greedy_identical_with_draft_trees(tiny_llama_dir, drafts, draft, page_size):
    """The draft model grows a tree per row (its KV of the nodes in scratch
    slots); after verification its KV follows the accepted path. The
    target's own weights as the draft keep the part of the greedy path
    the best-first tree holds: near 3 tokens a step on this flat random
    model (near 2 if the draft's KV were left in the tree's node order)."""
    requests = [(repetitive(), {**GREEDY, "max_new_tokens": 30}),
                (repetitive(33), {**GREEDY, "max_new_tokens": 12, "logprobs": True, "top_logprobs": 3}),
                ([5, 17, 99], {**GREEDY, "max_new_tokens": 13}),
                (repetitive(), {**GREEDY, "max_new_tokens": 20, "presence_penalty": 0.5})]
    plain, got, metrics = with_and_without(tiny_llama_dir, requests, spec(drafts[draft], **TREE),
                                           {"torchao_config": "none", "page_size": page_size})
    same(plain, got)
    assert metrics.spec_verify_steps > 0
    if draft == "same":
        assert metrics.spec_emitted_tokens >= 2.5 * metrics.spec_verify_steps
    if draft == "noisy":
        assert metrics.spec_emitted_tokens > 1.5 * metrics.spec_verify_steps


def test_draft_trees_under_overlap_scheduling(tiny_llama_dir, drafts):
    """The next step's row moves back over the tree's unkept nodes as over a
    chain's rejected drafts; the draft model drafts from the moved row."""
    requests = [(repetitive(), {**GREEDY, "max_new_tokens": 30}), ([5, 17, 99], {**GREEDY, "max_new_tokens": 13}),
                (repetitive(33), {**GREEDY, "max_new_tokens": 20})]
    plain, got, metrics = with_and_without(tiny_llama_dir, requests, spec(drafts["noisy"], **TREE),
                                           {"torchao_config": "none", "disable_overlap_schedule": False})
    same(plain, got)
    assert metrics.spec_emitted_tokens > 1.5 * metrics.spec_verify_steps


@pytest.mark.parametrize("mode", ["int8wo", "int4wo-32", "8da4w"])
def test_greedy_identical_in_each_cpu_quantization_mode(tiny_llama_dir, drafts, mode):
    """The draft model loads in the target's --torchao-config mode; its KV
    pass over the step's rows computes no logits (a projection of no rows)."""
    requests = [(repetitive(), {**GREEDY, "max_new_tokens": 24}),
                (repetitive(33), {**GREEDY, "max_new_tokens": 9, "logprobs": True, "top_logprobs": 2})]
    plain, got, metrics = with_and_without(tiny_llama_dir, requests, spec(drafts["noisy"]), {"torchao_config": mode})
    same(plain, got)
    assert metrics.spec_emitted_tokens > metrics.spec_verify_steps > 0


async def _plain_tokens(model_dir, ids, n):
    engine = await started(model_dir, torchao_config="none")
    try:
        return (await collect(engine, ids, **GREEDY, max_new_tokens=n))[1]
    finally:
        await engine.shutdown()


def test_the_draft_sees_chunked_prompts_and_cached_prefixes(tiny_llama_dir, drafts):
    """With the target's own weights as the draft, a draft is kept exactly
    when the draft model's KV holds every earlier token. Prompts computed
    in chunks of 8, then a second request whose prompt starts with the
    first's (its prefix comes from the radix cache, computed by the first
    request's steps): both keep nearly every draft, and decode as without
    speculation."""
    first = repetitive(45)
    requests = [(first, {**GREEDY, "max_new_tokens": 25}),
                (first + [7, 8, 9], {**GREEDY, "max_new_tokens": 25})]
    plain, got, metrics = run_both(tiny_llama_dir, requests, drafts["same"],
                                   {"chunked_prefill_size": 8, "page_size": 4}, sequential=True)
    same(plain, got)
    assert got[1][3].cached_tokens >= 40  # the second prompt's prefix came from the cache
    # 50 tokens over the two requests: at most 10 steps of K + 1 when every draft is kept.
    assert metrics.spec_emitted_tokens >= 0.9 * (K + 1) * metrics.spec_verify_steps


def test_a_request_that_stops_drafting_stops_running_the_draft_model(tiny_llama_dir, monkeypatch):
    """A request that stops drafting (here after its 8th verify step: the
    bar is raised past what any draft reaches) runs no draft forward after
    that, and the tokens it computes then have no draft KV, so they stay
    out of the prefix cache. A second request continuing its text takes
    from the cache only what the draft model has KV for, and with the
    target's own weights as the draft keeps every draft: its draft KV is
    whole. Both decode as without speculation."""
    from collections import Counter

    from pyserve.engine.runner.model_runner import ModelRunner
    from pyserve.engine.speculative import drafter
    from pyserve.engine.speculative.standalone import DraftModel

    monkeypatch.setattr(drafter, "_MIN_ACCEPT_RATE", 1.01)
    calls = Counter()
    for cls, name in ((ModelRunner, "step"), (DraftModel, "follow")):
        def counted(self, *args, _run=getattr(cls, name), _name=name):
            calls[_name] += 1
            return _run(self, *args)
        monkeypatch.setattr(cls, name, counted)

    first = repetitive(30)

    async def main():
        engine = await started(tiny_llama_dir, torchao_config="none", **spec(tiny_llama_dir))
        plain = await started(tiny_llama_dir, torchao_config="none")
        try:
            _, out1, _, _ = await collect(engine, first, **GREEDY, max_new_tokens=80)
            steps, follows, verify = calls["step"], calls["follow"], engine.metrics.spec_verify_steps
            second = first + out1
            _, out2, _, last2 = await collect(engine, second, **GREEDY, max_new_tokens=20)
            m = engine.metrics
            drafted = m.spec_draft_tokens - 8 * K
            kept = (m.accepted_drafts() - 8 * K, drafted)
            want1 = (await collect(plain, first, **GREEDY, max_new_tokens=80))[1]
            want2 = (await collect(plain, second, **GREEDY, max_new_tokens=20))[1]
            return out1, out2, want1, want2, steps, follows, verify, kept, last2.cached_tokens
        finally:
            await engine.shutdown()
            await plain.shutdown()

    out1, out2, want1, want2, steps, follows, verify, (kept2, drafted2), cached2 = asyncio.run(main())
    assert out1 == want1 and out2 == want2
    # The prompt's step samples a token; 8 verify steps keep every draft (K + 1
    # tokens each), then drafting is off and each step decodes one token.
    assert verify == 8 and steps == 1 + 8 + (80 - 1 - 8 * (K + 1))
    assert follows == 1 + 8  # the draft model ran the prompt's step and the verify steps only
    # From the cache: the prompt and the drafted stretch; the undrafted tokens after it were computed again.
    assert cached2 == len(first) + 8 * (K + 1)
    assert drafted2 > 0 and kept2 == drafted2


def test_steps_mixing_drafting_and_undrafted_requests_run_the_draft_model_on_the_drafting_rows(
        tiny_llama_dir, monkeypatch):
    """A second request arrives once the first has stopped drafting (after
    its 8th verify step, the bar raised past any draft): the steps they
    share run the draft model on the second's rows only. With the target's
    own weights as the draft, the second keeps every draft (its draft KV is
    whole), and both decode as without speculation."""
    from pyserve.engine.speculative import drafter
    from pyserve.engine.speculative.standalone import DraftModel

    monkeypatch.setattr(drafter, "_MIN_ACCEPT_RATE", 1.01)
    followed = []
    follow = DraftModel.follow

    def counted(self, step, *args):
        """Records (the step's sequences, the rows the draft model ran)."""
        rows, forward = [], self.model.forward
        self.model.forward = lambda batch: rows.append(len(batch.extend_lens)) or forward(batch)
        try:
            return follow(self, step, *args)
        finally:
            del self.model.forward
            followed.append((len(step.seqs), rows[0]))

    monkeypatch.setattr(DraftModel, "follow", counted)
    first, second = repetitive(30), repetitive(41)

    async def main():
        engine = await started(tiny_llama_dir, torchao_config="none", **spec(tiny_llama_dir))
        plain = await started(tiny_llama_dir, torchao_config="none")
        try:
            undrafted = asyncio.Event()
            out1 = []

            async def run_first():
                request = GenerateRequest(first, SamplingParams(**GREEDY, max_new_tokens=80))
                async for out in engine.generate(request):
                    out1.extend(out.token_ids)
                    if len(out1) > 8 * (K + 1):  # past its 8 verify steps: drafting is off
                        undrafted.set()

            task = asyncio.create_task(run_first())
            await undrafted.wait()
            before = (engine.metrics.spec_draft_tokens, engine.metrics.accepted_drafts())
            _, out2, _, _ = await collect(engine, second, **GREEDY, max_new_tokens=30)
            kept = (engine.metrics.accepted_drafts() - before[1], engine.metrics.spec_draft_tokens - before[0])
            await task
            want1 = (await collect(plain, first, **GREEDY, max_new_tokens=80))[1]
            want2 = (await collect(plain, second, **GREEDY, max_new_tokens=30))[1]
            return out1, out2, want1, want2, kept
        finally:
            await engine.shutdown()
            await plain.shutdown()

    out1, out2, want1, want2, (kept2, drafted2) = asyncio.run(main())
    assert out1 == want1 and out2 == want2
    assert drafted2 > 0 and kept2 == drafted2
    assert (2, 1) in followed  # a step of both ran the draft model on one row


def test_greedy_identical_when_the_kv_pool_forces_retraction(tiny_llama_dir, drafts):
    requests = [(repetitive(40 + i), {**GREEDY, "max_new_tokens": 40}) for i in range(4)]
    plain, got, metrics = run_both(tiny_llama_dir, requests, drafts["noisy"],
                                   {"page_size": 4, "max_total_tokens": 200})
    same(plain, got)
    assert metrics.spec_verify_steps > 0


def assert_abort_gives_every_page_back(model_dir, speculative: dict, prompt: list[int]) -> None:
    """A request aborted after its first drafted steps on an engine with the
    `speculative` options: every KV page comes back, and the next request
    decodes in full."""
    async def main():
        engine = await started(model_dir, torchao_config="none", **speculative)
        try:
            stream = engine.generate(GenerateRequest(prompt, SamplingParams(**GREEDY, max_new_tokens=200)))
            seen = 0
            async for out in stream:
                seen += len(out.token_ids)
                if seen >= 6:
                    break
            await stream.aclose()
            other = await collect(engine, repetitive(35), **GREEDY, max_new_tokens=10)
            assert engine.integrity_problem() is None
            assert engine.kv_usage()["in_use"] == 0
            return seen, other
        finally:
            await engine.shutdown()
    seen, other = asyncio.run(main())
    assert seen >= 6 and len(other[1]) == 10


def test_after_a_jump_forward_the_draft_computes_the_forced_text_before_drafting(tiny_llama_dir, drafts,
                                                                                  monkeypatch):
    """A row after a jump-forward holds the forced tokens, not computed
    yet; the draft model computes its own KV of them before it drafts
    from them (DraftModel.propose): the KV the step's follow pass then
    writes there is the same. The output is plain decoding's."""
    import torch

    from pyserve.engine.request import Constraint
    from pyserve.engine.speculative import standalone

    checked = []
    propose, follow = standalone.DraftModel.propose, standalone.DraftModel.follow

    def recording_propose(self, step, batch, states, sampler):
        result = propose(self, step, batch, states, sampler)
        drafted = [i for i, d in enumerate(step.drafts) if d]
        token_at, slots, starts = standalone._drafted_rows(step.batch, step.drafts, drafted)
        known = [slots[n][int(step.batch.positions[start]) : int(step.batch.positions[token_at[n]])]
                 for n, start in enumerate(starts) if start < token_at[n]]
        self.known = [(s, [k[s].clone() for k in self.model.kv_buffer.k_buffer]) for s in known]
        return result

    def checking_follow(self, *args):
        follow(self, *args)
        for slots, before in getattr(self, "known", []):
            for k, b in zip(self.model.kv_buffer.k_buffer, before):
                torch.testing.assert_close(k[slots], b, rtol=1e-5, atol=1e-5)
            checked.append(len(slots))
        self.known = []

    monkeypatch.setattr(standalone.DraftModel, "propose", recording_propose)
    monkeypatch.setattr(standalone.DraftModel, "follow", checking_follow)
    schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 3} for k in "abcd"},
              "required": list("abcd")}
    requests = [(repetitive(30), {"temperature": 0, "max_new_tokens": 60,
                                  "constraint": Constraint("json_schema", json.dumps(schema))})]
    plain, got, metrics = run_both(tiny_llama_dir, requests, drafts["same"])
    same(plain, got)
    json.loads(got[0][0])
    assert checked and metrics.spec_verify_steps > 0


def test_abort_mid_request_gives_every_page_back(tiny_llama_dir, drafts):
    assert_abort_gives_every_page_back(tiny_llama_dir, spec(drafts["noisy"]), repetitive())


def test_a_draft_with_another_tokenizer_is_refused_at_start(tiny_llama_dir, drafts, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(drafts["small"], other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="must use the target's tokenizer"):
        Engine.from_args(ServerArgs(model_path=str(tiny_llama_dir), **spec(other)))
    with pytest.raises(ValueError, match="needs --speculative-draft-model-path"):
        Engine.from_args(ServerArgs(model_path=str(tiny_llama_dir), speculative_algorithm="STANDALONE"))


def assert_served_like_without(model_dir, *speculative: str) -> None:
    """The app of `pyserve --model model_dir` with the `speculative`
    arguments, in process (app_of_cli), through the openai client: streamed
    text equals the non-streamed text, n=2 gives two identical greedy
    choices, verify steps ran (in /metrics and in the native route's
    meta_info), the KV is whole, and the answers equal the app's without
    speculation."""
    import openai

    from tests.conftest import app_of_cli

    base = ("--model", str(model_dir), "--max-total-tokens", "4096", "--torchao-config", "none")
    prompt = "one two three four five one two three four five one two three four"

    def answers(*args: str):
        with app_of_cli(*base, *args) as srv:
            client = openai.OpenAI(api_key="EMPTY", base_url=f"{srv.base_url}/v1", http_client=srv, timeout=120)
            model = client.models.list().data[0].id
            whole = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, n=2)
            stream = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True)
            streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
            # SGLang's native route reports each request's verify steps and kept drafts.
            meta = srv.post("/generate", json={
                "text": prompt, "sampling_params": {"max_new_tokens": 24, "temperature": 0}}).json()["meta_info"]
            assert ("spec_verify_ct" in meta) == bool(args)
            if args:
                steps, drafted, kept = meta["spec_verify_ct"], meta["spec_draft_token_num"], meta["spec_accept_token_num"]
                assert 0 < steps <= 24 and 0 <= kept <= drafted
                assert meta["spec_accept_length"] == pytest.approx((steps + kept) / steps)
                assert meta["spec_accept_rate"] == pytest.approx(kept / drafted)
            info = srv.get("/get_server_info").json()
            assert info["kv_integrity"] == "ok", info["kv_integrity"]
            metrics = srv.get("/metrics").text
            # Where SGLang's tests read the accept length: only with speculation on.
            accept_length = info["internal_states"][0].get("avg_spec_accept_length")
            assert (accept_length is None) == (not args)
            if args:
                assert accept_length >= 1.0 and f"pyserve:spec_accept_length {accept_length}" in metrics
            return [c.text for c in whole.choices], streamed, whole.usage.completion_tokens, metrics

    texts, streamed, tokens, metrics = answers(*speculative)
    plain_texts, _, _, _ = answers()
    assert texts[0] == texts[1] == streamed == plain_texts[0]
    assert tokens == 48
    verified = next(float(line.split()[1]) for line in metrics.splitlines()
                    if line.startswith("pyserve:spec_verify_calls_total"))
    assert verified > 0


@slow_test
def test_the_app_with_a_draft_model_answers_the_openai_client(tiny_llama_dir, drafts):
    """`pyserve --model T --speculative-algorithm STANDALONE
    --speculative-draft-model-path D` (assert_served_like_without)."""
    assert_served_like_without(tiny_llama_dir, "--speculative-algorithm", "STANDALONE",
                               "--speculative-draft-model-path", str(drafts["noisy"]))
