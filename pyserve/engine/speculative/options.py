"""The drafter the --speculative-* options ask for, or a clear refusal at start."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pyserve._rust import NgramTrie, Tokenizer
from pyserve.engine.speculative.corpora import ExternalCorpora
from pyserve.engine.speculative.drafter import CPU_DRAFT_COST, Drafter, PlaceholderDrafter
from pyserve.engine.speculative.ngram import NgramDrafter, NgramTreeDrafter
from pyserve.engine.speculative.rejection import Acceptance
from pyserve.engine.speculative.tree import TreeShape
from pyserve.model.config import read_config_files
from pyserve.options import EngineOptions, ModelOptions

if TYPE_CHECKING:
    from pyserve.engine.runner.model_runner import ModelRunner

logger = logging.getLogger("pyserve.engine")
# SGLang's defaults for NGRAM trees' trie (a node takes about 80 bytes)
# and their corpora (about 55 bytes a token of text).
_NGRAM_BRANCH_LENGTH = 18
_NGRAM_CAPACITY = 10_000_000
_NGRAM_CORPUS_MAX_TOKENS = 10_000_000
# Draft heads over the target's hidden states: EAGLE-3's, EAGLE-1/2's, and a
# checkpoint's own multi-token-prediction layer (NEXTN; EAGLE finds one too).
EAGLE_ALGORITHMS = ("EAGLE3", "EAGLE", "NEXTN")
# SGLang's (--speculative-num-steps, --speculative-eagle-topk,
# --speculative-num-draft-tokens) for a draft model or head given none of
# them, tuned on its GPUs: a tree of 8 over a Llama target's head, else a
# chain of 3 (a draft model's whatever the target). A tree's extra rows
# cost a CPU what they save, so there every draft is a chain of 3.
_LLAMA_HEAD_SHAPE = (5, 4, 8)
_DRAFT_SHAPE = (3, 1, 4)
# Otherwise a chain of this many drafts.
_DEFAULT_DRAFT_TOKENS = 4


@dataclass(frozen=True)
class TargetGraphs:
    """The CUDA graphs the target captures at start for speculation (where
    it captures any): verify rows of `verify_tokens` tokens (0: none) and,
    for EAGLE3, EAGLE and NEXTN, graphs keeping the hidden states the head in
    `eagle_head` reads. Known from the options alone, so that every graph
    is captured once, and over several ranks while the others capture
    theirs (a capture runs the ranks' collectives)."""

    verify_tokens: int = 0
    eagle_head: Path | None = None
    eagle_algorithm: str | None = None  # one of EAGLE_ALGORITHMS, with eagle_head

    def aux_layers(self, target_layers: int) -> frozenset[int] | None:
        if self.eagle_head is None:
            return None
        return eagle_config(self.eagle_algorithm, self.eagle_head).aux_layers(target_layers)


def draft_shape(algorithm: str, model_path: str | None, on_cuda: bool, steps: int | None, topk: int | None,
                tokens: int | None) -> tuple[int | None, int, int]:
    """(steps, topk, draft tokens) from the options given: SGLang's choice
    by the target's architecture where a draft model or head is given none
    (on a CPU, chains), else chains of 4 drafts where the topk or draft
    tokens are left out."""
    if algorithm != "NGRAM" and steps is None and topk is None and tokens is None:
        if algorithm == "STANDALONE" or not on_cuda or _architecture(model_path) != "LlamaForCausalLM":
            return _DRAFT_SHAPE
        return _LLAMA_HEAD_SHAPE
    return steps, 1 if topk is None else topk, _DEFAULT_DRAFT_TOKENS if tokens is None else tokens


def _architecture(model_path: str | None) -> str | None:
    """The served model's architecture; None where its config.json cannot
    say (the engine's start-up then tells what is wrong)."""
    if model_path is None:
        from pyserve.model.default_model import DEFAULT_ARCHITECTURE

        return DEFAULT_ARCHITECTURE
    try:
        cfg, _ = read_config_files(model_path)
    except (ValueError, OSError):
        return None
    return next(iter(cfg.get("architectures") or []), None)


def eagle_config(algorithm: str, head_dir: Path, target_overrides: dict | None = None):
    """The head's config: an Eagle3Config for EAGLE3; for NEXTN, and for
    EAGLE given a checkpoint that carries multi-token-prediction layers,
    an MtpConfig; else an EagleConfig."""
    if algorithm == "EAGLE3":
        from pyserve.model.eagle3_head import Eagle3Config

        return Eagle3Config(head_dir)
    from pyserve.model.mtp_head import MtpConfig, has_mtp_layers

    if algorithm == "NEXTN" or has_mtp_layers(head_dir):
        return MtpConfig(head_dir, target_overrides)
    from pyserve.model.eagle_head import EagleConfig

    return EagleConfig(head_dir)


def target_graphs(options: EngineOptions, model_options: ModelOptions) -> TargetGraphs:
    """What the target captures for the --speculative-* options. Over
    several ranks verify steps run eagerly (the other ranks know nothing of
    speculation, and every rank must replay the same shapes): decode graphs
    only, rank 0's keeping an EAGLE3 head's hidden states."""
    algorithm = options.speculative_algorithm
    if algorithm is None:
        return TargetGraphs()
    drafts = _drafts_per_row(options, model_options)  # first: it asks for a missing draft path
    head = _draft_dir(options, model_options) if algorithm in EAGLE_ALGORITHMS else None
    return TargetGraphs(drafts + 1 if model_options.tp_size == 1 else 0, head, algorithm if head else None)


def _drafts_per_row(options: EngineOptions, model_options: ModelOptions) -> int:
    """The drafts a verify row carries: NGRAM's --speculative-num-draft-tokens,
    a draft model's steps, or a draft tree's nodes (the root not counted)."""
    if options.speculative_algorithm == "NGRAM":
        return options.speculative_num_draft_tokens
    steps = _draft_model_steps(options, model_options)
    return options.speculative_num_draft_tokens - 1 if options.speculative_eagle_topk > 1 else steps


def drafter_of(options: EngineOptions, model_options: ModelOptions, model_dir: Path,
               runner: ModelRunner, tokenizer: Tokenizer | None, tokenizer_dir: Path | None = None) -> Drafter | None:
    """None with speculation off; ValueError for what cannot run. For
    STANDALONE, loads the draft model (checked against the served
    tokenizer in `tokenizer_dir`, default `model_dir`) and gives it to the runner; for EAGLE3 and
    EAGLE, the draft head (checked against the target's shapes); for NGRAM trees, the
    corpus file (with `tokenizer`)."""
    algorithm = options.speculative_algorithm
    if algorithm is None:
        _refuse_options_without_speculation(options)
        return None
    acceptance = _acceptance(options)
    k = options.speculative_num_draft_tokens
    if k < 1:
        raise ValueError("--speculative-num-draft-tokens must be at least 1")
    if options.speculative_token_map is not None and algorithm not in ("EAGLE", "NEXTN"):
        raise ValueError("--speculative-token-map is for EAGLE heads, which project onto the target's whole "
                         "vocabulary; " + ("an EAGLE-3 head has a reduced one of its own (its d2t)"
                                           if algorithm == "EAGLE3" else f"{algorithm} drafts with no such head"))
    draft_cost = CPU_DRAFT_COST if model_options.device == "cpu" else None
    if algorithm == "NGRAM":
        low, high = options.speculative_ngram_min_match_window_size, options.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError("the NGRAM match windows need 1 <= --speculative-ngram-min-match-window-size "
                             "<= --speculative-ngram-max-match-window-size")
        if options.speculative_eagle_topk != 1:
            raise ValueError("--speculative-eagle-topk is EAGLE3's and EAGLE's: NGRAM drafts trees with "
                             "--speculative-ngram-max-bfs-breadth above 1")
        trie = _ngram_trie(options)
        corpora = None if trie is None else _external_corpora(options, tokenizer)
        _warn_eager_verify(runner, model_options)
        runner.acceptance = acceptance
        if trie is None:
            return NgramDrafter(k, low, high, draft_cost)
        return NgramTreeDrafter(k, trie, corpora, low, high, draft_cost)
    steps = _drafts_per_row(options, model_options)
    draft_dir = _draft_dir(options, model_options)
    topk = options.speculative_eagle_topk
    if topk < 1:
        raise ValueError("--speculative-eagle-topk must be at least 1")
    tree = _tree_shape(options, topk) if topk > 1 else None
    draft_options = _draft_options(options, model_options)
    if algorithm in EAGLE_ALGORITHMS:
        runner.draft = _eagle(algorithm, draft_dir, runner, draft_options, tree, model_dir,
                              options.speculative_token_map, model_options.config_overrides)
    else:
        from pyserve.engine.speculative.standalone import DraftModel, tokenizer_mismatch

        problem = tokenizer_mismatch(tokenizer_dir or model_dir, draft_dir)
        if problem is not None:
            raise ValueError(problem)
        _check_draft_quantization(draft_dir, draft_options.quantization)
        runner.draft = DraftModel(draft_options, draft_dir, runner.rank_model, steps + 1, tree)
    _warn_eager_verify(runner, model_options)
    runner.acceptance = acceptance
    return PlaceholderDrafter(steps, draft_cost, drafts_from_computed_rows=algorithm in EAGLE_ALGORITHMS,
                              follows_steps=algorithm == "STANDALONE")


def _draft_options(options: EngineOptions, model_options: ModelOptions) -> ModelOptions:
    """The target's model options with the draft's quantization and
    attention backend in place of the target's, and none of the target's
    config.json overrides (--json-model-override-args name the target's keys)."""
    quantization = options.speculative_draft_model_quantization
    return replace(model_options, quantization="none" if quantization == "unquant" else quantization,
                   attention_backend=options.speculative_draft_attention_backend or model_options.attention_backend,
                   load_format=options.speculative_draft_load_format or model_options.load_format,
                   json_model_override_args="{}")


def _check_draft_quantization(draft_dir: Path, quantization: str) -> None:
    """What the loader checks of the draft's checkpoint, ahead of it, for
    an error that names the draft's option."""
    from pyserve.model.quantized.scheme import detect

    detect(read_config_files(draft_dir)[0], quantization, "--speculative-draft-model-quantization")


def _acceptance(options: EngineOptions) -> Acceptance:
    """SGLang's relaxed acceptance thresholds, checked."""
    acceptance = Acceptance(options.speculative_accept_threshold_single, options.speculative_accept_threshold_acc)
    for value, flag in ((acceptance.single, "single"), (acceptance.acc, "acc")):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"--speculative-accept-threshold-{flag} {value}: must be in (0, 1]")
    return acceptance


