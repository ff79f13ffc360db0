"""logprobs through the official openai client, against the real server."""

from __future__ import annotations

MESSAGES = [{"role": "user", "content": "Name three colors."}]


def test_chat_logprobs_cover_every_token(client, model_name):
    plain = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0, max_tokens=12)
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0, max_tokens=12,
                                       logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.message.content == plain.choices[0].message.content  # asking changes nothing
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens
    if choice.finish_reason == "length":
        assert "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob  # greedy
    assert plain.choices[0].logprobs is None


def test_streamed_chat_logprobs_arrive_with_their_text(client, model_name):
    stream = client.chat.completions.create(model=model_name, messages=MESSAGES, temperature=0, max_tokens=12,
                                            logprobs=True, stream=True, stream_options={"include_usage": True})
    text, tokens, usage, finish = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
            if c.logprobs is not None:
                assert c.logprobs.content and all(t.top_logprobs == [] for t in c.logprobs.content)
                tokens += [t.token for t in c.logprobs.content]
    assert len(tokens) == usage.completion_tokens
    # the stop token, if any, has a logprob but no text
    assert "".join(tokens) == text if finish == "length" else "".join(tokens).startswith(text)


def test_completion_logprobs_legacy_shape(client, model_name):
    r = client.completions.create(model=model_name, prompt="The capital of France is", temperature=0,
                                  max_tokens=8, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == logprob and top[token] == logprob


def test_completion_logprobs_zero_is_the_sampled_token_alone(client, model_name):
    for stream in (False, True):
        r = client.completions.create(model=model_name, prompt="The capital of France is", temperature=0.8,
                                      seed=3, max_tokens=6, logprobs=0, stream=stream)
        chunks = list(r) if stream else [r]
        lps = [c.logprobs for chunk in chunks for c in chunk.choices if c.logprobs is not None]
        tokens = [t for lp in lps for t in lp.tokens]
        tops = [top for lp in lps for top in lp.top_logprobs]
        values = [v for lp in lps for v in lp.token_logprobs]
        assert len(tokens) == 6 and [list(top) for top in tops] == [[t] for t in tokens]
        assert [top[t] for top, t in zip(tops, tokens)] == values


def test_streamed_completion_offsets_run_on(client, model_name):
    stream = client.completions.create(model=model_name, prompt="Once upon a time", temperature=0, max_tokens=10,
                                       logprobs=1, stream=True)
    text, tokens, offsets = "", [], []
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert len(tokens) == 10
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert "".join(tokens) == text


def test_echo_with_logprobs_scores_the_prompt_as_eval_harnesses_ask(client, model_name):
    """lm-evaluation-harness's loglikelihood request: token ids, echo,
    logprobs=1, max_tokens=1; it reads token_logprobs[ctxlen:-1]."""
    prompt = [504, 3575, 282, 4649, 314, 7042, 30]  # some token ids
    r = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v < 0 for v in lp.token_logprobs[1:-1])
    # the likeliest token, and the prompt's own when it is another
    assert all(1 <= len(top) <= 2 and max(top.values()) >= v for top, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert "".join(lp.tokens) == r.choices[0].text
    # the prompt's scores do not depend on a cached prefix or on streaming
    again = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                      logprobs=1)
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs
    streamed, chunks = [], []
    for chunk in client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0,
                                           echo=True, logprobs=1, stream=True):
        for c in chunk.choices:
            chunks.append(c)
            if c.logprobs is not None:
                streamed += c.logprobs.token_logprobs
    assert streamed == lp.token_logprobs
    # the echoed prompt's chunk carries the prompt's logprobs
    echoed = chunks[0]
    assert echoed.text and "".join(echoed.logprobs.tokens) == echoed.text
    assert echoed.logprobs.token_logprobs == lp.token_logprobs[: len(prompt)]
