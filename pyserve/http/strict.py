"""Request bodies whose unknown fields are refused, for the routes where a
field the server ignored would change the answer (Responses, tokenize,
score): a 400 names the field rather than dropping it silently."""

from __future__ import annotations

from typing import TypeVar

import msgspec

from pyserve.http.errors import bad_request, from_msgspec
from pyserve.http.io import Request, decode_json

T = TypeVar("T")


def convert_strict(body: dict, struct: type[T], route: str, from_text: bool = False) -> T:
    """`body` (decoded JSON) as `struct`, a Struct declared with
    forbid_unknown_fields; `route` names the API in the refusal.
    `from_text`: the values are text to read as the fields' types (a query string's)."""
    try:
        return msgspec.convert(body, struct, strict=not from_text)
    except msgspec.ValidationError as e:
        text, _, path = str(e).partition(" - at `$")
        if text.startswith("Object contains unknown field `"):
            name = text.split("`")[1]
            where = path.rstrip("`").lstrip(".")
            raise bad_request(f"the parameter {name!r} is not supported: {route} does not serve it",
                              f"{where}.{name}" if where else name, "unsupported_parameter") from None
        raise from_msgspec(e) from None


async def read_strict(request: Request, struct: type[T], route: str, query: bool = False) -> T:
    """The request's JSON body as `struct` (convert_strict); an empty body,
    which some clients send to routes whose fields all have defaults, as {},
    or with `query` as the query string's parameters (a GET's)."""
    raw = await request.body()
    if raw.strip():
        return convert_strict(decode_json(msgspec.json.Decoder(dict), raw), struct, route)
    return convert_strict(request.query() if query else {}, struct, route, from_text=query)
