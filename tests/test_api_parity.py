"""SGLang's and vLLM's extra sampling and output fields, through the real
server with the official openai client (their names go in extra_body),
streamed and not."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

PROMPT = "The best thing about the sea is"
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]


def completion(client, model_name, stream=False, **extra):
    """(text, the choice's fields as a dict, finish_reason, the chunks' or response's dicts)."""
    standard = {k: extra.pop(k) for k in ("max_tokens", "stop", "logprobs", "echo", "stream_options") if k in extra}
    r = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, stream=stream,
                                  extra_body=extra, **{"max_tokens": 12, **standard})
    bodies = [c.model_dump() for c in r] if stream else [r.model_dump()]
    choices = [c for b in bodies for c in b["choices"]]
    text = "".join(c["text"] for c in choices)
    finish = next((c["finish_reason"] for c in choices if c["finish_reason"]), None)
    return text, choices, finish, bodies


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached(client, model_name):
    _, choices, _, _ = completion(client, model_name, max_tokens=1, return_token_ids=True)
    first = choices[0]["token_ids"][0]  # the greedy first token
    for stream in (False, True):
        _, choices, finish, _ = completion(client, model_name, stream, stop_token_ids=[first], return_token_ids=True)
        ids = [t for c in choices for t in c.get("token_ids") or []]
        assert ids == [first] and finish == "stop"
        _, choices, finish, _ = completion(client, model_name, stream, stop_token_ids=[first], min_tokens=4,
                                           return_token_ids=True)
        ids = [t for c in choices for t in c.get("token_ids") or []]
        assert len(ids) >= 4 and first not in ids[:4]


def test_min_tokens_beyond_max_tokens_is_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        completion(client, model_name, max_tokens=4, min_tokens=5)
    assert e.value.body["param"] == "min_tokens"


def test_stop_regex_ends_the_text_before_its_match(client, model_name):
    text, _, finish, _ = completion(client, model_name, max_tokens=24)
    words = re.findall(r"[A-Za-z]{3,}", text[4:])
    assert words, text
    pattern = words[0][:2] + "[a-z]+"
    start = re.search(pattern, text).start()
    for stream in (False, True):
        cut, choices, finish, _ = completion(client, model_name, stream, max_tokens=24, stop_regex=[pattern])
        assert cut == text[:start] and finish == "stop"
        assert [c["matched_stop"] for c in choices if c["finish_reason"]] == [pattern]


@pytest.mark.parametrize("name", ["include_stop_str_in_output", "no_stop_trim"])
def test_a_kept_stop_ends_the_text_with_the_stop_itself(client, model_name, name):
    """vLLM's include_stop_str_in_output and SGLang's no_stop_trim: the
    matched stop string, regex match or stop token's text stays in the
    text, and nothing after it; usage counts the same tokens as a trimmed stop."""
    text, choices, _, _ = completion(client, model_name, max_tokens=24, return_token_ids=True)
    ids = choices[0]["token_ids"]
    word = re.findall(r"[A-Za-z]{3,}", text[4:])[0]
    at = text.index(word, 4) + len(word)
    pattern = word[:2] + "[a-z]+"
    for stream in (False, True):
        trimmed, _, _, bodies = completion(client, model_name, stream, max_tokens=24, stop=[word],
                                           stream_options={"include_usage": True} if stream else None)
        kept, choices, finish, kept_bodies = completion(client, model_name, stream, max_tokens=24, stop=[word],
                                                        stream_options={"include_usage": True} if stream else None,
                                                        **{name: True})
        assert trimmed == text[: at - len(word)] and kept == text[:at] and finish == "stop"
        assert [c["matched_stop"] for c in choices if c["finish_reason"]] == [word]
        assert kept_bodies[-1]["usage"] == bodies[-1]["usage"]
        by_regex, _, _, _ = completion(client, model_name, stream, max_tokens=24, stop_regex=[pattern], **{name: True})
        start = re.search(pattern, text).start()  # the text up to the match, then the match itself
        assert text.startswith(by_regex) and re.fullmatch(pattern, by_regex[start:])
    token_text, _, finish, _ = completion(client, model_name, max_tokens=24, stop_token_ids=[ids[2]],
                                          skip_special_tokens=False, **{name: True})
    plain_text, _, _, _ = completion(client, model_name, max_tokens=24, stop_token_ids=[ids[2]])
    assert finish == "stop" and token_text.startswith(plain_text) and len(token_text) > len(plain_text)


def test_a_stop_regex_that_does_not_parse_is_a_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as e:
        completion(client, model_name, stop_regex="(unclosed")
    assert e.value.body["param"] == "stop_regex"


