"""SGLang's and vLLM's extensions, sent as their users send them (the
official openai client, extras in `extra_body`), against the app on a tiny
random Llama with a short context, in process (the answers are checked,
not the server process): prompt_logprobs, assistant prefill, token ids
out, allowed_token_ids and bad_words, sampling extras on /v1/responses,
the peers' error phrases, and a 413 the client can read over a real
socket (the shared server's).

The deliberate differences from the peers that README lists are pinned
at the end."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from tests.test_tokenize_api import tiny_server_http

CONTEXT = 256
USER = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def http(tiny_llama_dir, tmp_path_factory):
    with tiny_server_http(tiny_llama_dir, tmp_path_factory.mktemp("peer"), context_length=CONTEXT,
                          max_total_tokens=4096) as c:
        yield c


@pytest.fixture(scope="module")
def oai(http):
    return openai.OpenAI(api_key="EMPTY", base_url=f"{http.base_url}/v1", http_client=http, max_retries=0,
                         timeout=120)


def tokenize(http, **body) -> list[int]:
    return http.post("/tokenize", json=body).json()["tokens"]


# -- prompt_logprobs (vLLM) ----------------------------------------------------


def test_completion_prompt_logprobs_in_vllm_shape(oai, http):
    prompt = "The quick brown fox jumps"
    ids = tokenize(http, prompt=prompt, add_special_tokens=True)
    r = oai.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                               extra_body={"prompt_logprobs": 2})
    scored = r.choices[0].model_extra["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    for token_id, entry in zip(ids[1:], scored[1:]):
        own = entry[str(token_id)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        # The prompt's own token, plus up to 2 alternatives ranked 1 and 2.
        assert len(entry) <= 3 and {e["rank"] for k, e in entry.items() if k != str(token_id)} <= {1, 2}
    # The same numbers as echo + logprobs, the legacy way of scoring a prompt.
    echoed = oai.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=0)
    legacy = echoed.choices[0].logprobs.token_logprobs[:len(ids)]
    assert legacy[0] is None
    assert all(abs(a - e[str(t)]["logprob"]) < 1e-4 for a, e, t in zip(legacy[1:], scored[1:], ids[1:]))


def test_prompt_logprobs_are_computed_for_a_cached_prefix_too(oai):
    """A prompt the radix cache holds is scored again, not skipped: the
    request bypasses the cache for the scored prompt."""
    prompt = "Once upon a time there was a cached prefix"
    oai.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0)  # now cached
    runs = [oai.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                                   extra_body={"prompt_logprobs": 0}) for _ in range(2)]
    first, second = (r.choices[0].model_extra["prompt_logprobs"] for r in runs)
    assert first == second and all(e is not None for e in first[1:])
    assert runs[1].usage.prompt_tokens_details.cached_tokens == 0


def test_chat_prompt_logprobs_are_top_level(oai):
    r = oai.chat.completions.create(model="m", messages=USER, max_tokens=1, extra_body={"prompt_logprobs": 1})
    scored = r.model_extra["prompt_logprobs"]
    assert len(scored) == r.usage.prompt_tokens and scored[0] is None and all(scored[1:])


def test_prompt_logprobs_out_of_range_is_a_400(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt="hi", max_tokens=1, extra_body={"prompt_logprobs": 21})
    assert e.value.body["param"] == "prompt_logprobs"


# -- assistant prefill (vLLM's and SGLang's chat fields) -------------------------


def test_continue_final_message_as_vllm_sends_it(oai, http):
    prefix = "My favourite colour is"
    messages = USER + [{"role": "assistant", "content": prefix}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    r = oai.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0,
                                    extra_body={**body, "echo": True, "return_token_ids": True})
    # The prompt ends inside the assistant's message: no end of turn after it.
    prompt_text = http.post("/detokenize", json={"tokens": r.model_extra["prompt_token_ids"]}).json()["prompt"]
    assert prompt_text.endswith(prefix)
    # echo: the answer starts with the continued prefix.
    generated = http.post("/detokenize", json={"tokens": r.choices[0].model_extra["token_ids"]}).json()["prompt"]
    assert r.choices[0].message.content == prefix + generated


def test_add_generation_prompt_false_opens_no_assistant_turn(oai, http):
    kwargs = dict(model="m", messages=USER, max_tokens=1, extra_body={"return_token_ids": True})
    opened = oai.chat.completions.create(**kwargs).model_extra["prompt_token_ids"]
    kwargs["extra_body"] = {"return_token_ids": True, "add_generation_prompt": False}
    bare = oai.chat.completions.create(**kwargs).model_extra["prompt_token_ids"]
    assert opened[:len(bare)] == bare and len(bare) < len(opened)
    assert http.post("/detokenize", json={"tokens": opened[len(bare):]}).json()["prompt"].strip().endswith("assistant")


# -- token ids out (vLLM) --------------------------------------------------------


def test_return_token_ids_on_chat_and_completions(oai, http):
    chat = oai.chat.completions.create(model="m", messages=USER, max_tokens=5, temperature=0, n=2,
                                       extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == tokenize(http, messages=USER)
    for choice in chat.choices:
        ids = choice.model_extra["token_ids"]
        assert len(ids) == 5 and all(isinstance(i, int) for i in ids)
    cmpl = oai.completions.create(model="m", prompt="Hello there", max_tokens=3, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = cmpl.choices[0].model_extra
    assert choice["prompt_token_ids"] == tokenize(http, prompt="Hello there", add_special_tokens=True)
    assert len(choice["token_ids"]) == cmpl.usage.completion_tokens == 3


def test_return_token_ids_on_a_tool_call_choice(oai, http):
    tools = [{"type": "function", "function": {"name": "paint", "parameters": {
        "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
        "required": ["colour"]}}}]
    r = oai.chat.completions.create(model="m", messages=USER, tools=tools, tool_choice="required", max_tokens=60,
                                    temperature=0, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.message.tool_calls and choice.message.tool_calls[0].function.name == "paint"
    ids = choice.model_extra["token_ids"]
    assert len(ids) == r.usage.completion_tokens
    assert "paint" in http.post("/detokenize", json={"tokens": ids}).json()["prompt"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(oai):
    chat = oai.chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == [f"token_id:{i}" for i in chat.choices[0].model_extra["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", t.token) for e in content for t in e.top_logprobs)
    cmpl = oai.completions.create(model="m", prompt="Hello there", max_tokens=3, temperature=0, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    logprobs = cmpl.choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{i}" for i in cmpl.choices[0].model_extra["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in logprobs.top_logprobs for k in top)


def test_streamed_logprob_tokens_as_token_ids(oai):
    stream = oai.chat.completions.create(model="m", messages=USER, max_tokens=4, temperature=0, logprobs=True,
                                         stream=True, extra_body={"return_tokens_as_token_ids": True,
                                                                  "return_token_ids": True})
    tokens, ids = [], []
    for chunk in stream:
        for choice in chunk.choices:
            ids += choice.model_extra.get("token_ids") or []
            tokens += [e.token for e in (choice.logprobs.content if choice.logprobs else [])]
    assert len(ids) == 4 and tokens == [f"token_id:{i}" for i in ids]


# -- sampling extras on /v1/responses (SGLang, vLLM) --------------------------------


# -- allowed_token_ids and bad_words (vLLM) ------------------------------------


def _greedy_ids(oai, **extra) -> list[int]:
    r = oai.completions.create(model="m", prompt="Once upon a time", max_tokens=12, temperature=0,
                               extra_body={"return_token_ids": True, "ignore_eos": True, **extra})
    return r.choices[0].model_extra["token_ids"]


def test_allowed_token_ids_pick_the_best_of_those_ids(oai):
    """Greedy among the allowed ids is greedy under a +100 bias on them (a
    separate code path); sampled tokens never leave the set."""
    allowed = [262, 284, 290, 314, 338, 1450]
    assert _greedy_ids(oai, allowed_token_ids=allowed) == \
        _greedy_ids(oai, logit_bias={str(t): 100 for t in allowed})
    r = oai.completions.create(model="m", prompt="Hi", max_tokens=16, temperature=1.0, n=3,
                               extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True})
    assert all(set(c.model_extra["token_ids"]) <= set(allowed) for c in r.choices)


def test_bad_words_are_never_written(oai, http):
    """A two-token word of the free greedy output, banned: the output is
    the same up to its first token, then goes another way, and never
    holds either spelling of the word."""
    free = _greedy_ids(oai)

    def spellings(word: str) -> list[list[int]]:
        return [tokenize(http, prompt=w, add_special_tokens=False) for w in (word.lstrip(), " " + word.lstrip())]

    def text(ids: list[int]) -> str:
        return http.post("/detokenize", json={"tokens": ids}).json()["prompt"]

    at, word = next((i, w) for i in range(len(free) - 1) if free[i:i + 2] in spellings(w := text(free[i:i + 2])))
    banned = _greedy_ids(oai, bad_words=[word])
    assert banned[:at + 1] == free[:at + 1] and banned[at + 1] != free[at + 1]
    assert not any(banned[i:i + len(s)] == s for s in spellings(word) for i in range(len(banned)))


@pytest.mark.parametrize("extra, param", [
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [10 ** 7]}, "allowed_token_ids"),
    ({"bad_words": [" "]}, "bad_words"), ({"bad_words": ["x"], "regex": "a+"}, "bad_words"),
])
def test_token_rules_that_cannot_hold_are_400s(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt="Hi", max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param


def test_responses_take_the_peers_sampling_extras(oai):
    greedy = oai.responses.create(model="m", input="Say something.", max_output_tokens=8, temperature=0)
    # top_k 1 at temperature 1 is greedy: the extra reaches the sampler.
    top1 = oai.responses.create(model="m", input="Say something.", max_output_tokens=8, temperature=1.0,
                                extra_body={"top_k": 1, "seed": 7, "min_p": 0.0, "frequency_penalty": 0.0,
                                            "presence_penalty": 0.0, "repetition_penalty": 1.0})
    assert top1.output_text == greedy.output_text
    # stop: the output ends before the stop string (a piece of the greedy answer past its start).
    text = greedy.output_text
    stop = next(text[i:i + 3] for i in range(2, len(text) - 2) if text[i:i + 3].strip())
    cut = oai.responses.create(model="m", input="Say something.", max_output_tokens=8, temperature=0,
                               extra_body={"stop": [stop]})
    assert cut.output_text == text[:text.index(stop)]


@pytest.mark.parametrize("field, value", [("top_k", -5), ("min_p", 2.0), ("repetition_penalty", 0.0),
                                          ("frequency_penalty", 3.0), ("seed", 1 << 64)])
def test_responses_refuse_bad_sampling_extras(oai, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="m", input="hi", max_output_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field


# -- the peers' error phrases --------------------------------------------------------


def test_error_messages_carry_the_peers_phrases(oai):
    cases = [
        ({"prompt": ""}, "decoder prompt cannot be empty"),  # vLLM
        ({"prompt": [999999]}, "out of vocabulary"),  # vLLM
        ({"prompt": "hello " * (CONTEXT + 10)}, "is longer than the model's context length"),  # SGLang
        ({"prompt": "hello " * (CONTEXT + 10)}, "maximum context length"),  # vLLM
        ({"prompt": "hi", "seed": 1 << 63}, "Input should be"),  # vLLM's seed bounds
    ]
    for body, phrase in cases:
        extra = {k: v for k, v in body.items() if k != "prompt"}
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model="m", prompt=body["prompt"], max_tokens=1, extra_body=extra)
        assert phrase in str(e.value), (body, e.value.body)
        assert e.value.body["type"] == "invalid_request_error"


def test_a_65_mib_body_is_a_413_the_client_reads(server):
    """Over a real socket (the shared server's, whose limit is the default
    64 MiB): the server answers before reading the whole body, and the
    client still reads the 413, not a reset connection."""
    oai = openai.OpenAI(api_key="EMPTY", base_url=f"{server.base_url}/v1", max_retries=0, timeout=120)
    with pytest.raises(openai.APIStatusError) as e:
        oai.completions.create(model="m", prompt="x" * (65 << 20), max_tokens=1)
    assert e.value.status_code == 413 and e.value.body["code"] == "payload_too_large"
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200


# -- deliberate differences (README, "Where pyserve differs from its peers") ------------


def test_responses_cut_by_max_output_tokens_are_incomplete(oai):
    r = oai.responses.create(model="m", input="Tell a long story.", max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_unknown_fields_and_roles_and_stop_ids_are_400s(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=USER, max_tokens=1, extra_body={"no_such_field": 1})
    assert e.value.body["param"] == "no_such_field"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=[{"role": "narrator", "content": "hi"}], max_tokens=1)
    assert e.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt="hi", max_tokens=1, extra_body={"stop_token_ids": [10 ** 7]})
    assert e.value.body["param"] == "stop_token_ids"
