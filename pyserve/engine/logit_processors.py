"""SGLang's custom logit processors (--enable-custom-logit-processor).

A client sends a processor class as SGLang's CustomLogitProcessor.to_str()
writes it, `{"callable": "<hex of dill.dumps(cls)>"}`, and its own
parameters in `sampling_params.custom_params`. Unpickling runs the
client's code in the server, hence the option. Each step, the rows of the
requests that carry one processor go to one instance of it together:
`processor(logits[rows], [custom_params of each row])`, and it returns the
rows' logits. As in SGLang, each row's parameters carry `__req__`, the
request as far as a processor reads it: `origin_input_ids`, `output_ids`
(with the drafts before a verify row, as plain decoding would have them)
and `rid`.

A processor that raises ends its requests with an error (the engine's
`refused`), not the step: the other requests go on."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from pyserve.engine.sampling_state import SamplingState

logger = logging.getLogger("pyserve.engine")


@dataclass(frozen=True, eq=False)
class LogitProcessor:
    """One deserialized processor: `source` (its serialized text) names it,
    so that the requests sending the same text share one instance."""

    source: str
    instance: Any = field(repr=False)


@lru_cache(maxsize=64)
def load(source: str) -> LogitProcessor:
    """The processor `source` serializes; ValueError saying what is wrong."""
    try:
        import dill
    except ImportError:
        raise ValueError("custom logit processors are unpickled with dill, which this server lacks: "
                         "pip install dill") from None
    try:
        data = json.loads(source)
        cls = dill.loads(bytes.fromhex(data["callable"]))
    except Exception as e:  # the client's bytes: any failure to read them is theirs
        raise ValueError(f"custom_logit_processor is not a CustomLogitProcessor.to_str() text: {e}") from None
    try:
        instance = cls()
    except Exception as e:
        raise ValueError(f"custom_logit_processor's class could not be made: {e}") from None
    if not callable(instance):
        raise ValueError("custom_logit_processor's class makes no callable instance")
    return LogitProcessor(source, instance)


@dataclass
class RequestView:
    """SGLang's `__req__`, as far as processors read it."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]


def apply(logits: torch.Tensor, states: list[SamplingState], after: list[list[int]]) -> None:
    """Each processor over its rows, in place; row i follows `after[i]`."""
    groups: dict[str, list[int]] = {}
    for i, state in enumerate(states):
        if state.params.logit_processor is not None:
            groups.setdefault(state.params.logit_processor.source, []).append(i)
    for rows in groups.values():
        processor = states[rows[0]].params.logit_processor
        params = []
        for i in rows:
            seq = states[i].seq
            view = RequestView(seq.rid, list(seq.prompt_ids), seq.output_ids + after[i])
            params.append({**(states[i].params.custom_params or {}), "__req__": view})
        index = torch.tensor(rows, device=logits.device)
        try:
            out = processor.instance(logits[index], params)
            logits[index] = out.to(logits.dtype)
        except Exception:
            logger.exception("a custom logit processor failed: its %d request(s) end with an error", len(rows))
            for i in rows:
                states[i].processor_failed = True
