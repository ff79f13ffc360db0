"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import msgspec


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, "invalid_request_error", param, code)


def from_msgspec(exc: msgspec.DecodeError) -> APIError:
    """A readable 400 from msgspec's message, whose `- at `$.path`` suffix
    names the field: "Expected `int`, got `str` - at `$.max_tokens`"."""
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"invalid JSON body: {exc}")
    text, _, path = str(exc).partition(" - at `$")
    path = path.rstrip("`").lstrip(".")
    if text.startswith("Object contains unknown field `"):
        field = text.split("`")[1]
        path = f"{path}.{field}" if path else field
        return bad_request(f"unknown field '{path}': this server does not honour it", path)
    missing = text.startswith("Object missing required field `")
    if missing:
        field = text.split("`")[1]
        path = f"{path}.{field}" if path else field
        return bad_request(f"missing required field '{path}'", path)
    if not path:
        return bad_request(f"the request body must be a JSON object ({text})")
    return bad_request(f"{text} for field '{path}'", path)
