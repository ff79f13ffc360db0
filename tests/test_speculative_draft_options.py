"""SGLang's options for the draft: the shape a draft model or head takes
when its launch line gives none (SGLang's choice by the target's
architecture), the draft's own checkpoint quantization and attention
backend, and the attention mode."""

from __future__ import annotations

import json
from pathlib import Path
from unittest.mock import patch

import pytest

from pyserve.engine.engine import Engine
from pyserve.engine.speculative.options import drafter_of
from pyserve.server_args import ServerArgs
from tests.test_speculative import repetitive, same, with_and_without
from tests.tiny_models import build_tiny_model

GREEDY = {"temperature": 0, "ignore_eos": True}


def shape(args: ServerArgs, on_cuda: bool = False) -> tuple:
    """The draft's shape as start-up resolves `args` (on a GPU, where `on_cuda`)."""
    with patch("torch.cuda.is_available", return_value=on_cuda):
        resolved = args.resolved()
        assert resolved.resolved() == resolved
    return resolved.speculative_num_steps, resolved.speculative_eagle_topk, resolved.speculative_num_draft_tokens


def test_a_draft_given_no_shape_takes_sglangs_for_the_target(tmp_path):
    glm = tmp_path / "glm"
    glm.mkdir()
    (glm / "config.json").write_text(json.dumps({"architectures": ["Glm4MoeForCausalLM"]}))
    eagle3 = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(tmp_path)]
    # On a GPU a head over the embedded model (a Llama) drafts a tree of 8
    # tokens, 5 deep, 4 wide; on a CPU, and over other targets, a chain of 3.
    assert shape(ServerArgs.from_cli(eagle3), on_cuda=True) == (5, 4, 8)
    assert shape(ServerArgs.from_cli(eagle3)) == (3, 1, 4)
    nextn = ["--model", str(glm), "--speculative-algorithm", "NEXTN"]
    assert shape(ServerArgs.from_cli(nextn), on_cuda=True) == shape(ServerArgs.from_cli(nextn)) == (3, 1, 4)
    assert shape(ServerArgs.from_cli(["--speculative-algorithm", "STANDALONE",
                                      "--speculative-draft-model-path", str(tmp_path)]), on_cuda=True) == (3, 1, 4)
    # Any one of the three given: the others keep pyserve's defaults (a chain of 4).
    assert shape(ServerArgs.from_cli([*eagle3, "--speculative-num-steps", "2"])) == (2, 1, 4)
    assert shape(ServerArgs.from_cli([*eagle3, "--speculative-eagle-topk", "2"])) == (None, 2, 4)
    assert shape(ServerArgs.from_cli(["--speculative-algorithm", "NGRAM"])) == (None, 1, 4)
    assert shape(ServerArgs()) == (None, None, None)


def small_draft(root: Path, tokenizer_dir: Path) -> Path:
    """One layer, its projections' sides multiples of FP8's 32-wide blocks."""
    return build_tiny_model(root, "llama", tokenizer_dir=tokenizer_dir, seed=7, num_hidden_layers=1, hidden_size=64,
                            intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def standalone(draft: Path, **extra) -> dict:
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft),
            "speculative_num_steps": 3, **extra}


def test_the_draft_models_checkpoint_quantization_is_its_own_option(tiny_llama_dir, default_model_dir, tmp_path):
    """--quantization is the target's; an FP8 draft model is read by
    --speculative-draft-model-quantization, and refused where it says so."""
    from tests.test_quantized_checkpoints import FORMATS
    from tests.test_quantized_formats import write_quantized

    plain_draft = small_draft(tmp_path / "plain", default_model_dir)
    quantization, tensors_of, dequantize = FORMATS["fp8-block"]
    write_quantized(plain_draft, tmp_path / "fp8", quantization, tensors_of, dequantize)
    requests = [(repetitive(24), {**GREEDY, "max_new_tokens": 12})]
    # The target's --quantization none refuses a quantized target, not the FP8 draft.
    plain, got, metrics = with_and_without(tiny_llama_dir, requests, standalone(tmp_path / "fp8"),
                                           {"torchao_config": "none", "quantization": "none"})
    same(plain, got)
    assert metrics.spec_verify_steps > 0
    for draft, flag, message in [
            ("fp8", "none", "--speculative-draft-model-quantization none: the checkpoint's weights are fp8-quantized"),
            ("fp8", "unquant", "--speculative-draft-model-quantization none: the checkpoint's weights are fp8"),
            ("fp8", "awq", "--speculative-draft-model-quantization awq: the checkpoint's quantization_config says fp8"),
            ("plain", "fp8", "--speculative-draft-model-quantization fp8: the checkpoint's config.json has no")]:
        with pytest.raises(ValueError, match=message):
            Engine.from_args(ServerArgs(model_path=str(tiny_llama_dir), torchao_config="none",
                                        **standalone(tmp_path / draft, speculative_draft_model_quantization=flag)))


