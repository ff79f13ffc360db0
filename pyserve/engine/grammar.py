"""Constrained decoding on xgrammar: compiled grammars and each request's
place in its grammar.

`GrammarBackend` (one per engine) builds xgrammar's TokenizerInfo once for
the model and compiles constraints on a thread of its own, never on the
event loop, within a time budget; compiled grammars are cached by their
text, so a repeated schema costs a dictionary lookup.

`GrammarState` (one per constrained request, in its SamplingState) holds
the xgrammar matcher. Only the forward thread touches it, in the sampler:
a step accepts the tokens its sequences sampled in their previous step
(the thread runs steps in order, so with overlap scheduling too the mask
of step N+1 is filled after step N's token was accepted), then fills the
token bitmask of this step. A speculative verify step fills a mask per
logits row, walking the matcher through the drafts and back
(`GrammarState.along`), then accepts the run it kept.

Jump-forward: where the grammar allows exactly one continuation (a JSON
schema's keys, quotes, colons and braces, a regex's literal stretch), a
jumping request's sampled token is accepted at once, in its own step, and
the forced text that follows it is appended as the tokenizer encodes it
after that token (`GrammarState.jump_forward`). The forced tokens are known
tokens, not drafts: the engine adds them to the output and the next step
computes their KV as one multi-token row whose last logits row samples the
next token. Sampling token by token would instead make the model spell a
key as the grammar lets it (`n`, `am`, `e`), a tokenization it never saw
in training, and its later tokens drift from its own distribution.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import torch
import xgrammar as xgr

from pyserve._rust import Tokenizer
from pyserve.engine.ownership import ThreadOwned
from pyserve.engine.request import Constraint, RequestError

logger = logging.getLogger("pyserve.engine")

COMPILE_TIMEOUT_S = 10.0  # a constraint that takes longer is refused (its compilation finishes in the background)
_CACHE_BYTES = 512 << 20  # compiled grammars kept, by xgrammar's own size estimate
_COMPILE_THREADS = 2
# xgrammar's messages start with where in its C++ sources they were raised.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def tokenizer_info(tokenizer: Tokenizer, tokenizer_json: str, vocab_size: int, stop_ids: list[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the model's vocabulary: every id's token as the
    tokenizer stores it (ids past the tokenizer's vocabulary, padding of
    the embedding, are empty and never allowed), decoded the way
    tokenizer.json says (byte-level, byte-fallback or raw)."""
    vocab = [tokenizer.id_to_token(i) or "" for i in range(vocab_size)]
    meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
    return xgr.TokenizerInfo(vocab, meta["vocab_type"], vocab_size=vocab_size, stop_token_ids=stop_ids,
                             add_prefix_space=meta["add_prefix_space"])


def _message(exc: Exception) -> str:
    return _SOURCE_PREFIX.sub("", str(exc).strip())


