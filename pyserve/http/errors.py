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
    """A 400 in OpenAI's words from msgspec's message, whose `- at `$.path``
    suffix names the field: "Expected `int`, got `str` - at `$.max_tokens`"
    becomes "Invalid type for 'max_tokens': expected `int`, but got `str`
    instead." (code invalid_type)."""
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"invalid JSON body: {exc}")
    text, _, path = str(exc).partition(" - at `$")
    path = path.rstrip("`").lstrip(".")
    for prefix, code in (("Object missing required field `", "missing_required_parameter"),
                         ("Object contains unknown field `", "unknown_parameter")):
        if text.startswith(prefix):
            field = text.split("`")[1]
            path = f"{path}.{field}" if path else field
            if code == "unknown_parameter":
                return bad_request(f"Unrecognized request argument supplied: '{path}' (this server does not "
                                   "support it).", path, code)
            return bad_request(f"Missing required parameter: '{path}'.", path, code)
    if not path:
        return bad_request(f"the request body must be a JSON object ({text})")
    if text.startswith("Expected `") and ", got `" in text:
        want, got = text[len("Expected "):].split(", got ", 1)
        return bad_request(f"Invalid type for '{path}': expected {want}, but got {got} instead.", path,
                           "invalid_type")
    return bad_request(f"Invalid value for '{path}': {text}.", path, "invalid_value")
