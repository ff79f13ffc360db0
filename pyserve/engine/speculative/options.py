"""The drafter the --speculative-* options ask for, or a clear refusal at start."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pyserve.engine.speculative.drafter import Drafter
from pyserve.engine.speculative.ngram import NgramDrafter
from pyserve.server_args import EngineOptions, ModelOptions

if TYPE_CHECKING:
    from pyserve.engine.runner.model_runner import ModelRunner

_EAGLE3 = ("--speculative-algorithm EAGLE3 is not implemented in this build of pyserve; "
           "NGRAM (prompt lookup, no draft model) and STANDALONE (a smaller draft model with the "
           "target's tokenizer, --speculative-draft-model-path) are")


def drafter_of(options: EngineOptions, model_options: ModelOptions, model_dir: Path,
               runner: ModelRunner) -> Drafter | None:
    """None with speculation off; ValueError for what cannot run. For
    STANDALONE, loads the draft model (checked against the target's
    tokenizer in `model_dir`) and gives it to the runner."""
    algorithm = options.speculative_algorithm
    if algorithm is None:
        return None
    if algorithm == "EAGLE3":
        raise ValueError(_EAGLE3)
    k = options.speculative_num_draft_tokens
    if k < 1:
        raise ValueError("--speculative-num-draft-tokens must be at least 1")
    if algorithm == "NGRAM":
        low, high = options.speculative_ngram_min_match_window_size, options.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError("the NGRAM match windows need 1 <= --speculative-ngram-min-match-window-size "
                             "<= --speculative-ngram-max-match-window-size")
        return NgramDrafter(k, low, high)
    return _standalone(options, model_options, model_dir, runner)


def _standalone(options: EngineOptions, model_options: ModelOptions, model_dir: Path, runner: ModelRunner) -> Drafter:
    from pyserve.engine.speculative.standalone import DraftModel, StandaloneDrafter, tokenizer_mismatch

    if not options.speculative_draft_model_path:
        raise ValueError("--speculative-algorithm STANDALONE needs --speculative-draft-model-path")
    steps = options.speculative_num_steps or options.speculative_num_draft_tokens
    if steps < 1:
        raise ValueError("--speculative-num-steps must be at least 1")
    if model_options.tp_size > 1:
        raise ValueError("--speculative-algorithm STANDALONE runs on one rank: --tp-size must be 1")
    if model_options.is_embedding:
        raise ValueError("--speculative-algorithm is for generation; an --is-embedding server decodes nothing")
    draft_dir = Path(options.speculative_draft_model_path)
    problem = tokenizer_mismatch(model_dir, draft_dir)
    if problem is not None:
        raise ValueError(problem)
    runner.draft = DraftModel(model_options, draft_dir, runner.rank_model)
    return StandaloneDrafter(steps)
