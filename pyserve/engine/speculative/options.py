"""The drafter the --speculative-* options ask for, or a clear refusal at start."""

from __future__ import annotations

from pyserve.engine.speculative.ngram import NgramDrafter
from pyserve.server_args import EngineOptions

_NOT_BUILT = ("--speculative-algorithm {0} is not implemented in this build of pyserve; "
              "NGRAM (prompt lookup) is, and needs no draft model")


def drafter_of(options: EngineOptions) -> NgramDrafter | None:
    """None with speculation off; ValueError for what cannot run."""
    algorithm = options.speculative_algorithm
    if algorithm is None:
        return None
    if algorithm != "NGRAM":
        raise ValueError(_NOT_BUILT.format(algorithm))
    k = options.speculative_num_draft_tokens
    low, high = options.speculative_ngram_min_match_window_size, options.speculative_ngram_max_match_window_size
    if k < 1:
        raise ValueError("--speculative-num-draft-tokens must be at least 1")
    if not 1 <= low <= high:
        raise ValueError("the NGRAM match windows need 1 <= --speculative-ngram-min-match-window-size "
                         "<= --speculative-ngram-max-match-window-size")
    return NgramDrafter(k, low, high)