def test_return_token_ids_on_completions(client, model_name):
    whole, choices, _, bodies = completion(client, model_name, return_token_ids=True)
    prompt_ids, ids = choices[0]["prompt_token_ids"], choices[0]["token_ids"]
    assert len(prompt_ids) == bodies[0]["usage"]["prompt_tokens"] and len(ids) == bodies[0]["usage"]["completion_tokens"]
    text, chunks, _, _ = completion(client, model_name, True, return_token_ids=True)
    assert text == whole
    assert [c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")] == [prompt_ids]
    assert [t for c in chunks for t in c.get("token_ids") or []] == ids


def test_return_token_ids_on_chat(client, model_name):
    kwargs = dict(model=model_name, messages=CHAT, temperature=0, max_tokens=10,
                  extra_body={"return_token_ids": True})
    r = client.chat.completions.create(**kwargs).model_dump()
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    assert len(r["choices"][0]["token_ids"]) == r["usage"]["completion_tokens"]
    chunks = [c.model_dump() for c in client.chat.completions.create(stream=True, **kwargs)]
    assert chunks[0]["prompt_token_ids"] == r["prompt_token_ids"]
    assert all("prompt_token_ids" not in c or c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == r["choices"][0]["token_ids"]


def test_continuous_usage_stats_put_usage_on_every_chunk(client, model_name):
    _, _, _, whole = completion(client, model_name)
    for create in (lambda **kw: completion(client, model_name, True, **kw)[3],
                   lambda **kw: [c.model_dump() for c in client.chat.completions.create(
                       model=model_name, messages=CHAT, temperature=0, max_tokens=12, stream=True, **kw)]):
        chunks = create(stream_options={"include_usage": True, "continuous_usage_stats": True})
        assert all(c["usage"] is not None for c in chunks)
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 12 and chunks[-1]["choices"] == []
        assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n for c, n in zip(chunks, counts))
        plain = create(stream_options={"include_usage": True})
        assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"] == chunks[-1]["usage"]
    assert whole[0]["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_logprobs_score_every_prompt_token_after_the_first(client, model_name, route):
    if route == "completions":
        r = completion(client, model_name, max_tokens=2, prompt_logprobs=2, return_token_ids=True)[3][0]
        choice = r["choices"][0]
        scored, prompt_ids = choice["prompt_logprobs"], choice["prompt_token_ids"]
    else:
        r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=2, temperature=0,
                                           extra_body={"prompt_logprobs": 2, "return_token_ids": True}).model_dump()
        scored, prompt_ids = r["prompt_logprobs"], r["prompt_token_ids"]
    assert len(scored) == len(prompt_ids) == r["usage"]["prompt_tokens"] and scored[0] is None
    for token, entry in zip(prompt_ids[1:], scored[1:]):
        own = entry[str(token)]
        assert own["logprob"] <= 0 and own["rank"] >= 1
        # the two likeliest, and the prompt's own token when it is neither
        assert sorted(e["rank"] for e in entry.values() if e["rank"] <= 2) == [1, 2] and 2 <= len(entry) <= 3
        assert (own["rank"] == 1) == (own["logprob"] == max(e["logprob"] for e in entry.values()))


@pytest.mark.parametrize("value, stream", [(-1, False), (21, False), (1, True)])
def test_prompt_logprobs_out_of_range_or_streamed_is_a_400(client, model_name, value, stream):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, stream=stream,
                                  extra_body={"prompt_logprobs": value})
    assert e.value.body["param"] == "prompt_logprobs"


def test_chat_echo_starts_the_answer_with_the_continued_message(client, model_name):
    messages = CHAT + [{"role": "assistant", "content": "The sea is"}]
    kwargs = dict(model=model_name, messages=messages, temperature=0, max_tokens=8,
                  extra_body={"continue_final_message": True})
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    kwargs["extra_body"]["echo"] = True
    echoed = client.chat.completions.create(**kwargs).choices[0].message.content
    assert echoed == "The sea is" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == echoed
    # nothing to echo after a user turn
    answer = client.chat.completions.create(model=model_name, messages=CHAT, temperature=0, max_tokens=8,
                                            extra_body={"echo": True}).choices[0].message.content
    assert answer == client.chat.completions.create(model=model_name, messages=CHAT, temperature=0,
                                                    max_tokens=8).choices[0].message.content


def test_generate_honours_sglang_min_new_tokens_and_stop_regex(server, client, model_name):
    """/generate's sampling_params use SGLang's names for the same settings."""
    _, choices, _, _ = completion(client, model_name, max_tokens=1, return_token_ids=True)
    first = choices[0]["token_ids"][0]
    text, _, _, _ = completion(client, model_name, max_tokens=24)
    pattern = re.findall(r"[A-Za-z]{3,}", text[4:])[0][:2] + "[a-z]+"
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        def generate(**params):
            r = c.post("/generate", json={"text": PROMPT, "sampling_params": {"temperature": 0, **params}})
            assert r.status_code == 200, r.text
            return r.json()

        stopped = generate(max_new_tokens=12, stop_token_ids=[first])
        assert stopped["meta_info"]["completion_tokens"] == 1
        held = generate(max_new_tokens=12, stop_token_ids=[first], min_new_tokens=4)
        assert held["meta_info"]["completion_tokens"] >= 4
        cut = generate(max_new_tokens=24, stop_regex=pattern)
        assert cut["text"] == text[: re.search(pattern, text).start()]
        kept = generate(max_new_tokens=24, stop_regex=pattern, no_stop_trim=True)
        assert kept["text"].startswith(cut["text"]) and re.fullmatch(pattern, kept["text"][len(cut["text"]):])
        r = c.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "min_new_tokens"


def test_generate_answers_its_token_ids_as_sglang_does(server, client, model_name):
    """/generate's `output_ids`: the tokens the completions route samples for
    the same prompt, whole and, streamed, all so far in every event."""
    _, choices, _, _ = completion(client, model_name, max_tokens=10, return_token_ids=True, ignore_eos=True)
    expected = choices[0]["token_ids"]
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}}
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        whole = c.post("/generate", json=body).json()
        events = [line[6:] for line in c.post("/generate", json={**body, "stream": True}).text.splitlines()
                  if line.startswith("data: {")]
    assert whole["output_ids"] == expected and whole["text"] == choices[0]["text"]
    streamed = [json.loads(e)["output_ids"] for e in events]
    assert streamed[-1] == expected and all(expected[:len(ids)] == ids for ids in streamed)
