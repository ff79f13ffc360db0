"""Fill-in-the-middle prompts: /v1/completions' `suffix`.

A code model trained to fill a gap reads the text before it and the text
after it between three marker tokens and writes the middle; the completion
is that middle. Each family names its markers (SGLang's
--completion-template names them the same way); with `auto` the server
takes the family whose three markers are single tokens of the served
tokenizer's vocabulary, as llama.cpp's server finds its infill tokens. The
prompt is built as text and encoded whole, as these models' own examples
encode it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the option's choices are read by `pyserve --help`, which loads nothing
    from pyserve._rust import Tokenizer


@dataclass(frozen=True)
class CompletionTemplate:
    name: str
    prefix: str  # the marker before the text ahead of the gap
    suffix: str  # the marker before the text after the gap
    middle: str  # the marker after which the model writes the gap

    def prompt(self, before: str, after: str) -> str:
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"

    def fits(self, tokenizer: Tokenizer) -> bool:
        return all(tokenizer.token_to_id(m) is not None for m in (self.prefix, self.suffix, self.middle))


# Qwen2.5-Coder's markers are also CodeGemma's; StarCoder's, StarCoder2's and Granite Code's.
TEMPLATES = {t.name: t for t in (
    CompletionTemplate("qwen_coder", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    CompletionTemplate("star_coder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    CompletionTemplate("deepseek_coder", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
)}
CHOICES = ["auto", "none", *TEMPLATES]


def completion_template(tokenizer: Tokenizer, choice: str) -> CompletionTemplate | None:
    """--completion-template: `auto` finds the template the vocabulary
    holds (None when it holds none), `none` turns `suffix` off, a name
    insists on that template."""
    if choice == "none":
        return None
    if choice == "auto":
        return next((t for t in TEMPLATES.values() if t.fits(tokenizer)), None)
    template = TEMPLATES[choice]
    if not template.fits(tokenizer):
        raise ValueError(f"--completion-template {choice}: the tokenizer has no {template.prefix}, "
                         f"{template.suffix} and {template.middle} tokens")
    return template
