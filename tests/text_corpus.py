"""Texts and tokenizer.json files for the tests of the Rust text core.

Three tokenizers, each a real `tokenizer.json`:
- "byte_level": a small GPT-2 style byte-level BPE trained here on the corpus
  (multi-byte characters split across tokens);
- "metaspace": a small SentencePiece/Llama style BPE trained here, with a
  limited alphabet and byte fallback (CJK and emoji become <0xXX> tokens;
  the decoder strips the leading space);
- "default": the embedded default model's tokenizer (skipped when the
  default model is not available).
The first two are built with the Python `tokenizers` package, which the
tests also use as the reference implementation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CORPUS = [
    "Hello, world! This is a plain ASCII sentence.",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "Ünïcödé àccents: café, naïve, façade, Ångström, Straße.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキスト：東京は大きな都市です。カタカナとひらがな。",
    "한국어 문장입니다. 안녕하세요!",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️‍🔥 🎉",
    "Mixed: the cat 猫 says 🐱 meow ニャー and the dog 犬 says woof.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    "Whitespace   runs\t\tand\ttabs\n\n\nand newlines     end.",
    "    leading spaces and trailing spaces    ",
    "\n\nstarts with newlines",
    "العربية نص من اليمين إلى اليسار. עברית גם כן.",
    "Math: ∀x ∈ ℝ, x² ≥ 0; ∑ᵢ aᵢ = π ≈ 3.14159 ∞",
    "Box drawing ┌─┐ │ │ └─┘ and arrows ← ↑ → ↓ ⇒",
    "Numbers 3.14, 1e-9, 0xFF, -42, 1,000,000 and dates 2024-01-31.",
    "URLs: https://example.com/path?q=1&r=2#frag and emails a.b@c.org",
    "Repeated: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!!!!!????",
    "Quotes “curly” ‘single’ «guillemets» and dashes — – -",
    "Zero width: a\u200bb\u200cc\u200dd and combining e\u0301 n\u0303",
    "<think>reasoning</think> then an answer, and a stop: THE END",
    "A",
    " ",
]

# Added tokens of the tokenizers built here: special ones and an ordinary one.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = ["<tool_call>"]
# The metaspace tokenizer's alphabet: everything else falls back to bytes.
_METASPACE_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?;:'\"()-_"

KINDS = ["byte_level", "metaspace", "default"]

_built: dict[str, Path] = {}


def _training_texts() -> list[str]:
    return CORPUS * 4 + [" ".join(CORPUS)]


def build_byte_level_bpe(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(), trainer)
    tok.add_tokens(ADDED_TOKENS)
    tok.save(str(path))


def build_metaspace_bpe(path: Path) -> None:
    """Llama-2 style: Metaspace words, BPE with <0xXX> byte fallback."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<unk>", *SPECIAL_TOKENS],
        initial_alphabet=list(_METASPACE_ALPHABET.replace(" ", "▁")),
        limit_alphabet=len(_METASPACE_ALPHABET),
        show_progress=False,
    )
    tok.train_from_iterator(_training_texts(), trainer)
    # SentencePiece keeps the 256 byte pieces in the model's vocabulary.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = next_id + byte
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_tokens(ADDED_TOKENS)
    tok.save(str(path))


def tokenizer_file(kind: str, tmp_path_factory) -> Path:
    """Path of the tokenizer.json of `kind` (built once per test session)."""
    if kind == "default":
        try:
            from pyserve.model.default_model import default_model_path

            return default_model_path() / "tokenizer.json"
        except Exception as e:  # the default model is optional here
            pytest.skip(f"default model not available: {e}")
    if kind not in _built:
        path = tmp_path_factory.mktemp(kind) / "tokenizer.json"
        {"byte_level": build_byte_level_bpe, "metaspace": build_metaspace_bpe}[kind](path)
        _built[kind] = path
    return _built[kind]