def test_eagle_heads_load_unquantized(eagle3_target, tmp_path):
    from tests.test_speculative_eagle import head_config, random_weights, save_head

    cfg = head_config(eagle3_target)
    head = save_head(tmp_path / "head", cfg, random_weights(cfg))
    quantized = save_head(tmp_path / "fp8-head", {**cfg, "quantization_config": {"quant_method": "fp8"}},
                          random_weights(cfg))

    def refused(head_dir: Path, message: str, **extra):
        args = ServerArgs(model_path=str(eagle3_target), speculative_algorithm="EAGLE",
                          speculative_draft_model_path=str(head_dir), **extra).resolved().split()
        with pytest.raises(ValueError, match=message):
            drafter_of(args.engine, args.model, eagle3_target, None, None)

    refused(head, "--speculative-draft-model-quantization fp8: the EAGLE head in .* loads unquantized",
            speculative_draft_model_quantization="fp8")
    refused(quantized, "the EAGLE head is quantized \\(fp8\\); pyserve loads draft heads unquantized")


def test_the_draft_attends_with_its_own_backend(tiny_llama_dir, default_model_dir, tmp_path):
    """--speculative-draft-attention-backend triton beside a target on
    torch (on CPU, Triton's interpreter runs the draft's kernels: conftest.py)."""
    from pyserve.model.attention.torch_backend import TorchAttention
    from pyserve.model.attention.triton_backend import TritonAttention

    draft = small_draft(tmp_path / "draft", default_model_dir)
    requests = [(repetitive(20), {**GREEDY, "max_new_tokens": 6})]
    options = standalone(draft, speculative_num_steps=2, speculative_draft_attention_backend="triton")
    target = {"torchao_config": "none", "attention_backend": "torch"}
    plain, got, metrics = with_and_without(tiny_llama_dir, requests, options, target)
    same(plain, got)
    assert metrics.spec_verify_steps > 0
    engine = Engine.from_args(ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=4096, **target, **options))
    assert isinstance(engine.runner.rank_model.attention, TorchAttention)
    assert isinstance(engine.runner.draft.model.attention, TritonAttention)


def test_draft_options_without_an_algorithm_are_refused():
    """A launch line that forgot --speculative-algorithm would decode plainly."""
    args = ServerArgs.from_cli(["--speculative-draft-model-path", "/draft", "--speculative-num-steps", "3",
                                "--speculative-draft-model-quantization", "fp8"]).resolved().split()
    with pytest.raises(ValueError, match="--speculative-num-steps, --speculative-draft-model-path, "
                                         "--speculative-draft-model-quantization: for speculative decoding, which "
                                         "is off without --speculative-algorithm"):
        drafter_of(args.engine, args.model, None, None, None)
    plain = ServerArgs().resolved().split()
    assert drafter_of(plain.engine, plain.model, None, None, None) is None


def test_the_cli_takes_sglangs_draft_options():
    args = ServerArgs.from_cli(["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/h",
                                "--speculative-draft-model-quantization", "unquant",
                                "--speculative-draft-attention-backend", "torch",
                                "--speculative-attention-mode", "decode"])
    assert (args.speculative_draft_model_quantization, args.speculative_draft_attention_backend,
            args.speculative_attention_mode) == ("unquant", "torch", "decode")
    for flag, value in [("--speculative-attention-mode", "extend"), ("--speculative-draft-attention-backend", "fa3"),
                        ("--speculative-draft-model-quantization", "int4")]:
        with pytest.raises(SystemExit):
            ServerArgs.from_cli([flag, value])
