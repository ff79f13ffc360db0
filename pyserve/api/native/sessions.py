"""SGLang's POST /open_session and /close_session (the sessions
themselves: api/generation/sessions.py)."""

from __future__ import annotations

from pyserve.api.generation.serving import ServingContext
from pyserve.api.protocol.native import CloseSessionRequest, OpenSessionRequest
from pyserve.http.errors import bad_request


def open_session(ctx: ServingContext, req: OpenSessionRequest) -> str:
    """The new session's id, as SGLang answers it: a JSON string."""
    if req.streaming:
        raise bad_request("streaming sessions (KV held between turns) are not supported: a session's "
                          "turns find their shared prefix in the prefix cache; open it without streaming",
                          "streaming")
    return ctx.sessions.open(req.session_id, req.timeout)


def close_session(ctx: ServingContext, req: CloseSessionRequest) -> None:
    """An empty 200, as SGLang answers."""
    ctx.sessions.close(req.session_id)
