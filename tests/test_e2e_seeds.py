"""The user's own examples (../shared/seeds, the cells before "Batches"),
run unchanged with the official openai client against a real pyserve on
the embedded model. Only the model name is substituted."""

from __future__ import annotations

import pytest

from tests.conftest import SERVER_DEFAULT_MAX_TOKENS

HISTORIAN = [
    {"role": "system", "content": "You are a knowledgeable historian who provides concise responses."},
    {"role": "user", "content": "Tell me about ancient Rome"},
    {"role": "assistant", "content": "Ancient Rome was a civilization centered in Italy."},
    {"role": "user", "content": "What were their major achievements?"},
]

# Every distinct chat call in the seeds, keyword arguments as written there.
CHAT_CALLS = {
    "capitals": dict(messages=[{"role": "user", "content": "List 3 countries and their capitals."}],
                     temperature=0, max_tokens=64),
    "capitals-system": dict(messages=[{"role": "system", "content": "You are a helpful AI assistant"},
                                      {"role": "user", "content": "List 3 countries and their capitals."}],
                            temperature=0, max_tokens=64),
    "historian-128": dict(messages=HISTORIAN, temperature=0.3, max_tokens=128, top_p=0.95,
                          presence_penalty=0.2, frequency_penalty=0.2, n=1, seed=42),
    "historian-100-stop": dict(messages=HISTORIAN, temperature=0.3, max_tokens=100, top_p=0.95,
                               stop=["\n\n"], presence_penalty=0.2, frequency_penalty=0.2, n=1, seed=42),
    "say-test": dict(messages=[{"role": "user", "content": "Say this is a test"}]),
}

COMPLETION_CALLS = {
    "capitals": dict(prompt="List 3 countries and their capitals.", temperature=0, max_tokens=64, n=1, stop=None),
    "story": dict(prompt="Write a short story about a space explorer.", temperature=0.7, max_tokens=150,
                  top_p=0.9, presence_penalty=0.3, frequency_penalty=0.3, n=1, seed=123,
                  stop=["\n\n", "THE END"]),
}


def stream_chat_text(client, **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    # As the seeds read a stream: choices[0] of every chunk.
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    return text, chunks


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from pyserve._rust import Tokenizer

    return Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))


def check_usage(usage, max_tokens, choice=None, text=None, tokenizer=None):
    """Counts add up; with the output in hand, completion_tokens is the
    number of generated tokens: max_tokens when cut for length, the text's
    tokens plus the EOS token when the model ended it (greedy output
    re-encodes to the same tokens)."""
    assert usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if max_tokens is not None:
        assert 1 <= usage.completion_tokens <= max_tokens
    if choice is not None and choice.finish_reason == "length":
        assert usage.completion_tokens == max_tokens
    if tokenizer is not None and choice.finish_reason == "stop" and isinstance(choice.matched_stop, int):
        assert usage.completion_tokens == len(tokenizer.encode(text)) + 1


@pytest.mark.parametrize("name", list(CHAT_CALLS))
def test_seed_chat_call(client, model_name, tokenizer, name):
    kwargs = dict(CHAT_CALLS[name], model=model_name)
    response = client.chat.completions.create(**kwargs)
    choice = response.choices[0]
    assert response.object == "chat.completion"
    assert response.model == model_name
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    max_tokens = kwargs.get("max_tokens", SERVER_DEFAULT_MAX_TOKENS)
    greedy = kwargs.get("temperature") == 0
    check_usage(response.usage, max_tokens, choice, choice.message.content, tokenizer if greedy else None)
    for stop in kwargs.get("stop") or []:
        assert stop not in choice.message.content


@pytest.mark.parametrize("name", ["historian-100-stop", "say-test"])
def test_seed_chat_call_streamed(client, model_name, name):
    """The seeds print `chunk.choices[0].delta.content` for every chunk."""
    kwargs = dict(CHAT_CALLS[name], model=model_name)
    text, chunks = stream_chat_text(client, **kwargs)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks].count(None) == len(chunks) - 1
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert text
    for stop in kwargs.get("stop") or []:
        assert stop not in text