class GrammarBackend:
    """Compiles constraints for one model and caches what it compiled."""

    def __init__(self, info: xgr.TokenizerInfo, jump_tokenizer: Tokenizer | None = None):
        """`jump_tokenizer`: the model's tokenizer, which encodes the text a
        grammar forces (jump-forward); None turns jump-forward off."""
        self.info = info
        self.jump_tokenizer = jump_tokenizer
        self.compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS, cache_enabled=False)
        self.timeout_s = COMPILE_TIMEOUT_S
        self._executor = ThreadPoolExecutor(max_workers=_COMPILE_THREADS, thread_name_prefix="pyserve-grammar")
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        # Compilations under way: a second request for the same text waits
        # for the first instead of starting another.
        self._compiling: dict[tuple[str, str], asyncio.Future] = {}
        # Each token's bytes, to find where a constraint starts (GrammarState).
        self._decoded_vocab: list[bytes] = info.decoded_vocab

    def cached(self, constraint: Constraint) -> xgr.CompiledGrammar | None:
        compiled = self._cache.get(constraint.key)
        if compiled is not None:
            self._cache.move_to_end(constraint.key)
        return compiled

    async def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar, or RequestError (field "constraint") with
        xgrammar's message when it cannot be compiled in time."""
        compiled = self.cached(constraint)
        if compiled is not None:
            return compiled
        key = constraint.key
        future = self._compiling.get(key)
        if future is None:
            future = asyncio.get_running_loop().run_in_executor(self._executor, self._compile, constraint)
            future.add_done_callback(lambda f: self._on_compiled(key, f))
            self._compiling[key] = future
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise RequestError(f"the {constraint.kind} took longer than {self.timeout_s:g} s to compile",
                               "constraint") from None
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's and pydantic's errors about the input
            raise RequestError(f"invalid {constraint.kind}: {_message(e)}", "constraint") from None

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        if c.kind == "json_schema":
            # Strict: no properties beyond the schema's, as OpenAI's strict mode.
            return self.compiler.compile_json_schema(c.text, any_whitespace=False, strict_mode=True)
        if c.kind == "regex":
            return self.compiler.compile_regex(c.text)
        if c.kind == "ebnf":
            return self.compiler.compile_grammar(c.text)
        if c.kind == "lark":
            return self.compiler.compile_lark(c.text)
        if c.kind == "structural_tag":
            return self.compiler.compile_structural_tag(c.text)
        raise ValueError(f"unknown constraint kind {c.kind!r}")

    def _on_compiled(self, key: tuple[str, str], future: asyncio.Future) -> None:
        """Runs on the event loop: cache a success (even one that came after
        its requests gave up waiting), forget the attempt either way."""
        del self._compiling[key]
        if future.cancelled() or future.exception() is not None:
            return
        compiled = future.result()
        self._cache[key] = compiled
        self._cache_bytes += compiled.memory_size_bytes
        while self._cache_bytes > _CACHE_BYTES and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= old.memory_size_bytes

    def new_state(self, compiled: xgr.CompiledGrammar, after: str | None) -> GrammarState:
        return GrammarState(compiled, after, self._decoded_vocab, self.jump_tokenizer)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class GrammarState(ThreadOwned):
    """One request's position in its grammar. Created on the event loop
    before the request is scheduled, then owned by the forward thread with
    the rest of the request's SamplingState. It outlives retraction (what
    was accepted stays accepted)."""

    def __init__(self, compiled: xgr.CompiledGrammar, after: str | None, decoded_vocab: list[bytes],
                 jump_tokenizer: Tokenizer | None = None):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.jump_tokenizer = jump_tokenizer  # None: no jump-forward
        # Until the output contains `after` (a reasoning block's end), it is
        # not constrained; the vocabulary's bytes find it across tokens.
        self._after = after.encode() if after is not None else None
        self._vocab = decoded_vocab
        self._tail = b""
        # The token this request's last step sampled, not accepted yet: the
        # step's ids and this request's row in them.
        self.unaccepted: tuple[SampledIds, int] | None = None
        self.failed = False  # a sampled token the grammar refused: a bug, the request is ended

    @property
    def active(self) -> bool:
        """Whether the next token is constrained."""
        return self._after is None and not self.matcher.is_terminated()

    def accept_unaccepted(self) -> None:
        if self.unaccepted is not None:
            ids, row = self.unaccepted
            self.unaccepted = None
            self.accept(ids.values()[row])

    def accept(self, token_id: int) -> None:
        if self._after is not None:
            self._watch_for_start(token_id)
        elif not self.matcher.is_terminated() and not self.matcher.accept_token(token_id):
            logger.error("the grammar refused token %d that was sampled under its mask", token_id)
            self.failed = True

    def _watch_for_start(self, token_id: int) -> None:
        seen = self._tail + self._vocab[token_id]
        at = seen.find(self._after)
        if at < 0:
            self._tail = self._kept_tail(seen)
            return
        rest = seen[at + len(self._after):]
        # Whitespace that shares a token with the marker is left out of the
        # grammar (chat answers strip it); anything else must fit it.
        if rest.strip() and not self.matcher.accept_string(rest):
            logger.error("the grammar refused %r, written right after %r", rest, self._after)
            self.failed = True
        self._after = None

    def jump_forward(self, token_id: int) -> list[int]:
        """Accept a sampled token now, with the text the grammar then forces.
        Returns the tokens the output gets: [token_id] when nothing is
        forced; else the tokenizer's encoding of the token's text and the
        forced text together, whose first token replaces token_id when the
        two merge (`{` then `"name` may be `{"` then `name`). The sampled
        token's KV is not computed yet, so replacing it rolls nothing back
        but the matcher. Falls back to the forced text encoded on its own,
        then to no jump, when the grammar refuses an encoding. A token that
        ends `after` is free text, never in the matcher: the forced text's
        own encoding follows it."""
        started_here = self.watching
        self.accept(token_id)
        if self.failed or not self.active:
            return [token_id]
        forced = self.matcher.find_jump_forward_string()
        if not forced:
            return [token_id]
        if started_here:
            ids = self.jump_tokenizer.encode(forced)
            return [token_id] + ids if self._spells(ids, forced.encode()) and self._accepts_all(ids) else [token_id]
        for ids in self._encodings(token_id, forced):
            if self._accepts_instead(token_id, ids):
                return ids
        return [token_id]

    def _encodings(self, token_id: int, forced: str) -> list[list[int]]:
        """Encodings of the token's bytes then `forced` to try, in context
        first; each spells exactly those bytes."""
        first, text = self._vocab[token_id], forced.encode()
        candidates = []
        try:
            candidates.append(self.jump_tokenizer.encode((first + text).decode()))
        except UnicodeDecodeError:  # the token ends inside a character
            pass
        candidates.append([token_id] + self.jump_tokenizer.encode(forced))
        return [ids for ids in candidates if self._spells(ids, first + text)]

    def _spells(self, ids: list[int], text: bytes) -> bool:
        """Whether the tokens `ids` are exactly the bytes `text`."""
        return bool(ids) and b"".join(self._vocab[t] for t in ids) == text

    def _accepts_instead(self, token_id: int, ids: list[int]) -> bool:
        """Replace the accepted token_id by `ids` in the matcher; if the
        grammar refuses one of them, leave token_id accepted."""
        self.matcher.rollback(1)
        if self._accepts_all(ids):
            return True
        self.matcher.accept_token(token_id)
        return False

    def _accepts_all(self, ids: list[int]) -> bool:
        """Accept `ids` in the matcher, or none of them if it refuses one."""
        for n, t in enumerate(ids):
            if not self.matcher.accept_token(t):
                if n:
                    self.matcher.rollback(n)
                return False
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write this request's allowed tokens into bitmask[row]; False when
        nothing is to be masked (free text before the constraint starts, or
        the grammar ended: that token is never used)."""
        return self.active and not self.failed and self.matcher.fill_next_token_bitmask(bitmask, row)

    def _kept_tail(self, seen: bytes) -> bytes:
        """What of the output's bytes a later token may complete `after` with."""
        return seen[-(len(self._after) - 1):] if len(self._after) > 1 else b""

    @property
    def watching(self) -> bool:
        """The constraint has not started: the output is free text until
        `after` appears in it."""
        return self._after is not None

    def drafts_before_start(self, drafts: list[int]) -> int:
        """While watching: how many leading drafts leave `after` unwritten
        (the constraint starts after the next one, if it is kept)."""
        tail = self._tail
        for j, token in enumerate(drafts):
            seen = tail + self._vocab[token]
            if self._after in seen:
                return j
            tail = self._kept_tail(seen)
        return len(drafts)

    def along(self, prefixes: list[list[int]], bitmask: torch.Tensor, first_row: int, jumping: bool
              ) -> tuple[list[int], list[bool]]:
        """A speculative verify step's masks: for each prefix (draft tokens
        after the accepted ones, one per logits row), what the grammar
        allows after it, in bitmask[first_row + r]; and for a `jumping`
        request whether the grammar forces text after it (a jump-forward
        would follow its last token).
        A prefix the grammar refuses gets neither: its last token is masked
        at the row before, so its row is never reached. The matcher ends
        where it started. Call on an active grammar (not `watching`)."""
        masked, forces = [], []
        path: list[int] = []  # the tokens the matcher holds beyond its start
        for r, prefix in enumerate(prefixes):
            common = 0
            while common < min(len(path), len(prefix)) and path[common] == prefix[common]:
                common += 1
            if len(path) > common:
                self.matcher.rollback(len(path) - common)
                del path[common:]
            for token in prefix[common:]:
                if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                    break
                path.append(token)
            reached = len(path) == len(prefix)
            if reached and self.fill(bitmask, first_row + r):
                masked.append(first_row + r)
            forces.append(jumping and reached and bool(prefix) and not self.matcher.is_terminated()
                          and bool(self.matcher.find_jump_forward_string()))
        if path:
            self.matcher.rollback(len(path))
        return masked, forces


