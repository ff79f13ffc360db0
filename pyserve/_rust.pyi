"""Type stubs for the Rust extension `pyserve._rust` (sources in rust/:
text/ and kernels/, bound in python/).

Bad input (an unreadable tokenizer file, a token id outside the
vocabulary, malformed message content) raises ValueError.

The kernels (pyserve.model.cpu) take numpy arrays, `tensor.numpy()` views
of CPU tensors, and check them before they read or write: a wrong dtype
or number of dimensions is a TypeError; an array that is not C-contiguous,
sizes that do not fit together, a KV slot outside its cache, or an output
that overlaps another argument is a ValueError. Each borrows its arrays
for the call and releases the GIL while it computes; `threads` share the
work, the caller's thread among them.
"""

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

class Tokenizer:
    """A Hugging Face `tokenizer.json` loaded with the `tokenizers` crate.

    Thread-safe: one instance may be shared by every request and thread.
    """

    @staticmethod
    def from_file(path: str) -> Tokenizer: ...
    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary including added tokens (max id + 1)."""
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Encode one text; the GIL is released while the crate works."""
    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Encode many texts in parallel; the GIL is released meanwhile."""
    def encode_pairs(self, pairs: list[tuple[str, str]]) -> list[list[int]]:
        """Encode each (first, second) pair as one input, with the special
        tokens the tokenizer puts around and between them (a cross-encoder's
        `[CLS] first [SEP] second [SEP]`)."""
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, id: int) -> str | None: ...
    def added_tokens(self) -> dict[str, int]:
        """Added tokens (content -> id), special or not."""
    def special_token_ids(self) -> list[int]:
        """Ids of the added tokens marked special, ascending."""

class DecodeStream:
    """Incremental detokenizer for one request.

    `prompt_tail` gives a few ids that precede the first generated token so
    that tokenizers which strip a leading space (Metaspace) decode the first
    token as it reads inside the whole text. For valid UTF-8 text and any
    split of the ids into `step` calls, the concatenated outputs plus
    `flush()` equal `decode(prompt_tail + ids)` minus `decode(prompt_tail)`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_tail: list[int] | None = None,
    ) -> None: ...
    def step(self, ids: list[int]) -> str:
        """Feed new ids; returns the text they complete (only whole UTF-8
        characters; an incomplete byte sequence is held back)."""
    def flush(self) -> str:
        """End of stream: returns whatever is still held back."""

class StopMatcher:
    """Finds any of several stop strings and stop regular expressions in a
    stream of text deltas.

    Empty stop strings are ignored. The result does not depend on how the
    text is split: the stop that ends first wins (of those ending together,
    the longest, then the first listed; stop strings are listed before
    regexes). A regex is searched from every character with a lazy DFA
    (regex-automata syntax); a match must fit in 2,048 bytes, and one whose
    end depends on what follows (`$`, `\b`) is decided by the next character
    or at `flush`.
    """

    def __init__(self, stops: list[str], regexes: list[str] | None = None, keep_stops: bool = False) -> None:
        """A regex that does not parse or that matches the empty string is a
        ValueError naming it (`stop_regex[i]`). `keep_stops`: the matched
        stop's own text is returned too (and still nothing after it)."""
    def feed(self, text: str) -> tuple[str, int | None]:
        """Returns (text safe to emit now, index of the matched stop or None):
        an index into `stops`, or `len(stops) + i` for `regexes[i]`.

        Text that could still be part of a stop is held back. Once a stop
        matched, the text before it is returned (with the stop itself only
        when kept), and every later call returns ("", index)."""
    def flush(self) -> tuple[str, int | None]:
        """End of stream: the held-back tail, up to a regex that matches at
        the end of the text, which is then the stop."""
    @property
    def matched(self) -> int | None:
        """Index of the stop that matched, if one did."""

class NgramTrie:
    """NGRAM speculation's trie: from each position of every request's
    tokens, the next `branch_length` tokens as a path, counted; at most
    `capacity` nodes, the least recently touched dropped first with the
    nodes below them. `draft` reads the continuations of the suffixes of
    a request's tokens `min_window` to `max_window` long, the longest
    first: breadth first (the most recently seen first, `max_breadth`
    branches below the shortest match down to `min_breadth` below the
    longest, half as many at each level below) or, `by_probability`, the
    likeliest by count."""

    MAX_CAPACITY: int
    """Most nodes a trie may be asked to keep (its nodes are numbered in 32 bits)."""

    def __init__(self, branch_length: int, capacity: int, min_window: int, max_window: int, min_breadth: int,
                 max_breadth: int, by_probability: bool) -> None:
        """ValueError for a shape that cannot draft (windows or breadths out
        of order, a branch no longer than max_window, capacity below one
        branch or above MAX_CAPACITY)."""
    def extend(self, cursor: NgramCursor, tokens: list[int]) -> None:
        """Add a request's tokens after those its cursor has in."""
    def draft(self, ids: list[int], k: int, corpora: Sequence[NgramCorpus] = (),
              reserved: int = 0) -> tuple[list[int], list[int]]:
        """Up to k drafts after `ids`: their tokens and each one's parent
        (-1: the newest of `ids`), parents before children; `reserved` of
        them for the `corpora`' drafts, shared evenly in their order, any
        room one source leaves going to the others."""
    def clear(self) -> None:
        """Drop every node (the cursors' paths end)."""
    @property
    def size(self) -> int:
        """Nodes held."""

