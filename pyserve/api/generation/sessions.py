"""SGLang's sessions: a conversation kept by the server as token ids.

A session remembers each of its requests (a turn): the prompt the engine
ran and the tokens it generated so far. A later /generate names a turn by
its rid in `session_params` and sends only its new tokens; its prompt is
that turn's tokens (its prompt alone with `drop_previous_output`; cut to
the first `offset` tokens, or all but the last -offset, when `offset` is
not 0) followed by the new ones, without a BOS they begin with. The
shared prefix's KV is found in the prefix cache, as for any prompt.

A turn continues a finished turn; `replace` may take a running one, which
is then aborted. `replace` also forgets the turns that continued the named
one (with no rid: every turn of the session), so the conversation branches
from there anew. A session stays until /close_session, or until it has
been idle for its `timeout` seconds; closing one lets its running requests
finish."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pyserve.api.protocol.native import SessionParams
from pyserve.http.errors import APIError, bad_request

PARAM = "session_params"


@dataclass(eq=False)
class Turn:
    rid: str
    session: Session
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    running: bool = True  # until its request ends: finished, aborted, or its client gone
    children: list[Turn] = field(default_factory=list)

    def tokens(self, drop_output: bool) -> list[int]:
        return list(self.prompt_ids) if drop_output else self.prompt_ids + self.output_ids


@dataclass
class Continuation:
    """One prompt's place in a session: checked when the prompt is built,
    and again when its requests join the session (the session may have
    changed while the engine validated them)."""

    session: Session
    params: SessionParams
    parent: Turn | None
    prompt_ids: list[int]


class Session:
    def __init__(self, session_id: str, timeout: float | None, now: float):
        self.id = session_id
        self.timeout = timeout
        self.used = now  # when a request of it last started or ended
        self.turns: dict[str, Turn] = {}

    def idle_past(self, now: float) -> bool:
        return self.timeout is not None and now - self.used > self.timeout \
            and not any(t.running for t in self.turns.values())

    def parent(self, params: SessionParams) -> Turn | None:
        """The turn `params` continues, checked as it stands now."""
        if params.rid is None:
            return None
        turn = self.turns.get(params.rid)
        if turn is None:
            raise bad_request(f"session {self.id!r} has no request {params.rid!r} (a replace may have removed it)",
                              f"{PARAM}.rid")
        if turn.running and not params.replace:
            raise bad_request(f"request {params.rid!r} of session {self.id!r} is still running: wait for it to "
                              "finish, or set replace to abort it and continue from what it has", f"{PARAM}.rid")
        return turn

    def forget_after(self, turn: Turn | None) -> None:
        """Drop the turns that continued `turn` (None: every turn)."""
        for t in list(self.turns.values()) if turn is None else turn.children:
            self._forget(t)
        if turn is not None:
            turn.children = []

    def _forget(self, turn: Turn) -> None:
        self.turns.pop(turn.rid, None)
        for child in turn.children:
            self._forget(child)


class Sessions:
    """The server's open sessions (the ServingContext owns them)."""

    def __init__(self):
        self._open: dict[str, Session] = {}

    def open(self, session_id: str | None, timeout: float | None) -> str:
        self._expire()
        if session_id is not None and session_id in self._open:
            raise bad_request(f"a session {session_id!r} is already open: close it first, or give another id",
                              "session_id")
        if timeout is not None and timeout <= 0:
            raise bad_request(f"timeout must be a positive number of seconds, not {timeout}", "timeout")
        sid = session_id if session_id is not None else uuid.uuid4().hex
        self._open[sid] = Session(sid, timeout, time.monotonic())
        return sid

    def close(self, session_id: str) -> None:
        self._expire()
        if self._open.pop(session_id, None) is None:
            raise APIError(f"no session {session_id!r} is open", 404, param="session_id", code="session_not_found")

    def get(self, session_id: str) -> Session:
        self._expire()
        session = self._open.get(session_id)
        if session is None:
            raise bad_request(f"no session {session_id!r} is open: open one with /open_session", f"{PARAM}.id")
        return session

    def _expire(self) -> None:
        now = time.monotonic()
        for sid in [sid for sid, s in self._open.items() if s.idle_past(now)]:
            del self._open[sid]

    def continuation(self, params: SessionParams, new_ids: list[int], bos: int | None) -> Continuation:
        """The prompt of a request in a session: the continued turn's tokens, then `new_ids`."""
        session = self.get(params.id)
        parent = session.parent(params)
        if parent is None:
            return Continuation(session, params, None, list(new_ids))
        if new_ids and bos is not None and new_ids[0] == bos:
            new_ids = new_ids[1:]
        base = parent.tokens(bool(params.drop_previous_output))
        if params.offset:
            if not -len(base) <= params.offset <= len(base):
                raise bad_request(f"offset {params.offset} is outside request {parent.rid!r}'s {len(base)} "
                                  f"tokens: give a position from {-len(base)} to {len(base)}", f"{PARAM}.offset")
            base = base[: params.offset]
        return Continuation(session, params, parent, base + new_ids)

    def join(self, continuations: list[Continuation], rids: list[list[str]],
             abort: Callable[[str], None]) -> list[Turn]:
        """Each continuation's requests (`rids`: its n choices) become turns
        of its session; a replace first aborts a running turn it continues
        (`abort`, by rid) and forgets the turns after it. Returns the new
        turns, whose requests then run: `ended` is called when they stop."""
        for c, choice_rids in zip(continuations, rids):  # everything checked before anything changes
            if self._open.get(c.session.id) is not c.session:
                raise bad_request(f"session {c.session.id!r} was closed", f"{PARAM}.id")
            if c.parent is not None and c.session.parent(c.params) is not c.parent:
                raise bad_request(f"request {c.params.rid!r} of session {c.session.id!r} changed while this "
                                  "request was admitted: send it again", f"{PARAM}.rid")
            taken = [rid for rid in choice_rids if rid in c.session.turns]
            if taken:
                raise bad_request(f"session {c.session.id!r} already has a request {taken[0]!r}: give this one "
                                  "another rid", "rid")
        for c in continuations:  # a batch's prompts may replace from one turn: all forget, then all join
            if c.params.replace:
                if c.parent is not None and c.parent.running:
                    abort(c.parent.rid)
                c.session.forget_after(c.parent)
        turns = []
        for c, choice_rids in zip(continuations, rids):
            for rid in choice_rids:
                turn = Turn(rid, c.session, c.prompt_ids)
                if c.parent is not None:
                    c.parent.children.append(turn)
                c.session.turns[rid] = turn
                turns.append(turn)
            c.session.used = time.monotonic()
        return turns

    def ended(self, turns: list[Turn]) -> None:
        now = time.monotonic()
        for turn in turns:
            turn.running = False
            turn.session.used = now


class SessionStream:
    """A streamed response whose turns end (`end`) when it closes: done,
    failed, or closed by a client that left, even before its first event."""

    def __init__(self, events: AsyncIterator[dict], end: Callable[[], None]):
        self.events = events
        self.end = end

    def __aiter__(self) -> SessionStream:
        return self

    async def __anext__(self) -> dict:
        return await self.events.__anext__()

    async def aclose(self) -> None:
        try:
            await self.events.aclose()
        finally:
            self.end()
