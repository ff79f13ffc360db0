"""SGLang's sessions (/open_session, /close_session, /generate's
`session_params`), used as SGLang's own session test uses them: each turn
sends only its new tokens and answers exactly as /generate answers the
whole prompt the session built (tokens, logprobs within 1e-4), with that
prompt's prefix found in the cache; replace branches from an earlier turn
and forgets the turns after it, or aborts a running turn and continues from
what it had; what a session cannot serve is a 4xx naming the field."""

from __future__ import annotations

import asyncio
import json

import pytest

from pyserve._rust import Tokenizer
from pyserve.asgi import create_app
from tests.test_api_handlers import call, sse_events
from tests.tiny_models import build_tiny_model

OPTIONS = {"dtype": "float32", "torchao_config": "none", "max_total_tokens": 4096}
CHUNKS = ["Let me tell you something about France.", "The capital of France is",
          "The population of the city is", "A brief history about that city is"]


def greedy(n: int, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


async def post(app, path: str, body: dict):
    status, _, raw = await call(app, "POST", path, body)
    return status, (json.loads(raw) if raw else None)


def serve(model_dir, tmp_path, scenario, **options):
    """`scenario(app)` on an in-process server of `model_dir` (float32, `options` added)."""
    async def go():
        app = create_app(model_path=str(model_dir), file_storage_path=str(tmp_path), **{**OPTIONS, **options})
        await app.startup()
        try:
            return await scenario(app)
        finally:
            await app.shutdown()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory, default_model_dir):
    """A tiny Llama whose tokenizer puts a BOS before each text, as Llama's does."""
    from tokenizers import Tokenizer as HFTokenizer, processors

    model_dir = build_tiny_model(tmp_path_factory.mktemp("bos-llama"), "llama", tokenizer_dir=default_model_dir)
    tokenizer = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
    bos = "<|im_start|>"
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))])])
    tokenizer.save(str(model_dir / "tokenizer.json"))
    return model_dir


def test_turns_answer_as_the_whole_prompts_they_build(bos_model_dir, tmp_path):
    tokenizer = Tokenizer.from_file(str(bos_model_dir / "tokenizer.json"))
    bos = tokenizer.encode("", add_special_tokens=True)

    async def scenario(app):
        status, sid = await post(app, "/open_session", {"capacity_of_str_len": 1000})
        assert status == 200 and isinstance(sid, str)
        again, error = await post(app, "/open_session", {"capacity_of_str_len": 1000, "session_id": sid})
        assert again == 400 and error["error"]["param"] == "session_id"
        turns, rid = [], None
        for i, chunk in enumerate(CHUNKS[:3]):  # text: the tokenizer's BOS, which a continuation drops
            status, out = await post(app, "/generate", {
                "text": chunk, "session_params": {"id": sid, "rid": rid, "offset": -1, "replace": True},
                "sampling_params": greedy(1 if i == 0 else 6), "return_logprob": True})
            assert status == 200, out
            rid = out["meta_info"]["id"]
            turns.append(out)
        # Back to the first turn: the turns after it are forgotten.
        status, branch = await post(app, "/generate", {
            "input_ids": tokenizer.encode(CHUNKS[3]),
            "session_params": {"id": sid, "rid": turns[0]["meta_info"]["id"], "offset": -1, "replace": True},
            "sampling_params": greedy(6), "return_logprob": True})
        assert status == 200, branch
        gone, error = await post(app, "/generate", {
            "input_ids": [5, 6], "session_params": {"id": sid, "rid": rid}, "sampling_params": greedy(2)})
        assert gone == 400 and error["error"]["param"] == "session_params.rid", error
        # Plain appends: the whole previous prompt and output, or its prompt alone.
        status, appended = await post(app, "/generate", {
            "input_ids": [7, 8, 9], "session_params": {"id": sid, "rid": branch["meta_info"]["id"]},
            "sampling_params": greedy(4)})
        status, dropped = await post(app, "/generate", {
            "input_ids": [7, 8, 9],
            "session_params": {"id": sid, "rid": branch["meta_info"]["id"], "drop_previous_output": True},
            "sampling_params": greedy(4)})
        assert (await post(app, "/close_session", {"session_id": sid}))[0] == 200
        closed, error = await post(app, "/generate", {
            "input_ids": [5, 6], "session_params": {"id": sid, "rid": turns[0]["meta_info"]["id"]},
            "sampling_params": greedy(2)})
        assert closed == 400 and error["error"]["param"] == "session_params.id", error

        # The same prompts, built by hand, without a session.
        ids = [tokenizer.encode(c, add_special_tokens=True) for c in CHUNKS]
        prompts = [ids[0]]
        for i in (1, 2):
            prompts.append((prompts[-1] + turns[i - 1]["output_ids"])[:-1] + ids[i][1:])
        branch_prompt = (prompts[0] + turns[0]["output_ids"])[:-1] + ids[3][1:]
        expected = []
        for prompt, n in [*zip(prompts, (1, 6, 6)), (branch_prompt, 6)]:
            expected.append((await post(app, "/generate", {"input_ids": prompt, "sampling_params": greedy(n),
                                                          "return_logprob": True}))[1])
        tail = [(branch_prompt + branch["output_ids"] + [7, 8, 9], appended), (branch_prompt + [7, 8, 9], dropped)]
        for prompt, got in tail:
            want = (await post(app, "/generate", {"input_ids": prompt, "sampling_params": greedy(4)}))[1]
            assert got["output_ids"] == want["output_ids"]
            assert got["meta_info"]["prompt_tokens"] == len(prompt)
        return turns + [branch], expected

    got, expected = serve(bos_model_dir, tmp_path, scenario)
    assert len(bos) == 1
    for session_turn, plain in zip(got, expected):
        assert session_turn["output_ids"] == plain["output_ids"]
        assert session_turn["meta_info"]["prompt_tokens"] == plain["meta_info"]["prompt_tokens"]
        assert [e[0] for e in session_turn["meta_info"]["output_token_logprobs"]] == \
            pytest.approx([e[0] for e in plain["meta_info"]["output_token_logprobs"]], abs=1e-4)
    # Each later turn found the earlier turns' tokens in the prefix cache.
    assert all(t["meta_info"]["cached_tokens"] > 0 for t in got[1:])


