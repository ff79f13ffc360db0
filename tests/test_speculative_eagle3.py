"""EAGLE3 speculative decoding: an EAGLE-3 draft head (SGLang's checkpoint
format) over a tiny Llama target and over the embedded model. The target
keeps the right hidden states, the head computes what the format defines,
greedy output is identical to decoding without speculation whatever lands
inside an accepted run, a head fitted to the target's text gets its
drafts kept, and what cannot run is refused at start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from pyserve.engine.engine import Engine
from pyserve.engine.request import Constraint, SamplingParams
from pyserve.engine.speculative.options import drafter_of
from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.model.eagle3_head import Eagle3Config, load_eagle3_head
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.layers.causal_lm import AuxCapture
from pyserve.model.loader import load_model
from pyserve.server_args import ServerArgs
from tests.slow import slow_test
from tests.eagle3_heads import (AUX_LAYERS, PROMPTS, first_drafts, greedy_continuations, head_config, head_step,
                                hot_ids, save_head, second_drafts, target_features, trained_weights, vocab_size)
from tests.test_speculative import (COPY, assert_identical_on_the_embedded_model, collect, repetitive, same, started,
                                   with_and_without)
from tests.test_speculative_overlap import late_steps  # noqa: F401 (a fixture)
from tests.tiny_models import build_tiny_model

K = 4
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture
def target(eagle3_target) -> Path:
    """A tiny Llama of four layers with the default model's tokenizer
    (conftest's, built once a session)."""
    return eagle3_target


@pytest.fixture
def heads(eagle3_heads) -> dict[str, Path]:
    """Its random and fitted heads (conftest's, fitted once a session)."""
    return eagle3_heads


def spec(head: Path, **extra) -> dict:
    return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head),
            "speculative_num_draft_tokens": K, **extra}


def run_both(target, requests, head, engine_args=None, sequential=False, tree: dict | None = None):
    """with_and_without in float32, speculating with the head (`tree`:
    more speculative options, such as a draft tree's)."""
    return with_and_without(target, requests, spec(head, **(tree or {})),
                            {"torchao_config": "none", **(engine_args or {})}, sequential)


