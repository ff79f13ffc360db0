"""Quantized checkpoints under --tp-size 2 (gloo, CPU): each rank's slice
of the packed layers (after unpacking: rows of column-parallel layers,
whole groups of inputs of row-parallel ones, act-order g_idx applied
first) gives what one rank generates; and a real `pyserve --model DIR`
server answers with transformers' greedy tokens."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.slow import slow_test
from tests.test_quantized_checkpoints import PROMPTS, NEW_TOKENS, compressed_pair, hf_greedy, quantized_pair
from tests.test_tensor_parallel import _one_and_two_ranks, assert_same_generation


# gptq-int4-act-order's and awq-int4-g64's same checkpoints generate on two
# ranks in test_quantized_tp_reads.py (test_each_rank_reads_only_its_slice_of_dense_quantized_layers).
@pytest.mark.parametrize("fmt", ["fp8-block"])
def test_two_ranks_generate_what_one_does(tmp_path, default_model_dir, fmt):
    quant_dir, _ = quantized_pair(tmp_path, default_model_dir, fmt)
    assert_same_generation(*_one_and_two_ranks(quant_dir, torchao_config="none"))


def test_two_ranks_in_the_natural_4bit_mode(tmp_path, default_model_dir):
    """W4A16 (groups of 128) on two ranks as 8da4w: down_proj's 256 inputs
    split into two whole groups; the same tokens as one rank."""
    quant_dir, _ = compressed_pair(tmp_path, default_model_dir, "W4A16")
    one, two = _one_and_two_ranks(quant_dir)
    assert [ids for ids, _, _ in two] == [ids for ids, _, _ in one]


@slow_test
def test_real_server_serves_a_quantized_checkpoint(tmp_path, default_model_dir):
    quant_dir, dense_dir = quantized_pair(tmp_path, default_model_dir, "gptq-int4-sym")
    server = ServerProcess("--model", str(quant_dir), "--torchao-config", "none", "--quantization", "gptq")
    try:
        answers = [httpx.post(f"{server.base_url}/generate", timeout=60, json={
            "input_ids": p, "return_logprob": True,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}}).json()
            for p in PROMPTS]
        info = httpx.get(f"{server.base_url}/get_server_info", timeout=10).json()
    finally:
        server.stop()
    assert info.get("quantization") == "gptq"
    tokens = [[token for _, token, _ in a["meta_info"]["output_token_logprobs"]] for a in answers]
    assert tokens == hf_greedy(dense_dir)
