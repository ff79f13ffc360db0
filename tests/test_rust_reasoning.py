"""pyserve._rust.ReasoningSplitter against a pure-Python reference on random
streams, and pyserve._rust.content_text."""

from __future__ import annotations

import random

import pytest

from pyserve._rust import ReasoningSplitter, content_text

MARKERS = [("<think>", "</think>"), ("◁think▷", "◁/think▷")]


def reference(text: str, start: str, end: str, in_reasoning: bool) -> tuple[str, str]:
    """(reasoning, content) of a whole output: a start marker counts only at
    the start (after whitespace); the first end marker closes the block."""
    stripped = text.lstrip(" \n\t")
    if stripped.startswith(start):
        text, in_reasoning = stripped[len(start) :], True
    if not in_reasoning:
        return "", text
    reasoning, _, content = text.partition(end)
    return reasoning, content


def split_stream(deltas: list[str], start: str, end: str, in_reasoning: bool) -> tuple[str, str]:
    splitter = ReasoningSplitter(start, end, in_reasoning)
    reasoning, content = "", ""
    for delta in deltas:
        r, c = splitter.feed(delta)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.flush()
    return reasoning + r, content + c


@pytest.mark.parametrize("start, end", MARKERS)
@pytest.mark.parametrize("in_reasoning", [False, True])
def test_random_streams_match_reference(start, end, in_reasoning):
    rng = random.Random(0)
    pieces = [start, end, start[:2], end[:3], end[1:], "<", "a", "想", "🎉", " ", "\n", "b c"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text) + 1, 6))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert split_stream(deltas, start, end, in_reasoning) == reference(text, start, end, in_reasoning), deltas


def test_partial_markers_are_held_back():
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == ("", "")
    assert splitter.in_reasoning is False
    assert splitter.feed("nk>Let me see</th") == ("Let me see", "")
    assert splitter.in_reasoning is True
    assert splitter.feed("ink>\n\nIt is 4.") == ("", "\n\nIt is 4.")
    assert splitter.in_reasoning is False
    assert splitter.flush() == ("", "")


def test_template_opened_block():
    # DeepSeek-R1: the chat template ends with "<think>\n".
    assert split_stream(["Hmm", ".</think>", "Answer"], "<think>", "</think>", True) == ("Hmm.", "Answer")
    # Qwen3 without thinking: no markers at all, everything is content.
    assert split_stream(["Just ", "the answer"], "<think>", "</think>", False) == ("", "Just the answer")


def test_empty_markers_are_rejected():
    with pytest.raises(ValueError):
        ReasoningSplitter("", "</think>")


def test_content_text():
    assert content_text(None) == ""
    assert content_text("plain") == "plain"
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": ""}, {"type": "text", "text": "second"}]
    assert content_text(parts) == "first\nsecond"
    assert content_text([]) == ""
    for bad in (
        [{"type": "image_url", "image_url": {"url": "http://x"}}],
        [{"type": "text"}],
        [{"text": "no type"}],
        ["not a dict"],
        [{"type": "text", "text": 3}],
        42,
    ):
        with pytest.raises(ValueError):
            content_text(bad)