def _refuse_options_without_speculation(options: EngineOptions) -> None:
    """A --speculative-* option given without --speculative-algorithm would
    change nothing: refused, so that no one believes speculation is on."""
    given = options.speculative_flags_given()
    if given:
        raise ValueError(f"{', '.join(given)}: for speculative decoding, which is off without "
                         "--speculative-algorithm")


def _ngram_trie(options: EngineOptions) -> NgramTrie | None:
    """The trie NGRAM draft trees are read from; None for chains (a
    breadth of 1 and BFS), which refuse the trie's own options."""
    low, high = options.speculative_ngram_min_bfs_breadth, options.speculative_ngram_max_bfs_breadth
    if not 1 <= low <= high:
        raise ValueError("the NGRAM tree breadths need 1 <= --speculative-ngram-min-bfs-breadth "
                         "<= --speculative-ngram-max-bfs-breadth")
    by_probability = options.speculative_ngram_match_type == "PROB"
    branch_length, capacity = options.speculative_ngram_branch_length, options.speculative_ngram_capacity
    if high == 1 and not by_probability:
        for value, flag in ((branch_length, "branch-length"), (capacity, "capacity"),
                            (options.speculative_ngram_external_corpus_path, "external-corpus-path"),
                            (options.speculative_ngram_external_sam_budget, "external-sam-budget"),
                            (options.speculative_ngram_external_corpus_max_tokens, "external-corpus-max-tokens")):
            if value is not None:
                raise ValueError(f"--speculative-ngram-{flag} is for NGRAM trees (--speculative-ngram-max-bfs-"
                                 f"breadth above 1, or --speculative-ngram-match-type PROB); chains are drafted "
                                 f"from the request's own tokens")
        return None
    branch_length = _NGRAM_BRANCH_LENGTH if branch_length is None else branch_length
    capacity = _NGRAM_CAPACITY if capacity is None else capacity
    max_window = options.speculative_ngram_max_match_window_size
    if branch_length <= max_window:
        raise ValueError(f"--speculative-ngram-branch-length {branch_length} leaves no draft after a match of "
                         f"--speculative-ngram-max-match-window-size {max_window} tokens: it must be longer")
    if capacity < branch_length:
        raise ValueError(f"--speculative-ngram-capacity {capacity} cannot hold one branch of {branch_length} tokens")
    if capacity > NgramTrie.MAX_CAPACITY:
        raise ValueError(f"--speculative-ngram-capacity {capacity}: the trie holds at most {NgramTrie.MAX_CAPACITY} "
                         f"nodes")
    return NgramTrie(branch_length, capacity, options.speculative_ngram_min_match_window_size, max_window,
                     low, high, by_probability)


