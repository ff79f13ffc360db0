"""ServerArgs: each option declared once, in one group of options, and "auto"
resolved in one place."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from pyserve.options import EngineOptions, ModelOptions, ServerOptions
from pyserve.server_args import ServerArgs


@pytest.fixture
def cuda(monkeypatch):
    """Pretend CUDA is there (True) or not (False)."""

    def pretend(available: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)

    return pretend


def test_every_field_is_an_option_with_its_default():
    parser = ServerArgs.parser()
    dests = {action.dest: action for action in parser._actions if action.dest != "help"}
    assert set(dests) == {f.name for f in fields(ServerArgs)}
    assert ServerArgs.from_cli([]) == ServerArgs()
    for f in fields(ServerArgs):
        assert dests[f.name].help, f"--{f.name} has no help"


def test_values_are_converted_to_the_field_types():
    args = ServerArgs.from_cli(["--port", "8080", "--mem-fraction-static", "0.5", "--context-length", "512",
                                "--disable-cuda-graph", "--host", "0.0.0.0"])
    assert (args.port, args.mem_fraction_static, args.context_length) == (8080, 0.5, 512)
    assert args.disable_cuda_graph is True and args.host == "0.0.0.0"
    assert ServerArgs.from_cli(["--tp", "1"]).tp_size == 1


def test_a_vllm_launch_line_reads_as_the_same_options():
    """`vllm serve`'s flags and value names for the options pyserve has
    under SGLang's names."""
    vllm = ServerArgs.from_cli([
        "--model", "m", "--tokenizer", "t", "--max-model-len", "4096", "--gpu-memory-utilization", "0.8",
        "--tensor-parallel-size", "2", "--max-num-seqs", "32", "--max-num-batched-tokens", "1024", "--seed", "7",
        "--enforce-eager", "--block-size", "16", "--enable-lora", "--lora-modules", "a=/x", "b=/y", "--max-loras", "4",
        "--no-enable-prefix-caching", "--generation-config", "vllm", "--enable-auto-tool-choice",
        "--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1", "--kv-cache-dtype", "fp8",
    ])
    sglang = ServerArgs.from_cli([
        "--model", "m", "--tokenizer-path", "t", "--context-length", "4096", "--mem-fraction-static", "0.8",
        "--tp-size", "2", "--max-running-requests", "32", "--chunked-prefill-size", "1024", "--random-seed", "7",
        "--disable-cuda-graph", "--page-size", "16", "--enable-lora", "--lora-paths", "a=/x", "b=/y",
        "--max-loras-per-batch", "4", "--disable-radix-cache", "--sampling-defaults", "openai",
        "--tool-call-parser", "llama3", "--reasoning-parser", "deepseek-r1", "--kv-cache-dtype", "fp8_e4m3",
    ])
    assert vllm == ServerArgs(**{**vars(sglang), "enable_auto_tool_choice": True})
    assert ServerArgs.from_cli(["-tp", "2", "--tool-call-parser", "openai"]).tool_call_parser == "gpt-oss"
    assert ServerArgs.from_cli(["--served-model-name", "mine", "org/mine"]).served_model_name == "mine,org/mine"
    assert ServerArgs.from_cli(["--no-enable-prefix-caching", "--enable-prefix-caching"]).disable_radix_cache is False
    assert ServerArgs.from_cli(["--runner", "pooling", "--enable-log-requests"]) == \
        ServerArgs(is_embedding=True, log_requests=True)
    assert ServerArgs.from_cli(["--disable-log-requests", "--dp", "1", "-pp", "1"]) == ServerArgs()
    for options, problem in (({"dp_size": 2}, "smg gateway"), ({"pp_size": 2}, "--tp-size")):
        with pytest.raises(ValueError, match=problem):
            ServerArgs(**options).validate()


def test_choices_are_enforced(capsys):
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--device", "tpu"])
    assert "--device" in capsys.readouterr().err


def test_auto_resolves_to_cpu_settings_without_cuda(cuda):
    cuda(False)
    args = ServerArgs().resolved()
    assert (args.device, args.dtype, args.attention_backend) == ("cpu", "float32", "torch")
    assert args.disable_overlap_schedule is True


