"""vLLM's --speculative-config, a JSON object, read as the SGLang-named
--speculative-* options it means (ServerArgs.resolved expands it)."""

from __future__ import annotations

import json
from typing import Any

FLAG = "--speculative-config"
# vLLM's methods, by the algorithm each is; a draft model where none is named.
_ALGORITHMS = {"ngram": "NGRAM", "draft_model": "STANDALONE", "eagle3": "EAGLE3", "eagle": "EAGLE",
               "deepseek_mtp": "NEXTN", "mtp": "NEXTN"}
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "quantization",
         "revision", "draft_tensor_parallel_size")


def speculative_options(text: str, tp_size: int) -> dict[str, Any]:
    """The --speculative-* option values `text` means; ValueError naming
    what it cannot mean. `num_speculative_tokens` k is k drafts a step:
    NGRAM's draft tokens, or a draft chain of k steps."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{FLAG} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{FLAG} must be a JSON object such as {{\"method\": \"ngram\", \"num_speculative_tokens\": 4}}")
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(f"{FLAG}: {', '.join(unknown)} cannot be honoured; it takes {', '.join(_KEYS)}")
    method = config.get("method") or ("draft_model" if config.get("model") else None)
    if method not in _ALGORITHMS:
        raise ValueError(f"{FLAG}: method {method!r} is not one of {', '.join(_ALGORITHMS)}")
    algorithm = _ALGORITHMS[method]
    if config.get("draft_tensor_parallel_size", tp_size) != tp_size:
        raise ValueError(f"{FLAG}: the draft runs over the target's {tp_size} rank(s) (draft_tensor_parallel_size)")
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{FLAG}: num_speculative_tokens must be a positive integer")
    out: dict[str, Any] = {"speculative_algorithm": algorithm}
    if algorithm == "NGRAM":
        if config.get("model") is not None:
            raise ValueError(f"{FLAG}: ngram drafts from the request's own tokens and takes no model")
        out["speculative_num_draft_tokens"] = k
        if "prompt_lookup_min" in config:
            out["speculative_ngram_min_match_window_size"] = config["prompt_lookup_min"]
        if "prompt_lookup_max" in config:
            out["speculative_ngram_max_match_window_size"] = config["prompt_lookup_max"]
        return out
    if "prompt_lookup_min" in config or "prompt_lookup_max" in config:
        raise ValueError(f"{FLAG}: prompt_lookup_min and prompt_lookup_max are ngram's")
    out.update(speculative_num_steps=k, speculative_eagle_topk=1, speculative_num_draft_tokens=k + 1)
    if config.get("model") is not None:
        out["speculative_draft_model_path"] = config["model"]
    if config.get("revision") is not None:
        out["speculative_draft_model_revision"] = config["revision"]
    if config.get("quantization") is not None:
        from pyserve.model.quantized.scheme import CHOICES

        if config["quantization"] not in CHOICES:
            raise ValueError(f"{FLAG}: quantization {config['quantization']!r} is not one of {', '.join(CHOICES)}")
        out["speculative_draft_model_quantization"] = config["quantization"]
    return out