def _external_corpora(options: EngineOptions, tokenizer: Tokenizer | None) -> ExternalCorpora:
    """NGRAM trees' corpora, with --speculative-ngram-external-corpus-path's
    loaded under its path as its id (as SGLang names it)."""
    if tokenizer is None:
        raise ValueError("NGRAM trees keep corpora of text, which --skip-tokenizer-init leaves no tokenizer to read: "
                         "draft chains (--speculative-ngram-max-bfs-breadth 1)")
    reserved = options.speculative_ngram_external_sam_budget or 0
    max_tokens = options.speculative_ngram_external_corpus_max_tokens
    max_tokens = _NGRAM_CORPUS_MAX_TOKENS if max_tokens is None else max_tokens
    if reserved < 0:
        raise ValueError(f"--speculative-ngram-external-sam-budget {reserved}: a count of draft nodes, 0 or more")
    if max_tokens < 1:
        raise ValueError(f"--speculative-ngram-external-corpus-max-tokens {max_tokens}: must be at least 1")
    corpora = ExternalCorpora(tokenizer, reserved, max_tokens)
    path = options.speculative_ngram_external_corpus_path
    if path is not None:
        tokens = corpora.load_file_now(path, path)
        logger.info("NGRAM corpus %s: %d tokens", path, tokens)
    return corpora


