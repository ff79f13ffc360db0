"""pyserve._rust.DecodeStream: streamed text equals the full decode.

For every corpus text and every way of cutting its ids into a first chunk
and then one id per step, the concatenated deltas equal the reference
decode of all ids, and no delta contains U+FFFD unless the text does.
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as Reference

from pyserve._rust import DecodeStream, Tokenizer
from tests.text_corpus import CORPUS, KINDS, tokenizer_file

FFFD = "\ufffd"


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    path = tokenizer_file(request.param, tmp_path_factory)
    return Tokenizer.from_file(str(path)), Reference.from_file(str(path))


def stream(tok, chunks, skip_special_tokens=True, prompt_tail=None) -> list[str]:
    ds = DecodeStream(tok, skip_special_tokens, prompt_tail)
    return [ds.step(list(c)) for c in chunks] + [ds.flush()]


def test_every_split_point_equals_full_decode(pair):
    tok, ref = pair
    for text in CORPUS:
        ids = ref.encode(text, add_special_tokens=False).ids
        full = ref.decode(ids)
        for k in range(len(ids) + 1):
            pieces = stream(tok, [ids[:k]] + [[i] for i in ids[k:]])
            assert "".join(pieces) == full, (text, k)
            if FFFD not in full:
                assert not any(FFFD in p for p in pieces), (text, k, pieces)


def char_boundaries(ref, ids) -> list[int]:
    """Positions in `ids` that fall between whole characters."""
    return [p for p in range(len(ids) + 1) if not ref.decode(ids[:p]).endswith(FFFD)]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_chunks_with_added_tokens(pair, skip_special_tokens):
    tok, ref = pair
    rng = random.Random(0)
    added = sorted(tok.added_tokens().values())
    for text in CORPUS:
        ids = ref.encode(text, add_special_tokens=False).ids
        # Added tokens go between characters, as a model puts them: inside a
        # run of byte-fallback tokens one would turn the whole run into
        # U+FFFD in the full decode, which no stream can foresee.
        boundaries = char_boundaries(ref, ids)
        for _ in range(5):
            mixed = list(ids)
            for p in sorted(rng.sample(boundaries, min(3, len(boundaries))), reverse=True):
                mixed.insert(p, rng.choice(added))
            cuts = sorted(rng.sample(range(len(mixed) + 1), min(len(mixed) + 1, rng.randint(1, 6))))
            chunks = [mixed[a:b] for a, b in zip([0] + cuts, cuts + [len(mixed)])]
            expected = ref.decode(mixed, skip_special_tokens=skip_special_tokens)
            assert "".join(stream(tok, chunks, skip_special_tokens)) == expected, (text, mixed)


def test_prompt_tail_is_left_context(pair):
    tok, ref = pair
    for text in CORPUS:
        ids = ref.encode(text, add_special_tokens=False).ids
        for p in range(1, len(ids)):
            tail, gen = ids[max(0, p - 4) : p], ids[p:]
            context = ref.decode(tail)
            if FFFD in context:  # the tail cuts a character: no clean "minus"
                continue
            whole = ref.decode(tail + gen)
            assert whole.startswith(context)
            pieces = stream(tok, [[i] for i in gen], prompt_tail=tail)
            assert "".join(pieces) == whole[len(context) :], (text, p)


def test_metaspace_first_token_keeps_its_space(tmp_path_factory):
    tok = Tokenizer.from_file(str(tokenizer_file("metaspace", tmp_path_factory)))
    ids = tok.encode("say the")
    assert tok.id_to_token(ids[-1]) == "▁the"
    assert "".join(stream(tok, [ids[-1:]], prompt_tail=ids[:-1])) == " the"
    # Without left context it reads as the start of a text.
    assert "".join(stream(tok, [ids[-1:]])) == "the"


def test_byte_fallback_characters_arrive_whole(tmp_path_factory):
    tok = Tokenizer.from_file(str(tokenizer_file("metaspace", tmp_path_factory)))
    ids = tok.encode("猫🐱")
    assert sum(tok.id_to_token(i).startswith("<0x") for i in ids) == 7
    ds = DecodeStream(tok)
    pieces = [ds.step([i]) for i in ids] + [ds.flush()]
    assert [p for p in pieces if p] == [" 猫"[1:], "🐱"]


def test_random_ids_stream_like_full_decode(pair):
    """A broken model's output (invalid bytes, ids that add no text) streams
    like its full decode. Except with byte fallback: there one invalid byte
    turns its whole run of byte tokens into U+FFFD, which no stream can
    foresee, so there the stream only has to keep going."""
    tok, ref = pair
    rng = random.Random(1)
    ids = [rng.randrange(tok.vocab_size) for _ in range(3000)]
    out = "".join(stream(tok, [[i] for i in ids]))
    if tok.token_to_id("<0x41>") is None:
        assert out == ref.decode(ids)


def test_bad_ids_are_value_errors(pair):
    tok, _ = pair
    ds = DecodeStream(tok)
    with pytest.raises(ValueError):
        ds.step([tok.vocab_size])
    with pytest.raises(ValueError):
        ds.step([-5])
    with pytest.raises(ValueError):
        DecodeStream(tok, prompt_tail=[tok.vocab_size])
    ok = tok.encode("ok")
    assert ds.step(ok) + ds.flush() == tok.decode(ok)


def test_long_run_of_skipped_special_tokens_keeps_the_space(tmp_path_factory):
    """More skipped special tokens in a row than the window lets wait must
    not leave a left context that decodes to "": Metaspace would then strip
    the next word's space."""
    tok = Tokenizer.from_file(str(tokenizer_file("metaspace", tmp_path_factory)))
    hi, hi_there = tok.encode("hi"), tok.encode("hi there")
    ids = hi + [tok.special_token_ids()[0]] * 20 + hi_there[len(hi) :]
    assert tok.decode(ids) == "hi there"
    assert "".join(stream(tok, [[i] for i in ids])) == "hi there"
    # Kept, the special tokens are text like any other.
    kept = DecodeStream(tok, skip_special_tokens=False)
    pieces = [kept.step([i]) for i in ids] + [kept.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=False)
