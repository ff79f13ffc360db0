"""Structured outputs: the request fields that constrain the output, read
into the engine's Constraint.

OpenAI's `response_format` (json_object, json_schema, text, and SGLang's
structural_tag), SGLang's `regex`, `ebnf` and `json_schema` (a JSON
string), and vLLM's `structured_outputs` object (json, regex, choice,
grammar, json_object, structural_tag). One constraint per request: a
second one is a 400 naming both. Whether the text compiles is the engine's
to say (Engine.compile_grammar), with the parameter named here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pyserve.http.errors import bad_request
from pyserve.engine.request import Constraint

ANY_OBJECT = '{"type": "object"}'
# vLLM's structured_outputs keys this server honours.
_STRUCTURED_OUTPUTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# What a structural tag's `content` may be; anything else with a JSON
# schema's look is taken as one (SGLang's documentation writes it so).
_TAG_FORMATS = {"const_string", "json_schema", "any_text", "token", "exclude_token", "any_tokens", "grammar",
                "regex", "sequence", "or", "tag", "triggered_tags", "token_triggered_tags", "tags_with_separator",
                "optional", "plus", "star", "repeat", "dispatch", "token_dispatch", "qwen_xml_parameter"}


@dataclass(frozen=True)
class RequestConstraint:
    """A request's constraint and the parameter it came from (for errors)."""

    constraint: Constraint
    param: str


def _json_text(value: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    return json.dumps(value, ensure_ascii=False)


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    return value


def _grammar(text: str) -> Constraint:
    """vLLM's `grammar`: GBNF (as xgrammar reads it) when it has `::=` rules, else Lark."""
    return Constraint("ebnf" if "::=" in text else "lark", text)


def _choice(choices: Any, param: str) -> Constraint:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise bad_request(f"{param} must be a non-empty list of strings", param)
    # GBNF string literals escape like JSON strings.
    return Constraint("ebnf", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))


def _tag_content(fmt: Any) -> Any:
    """SGLang's examples put a bare JSON schema where xgrammar wants a
    format: wrap such contents as json_schema formats, at any depth."""
    if isinstance(fmt, list):
        return [_tag_content(f) for f in fmt]
    if not isinstance(fmt, dict):
        return fmt
    out = {k: v if k == "json_schema" else _tag_content(v) for k, v in fmt.items()}
    content = fmt.get("content")
    if isinstance(content, dict) and content.get("type") not in _TAG_FORMATS:
        out["content"] = {"type": "json_schema", "json_schema": content}
    return out


def structural_tag(value: Any, param: str) -> Constraint:
    """SGLang's structural tag, as JSON text or an object: the legacy
    `structures` + `triggers`, or xgrammar's `format`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object", param)
    if value.get("format") is not None:
        tag = {"type": "structural_tag", "format": _tag_content(value["format"])}
    else:
        structures, triggers = value.get("structures"), value.get("triggers")
        if not isinstance(structures, list) or not isinstance(triggers, list) or not triggers:
            raise bad_request(f"{param} needs `format`, or `structures` and `triggers`", param)
        tags = []
        for i, s in enumerate(structures):
            if not isinstance(s, dict) or not {"begin", "schema", "end"} <= set(s):
                raise bad_request(f"{param}.structures[{i}] needs begin, schema and end", f"{param}.structures")
            tags.append({"type": "tag", "begin": s["begin"], "end": s["end"],
                         "content": {"type": "json_schema", "json_schema": s["schema"]}})
        tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}
    return Constraint("structural_tag", json.dumps(tag, ensure_ascii=False))


def _response_format(rf) -> RequestConstraint | None:
    param = "response_format"
    kind = rf.type
    if kind == "text":
        return None
    if kind == "json_object":
        return RequestConstraint(Constraint("json_schema", ANY_OBJECT), param)
    if kind == "json_schema":
        spec = rf.json_schema
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format json_schema needs json_schema.schema", f"{param}.json_schema")
        where = f"{param}.json_schema.schema"
        return RequestConstraint(Constraint("json_schema", _json_text(spec["schema"], where)), where)
    if kind == "structural_tag":
        fields = {"format": rf.format, "structures": rf.structures, "triggers": rf.triggers}
        return RequestConstraint(structural_tag(fields, param), param)
    raise bad_request(f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema', "
                      "'structural_tag'", f"{param}.type")


def _structured_outputs(so: Any) -> list[RequestConstraint]:
    param = "structured_outputs"
    if not isinstance(so, dict):
        raise bad_request(f"{param} must be an object", param)
    found = []
    for key, value in so.items():
        where = f"{param}.{key}"
        if key not in _STRUCTURED_OUTPUTS:
            raise bad_request(f"{where} is not supported (supported: {', '.join(_STRUCTURED_OUTPUTS)})", where)
        if value is not None and value is not False:
            found.append(RequestConstraint(_structured_output(key, value, where), where))
    return found


def _structured_output(key: str, value: Any, where: str) -> Constraint:
    """One structured_outputs entry's constraint; `where` names it in errors."""
    if key == "json":
        return Constraint("json_schema", _json_text(value, where))
    if key == "regex":
        return Constraint("regex", _string(value, where))
    if key == "choice":
        return _choice(value, where)
    if key == "grammar":
        return _grammar(_string(value, where))
    if key == "json_object":
        return Constraint("json_schema", ANY_OBJECT)
    return structural_tag(value, where)


def only_one(found: list[RequestConstraint]) -> RequestConstraint | None:
    if len(found) > 1:
        a, b = found[0].param, found[1].param
        raise bad_request(f"only one constraint per request: got both {a} and {b}", b)
    return found[0] if found else None


def request_constraint(fields, prefix: str = "") -> RequestConstraint | None:
    """The constraint a request's fields ask for (chat, completions, or
    /generate's sampling_params with `prefix` "sampling_params.")."""
    found = []
    rf = getattr(fields, "response_format", None)
    if rf is not None and (asked := _response_format(rf)) is not None:
        found.append(asked)
    for name, make in (("json_schema", lambda v, p: Constraint("json_schema", _json_text(v, p))),
                       ("regex", lambda v, p: Constraint("regex", _string(v, p))),
                       ("ebnf", lambda v, p: Constraint("ebnf", _string(v, p))),
                       ("structural_tag", structural_tag)):
        value = getattr(fields, name, None)
        if value is not None:
            found.append(RequestConstraint(make(value, prefix + name), prefix + name))
    so = getattr(fields, "structured_outputs", None)
    if so is not None:
        found += _structured_outputs(so)
    found += _guided(fields)
    return only_one(found)


# vLLM's guided_* fields, by the structured_outputs key each is.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _guided(fields) -> list[RequestConstraint]:
    """vLLM's guided_* fields, read as its structured_outputs (chat and
    completions only; /generate's sampling_params has none)."""
    backend = getattr(fields, "guided_decoding_backend", None)
    if backend not in (None, "auto", "xgrammar"):
        raise bad_request(f"guided_decoding_backend {backend!r}: this server constrains output with xgrammar",
                          "guided_decoding_backend")
    if getattr(fields, "guided_whitespace_pattern", None) is not None:
        raise bad_request("guided_whitespace_pattern is not supported: JSON output takes JSON's own whitespace",
                          "guided_whitespace_pattern")
    return [RequestConstraint(_structured_output(key, getattr(fields, name), name), name)
            for name, key in _GUIDED.items() if getattr(fields, name, None) is not None]
