"""Chat templates rendered the way Hugging Face transformers renders them.

The template comes from tokenizer_config.json (one string, or named
templates: "tool_use" when the request has tools and the model has one,
else "default"), a chat_template.jinja beside it, or --chat-template (a
file, or the name of one shipped in templates/). Rendering follows
transformers' `apply_chat_template`: a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson`
that keeps non-ASCII text, the `{% generation %}` tag, the named special
tokens as variables, message keys whose value is None left out, and
`continue_final_message` cutting the prompt right after the final message.
The rendered prompt already holds BOS where the model wants one, so it is
encoded without adding special tokens again.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"

# transformers' named special tokens, the ones templates see as variables
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Older and newer names of an assistant message's reasoning; templates read any of them.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the final message to find where it ends in the rendered text.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception) or failed."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's part
    for training masks; for serving it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(token) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def builtin_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def load_template_sources(model_dir: Path, override: str | None) -> dict[str, str]:
    """The model's templates by name ("default", maybe "tool_use"); empty if it has none."""
    if override:
        path = Path(override)
        if path.is_file():
            return {"default": path.read_text(encoding="utf-8")}
        builtin = TEMPLATES_DIR / f"{override}.jinja"
        if builtin.is_file():
            return {"default": builtin.read_text(encoding="utf-8")}
        raise ValueError(f"--chat-template {override!r} is neither a file nor one of {builtin_templates()}")
    template = _read_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return {} if template is None else {"default": template}


def load_special_tokens(model_dir: Path) -> dict[str, str]:
    """The named special tokens that are set (tokenizer_config.json wins over
    special_tokens_map.json); unset ones stay undefined in the template."""
    tokens = {}
    for source in ("special_tokens_map.json", "tokenizer_config.json"):
        config = _read_json(model_dir / source)
        for name in SPECIAL_TOKENS:
            text = _token_text(config.get(name))
            if text is not None:
                tokens[name] = text
    return tokens


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


class ChatTemplate:
    def __init__(self, sources: dict[str, str], special_tokens: dict[str, str]):
        env = _environment()
        try:
            self.templates = {name: env.from_string(source) for name, source in sources.items()}
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse: {e}") from e
        if "default" not in self.templates and len(self.templates) != 1:
            raise ValueError(f"the model has chat templates {sorted(sources)} but none named 'default'")
        self.sources = sources
        self.special_tokens = special_tokens

    @classmethod
    def for_model(cls, model_dir: Path, override: str | None = None) -> "ChatTemplate | None":
        sources = load_template_sources(model_dir, override)
        return cls(sources, load_special_tokens(model_dir)) if sources else None

    def _pick(self, tools) -> jinja2.Template:
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default") or next(iter(self.templates.values()))

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text. `continue_final_message` ends it inside the final
        message, for the model to go on with it (no generation prompt then)."""
        messages = [_template_message(m) for m in messages]
        final = ""
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ChatTemplateError("continue_final_message: the final message has no text to continue")
            final = messages[-1]["content"]
            messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
        variables = {**self.special_tokens, **(template_kwargs or {})}
        variables.update(messages=messages, tools=tools, documents=None,
                         add_generation_prompt=add_generation_prompt and not continue_final_message)
        try:
            text = self._pick(tools).render(**variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template bug must not become a 500
            raise ChatTemplateError(f"chat template failed: {e}") from e
        if continue_final_message:
            text = _cut_after_final(text, final)
        return text


def _cut_after_final(text: str, final: str) -> str:
    """The rendered text up to the end of the final message, found by the tag
    appended to it (a template may trim the message, and the tag's space)."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the chat template drops part of the final message")
    at = text.rindex(tag)
    if text[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()
