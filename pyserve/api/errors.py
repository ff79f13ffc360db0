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
    """A readable 400 from msgspec's message, which ends in `- at `$.field``."""
    text = str(exc)
    param = None
    if " - at `$." in text:
        text, _, path = text.rpartition(" - at `$.")
        param = path.rstrip("`")
        text = f"{text} for field '{param}'"
    elif isinstance(exc, msgspec.ValidationError) and text.startswith("Object missing required field"):
        param = text.rsplit("`", 2)[-2] if text.count("`") >= 2 else None
    else:
        text = f"invalid JSON body: {text}" if not isinstance(exc, msgspec.ValidationError) else text
    return bad_request(text, param)
