"""Text path benchmark: the per-token work between sampling and the client.

Compares, on the same token streams, the Rust DecodeStream + StopMatcher
with a pure-Python incremental detokenizer (the classic prefix/read offset
scheme on the `tokenizers` package) plus a Python stop check; and the Rust
Tokenizer.encode_batch with the `tokenizers` package's. Prints µs per token
and the ratios.

    python bench/text_path.py [--tokenizer path/to/tokenizer.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

# Run as a script from anywhere: the corpus lives in the tests package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizers import Tokenizer as PyTokenizer  # noqa: E402

from pyserve._rust import DecodeStream, StopMatcher, Tokenizer  # noqa: E402
from tests.text_corpus import CORPUS, build_byte_level_bpe  # noqa: E402

STOPS = ["</answer>", "\n\nUser:", "THE END!", "<|im_end|>"]
STREAMS = 64
TOKENS_PER_STREAM = 256


class PyDecodeStream:
    """Incremental detokenizer in Python: decode the ids since `prefix`
    twice (with and without the new ones) and emit the difference once it
    is not an incomplete character."""

    def __init__(self, tok: PyTokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def step(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        text = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(prefix_text) :]


class PyStopMatcher:
    """Stop strings in Python: search the buffer for each stop, hold back
    the last (longest stop - 1) characters."""

    def __init__(self, stops: list[str]):
        self.stops, self.hold, self.buf = stops, max(map(len, stops)) - 1, ""

    def feed(self, text: str) -> tuple[str, int | None]:
        self.buf += text
        found = [(p + len(s), p, i) for i, s in enumerate(self.stops) if (p := self.buf.find(s)) >= 0]
        if found:
            _, pos, i = min(found)
            return self.buf[:pos], i
        safe, self.buf = self.buf[: len(self.buf) - self.hold], self.buf[len(self.buf) - self.hold :]
        return safe, None


def token_streams(py_tok: PyTokenizer) -> list[list[int]]:
    text = " ".join(CORPUS)
    ids = py_tok.encode(text * (1 + TOKENS_PER_STREAM * STREAMS // max(1, len(py_tok.encode(text).ids))),
                        add_special_tokens=False).ids
    return [ids[i * TOKENS_PER_STREAM : (i + 1) * TOKENS_PER_STREAM] for i in range(STREAMS)]


def best_of(repeats: int, fn) -> float:
    """Smallest wall time of `repeats` runs, in seconds."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def run_streams(tok, decode_stream, stop_matcher, streams, stops: bool) -> str:
    """Detokenize each stream one token per step, optionally through stops.
    The same loop drives the Rust types and the Python reference."""
    out = []
    for ids in streams:
        ds, sm = decode_stream(tok), stop_matcher(STOPS)
        for t in ids:
            delta = ds.step([t])
            out.append(sm.feed(delta)[0] if stops else delta)
    return "".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="tokenizer.json (default: the embedded default model's)")
    args = parser.parse_args()
    path = args.tokenizer
    if path is None:
        try:
            from pyserve.model.default_model import default_model_path

            path = str(default_model_path() / "tokenizer.json")
        except Exception as e:  # no default model: a small tokenizer trained here
            print(f"(default model unavailable: {e}; using a small trained byte-level BPE)")
            path = str(Path(tempfile.mkdtemp()) / "tokenizer.json")
            build_byte_level_bpe(Path(path))
    tok, py_tok = Tokenizer.from_file(path), PyTokenizer.from_file(path)
    streams = token_streams(py_tok)
    n_tokens = sum(map(len, streams))
    print(f"tokenizer: {path}\n{STREAMS} streams x {TOKENS_PER_STREAM} tokens, one token per step\n")

    rows = []
    for label, stops in (("detokenize", False), ("detokenize + stop strings", True)):
        rust = best_of(5, lambda: run_streams(tok, DecodeStream, StopMatcher, streams, stops)) / n_tokens * 1e6
        python = best_of(3, lambda: run_streams(py_tok, PyDecodeStream, PyStopMatcher, streams, stops)) / n_tokens * 1e6
        rows.append((label + " (µs/token)", rust, python))

    docs = [" ".join(CORPUS[i % len(CORPUS) :] + CORPUS[: i % len(CORPUS)]) * 4 for i in range(64)]
    n_doc_tokens = sum(map(len, tok.encode_batch(docs)))
    rust = best_of(5, lambda: tok.encode_batch(docs)) / n_doc_tokens * 1e6
    python = best_of(5, lambda: py_tok.encode_batch(docs, add_special_tokens=False)) / n_doc_tokens * 1e6
    rows.append((f"encode_batch, {len(docs)} docs (µs/token)", rust, python))

    print(f"{'':40} {'rust':>9} {'python':>9} {'speed-up':>9}")
    for label, r, p in rows:
        print(f"{label:40} {r:9.3f} {p:9.3f} {p / r:8.1f}x")


if __name__ == "__main__":
    main()