def test_the_target_keeps_the_hidden_states_entering_the_chosen_layers(target):
    ids = repetitive(21)
    model, config = load_model(target, torch.float32, "cpu")
    pool = KVBuffer(config.num_hidden_layers, 32, config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
    batch = ForwardBatch.build(ids, list(range(len(ids))), torch.arange(1, len(ids) + 1), [len(ids)],
                               [torch.arange(1, len(ids) + 1)], [len(ids) - 1], False, "cpu")
    capture = AuxCapture(frozenset(AUX_LAYERS))
    with torch.inference_mode():
        model(batch, TorchAttention(pool), capture=capture)
    _, expected = target_features(target, ids, AUX_LAYERS)
    assert torch.allclose(torch.cat(capture.states, dim=-1), expected, atol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_head_computes_what_the_format_defines(target, heads, backend):
    """pyserve's head against the reference forward (tests/eagle3_heads.py):
    a prompt's pairs in one extend, then one position at a time over its
    own KV, each followed by a chained step from its output hidden state
    (written where the next pair then goes); with either attention
    backend (Triton's interpreted on a CPU)."""
    head_dir = heads["random"]
    config = Eagle3Config(head_dir)
    model, _ = load_model(target, torch.float32, "cpu")
    head = load_eagle3_head(head_dir, config, model.embed_tokens.weight, model.lm_head.weight, torch.float32,
                            torch.device("cpu"))
    from safetensors.torch import load_file

    weights = load_file(str(head_dir / "model.safetensors"))
    cfg = json.loads((head_dir / "config.json").read_text())
    ids = repetitive(17)
    embeds, hidden = target_features(target, ids, AUX_LAYERS)
    with torch.no_grad():
        expected, outputs = first_drafts(weights, cfg, embeds[1:], hidden[:-1])
        chained = second_drafts(weights, cfg, embeds[1:], hidden[:-1], outputs)
    n = len(ids) - 1
    kv = KVBuffer(1, 32, 2, 16, torch.float32, "cpu")
    if backend == "torch":
        attn = TorchAttention(kv)
    else:
        pytest.importorskip("triton")
        from pyserve.model.attention.triton_backend import TritonAttention

        attn = TritonAttention(kv, 4, 64)
    slots = torch.arange(1, n + 1)
    split = 10  # pairs 0..9 as one extend, then one at a time

    def run(tokens, first, h):
        return head_step(head, attn, slots, tokens, first, h)

    with torch.inference_mode():
        logits, out = run(ids[1 : split + 1], 0, hidden[:split])
        got, got_chained = [logits], []
        for i in range(split, n):
            logits, out = run([ids[i + 1]], i, hidden[i : i + 1])
            got.append(logits)
            if i + 1 < n:
                got_chained.append(run([ids[i + 2]], i + 1, out)[0])
    got = torch.cat(got)
    assert torch.allclose(got, expected, atol=1e-4)
    assert torch.allclose(torch.cat(got_chained), chained[split:], atol=1e-4)
    hot = weights["d2t"] + torch.arange(len(weights["d2t"]))
    assert torch.equal(head.draft_to_target[got.argmax(-1)], hot[expected.argmax(-1)])


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_identical_with_a_random_head(target, heads, page_size):
    requests = [
        (repetitive(), {**GREEDY, "max_new_tokens": 30}),
        (repetitive(33), {**GREEDY, "max_new_tokens": 7, "logprobs": True, "top_logprobs": 3}),
        ([5, 17, 99], {**GREEDY, "max_new_tokens": 13}),
        (repetitive(), {**GREEDY, "max_new_tokens": 20, "presence_penalty": 0.5}),
    ]
    plain, got, metrics = run_both(target, requests, heads["random"], {"page_size": page_size})
    same(plain, got)
    assert metrics.spec_verify_steps > 0
    assert len(got[1][1]) == 7


def test_a_fitted_head_gets_its_drafts_kept_and_stops_inside_runs_hold(target, heads):
    """The fitted head's first two drafts of a step (the second chained
    from its own output hidden state) are the target's next tokens: runs
    of three tokens a step, where a random head's drafts are rejected.
    Stops and the length limit that land inside those runs end the output
    exactly where plain decoding does."""
    from pyserve._rust import Tokenizer

    text = heads["texts"][0][len(PROMPTS[0]):]
    stop_text = Tokenizer.from_file(str(target / "tokenizer.json")).decode(text[12:14])
    requests = [
        (PROMPTS[0], {**GREEDY, "max_new_tokens": 40, "logprobs": True, "top_logprobs": 2}),
        (PROMPTS[1], {**GREEDY, "max_new_tokens": 40}),
        (PROMPTS[0], {**GREEDY, "max_new_tokens": 40, "stop_token_ids": [text[9]]}),
        (PROMPTS[0], {**GREEDY, "max_new_tokens": 40, "stop": [stop_text]}),
        (PROMPTS[1], {**GREEDY, "max_new_tokens": 8}),
    ]
    plain, got, metrics = run_both(target, requests, heads["fitted"])
    same(plain, got)
    assert got[2][3].finish_reason == "stop" and got[2][1][-1] == text[9]
    assert got[3][3].finish_reason == "stop" and stop_text not in got[3][0]
    assert len(got[4][1]) == 8
    assert metrics.spec_emitted_tokens >= 2.9 * metrics.spec_verify_steps
    _, _, random_metrics = run_both(target, requests[:2], heads["random"])
    assert random_metrics.spec_emitted_tokens < 1.3 * random_metrics.spec_verify_steps


def _draft_kv(target, head, requests, **engine_args):
    """Per request (run one after the other): its tokens, and the head's
    K and V at the slots of the positions of its text (prompt and output)
    that the radix cache kept after it ended."""
    async def main():
        engine = await started(target, torchao_config="none", page_size=4, **engine_args, **spec(head))
        try:
            got = []
            for ids, params in requests:
                tokens = (await collect(engine, ids, **params))[1]
                text = list(ids) + tokens
                slots, _ = engine.kv.cache.match_prefix(text[:-1])  # whole pages
                assert slots.numel() > len(text) - 1 - 4
                kv = engine.runner.draft.kv_buffer
                got.append((tokens, kv.k_buffer[0][slots].clone(), kv.v_buffer[0][slots].clone()))
            assert engine.integrity_problem() is None
            return got
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def test_the_heads_kv_is_the_same_for_chunked_and_cached_prompts(target, heads):
    """The head's KV at every position of a request's text: the same when
    its prompt is computed whole, in chunks of 8 (each chunk's last pair
    waits for the next chunk's first token), or mostly taken from the
    radix cache (written by an earlier request's steps)."""
    first = PROMPTS[0] + [3, 5]
    second = first + [7, 8, 9]
    requests = [(first, {**GREEDY, "max_new_tokens": 12}), (second, {**GREEDY, "max_new_tokens": 10})]
    whole = _draft_kv(target, heads["fitted"], requests)
    chunked = _draft_kv(target, heads["fitted"], requests, chunked_prefill_size=8)
    alone = _draft_kv(target, heads["fitted"], requests[1:])
    for a, b in [(whole[0], chunked[0]), (whole[1], chunked[1]), (whole[1], alone[0])]:
        assert a[0] == b[0]
        assert torch.allclose(a[1], b[1], atol=1e-4) and torch.allclose(a[2], b[2], atol=1e-4)


def test_constrained_sampled_and_retracted_requests(target, heads):
    """A JSON-schema request, drafted beside the others, gives plain
    decoding's output; sampled requests give as many tokens as asked; a KV
    pool that forces retraction gives plain decoding's output and every
    page back."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    requests = [(repetitive(40 + i), {**GREEDY, "max_new_tokens": 40}) for i in range(4)]
    requests.append((PROMPTS[0], {"temperature": 0, "max_new_tokens": 30,
                                   "constraint": Constraint("json_schema", json.dumps(schema))}))
    plain, got, metrics = run_both(target, requests, heads["fitted"], {"page_size": 4, "max_total_tokens": 200})
    same(plain, got)
    json.loads(got[-1][0])
    assert metrics.spec_verify_steps > 0

    async def sampled():
        engine = await started(target, torchao_config="none", **spec(heads["fitted"]))
        try:
            outs = await asyncio.gather(*[collect(engine, PROMPTS[0], temperature=0.8, seed=s, max_new_tokens=25,
                                                  ignore_eos=True) for s in range(3)])
            assert engine.integrity_problem() is None
            return outs, engine.metrics
        finally:
            await engine.shutdown()
    outs, metrics = asyncio.run(sampled())
    assert [len(o[1]) for o in outs] == [25] * 3
    assert metrics.spec_verify_steps > 0


def test_abort_mid_request_gives_every_page_back(target, heads):
    from tests.test_speculative_standalone import assert_abort_gives_every_page_back

    assert_abort_gives_every_page_back(target, spec(heads["fitted"]), PROMPTS[0])


def test_a_row_after_a_jump_forward_is_not_drafted_by_the_head():
    """The head drafts from the target's hidden states of every token
    before the drafts; the text a jump-forward appended has none yet, so
    that row decodes plainly and the next one drafts again. A draft model
    computes such tokens itself and drafts."""
    import torch

    from pyserve.engine.sequence import Sequence
    from pyserve.engine.speculative.drafter import PlaceholderDrafter

    seq = Sequence("r", list(range(10)), SamplingParams(max_new_tokens=50, temperature=0))
    seq.output_ids = [11, 12, 13]  # 12 and 13 forced after 11
    seq.slots = torch.arange(11)  # the prompt and 11 computed
    head, draft_model = PlaceholderDrafter(4, drafts_from_computed_rows=True), PlaceholderDrafter(4)
    assert head.budget(seq) == 0 and draft_model.budget(seq) == 4
    seq.slots = torch.arange(12)  # one token to compute: a plain decode row
    assert head.budget(seq) == 4


def test_what_cannot_run_is_refused_at_start(target, heads, tmp_path, default_model_dir):
    with pytest.raises(ValueError, match="EAGLE3 needs --speculative-draft-model-path"):
        Engine.from_args(ServerArgs(model_path=str(target), speculative_algorithm="EAGLE3"))
    with pytest.raises(ValueError, match="is not a directory"):
        Engine.from_args(ServerArgs(model_path=str(target), **spec(tmp_path / "absent")))
    with pytest.raises(ValueError, match="--speculative-draft-load-format dummy: the EAGLE-3 head"):
        Engine.from_args(ServerArgs(model_path=str(target), **spec(heads["random"],
                                                                   speculative_draft_load_format="dummy")))
    with pytest.raises(ValueError, match="is not an EAGLE-3 head: its architectures are \\['LlamaForCausalLM'\\]"):
        Engine.from_args(ServerArgs(model_path=str(target), **spec(target)))  # a model, not a head
    wide = build_tiny_model(tmp_path / "wide", "llama", tokenizer_dir=default_model_dir, num_hidden_layers=4,
                            hidden_size=96)
    with pytest.raises(ValueError, match="hidden size 64 .* this model's is 96"):
        Engine.from_args(ServerArgs(model_path=str(wide), **spec(heads["random"])))
    # Default aux layers (2, L // 2, L - 3) of a four-layer target: 2, 2, 1, not three.
    cfg = json.loads((heads["random"] / "config.json").read_text())
    del cfg["eagle_config"]
    default = tmp_path / "default-layers"
    default.mkdir()
    (default / "config.json").write_text(json.dumps(cfg))
    (default / "model.safetensors").symlink_to(heads["random"] / "model.safetensors")
    with pytest.raises(ValueError, match="three hidden states of the target, entering layers \\[2, 2, 1\\]"):
        Engine.from_args(ServerArgs(model_path=str(target), **spec(default)))
    options = ServerArgs(model_path=str(target), speculative_eagle_topk=2, speculative_num_steps=2,
                         **spec(heads["random"], speculative_num_draft_tokens=8)).resolved().split()
    with pytest.raises(ValueError, match="a tree 2 deep with top 2 per step has 6 candidate nodes, fewer than the 7"):
        drafter_of(options.engine, options.model, target, None, None)


def test_the_app_with_an_eagle3_head_answers_the_openai_client(target, heads):
    """`pyserve --model T --speculative-algorithm EAGLE3
    --speculative-draft-model-path HEAD` (assert_served_like_without)."""
    from tests.test_speculative_standalone import assert_served_like_without

    assert_served_like_without(target, "--speculative-algorithm", "EAGLE3",
                               "--speculative-draft-model-path", str(heads["random"]))


@slow_test
def test_sampled_output_follows_the_target_distribution(target, heads):
    """The fitted head's drafts drawn from its own distribution (over its
    draft vocabulary, placed through d2t): the target's own distribution,
    with drafts both kept and rejected (assert_sampled_like_the_target)."""
    from tests.test_speculative_sampling import assert_sampled_like_the_target

    assert_sampled_like_the_target(target, PROMPTS[0], spec(heads["fitted"], speculative_num_steps=2))


@pytest.fixture(scope="module")
def embedded_head(default_model_dir, tmp_path_factory) -> Path:
    """A head for the embedded model (30 layers: the default layers 2, 15
    and 27, no eagle_config), fitted to its greedy continuation of COPY."""
    from pyserve._rust import Tokenizer

    ids = Tokenizer.from_file(str(default_model_dir / "tokenizer.json")).encode(COPY)
    text = ids + greedy_continuations(default_model_dir, [ids], 60)[0]
    hot = hot_ids(default_model_dir, text, size=1024)
    cfg = head_config(default_model_dir, len(hot), None)
    weights = trained_weights(default_model_dir, cfg, [text], hot, [2, 15, 27], steps=60)
    return save_head(tmp_path_factory.mktemp("eagle3-embedded") / "head", cfg, weights, hot, vocab_size(default_model_dir))


# The default 4-bit mode: the native layers keep the head's hidden states,
# and a verify row (or a tree's rows, each a decode row over its path) gets
# a decode step's bits, so logprobs agree there too.
@slow_test
@pytest.mark.parametrize("mode,tol,tree", [({"torchao_config": "none"}, 1e-4, {}), ({}, 1e-6, {}),
                                           ({}, 1e-6, {"speculative_eagle_topk": 2, "speculative_num_steps": 3,
                                                       "speculative_num_draft_tokens": 6})],
                         ids=["float32", "4bit", "4bit-tree"])
def test_greedy_identical_on_the_embedded_model(default_model_dir, embedded_head, mode, tol, tree):
    metrics = assert_identical_on_the_embedded_model(default_model_dir, spec(embedded_head, **tree), mode, tol)
    assert metrics.spec_emitted_tokens >= 2 * metrics.spec_verify_steps


def runs_with_stops(target, heads) -> tuple[list, str]:
    """Greedy requests over the fitted head's texts, two of them ending
    inside its accepted runs (a stop string: returned too, and a length
    limit of 8)."""
    from pyserve._rust import Tokenizer

    text = heads["texts"][0][len(PROMPTS[0]):]
    stop_text = Tokenizer.from_file(str(target / "tokenizer.json")).decode(text[12:14])
    return [
        (PROMPTS[0], {**GREEDY, "max_new_tokens": 40, "logprobs": True, "top_logprobs": 2}),
        (PROMPTS[1], {**GREEDY, "max_new_tokens": 40}),
        (PROMPTS[0], {**GREEDY, "max_new_tokens": 40, "stop": [stop_text]}),
        (PROMPTS[1], {**GREEDY, "max_new_tokens": 8}),
    ], stop_text


def test_with_overlap_scheduling_drafts_still_pay_and_output_is_identical(target, heads, late_steps):
    """Overlap scheduling (tests/test_speculative_overlap.py): the head
    drafts each row scheduled while its previous step ran, from the hidden
    states that step kept at its accepted positions."""
    requests, stop_text = runs_with_stops(target, heads)
    plain, got, metrics = run_both(target, requests, heads["fitted"], {"disable_overlap_schedule": False})
    same(plain, got)
    assert got[2][3].finish_reason == "stop" and stop_text not in got[2][0]
    assert len(got[3][1]) == 8
    # The length limit, counted as if every token in flight were kept, trims
    # a few drafts near the end: a little below the 2.9 of the test above.
    assert metrics.spec_emitted_tokens >= 2.7 * metrics.spec_verify_steps and late_steps["moved"] > 0