# capitals-system streams through the same path as capitals (its whole
# response is checked in test_seed_chat_call).
@pytest.mark.parametrize("name", ["capitals", "say-test"])
def test_streamed_chat_equals_non_streamed_at_temperature_0(client, model_name, name):
    kwargs = dict(CHAT_CALLS[name], model=model_name, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed, _ = stream_chat_text(client, **kwargs)
    assert streamed == whole


@pytest.mark.parametrize("name", list(COMPLETION_CALLS))
def test_seed_completion_call(client, model_name, tokenizer, name):
    kwargs = dict(COMPLETION_CALLS[name], model=model_name)
    response = client.completions.create(**kwargs)
    choice = response.choices[0]
    assert response.object == "text_completion"
    assert choice.text or choice.finish_reason == "stop"  # the model may end at once
    assert choice.finish_reason in ("stop", "length")
    check_usage(response.usage, kwargs["max_tokens"], choice, choice.text,
                tokenizer if kwargs["temperature"] == 0 else None)
    for stop in kwargs.get("stop") or []:
        assert stop not in choice.text
    if choice.finish_reason == "stop" and kwargs.get("stop"):
        assert choice.matched_stop in kwargs["stop"] or isinstance(choice.matched_stop, int)


@pytest.mark.parametrize("name", list(COMPLETION_CALLS))
def test_streamed_completion_equals_non_streamed_at_temperature_0(client, model_name, name):
    kwargs = dict(COMPLETION_CALLS[name], model=model_name, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole
    for stop in kwargs.get("stop") or []:
        assert stop not in whole


def test_seeded_story_streams_as_the_seed_prints_it(client, model_name):
    """The seeds' streamed story, as written: seeded sampling streams the
    same text as the whole response."""
    kwargs = dict(COMPLETION_CALLS["story"], model=model_name)
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(chunk.choices[0].text or "" for chunk in client.completions.create(stream=True, **kwargs))
    assert streamed == whole
    assert "\n\n" not in streamed and "THE END" not in streamed


def test_seeded_sampling_is_reproducible(client, model_name):
    kwargs = dict(CHAT_CALLS["historian-128"], model=model_name, max_tokens=24)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    again = client.chat.completions.create(**kwargs).choices[0].message.content
    assert first == again


def test_n_choices_are_independent(client, model_name):
    response = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Name a color."}],
        n=3, temperature=1.0, seed=7, max_tokens=12,
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    # completion tokens add up over choices; the prompt counts once
    assert 3 <= response.usage.completion_tokens <= 3 * 12
    single = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Name a color."}], max_tokens=1)
    assert response.usage.prompt_tokens == single.usage.prompt_tokens
    assert len({c.message.content for c in response.choices}) > 1


def test_reasoning_example_runs(client, model_name):
    """The seeds' enable_thinking + separate_reasoning request: SmolLM2 does
    not think, so without a reasoning parser the answer is all content."""
    response = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "9.11 and 9.8, which is greater?"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": True}, "separate_reasoning": True},
    )
    message = response.choices[0].message
    assert message.content
    assert getattr(message, "reasoning_content", None) is None


def test_embedded_model_answers_sensibly(client, model_name):
    """The converted embedded model is a working instruct model."""
    response = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=32,
    )
    assert "Paris" in response.choices[0].message.content


def test_stream_usage_chunk_and_n_choices_when_streaming(client, model_name):
    chunks = list(client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8,
        n=2, seed=3, stream=True, stream_options={"include_usage": True},
    ))
    usage_chunks = [c for c in chunks if not c.choices]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    usage = usage_chunks[0].usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    finished = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(c.index for c in finished) == [0, 1]
    produced = {0: "", 1: ""}
    for c in chunks:
        if c.choices:
            produced[c.choices[0].index] += c.choices[0].delta.content or ""
    assert all(produced.values())


def test_completion_prompt_forms(client, model_name):
    ids = client.completions.create(model=model_name, prompt="Hello", max_tokens=1).usage.prompt_tokens
    batch = client.completions.create(model=model_name, prompt=["Hello", "The sky is"], max_tokens=3,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    echoed = client.completions.create(model=model_name, prompt="The sky is", max_tokens=3, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "The sky is" + batch.choices[1].text
    assert ids >= 1


def test_list_of_text_parts_is_the_same_as_a_string(client, model_name):
    as_parts = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}])
    as_string = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content


def test_shared_prefix_is_reported_as_cached_tokens(client, model_name):
    system = {"role": "system", "content": "You are a meticulous assistant. " * 20}
    ask = lambda q: client.chat.completions.create(  # noqa: E731
        model=model_name, temperature=0, max_tokens=8, messages=[system, {"role": "user", "content": q}])
    first, second = ask("What is 2+2?"), ask("Name a planet.")
    assert second.usage.prompt_tokens_details.cached_tokens >= 100
    again = ask("What is 2+2?")
    assert again.choices[0].message.content == first.choices[0].message.content