def test_replace_aborts_a_running_turn_and_continues_from_what_it_had(tiny_llama_dir, tmp_path):
    async def scenario(app):
        sid = (await post(app, "/open_session", {"capacity_of_str_len": 0, "session_id": "talk"}))[1]
        assert sid == "talk"
        prompt = list(range(20, 32))
        first = asyncio.create_task(call(app, "POST", "/generate", {
            "input_ids": prompt, "session_params": {"id": sid}, "rid": "long", "stream": True,
            "sampling_params": greedy(1500)}))
        turns = app.http.ctx.sessions.get(sid).turns
        while "long" not in turns or len(turns["long"].output_ids) < 3:  # until it has a few tokens
            assert not first.done(), first.result()
            await asyncio.sleep(0.02)
        busy, error = await post(app, "/generate", {
            "input_ids": [5], "session_params": {"id": sid, "rid": "long"}, "sampling_params": greedy(2)})
        assert busy == 400 and "still running" in error["error"]["message"]
        status, second = await post(app, "/generate", {
            "input_ids": [40, 41], "rid": "next",
            "session_params": {"id": sid, "rid": "long", "offset": len(prompt) + 3, "replace": True},
            "sampling_params": greedy(5)})
        assert status == 200, second
        _, _, raw = await first
        events = [e for e in sse_events(raw) if e != "[DONE]"]
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        had = events[-1]["output_ids"]
        plain = (await post(app, "/generate", {"input_ids": prompt + had[:3] + [40, 41],
                                              "sampling_params": greedy(5)}))[1]
        assert app.http.ctx.engine.request_ids == []
        return second, plain

    second, plain = serve(tiny_llama_dir, tmp_path, scenario)
    assert second["output_ids"] == plain["output_ids"]


def test_what_a_session_cannot_serve_is_a_4xx_naming_the_field(tiny_llama_dir, tmp_path):
    async def scenario(app):
        sid = (await post(app, "/open_session", {"capacity_of_str_len": 100}))[1]
        _, first = await post(app, "/generate", {"input_ids": [5, 6, 7], "rid": "a", "session_params": {"id": sid},
                                                 "sampling_params": greedy(2)})
        cases = [
            ("/generate", {"input_ids": [5], "session_params": {"id": "nope"}}, 400, "session_params.id"),
            ("/generate", {"input_ids": [5], "session_params": {"id": sid, "rid": "a", "offset": 9}}, 400,
             "session_params.offset"),
            ("/generate", {"input_ids": [5], "session_params": {"id": sid, "rid": "a", "offset": -6}}, 400,
             "session_params.offset"),
            ("/generate", {"input_ids": [5], "rid": "a", "session_params": {"id": sid, "rid": "a"}}, 400, "rid"),
            ("/generate", {"input_ids": [5], "session_params": {"id": sid, "turn": 1}}, 400, "session_params.turn"),
            ("/open_session", {"capacity_of_str_len": 1, "streaming": True}, 400, "streaming"),
            ("/open_session", {"capacity_of_str_len": 1, "timeout": 0}, 400, "timeout"),
            ("/open_session", {"session_id": "x"}, 400, "capacity_of_str_len"),
            ("/close_session", {"session_id": "nope"}, 404, "session_id"),
        ]
        answers = [await post(app, path, body) for path, body, _, _ in cases]
        # Nothing refused changed the session: "a" is still there to continue.
        _, after = await post(app, "/generate", {"input_ids": [9], "session_params": {"id": sid, "rid": "a"},
                                                 "sampling_params": greedy(2)})
        return first, answers, after, cases

    first, answers, after, cases = serve(tiny_llama_dir, tmp_path, scenario)
    for (status, error), (path, _, want, param) in zip(answers, cases):
        assert status == want and error["error"]["param"] == param, (path, param, error)
    assert after["meta_info"]["prompt_tokens"] == 3 + 2 + 1


def test_an_idle_session_closes_after_its_timeout(tiny_llama_dir, tmp_path):
    async def scenario(app):
        sid = (await post(app, "/open_session", {"capacity_of_str_len": 10, "timeout": 0.3}))[1]
        _, first = await post(app, "/generate", {"input_ids": [5, 6], "rid": "a", "session_params": {"id": sid},
                                                 "sampling_params": greedy(2)})
        soon = (await post(app, "/generate", {"input_ids": [7], "rid": "b",
                                              "session_params": {"id": sid, "rid": "a"},
                                              "sampling_params": greedy(2)}))[0]
        await asyncio.sleep(0.5)
        late = await post(app, "/generate", {"input_ids": [8], "session_params": {"id": sid, "rid": "b"},
                                             "sampling_params": greedy(2)})
        return soon, late

    soon, (late, error) = serve(tiny_llama_dir, tmp_path, scenario)
    assert soon == 200
    assert late == 400 and error["error"]["param"] == "session_params.id"
