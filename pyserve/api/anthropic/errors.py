"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`,
with its error type for each status; the Messages routes' Dialect."""

from __future__ import annotations

from pyserve.http.errors import APIError
from pyserve.http.sse import Dialect

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
          504: "timeout_error", 529: "overloaded_error"}


class AnthropicError(APIError):
    def body(self) -> dict:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}


def anthropic_error(err: APIError) -> APIError:
    """`err` in Anthropic's words; the parameter it names is in the message."""
    if isinstance(err, AnthropicError):
        return err
    kind = _TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    message = err.message
    if err.param and err.param not in message:
        message = f"{err.param}: {message}"
    return AnthropicError(message, err.status, kind, err.param, err.code)


ANTHROPIC = Dialect(anthropic_error, named_events=True)