def _warn_eager_verify(runner: ModelRunner, model_options: ModelOptions) -> None:
    """Over several ranks the target has decode graphs only (target_graphs)."""
    if runner.rank_model.cuda_graphs is not None and model_options.tp_size > 1:
        logger.warning("Speculative decoding over %d ranks: verify steps run without CUDA graphs while plain "
                       "decode steps replay them, so speculation can be slower than none", model_options.tp_size)


def _draft_dir(options: EngineOptions, model_options: ModelOptions) -> Path:
    """--speculative-draft-model-path; for EAGLE and NEXTN without it, as
    SGLang does, the target's own checkpoint where it carries
    multi-token-prediction layers."""
    algorithm, path = options.speculative_algorithm, options.speculative_draft_model_path
    if path is None and algorithm in ("EAGLE", "NEXTN") and model_options.model_path is not None:
        from pyserve.model.mtp_head import has_mtp_layers

        if has_mtp_layers(Path(model_options.model_path)):
            path = model_options.model_path
    if path is None:
        own = " (or a model whose checkpoint carries multi-token-prediction layers)" if algorithm in (
            "EAGLE", "NEXTN") else ""
        raise ValueError(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path{own}")
    if not Path(path).is_dir():
        raise ValueError(f"--speculative-draft-model-path {path} is not a directory")
    return Path(path)


def _draft_model_steps(options: EngineOptions, model_options: ModelOptions) -> int:
    """Tokens a draft model (STANDALONE, EAGLE3) drafts per verify, once its options are checked."""
    _draft_dir(options, model_options)
    steps = options.speculative_num_steps or options.speculative_num_draft_tokens
    if steps < 1:
        raise ValueError("--speculative-num-steps must be at least 1")
    if model_options.is_embedding:
        raise ValueError("--speculative-algorithm is for generation; an --is-embedding server decodes nothing")
    return steps


def _tree_shape(options: EngineOptions, topk: int) -> TreeShape:
    """Draft trees: --speculative-num-draft-tokens tokens verified
    per row (the root, the newest known token, included, as SGLang counts
    them), nodes down to --speculative-num-steps deep."""
    nodes = options.speculative_num_draft_tokens - 1
    depth = options.speculative_num_steps or nodes
    if nodes < 1:
        raise ValueError("a draft tree (--speculative-eagle-topk above 1) needs --speculative-num-draft-tokens of "
                         "at least 2: the newest token and one node")
    candidates = topk + (depth - 1) * topk * topk
    if nodes > candidates:
        raise ValueError(f"--speculative-num-draft-tokens {nodes + 1}: a tree {depth} deep with top {topk} per step "
                         f"has {candidates} candidate nodes, fewer than the {nodes} asked for")
    return TreeShape(topk, depth, options.max_running_requests * (depth - 1) * topk)


def _eagle(algorithm: str, head_dir: Path, runner: ModelRunner, draft_options: ModelOptions,
           tree: TreeShape | None, model_dir: Path, token_map: str | None, target_overrides: dict):
    from pyserve.engine.speculative.eagle import EagleDraft
    from pyserve.model.eagle_head import EagleConfig, load_token_map
    from pyserve.model.mtp_head import MtpConfig

    config = eagle_config(algorithm, head_dir, target_overrides)
    if isinstance(config, MtpConfig):
        _check_draft_quantization(head_dir, draft_options.quantization)
    elif draft_options.quantization not in ("auto", "none"):
        raise ValueError(f"--speculative-draft-model-quantization {draft_options.quantization}: the {config.name} "
                         f"in {head_dir} loads unquantized (the option is for a STANDALONE draft model or a "
                         "NEXTN layer)")
    elif draft_options.load_format == "dummy" and runner.rank_model.options.load_format != "dummy":
        raise ValueError(f"--speculative-draft-load-format dummy: the {config.name} in {head_dir} loads from its "
                         "checkpoint (the option is for a STANDALONE draft model or a NEXTN layer)")
    target = runner.rank_model.config
    if config.target_hidden_size != target.hidden_size or config.model.hidden_size != target.hidden_size:
        raise ValueError(f"the {config.name} in {head_dir} is for a target of hidden size "
                         f"{config.target_hidden_size} (its own: {config.model.hidden_size}); this model's is "
                         f"{target.hidden_size}")
    if config.model.vocab_size != target.vocab_size:
        raise ValueError(f"the {config.name} in {head_dir} is for a vocabulary of {config.model.vocab_size} tokens; "
                         f"this model's has {target.vocab_size}")
    if token_map is not None and not isinstance(config, EagleConfig):
        raise ValueError(f"--speculative-token-map is for EAGLE heads; the {config.name} in {head_dir} projects "
                         "onto the whole vocabulary")
    hot_tokens = None if token_map is None else load_token_map(Path(token_map), target.vocab_size)
    return EagleDraft(head_dir, config, runner.rank_model, model_dir, draft_options, tree, hot_tokens)