class NgramCorpus:
    """An operator's corpus for NGRAM draft trees: a suffix automaton of
    `documents` (token ids; no match runs from one into the next), built
    without the GIL, read-only. Its continuations rank by recency (a later
    document is more recent) or by count, as the trie's do."""

    def __init__(self, documents: list[list[int]]) -> None: ...
    @property
    def tokens(self) -> int:
        """The documents' tokens."""
    @property
    def nbytes(self) -> int:
        """Bytes it holds."""

class NgramCursor:
    """One request's place in an NgramTrie."""

    def __init__(self) -> None: ...
    @property
    def indexed(self) -> int:
        """The request's tokens in the trie."""

class ReasoningSplitter:
    """Splits `<think>...</think>` reasoning from content in a text stream.

    The start marker counts only at the start of the output (after optional
    whitespace). `in_reasoning=True` is for templates that already opened
    the block (DeepSeek-R1): the output starts as reasoning, and a repeated
    start marker there is dropped.
    """

    def __init__(
        self,
        start: str = "<think>",
        end: str = "</think>",
        in_reasoning: bool = False,
    ) -> None: ...
    def feed(self, text: str) -> tuple[str, str]:
        """Returns (reasoning delta, content delta); markers are never emitted
        and a partial marker at the end is held back."""
    def flush(self) -> tuple[str, str]: ...
    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would count as reasoning."""

ToolCallDelta = tuple[int, str | None, str]
"""One OpenAI `delta.tool_calls` entry: (index, name, arguments). `index`
counts the output's calls from 0; `name` is set in a call's first delta
only (with it go the call's `id` and `type`); `arguments` is JSON text to
append to the call's arguments so far (it may be "")."""

class ToolCallParser:
    """Finds tool calls in a stream of text deltas, in a format named as
    SGLang's --tool-call-parser (another name is a ValueError):

    - "qwen25" / "hermes": `<tool_call>{"name", "arguments"}</tool_call>`.
    - "llama3": `<|python_tag|>`, or bare JSON at the start:
      `{"name", "parameters"}`, more after `;`.
    - "mistral": `[TOOL_CALLS]`, or a bare array at the start:
      `[{"name", "arguments"}, ...]`.
    - "deepseekv3": `<｜tool▁calls▁begin｜>`, then per call
      `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`,
      then `<｜tool▁calls▁end｜>`.
    - "pythonic" (Llama 3.2 / 4): `[f(a="x", b=2), g()]` anywhere, maybe
      inside `<|python_start|>` ... `<|python_end|>`; keyword arguments
      whose values are Python literals (str, int, float, True/False/None,
      lists, dicts).
    - "qwen3_coder": `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`.

    Arguments are JSON object text: the model's own text of the object in
    the JSON formats; built as `{"key": value, ...}` (", " and ": ") from
    pythonic literals and qwen3_coder values. The result (the calls the
    deltas add up to, and the text) does not depend on how the text is
    split.

    What cannot be taken back is never sent early. A call starts (its first
    delta) once its name is complete (and one of `tools`, if given) and its
    arguments have begun in the format's shape, or it ended without any. A
    section that fails before that stays text exactly as written. A call
    that breaks off after it started (bad JSON, the output ends) keeps what
    was streamed and is closed into a valid object at its last complete
    value; the text from the failing point on is plain text again (an end
    marker right there, such as `</tool_call>`, still ends the section).
    Argument text is held back until it could be closed that way.
    Whitespace that only separates text from calls is dropped.
    """

    def __init__(self, format: str, tools: list[dict] | None = None) -> None:
        """`tools`: the request's OpenAI tools. Given them, a call must name
        one (a section whose call names another function is text, as
        SGLang drops calls of unknown tools), and qwen3_coder converts a
        parameter's value by its schema `type` (integer, number, boolean,
        object, array, null, or a list of them tried in order) when the
        value is one, keeping it a string otherwise or without a schema.
        Without them any name is a call. Tools that are not JSON are a
        ValueError."""
    def feed_events(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Returns (text safe to emit now, deltas): one per call this text
        touched, in index order. Text that could still open a call is held
        back."""
    def flush_events(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: an open call is closed, a section that started no
        call is text, and held text comes out."""

class HarmonyParser:
    """gpt-oss's Harmony output (`<|channel|>analysis<|message|>...<|end|>`,
    `<|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`,
    `<|channel|>final<|message|>...`) read as a stream of text deltas,
    detokenized with the special tokens kept. The analysis channel is
    reasoning; a message to `functions.NAME` is a call of NAME whose body
    is its JSON arguments (streamed as they come, blanks around them
    trimmed, `{}` when empty); the final channel, preambles (commentary
    with no recipient) and text outside messages are content. Markers are
    never emitted; a tail that could become one is held back. The result
    does not depend on how the text is split."""

    def __init__(self, functions: list[str] | None = None, read_calls: bool = True) -> None:
        """`functions`: the names a call may have (a message to another
        function is content); None: any. `read_calls` False: calls are
        content."""
    def feed(self, text: str) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning, content, tool call deltas) this text completes."""
    def flush(self) -> tuple[str, str, list[ToolCallDelta]]:
        """End of output: an open message ends, a call with it; held text
        comes out where the stream was."""

def tool_call_prefix(format: str, name: str | None = None) -> str:
    """The start of a call in `format` (every format has one): up to the
    name, or with `name` up to its arguments. Put after the prompt, it
    makes the model go on with a call; fed to a ToolCallParser first, it
    returns no text and no events, and the model's continuation reads as
    the rest of the call."""

def content_text(content: str | list[dict] | None) -> str:
    """OpenAI message content as one string: a string as is, None as "",
    a list of parts as its text parts joined by newlines (empty ones
    skipped). A part of another type (image_url, ...) is a ValueError."""


def q4_1_tiles_size(n: int, k: int) -> int:
    """Bytes of a Q4_1 weight [n, k] in block_gemm's tiles (k a multiple of 32)."""

def pack_q4_1(codes: NDArray[np.uint8], scales: NDArray[np.float32], mins: NDArray[np.float32],
              out: NDArray[np.uint8]) -> None:
    """Packs codes [n, k] (0..15), scales and minimums [n, k / 32] into the tiles `out`."""

def matmul_q4_1(x: NDArray[np.float32], tiles: NDArray[np.uint8], out: NDArray[np.float32],
                threads: int) -> None:
    """out [rows, n] = x [rows, k] @ w.T, the Q4_1 weight w [n, k] given by its tiles."""

def q8_0_tiles_size(n: int, k: int) -> int:
    """Bytes of a Q8_0 weight [n, k] in rust/kernels/q8_0's tiles (k a multiple of 32)."""

def pack_q8_0(codes: NDArray[np.int8], scales: NDArray[np.float32], out: NDArray[np.uint8]) -> None:
    """Packs codes [n, k] and scales [n, k / 32] into the tiles `out`."""

def matmul_q8_0(x: NDArray[np.float32], tiles: NDArray[np.uint8], out: NDArray[np.float32],
                threads: int) -> None:
    """out [rows, n] = x [rows, k] @ w.T, the Q8_0 weight w [n, k] given by its tiles."""

def dequantize_q4_1(tiles: NDArray[np.uint8], out: NDArray[np.float32]) -> None:
    """out [n, k] = the Q4_1 weight given by its tiles."""

def dequantize_q8_0(tiles: NDArray[np.uint8], out: NDArray[np.float32], threads: int) -> None:
    """out [n, k] = the Q8_0 weight given by its tiles."""

def attend_extend(q: NDArray[np.float32], k_cache: NDArray[np.float32], v_cache: NDArray[np.float32],
                  slots: NDArray[np.int64], scale: float, out: NDArray[np.float32], threads: int) -> None:
    """out [tokens, heads, head_dim] = the causal attention of a sequence's
    new tokens q (alike) over a layer's caches [cache slots, kv_heads,
    head_dim] at `slots` (the sequence's, its new tokens' last)."""

def decode_layer_q4_1(
    x: NDArray[np.float32],
    residual: NDArray[np.float32],
    dims: tuple[int, int, int, int, int, float, float],
    layer: tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.uint8], NDArray[np.uint8],
                 NDArray[np.uint8], NDArray[np.uint8], NDArray[np.float32] | None],
    step: tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.int64]],
    decode: tuple[NDArray[np.int64], NDArray[np.int64]] | None,
    extends: list[tuple[int, NDArray[np.int64], bool]],
    cache: tuple[NDArray[np.float32], NDArray[np.float32]],
    threads: int,
) -> None:
    """One 8da4w decoder layer on x and residual [rows, hidden], in place.
    dims: (hidden, heads, kv_heads, head_dim, intermediate, eps, scale);
    layer: (input norm, post-attention norm, qkv, o, gate_up, down tiles,
    q/k/v bias or None); step: (cos, sin [rows, head_dim / 2], new KV slot
    per row); a decode step's `decode` (slots [rows, width], lens [rows]),
    else a prefill step's `extends` ((new tokens, slots, whether they attend
    as decode rows) per sequence);
    cache: the layer's (k, v) [cache slots, kv_heads, head_dim]."""
