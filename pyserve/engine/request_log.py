"""--log-requests: a line when a request enters the engine and one when it
ends, as SGLang's server logs them ("Receive:", "Finish:"), with as much
of each as --log-requests-level says:

0  the request's id and sizes, how it finished, its latency
1  and its sampling parameters
2  and its prompt and output text, each cut to MAX_PARTIAL_CHARS
3  and the whole prompt and output text
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
    def __init__(self, level: int | None, tokenizer: Tokenizer | None):
        """`level`: None logs nothing."""
        self.level, self.tokenizer = level, tokenizer

    def received(self, seq: Sequence) -> None:
        if self.level is None:
            return
        parts = [f"rid={seq.rid}", f"prompt_tokens={len(seq.prompt_ids)}"]
        if self.level >= 1:
            params = seq.params
            given = {f.name: getattr(params, f.name) for f in fields(params)
                     if f.name != "constraint" and getattr(params, f.name) != _default(f)}
            if params.constraint is not None:  # its kind: a schema may be long
                given["constraint"] = params.constraint.kind
            parts.append(f"sampling_params={given}")
        parts += self._text("prompt", seq.prompt_ids)
        logger.info("Receive: %s", ", ".join(parts))

    def finished(self, seq: Sequence, last: GenerateOutput) -> None:
        if self.level is None:
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