def test_auto_resolves_to_cuda_settings_with_cuda(cuda):
    cuda(True)
    args = ServerArgs().resolved()
    assert (args.device, args.dtype, args.attention_backend) == ("cuda", "bfloat16", "triton")
    assert args.disable_overlap_schedule is False
    # Speculation turns overlap off unless it is asked for.
    assert ServerArgs(speculative_algorithm="NGRAM").resolved().disable_overlap_schedule is True
    assert ServerArgs(speculative_algorithm="NGRAM", disable_overlap_schedule=False).resolved() \
        .disable_overlap_schedule is False


def test_explicit_choices_are_kept(cuda):
    cuda(True)
    args = ServerArgs(device="cpu", dtype="float16", attention_backend="triton",
                      disable_overlap_schedule=False).resolved()
    assert (args.device, args.dtype, args.attention_backend) == ("cpu", "float16", "triton")
    assert args.disable_overlap_schedule is False  # --enable-overlap-schedule on CPU
    assert ServerArgs(device="cpu").resolved().dtype == "float32"


def test_resolving_is_idempotent_and_leaves_the_original(cuda):
    for available in (False, True):
        cuda(available)
        original = ServerArgs()
        once = original.resolved()
        assert once.resolved() == once
        assert original == ServerArgs()  # a copy: the declared "auto" stays


def test_cuda_asked_for_but_absent_is_a_clear_error(cuda):
    cuda(False)
    with pytest.raises(ValueError, match="--device cuda was asked for, but CUDA is not available"):
        ServerArgs(device="cuda").resolved()


def test_every_option_belongs_to_exactly_one_group():
    in_groups = [f.name for group in (ServerOptions, EngineOptions, ModelOptions) for f in fields(group)]
    assert sorted(in_groups) == sorted(f.name for f in fields(ServerArgs))  # none lost, none in two


def test_split_hands_each_layer_its_own_options():
    args = ServerArgs(api_key="sekrit", port=8080, max_running_requests=3, page_size=4, model_path="/m")
    server, engine, model = args.split()
    assert (server.api_key, server.port) == ("sekrit", 8080)
    assert engine.max_running_requests == 3
    assert (model.page_size, model.model_path) == (4, "/m")
    assert "sekrit" not in repr(engine) + repr(model)


def test_the_api_key_is_neither_logged_nor_reported():
    args = ServerArgs(api_key="sekrit")
    assert "sekrit" not in repr(args) and "sekrit" not in repr(args.split())
    reported = args.reported()
    assert "api_key" not in reported and "sekrit" not in str(reported)
    assert reported["port"] == 30000 and len(reported) == len(fields(ServerArgs)) - 1


def test_cuda_graphs_capture_no_batch_larger_than_the_running_batch():
    assert ServerArgs(max_running_requests=16).resolved().cuda_graph_max_bs == 16
    assert ServerArgs(cuda_graph_max_bs=8).resolved().cuda_graph_max_bs == 8


def test_the_launch_lines_docs_deployment_shows_parse_alike():
    """docs/deployment.md's SGLang and vLLM launch lines, run as pyserve,
    are the options their programs' lines say."""
    import re
    import shlex
    from pathlib import Path

    from pyserve.speculative_config import speculative_options

    text = (Path(__file__).resolve().parent.parent / "docs" / "deployment.md").read_text()
    block = text.split("## From an SGLang or vLLM launch line", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [shlex.split(line.replace("\\\n", " ")) for line in re.split(r"(?<!\\)\n", block) if line.strip()]
    parsed = [ServerArgs.from_cli(words[1:]) for words in lines if words[0] == "pyserve"]
    assert len(parsed) == 2
    sglang, vllm = parsed
    assert (sglang.tp_size, sglang.context_length, sglang.speculative_algorithm) == (2, 8192, "NGRAM")
    vllm.validate()
    speculation = speculative_options(vllm.speculative_config, vllm.tp_size)["speculative_algorithm"]
    assert (vllm.tp_size, vllm.context_length, speculation) == (2, 8192, "NGRAM")
