"""pyserve._rust.StopMatcher against a pure-Python reference, on random
texts, stop strings and stop regexes cut into random deltas."""

from __future__ import annotations

import random
import re

import pytest

from pyserve._rust import StopMatcher
from tests.text_corpus import CORPUS


def reference(text: str, stops: list[str]) -> tuple[str, int | None]:
    """The text before the stop that ends first (of those ending together,
    the longest, then the first listed) and its index; or all the text."""
    found = []
    for i, stop in enumerate(stops):
        pos = text.find(stop) if stop else -1
        if pos >= 0:
            found.append((pos + len(stop), pos, i))
    if not found:
        return text, None
    _, pos, i = min(found)
    return text[:pos], i


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop."""
    longest = max((len(s) for s in stops), default=0)
    for n in range(min(len(text), longest - 1), 0, -1):
        if any(len(s) > n and s.startswith(text[-n:]) for s in stops):
            return n
    return 0


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text) + 1, 12))))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def check_stream(stops: list[str], deltas: list[str]) -> None:
    """Feeds `deltas` and checks every answer against the reference."""
    matcher = StopMatcher(stops)
    text = "".join(deltas)
    expected = reference(text, stops)
    seen, emitted = "", ""
    for i, delta in enumerate(deltas):
        seen += delta
        safe, matched = matcher.feed(delta)
        emitted += safe
        if matched is not None:
            assert (emitted, matched) == expected, (stops, deltas)
            assert matcher.matched == matched
            for later in deltas[i + 1 :] + ["more"]:
                assert matcher.feed(later) == ("", matched)
            assert matcher.flush() == ("", matched)
            return
        # Nothing held back that could not still begin a stop.
        assert emitted == seen[: len(seen) - held_back(seen, stops)], (stops, deltas)
    assert expected[1] is None, (stops, deltas)
    assert emitted + matcher.flush()[0] == text
    assert matcher.matched is None


def test_random_texts_and_stops():
    rng = random.Random(0)
    alphabet = "ab你🎉 \n"
    for _ in range(3000):
        word = lambda n: "".join(rng.choice(alphabet) for _ in range(n))  # noqa: E731
        stops = [word(rng.randint(1, 5)) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.2:
            stops.insert(rng.randrange(len(stops) + 1), "")
        if rng.random() < 0.1:
            stops.append(rng.choice(stops))
        check_stream(stops, random_split(rng, word(rng.randint(0, 60))))


def test_corpus_with_stops_taken_from_it():
    rng = random.Random(1)
    for text in CORPUS:
        for _ in range(30):
            stops = []
            for _ in range(rng.randint(1, 3)):
                a = rng.randrange(len(text))
                stops.append(text[a : a + rng.randint(1, 8)])
            check_stream(stops, random_split(rng, text))
            # One character per delta: stops span many deltas.
            check_stream(stops, list(text))


@pytest.mark.parametrize(
    "stops, deltas, expected",
    [
        (["THE END"], ["once upon TH", "E", " ", "E", "N", "D after"], ("once upon ", 0)),
        (["abcd", "bc"], ["abcd"], ("a", 1)),  # "bc" ends first
        (["c", "bc"], ["abc"], ("a", 1)),  # same end: the longest
        (["bc", "bc"], ["abc"], ("a", 0)),  # same stop twice: the first listed
        (["", "b"], ["abc"], ("a", 1)),  # empty stops are ignored, indices kept
        (["。", "！"], ["你好", "！再", "见。"], ("你好", 1)),
        (["🎉🎉"], ["party 🎉", "🎉 time"], ("party ", 0)),
        (["\n\n"], ["line\n", "\nnext"], ("line", 0)),
    ],
)
def test_examples(stops, deltas, expected):
    matcher = StopMatcher(stops)
    out = ""
    for delta in deltas:
        safe, matched = matcher.feed(delta)
        out += safe
        if matched is not None:
            break
    assert (out, matched) == expected


def test_holds_back_only_what_could_start_a_stop():
    matcher = StopMatcher(["</answer>", "STOP"])
    assert matcher.feed("see </ans") == ("see ", None)
    assert matcher.feed("wer is") == ("</answer is", None)
    assert matcher.feed(" ST") == (" ", None)
    assert matcher.flush() == ("ST", None)


def test_no_stops_passes_everything_through():
    for stops in ([], [""]):
        matcher = StopMatcher(stops)
        assert matcher.feed("anything at all") == ("anything at all", None)
        assert matcher.flush() == ("", None)


def regex_reference(text: str, stops: list[str], regexes: list[str]) -> tuple[str, int | None]:
    """The text before the stop whose match ends first (then the longest,
    then the first listed, strings before regexes), by brute force."""
    found = []
    for i, stop in enumerate(stops):
        pos = text.find(stop) if stop else -1
        if pos >= 0:
            found.append((pos + len(stop), pos, i))
    for j, pattern in enumerate(regexes):
        compiled = re.compile(pattern)
        for end in range(1, len(text) + 1):
            starts = [s for s in range(end) if compiled.fullmatch(text, s, end)]
            if starts:
                found.append((end, starts[0], len(stops) + j))
                break
    if not found:
        return text, None
    # Ends are compared in UTF-8 bytes, as the matcher counts them.
    _, pos, i = min((len(text[:e].encode()), len(text[:p].encode()), i) for e, p, i in found)
    return text.encode()[:pos].decode(), i


def run_matcher(matcher: StopMatcher, deltas: list[str]) -> tuple[str, int | None]:
    out = ""
    for delta in deltas:
        safe, matched = matcher.feed(delta)
        out += safe
        if matched is not None:
            return out, matched
    rest, matched = matcher.flush()
    return out + rest, matched


REGEX_PIECES = ["a+", "b", "[ab]c?", "你+", "(x|yz)", "a{2}", "c*d", ".b", "[^a ]"]


def test_random_texts_and_regexes():
    rng = random.Random(2)
    alphabet = "abcdxyz你 "
    for _ in range(1500):
        regexes = ["".join(rng.choice(REGEX_PIECES) for _ in range(rng.randint(1, 3)))
                   for _ in range(rng.randint(1, 2))]
        stops = [] if rng.random() < 0.5 else ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3)))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        want = regex_reference(text, stops, regexes)
        for deltas in (random_split(rng, text), list(text), [text]):
            assert run_matcher(StopMatcher(stops, regexes), deltas) == want, (stops, regexes, deltas)


def test_a_regex_holds_back_text_while_it_could_still_match():
    matcher = StopMatcher([], [r"Answer: \d+\."])
    assert matcher.feed("So. Ans") == ("So. ", None)
    assert matcher.feed("wer: 4") == ("", None)
    assert matcher.feed("2!") == ("Answer: 42!", None)
    assert run_matcher(StopMatcher([], [r"Answer: \d+\."]), ["x Answer: 4", "2. more"]) == ("x ", 0)


def test_a_regex_that_looks_past_its_end_waits_for_the_next_character_or_the_end():
    assert run_matcher(StopMatcher([], [r"\bcat\b"]), ["a cat", "s and a cat"]) == ("a cats and a ", 0)
    assert run_matcher(StopMatcher(["x"], [r"\.$"]), ["a. b."]) == ("a. b", 1)


@pytest.mark.parametrize("pattern, message", [("(a", "stop_regex[0]"), ("a*", "empty string"), ("", "empty string")])
def test_bad_regexes_are_value_errors_naming_them(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StopMatcher([], [pattern])