class SampledIds:
    """A step's sampled ids, readable on the host by a later step. On CUDA
    they are copied without waiting, and read once the copy has landed,
    which does not wait for the steps launched after them."""

    def __init__(self, ids: torch.Tensor):
        self._list: list[int] | None = None
        self._ready = None
        if ids.device.type == "cuda":
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = ids

    def values(self) -> list[int]:
        if self._list is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._list = self._host.tolist()
        return self._list


def token_bitmask(states: list[GrammarState | None], vocab_size: int) -> tuple[torch.Tensor, list[int]] | None:
    """For a batch's rows (None where unconstrained): accept each
    constrained row's previous token, then build the bitmask of this step.
    Returns (bitmask [rows, vocab_size / 32] int32 on the CPU, the rows it
    masks), or None when no row is masked."""
    for state in states:
        if state is not None:
            state.accept_unaccepted()
    bitmask = None
    rows = []
    for row, state in enumerate(states):
        if state is None or not state.active:
            continue
        if bitmask is None:
            bitmask = new_bitmask(len(states), vocab_size)
        if state.fill(bitmask, row):
            rows.append(row)
    return (bitmask, rows) if rows else None


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An empty token bitmask of `rows` rows, for GrammarState.fill and .along."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of the masked rows get -inf, in place, on the logits' device."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


def note_sampled(states: list[GrammarState | None], ids: torch.Tensor, jumping: list[bool]) -> list[list[int]]:
    """Each constrained row's token is accepted at its next step, but a
    jumping row's (`jumping`, with the state's jump_tokenizer set) now:
    its sampled id may be replaced in `ids` (GrammarState.jump_forward),
    and the forced tokens after it are returned, per row ([] for none)."""
    sampled = SampledIds(ids)
    forced: list[list[int]] = [[] for _ in states]
    for row, state in enumerate(states):
        if state is None:
            continue
        if jumping[row] and state.jump_tokenizer is not None:
            tokens = state.jump_forward(sampled.values()[row])
            if tokens[0] != sampled.values()[row]:
                ids[row] = tokens[0]
            forced[row] = tokens[1:]
        else:
            state.unaccepted = (sampled, row)
    return forced
