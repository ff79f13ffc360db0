"""Chat templates rendered the way Hugging Face transformers renders them.

The template comes from tokenizer_config.json, or from --chat-template (a
file, or a name of one shipped in templates/). Rendering follows
transformers' conventions: a sandboxed jinja2 environment with trim_blocks
and lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text, and the special tokens as variables.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"


class ChatTemplateError(ValueError):
    """The template rejected the conversation (raise_exception) or failed."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(token) -> str | None:
    """tokenizer_config stores special tokens as strings or AddedToken dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def builtin_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja"))


def load_template_source(model_dir: Path, override: str | None) -> str | None:
    if override:
        path = Path(override)
        if path.is_file():
            return path.read_text()
        builtin = TEMPLATES_DIR / f"{override}.jinja"
        if builtin.is_file():
            return builtin.read_text()
        raise ValueError(
            f"--chat-template {override!r} is neither a file nor one of {builtin_templates()}"
        )
    config_path = model_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return None
    template = json.loads(config_path.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: use "default"
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    return template


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template does not parse: {e}") from e
        self.source = source
        self.special_tokens = special_tokens

    @classmethod
    def for_model(cls, model_dir: Path, override: str | None = None) -> "ChatTemplate | None":
        source = load_template_source(model_dir, override)
        if source is None:
            return None
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        return cls(source, {name: _token_text(config.get(name)) for name in names})

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        variables = dict(self.special_tokens)
        variables.update(template_kwargs or {})
        variables.update(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
        )
        try:
            text = self.template.render(**variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # a template bug must not become a 500
            raise ChatTemplateError(f"chat template failed: {e}") from e
        if continue_final_message:
            # End the prompt right after the final message's text, so the
            # model continues it instead of starting a new turn.
            final = messages[-1].get("content") or ""
            cut = text.rfind(final) if final else -1
            if cut < 0:
                raise ChatTemplateError("continue_final_message: the final message is not in the rendered prompt")
            text = text[: cut + len(final)]
        return text
