"""pyserve._rust.Tokenizer against the Python `tokenizers` package."""

from __future__ import annotations

import json
import multiprocessing
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer as Reference

from pyserve._rust import Tokenizer
from tests.text_corpus import CORPUS, KINDS, tokenizer_file

# Texts where added tokens appear inside ordinary text.
WITH_ADDED = [
    "<|im_start|>user\nHi 你好<|im_end|>\n<|im_start|>assistant\n",
    "call <tool_call>{\"a\": 1}</tool_call> then<|endoftext|>",
]


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory):
    path = tokenizer_file(request.param, tmp_path_factory)
    return Tokenizer.from_file(str(path)), Reference.from_file(str(path))


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_matches_reference(pair, add_special_tokens):
    tok, ref = pair
    for text in CORPUS + WITH_ADDED + [""]:
        assert tok.encode(text, add_special_tokens) == ref.encode(text, add_special_tokens=add_special_tokens).ids, text


def test_encode_batch_matches_reference(pair):
    tok, ref = pair
    texts = CORPUS + WITH_ADDED
    expected = [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]
    assert tok.encode_batch(texts) == expected
    assert tok.encode_batch([]) == []


def test_encode_pairs_matches_reference(pair):
    """A (query, document) pair as one input, the post-processor's special tokens around and between."""
    tok, ref = pair
    pairs = list(zip(CORPUS, reversed(CORPUS))) + [("", "")]
    assert tok.encode_pairs(pairs) == [ref.encode(a, b, add_special_tokens=True).ids for a, b in pairs]
    assert tok.encode_pairs([]) == []


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_reference(pair, skip_special_tokens):
    tok, ref = pair
    for text in CORPUS + WITH_ADDED:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens) == ref.decode(ids, skip_special_tokens=skip_special_tokens)
    # Arbitrary id sequences too, cut-off characters included.
    ids = list(range(0, tok.vocab_size, 7))
    assert tok.decode(ids, skip_special_tokens) == ref.decode(ids, skip_special_tokens=skip_special_tokens)


def test_vocabulary(pair):
    tok, ref = pair
    vocab = ref.get_vocab(with_added_tokens=True)
    assert tok.vocab_size == max(vocab.values()) + 1
    for token, id in list(vocab.items())[:: max(1, len(vocab) // 500)]:
        assert tok.token_to_id(token) == id
        assert tok.id_to_token(id) == token
    assert tok.token_to_id("no such token, surely") is None
    added = ref.get_added_tokens_decoder()
    assert tok.added_tokens() == {t.content: id for id, t in added.items()}
    assert tok.special_token_ids() == sorted(id for id, t in added.items() if t.special)


def test_threads_share_one_tokenizer(pair):
    tok, ref = pair
    expected = [ref.encode(t, add_special_tokens=False).ids for t in CORPUS]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: [tok.encode(t) for t in CORPUS], range(8)))
        batches = list(pool.map(lambda _: tok.encode_batch(CORPUS), range(8)))
    assert all(r == expected for r in results + batches)


def _encode_batch_in_child(tok: Tokenizer, texts: list[str], expected: list[list[int]]) -> None:
    sys.exit(0 if tok.encode_batch(texts) == expected else 1)


def test_encode_batch_after_fork(pair):
    """The parent's thread pool is gone in a forked child: the child must
    encode without it instead of waiting for it forever."""
    tok, _ = pair
    texts = CORPUS * 8
    expected = tok.encode_batch(texts)  # the parent's pool now runs
    child = multiprocessing.get_context("fork").Process(target=_encode_batch_in_child, args=(tok, texts, expected))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0


def test_bad_ids_are_value_errors(pair):
    tok, _ = pair
    for bad in ([tok.vocab_size], [0, -1], [2**40]):
        with pytest.raises(ValueError):
            tok.decode(bad)
    assert tok.id_to_token(-1) is None
    assert tok.id_to_token(tok.vocab_size) is None


def test_bad_files_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="nonexistent"):
        Tokenizer.from_file(str(tmp_path / "nonexistent.json"))
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    with pytest.raises(ValueError):
        Tokenizer.from_file(str(broken))
