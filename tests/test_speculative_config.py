"""vLLM's --speculative-config: a JSON object that means the same as
SGLang's --speculative-* flags, so a vLLM launch line speculates as the
SGLang one does; what it cannot mean is refused at start."""

from __future__ import annotations

import asyncio
import json

import pytest

from pyserve.server_args import ServerArgs
from tests.test_engine import collect, started_engine


def _resolved(argv: list[str]) -> ServerArgs:
    args = ServerArgs.from_cli(argv)
    args.validate()
    return args.resolved()


@pytest.mark.parametrize("config, flags", [
    ({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 6},
     ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5",
      "--speculative-ngram-min-match-window-size", "2", "--speculative-ngram-max-match-window-size", "6"]),
    ({"model": "DRAFT", "num_speculative_tokens": 3},
     ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "DRAFT",
      "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]),
    ({"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 2, "quantization": "none"},
     ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "HEAD", "--speculative-num-steps", "2",
      "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
      "--speculative-draft-model-quantization", "none"]),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 1},
     ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
      "--speculative-num-draft-tokens", "2"]),
])
def test_the_config_means_what_sglangs_flags_say(tiny_llama_dir, tmp_path, config, flags):
    for name in ("DRAFT", "HEAD"):  # local directories, so that nothing is looked up on the Hub
        (tmp_path / name).mkdir()
    config = {k: str(tmp_path / v) if k == "model" else v for k, v in config.items()}
    flags = [str(tmp_path / f) if f in ("DRAFT", "HEAD") else f for f in flags]
    base = ["--model", str(tiny_llama_dir)]
    assert _resolved(base + ["--speculative-config", json.dumps(config)]) == _resolved(base + flags)


def test_a_draft_model_named_by_the_config_speculates(tiny_llama_dir):
    async def tokens(**options):
        engine = await started_engine(tiny_llama_dir, **options)
        try:
            _, ids, last = await collect(engine, [5, 6, 7, 5, 6, 7, 5, 6], max_new_tokens=12, temperature=0,
                                         ignore_eos=True)
            return ids, last.speculation
        finally:
            await engine.shutdown()

    plain, _ = asyncio.run(tokens())
    config = json.dumps({"model": str(tiny_llama_dir), "num_speculative_tokens": 3})
    drafted, counts = asyncio.run(tokens(speculative_config=config))
    assert drafted == plain and counts is not None and counts.accepted > 0  # its own copy drafts every token right


@pytest.mark.parametrize("config, problem", [
    ('{"method": "ngram"}', "num_speculative_tokens must be a positive integer"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method 'medusa' is not one of"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": "[(0,)]"}',
     "speculative_token_tree cannot be honoured"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "takes no model"),
    ('{"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size"),
    ('{"model": "x", "num_speculative_tokens": 2, "quantization": "int3"}', "quantization 'int3'"),
    ("[1]", "must be a JSON object"),
])
def test_what_it_cannot_mean_is_refused(config, problem):
    with pytest.raises(ValueError, match=problem):
        ServerArgs(speculative_config=config).validate()


def test_it_is_given_instead_of_sglangs_flags_not_beside_them():
    args = ServerArgs(speculative_config='{"method": "ngram", "num_speculative_tokens": 2}',
                      speculative_num_draft_tokens=3)
    with pytest.raises(ValueError, match="says what --speculative-num-draft-tokens would: give one or the other"):
        args.validate()
