"""--log-requests: a line when a request enters the engine and one when it
ends, as SGLang's server logs them ("Receive:", "Finish:"), with as much
of each as --log-requests-level says:

0  the request's id and sizes, how it finished, its latency
1  and its sampling parameters
2  and its prompt and output text, each cut to MAX_PARTIAL_CHARS
3  and the whole prompt and output text

SGLang's POST /configure_logging turns it on or off, or changes the level,
while the server runs (`configure`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import MISSING, Field, fields

from pyserve._rust import Tokenizer
from pyserve.engine.request import GenerateOutput
from pyserve.engine.sequence import Sequence

logger = logging.getLogger("pyserve.requests")

MAX_PARTIAL_CHARS = 2048


class RequestLog:
    def __init__(self, on: bool, level: int, tokenizer: Tokenizer | None):
        self.on, self.level, self.tokenizer = on, level, tokenizer

    def configure(self, on: bool | None = None, level: int | None = None) -> None:
        """Log or not, at another level; None leaves either as it is."""
        self.on = self.on if on is None else on
        self.level = self.level if level is None else level

    def received(self, seq: Sequence) -> None:
        if not self.on:
            return
        parts = [f"rid={seq.rid}", f"prompt_tokens={len(seq.prompt_ids)}"]
        if self.level >= 1:
            params = seq.params
            given = {f.name: getattr(params, f.name) for f in fields(params)
                     if f.name != "constraint" and getattr(params, f.name) != _default(f)}
            if params.constraint is not None:  # its kind: a schema may be long
                given["constraint"] = params.constraint.kind
            parts.append(f"sampling_params={given}")
        if seq.prompt_embeds is None:
            parts += self._text("prompt", seq.prompt_ids)
        else:  # its ids are placeholders
            parts.append(f"prompt_embeds={tuple(seq.prompt_embeds.shape)}")
        logger.info("Receive: %s", ", ".join(parts))

    def finished(self, seq: Sequence, last: GenerateOutput) -> None:
        if not self.on:
            return
        parts = [f"rid={seq.rid}", f"finish_reason={last.finish_reason}", f"prompt_tokens={len(seq.prompt_ids)}",
                 f"cached_tokens={seq.cache_hit or 0}", f"completion_tokens={len(seq.output_ids)}",
                 f"e2e_latency={time.monotonic() - seq.arrival:.3f}s"]
        parts += self._text("output", seq.output_ids)
        logger.info("Finish: %s", ", ".join(parts))

    def _text(self, name: str, ids: list[int]) -> list[str]:
        if self.level < 2:
            return []
        if self.tokenizer is None:  # --skip-tokenizer-init: the ids are the text there is
            return [f"{name}_ids={ids}"]
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if self.level == 2 and len(text) > MAX_PARTIAL_CHARS:
            text = text[:MAX_PARTIAL_CHARS] + f"... ({len(text) - MAX_PARTIAL_CHARS} more characters)"
        return [f"{name}={text!r}"]


def _default(f: Field):
    return f.default_factory() if f.default_factory is not MISSING else f.default
