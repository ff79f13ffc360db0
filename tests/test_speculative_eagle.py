"""EAGLE speculative decoding (`--speculative-algorithm EAGLE`): an
EAGLE-1/2 draft head in the checkpoint format SGLang loads (a LlamaConfig of
one layer; `fc` over the token's embedding and the target's last hidden
state, then the layer without its input norm, then the target's vocabulary
projection), over the tiny Llama target the EAGLE3 tests share. The target
keeps its last hidden state, the head computes what the format defines
(against a forward written here from that definition), greedy output is
identical to decoding without speculation in chains and trees, a head
fitted to the target's text gets its drafts kept, a token map (SGLang's
`--speculative-token-map`) cuts what the head may draft to its tokens, and
what cannot run is refused at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pyserve.engine.speculative.options import drafter_of
from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.model.eagle_head import EagleConfig, load_eagle_head
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.layers.causal_lm import AuxCapture
from pyserve.model.loader import load_model
from pyserve.server_args import ServerArgs
from tests.eagle3_heads import (HEAD_INTERMEDIATE, PROMPTS, greedy_continuations, head_step, hot_ids,
                                reference_layer)
from tests.test_speculative import assert_identical_on_the_embedded_model, repetitive, same, with_and_without
from tests.slow import slow

K = 4
GREEDY = {"temperature": 0, "ignore_eos": True}


def head_config(target_dir: Path) -> dict:
    target = json.loads((target_dir / "config.json").read_text())
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": target["hidden_size"], "intermediate_size": HEAD_INTERMEDIATE, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": target["rms_norm_eps"], "rope_theta": 10000.0, "max_position_embeddings": 2048,
            "vocab_size": target["vocab_size"], "torch_dtype": "float32"}


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"fc.weight": (h, 2 * h), "fc.bias": (h,), "layers.0.self_attn.q_proj.weight": (q, h),
              "layers.0.self_attn.k_proj.weight": (kv, h), "layers.0.self_attn.v_proj.weight": (kv, h),
              "layers.0.self_attn.o_proj.weight": (h, q), "layers.0.mlp.gate_proj.weight": (inter, h),
              "layers.0.mlp.up_proj.weight": (inter, h), "layers.0.mlp.down_proj.weight": (h, inter)}
    w = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}
    w["layers.0.post_attention_layernorm.weight"] = torch.rand(h, generator=g) + 0.5
    return w


def save_head(out: Path, cfg: dict, weights: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def target_parts(target_dir: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's (embeddings, last hidden state after its final norm,
    vocabulary projection) of the tokens `ids`, by transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        embeds = model.get_input_embeddings()(torch.tensor(ids))
    return embeds, out.hidden_states[-1][0], model.get_output_embeddings().weight.detach()


def reference_head(w: dict, cfg: dict, lm_head: torch.Tensor, embeds: torch.Tensor, h: torch.Tensor,
                   positions: torch.Tensor, sees: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and output hidden states of n pairs (`embeds` of their tokens,
    `h` their hidden states) at `positions`, pair r attending where sees[r]."""
    x = torch.cat([embeds, h], dim=-1) @ w["fc.weight"].T + w["fc.bias"]
    out = reference_layer(w, "layers.0.", cfg, x, x, positions, sees)  # no input norm
    return out @ lm_head.T, out


def first_drafts(w, cfg, lm_head, embeds, hidden):
    """Pair i at position i reads token i + 1 and the target's hidden state at i; predicts token i + 2."""
    n = embeds.shape[0]
    return reference_head(w, cfg, lm_head, embeds, hidden, torch.arange(n), torch.ones(n, n).tril().bool())


@pytest.fixture(scope="module")
def eagle_heads(eagle3_target, tmp_path_factory) -> dict:
    """A random head, and one fitted to the target's greedy continuations
    of PROMPTS (checked to draft them right > 90% of the time)."""
    root = tmp_path_factory.mktemp("eagle-heads")
    cfg = head_config(eagle3_target)
    texts = [p + out for p, out in zip(PROMPTS, greedy_continuations(eagle3_target, PROMPTS, 40))]
    data = []
    for ids in texts:
        embeds, hidden, lm_head = target_parts(eagle3_target, ids)
        data.append((embeds[1:-1], hidden[:-2], torch.tensor(ids[2:])))
    w = {k: v.clone().requires_grad_() for k, v in random_weights(cfg, seed=2).items()}
    opt = torch.optim.Adam(w.values(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only waits
    try:
        for _ in range(50):
            loss = sum(F.cross_entropy(first_drafts(w, cfg, lm_head, e, h)[0], y) for e, h, y in data)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    fitted = {k: v.detach() for k, v in w.items()}
    with torch.no_grad():
        for e, h, y in data:
            assert float((first_drafts(fitted, cfg, lm_head, e, h)[0].argmax(-1) == y).float().mean()) > 0.9
    return {"random": save_head(root / "random", cfg, random_weights(cfg, seed=1)),
            "fitted": save_head(root / "fitted", cfg, fitted), "texts": texts}


def spec(head: Path, **extra) -> dict:
    return {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(head),
            "speculative_num_draft_tokens": K, **extra}


def test_the_head_reads_the_targets_last_hidden_state_and_computes_what_the_format_defines(eagle3_target,
                                                                                          eagle_heads):
    """The target keeps its stream after the last layer; through its final
    norm that is transformers' last hidden state. pyserve's head over it,
    a prompt's pairs in one extend then one position at a time, gives the
    reference's logits; so does a chained step from a pair's output."""
    from safetensors.torch import load_file

    ids = repetitive(17)
    model, config = load_model(eagle3_target, torch.float32, "cpu")
    pool = KVBuffer(config.num_hidden_layers, 32, config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
    batch = ForwardBatch.build(ids, list(range(len(ids))), torch.arange(1, len(ids) + 1), [len(ids)],
                               [torch.arange(1, len(ids) + 1)], [len(ids) - 1], False, "cpu")
    head_dir = eagle_heads["random"]
    head = load_eagle_head(head_dir, EagleConfig(head_dir), model.embed_tokens.weight, model.lm_head.weight,
                           model.norm, torch.float32, torch.device("cpu"))
    capture = AuxCapture(EagleConfig(head_dir).aux_layers(config.num_hidden_layers))
    with torch.inference_mode():
        model(batch, TorchAttention(pool), capture=capture)
    embeds, hidden, lm_head = target_parts(eagle3_target, ids)
    assert torch.allclose(head.target_features(capture.states), hidden, atol=1e-4)

    weights = load_file(str(head_dir / "model.safetensors"))
    cfg = json.loads((head_dir / "config.json").read_text())
    n = len(ids) - 1
    with torch.no_grad():
        expected, outputs = first_drafts(weights, cfg, lm_head, embeds[1:], hidden[:-1])
        # The chained step after pair 9: token 11 at position 10, reading pair 9's output.
        sees = torch.zeros(11, 11, dtype=torch.bool)
        sees[:10, :10] = torch.ones(10, 10).tril().bool()
        sees[10, :11] = True
        chained = reference_head(weights, cfg, lm_head, torch.cat([embeds[1:11], embeds[11:12]]),
                                 torch.cat([hidden[:10], outputs[9:10]]), torch.cat([torch.arange(10),
                                                                                     torch.tensor([10])]), sees)[0][10]
    attn = TorchAttention(KVBuffer(1, 32, 2, 16, torch.float32, "cpu"))
    slots = torch.arange(1, n + 2)

    def run(tokens, first, h):
        return head_step(head, attn, slots, tokens, first, h)

    with torch.inference_mode():
        logits, out = run(ids[1:11], 0, hidden[:10])
        got_chained = run([ids[11]], 10, out[9:10])[0]
        got = [logits] + [run([ids[i + 1]], i, hidden[i: i + 1])[0] for i in range(10, n)]
    assert torch.allclose(torch.cat(got), expected, atol=1e-4)
    assert torch.allclose(got_chained[0], chained, atol=1e-4)


_TREE = {"speculative_eagle_topk": 2, "speculative_num_steps": 3, "speculative_num_draft_tokens": 6}


# Each head and each shape by default; their other two pairings are slow.
@pytest.mark.parametrize("which, tree", [
    pytest.param("random", {}, id="random-chain"), pytest.param("fitted", _TREE, id="fitted-tree"),
    pytest.param("fitted", {}, id="fitted-chain", marks=slow),
    pytest.param("random", _TREE, id="random-tree", marks=slow)])
def test_greedy_identical_and_a_fitted_head_gets_its_drafts_kept(eagle3_target, eagle_heads, which, tree):
    texts = eagle_heads["texts"]
    requests = [(texts[0][:len(PROMPTS[0])], {**GREEDY, "max_new_tokens": 30}),
                (texts[1][:len(PROMPTS[1])], {**GREEDY, "max_new_tokens": 20, "logprobs": True,
                                               "top_logprobs": 3}),
                ([5, 17, 99], {**GREEDY, "max_new_tokens": 13}),
                (texts[0][:len(PROMPTS[0])], {**GREEDY, "max_new_tokens": 20, "presence_penalty": 0.5})]
    plain, got, metrics = with_and_without(eagle3_target, requests, spec(eagle_heads[which], **tree),
                                           {"torchao_config": "none", "page_size": 4})
    same(plain, got)
    assert metrics.spec_verify_steps > 0
    if which == "fitted":
        assert metrics.accepted_drafts() >= 0.6 * 30  # the first request's answer is the fitted text


# float32 slow: the tiny checkpoints' tests run in float32; here the embedded model's default 4-bit mode.
@pytest.mark.parametrize("mode,tol", [pytest.param({"torchao_config": "none"}, 1e-4, id="float32", marks=slow),
                                      pytest.param({}, 1e-6, id="4bit")])
def test_greedy_identical_on_the_embedded_model(default_model_dir, tmp_path, mode, tol):
    """In the default 4-bit mode the native layers keep the stream after
    the last layer, and the head projects with the tied embedding read
    from the checkpoint (the target's own projection is 4-bit)."""
    cfg = head_config(default_model_dir)
    head = save_head(tmp_path / "head", cfg, random_weights(cfg))
    metrics = assert_identical_on_the_embedded_model(default_model_dir, spec(head), mode, tol)
    assert metrics.spec_verify_steps > 0


def token_map(path: Path, ids) -> Path:
    torch.save(ids, path)  # SGLang's format: a torch.save'd list of token ids
    return path


def test_a_token_map_cuts_the_heads_vocabulary_projection_to_its_tokens(eagle3_target, eagle_heads, tmp_path):
    """The head with a map gives, in the target's vocabulary, the logits
    the head without one gives at the map's tokens and -inf at the others."""
    ids = repetitive(12)
    model, config = load_model(eagle3_target, torch.float32, "cpu")
    head_dir = eagle_heads["random"]
    hot = hot_ids(eagle3_target, [], size=64)[torch.randperm(64, generator=torch.Generator().manual_seed(0))]

    def logits(hot_tokens):
        head = load_eagle_head(head_dir, EagleConfig(head_dir), model.embed_tokens.weight, model.lm_head.weight,
                               model.norm, torch.float32, torch.device("cpu"), hot_tokens)
        attn = TorchAttention(KVBuffer(1, 32, 2, 16, torch.float32, "cpu"))
        hidden = torch.randn(len(ids), config.hidden_size, generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            out = head_step(head, attn, torch.arange(1, len(ids) + 1), ids, 0, hidden)[0]
            return out, head.target_logits(out, config.vocab_size)

    whole, _ = logits(None)
    draft, placed = logits(hot)
    assert draft.shape == (len(ids), 64)
    assert torch.allclose(placed[:, hot], whole[:, hot], atol=1e-5)
    outside = torch.ones(config.vocab_size, dtype=torch.bool)
    outside[hot] = False
    assert bool((placed[:, outside] == float("-inf")).all())


@pytest.mark.parametrize("holds_the_text", [True, False])
def test_greedy_identical_with_a_token_map_whose_tokens_alone_are_drafted(eagle3_target, eagle_heads, tmp_path,
                                                                          holds_the_text):
    """With the fitted head, a map holding the tokens of its text keeps
    most drafts; one without any of them keeps none (the head drafts only
    the map's tokens). The output is plain decoding's either way, a
    sampled request's too in distribution (not checked here)."""
    text = eagle_heads["texts"][0]
    others = [t for t in hot_ids(eagle3_target, [], size=600).tolist() if t not in set(text)][:300]
    ids = sorted(set(text)) + others if holds_the_text else others
    requests = [(text[:len(PROMPTS[0])], {**GREEDY, "max_new_tokens": 30}),
                (text[:len(PROMPTS[0])], {**GREEDY, "max_new_tokens": 12, "logprobs": True, "top_logprobs": 2})]
    extra = {"speculative_token_map": str(token_map(tmp_path / "map.pt", ids))}
    plain, got, metrics = with_and_without(eagle3_target, requests, spec(eagle_heads["fitted"], **extra),
                                           {"torchao_config": "none"})
    same(plain, got)
    assert metrics.spec_verify_steps > 0
    if holds_the_text:
        assert metrics.accepted_drafts() >= 0.6 * 30
    else:
        assert metrics.accepted_drafts() == 0


def test_what_cannot_run_is_refused_at_start(eagle3_target, eagle3_heads, tmp_path):
    def refused(head: Path, message: str):
        args = ServerArgs(model_path=str(eagle3_target), **spec(head)).resolved().split()
        with pytest.raises(ValueError, match=message):
            drafter_of(args.engine, args.model, eagle3_target, None, None)

    refused(eagle3_heads["random"], "is not an EAGLE head: its architectures are \\['LlamaForCausalLMEagle3'\\]")
    cfg = head_config(eagle3_target)
    refused(save_head(tmp_path / "two", {**cfg, "num_hidden_layers": 2}, random_weights(cfg)),
            "EAGLE heads of 2 decoder layers are not supported")
    weights = random_weights(cfg)
    del weights["fc.weight"]
    from pyserve.engine.engine import Engine

    with pytest.raises(ValueError, match="lacks \\['fc.weight'\\]"):
        Engine.from_args(ServerArgs(model_path=str(eagle3_target), torchao_config="none",
                                    **spec(save_head(tmp_path / "no-fc", cfg, weights))))


def test_a_token_map_that_cannot_be_used_is_refused_at_start(eagle3_target, eagle3_heads, eagle_heads, tmp_path):
    from pyserve.engine.engine import Engine

    vocab = json.loads((eagle3_target / "config.json").read_text())["vocab_size"]
    good = str(token_map(tmp_path / "good.pt", [1, 2, 3]))

    def refused(message: str, **options):
        args = ServerArgs(model_path=str(eagle3_target), torchao_config="none", **options)
        with pytest.raises(ValueError, match=message):
            Engine.from_args(args)

    refused("an EAGLE-3 head has a reduced one of its own", speculative_algorithm="EAGLE3",
            speculative_draft_model_path=str(eagle3_heads["random"]), speculative_token_map=good)
    refused("NGRAM drafts with no such head", speculative_algorithm="NGRAM", speculative_token_map=good)
    head = eagle_heads["random"]
    refused("is not a file", **spec(head, speculative_token_map=str(tmp_path / "missing.pt")))
    (tmp_path / "junk.pt").write_text("not a pickle")
    refused("is not a torch.save'd list of token ids", **spec(head, speculative_token_map=str(tmp_path / "junk.pt")))
    for name, ids, message in [("outside", [0, vocab], "outside the model's vocabulary of"),
                               ("negative", [-1, 4], "outside the model's vocabulary of"),
                               ("twice", [7, 8, 7], "names a token more than once"),
                               ("floats", torch.tensor([1.0, 2.0]), "it must be a non-empty list of token ids"),
                               ("empty", [], "it must be a non-empty list of token ids"),
                               ("nested", [[1, 2], [3, 4]], "it must be a non-empty list of token ids")]:
        refused(message, **spec(head, speculative_token_map=str(token_map(tmp_path / f"{name}.pt", ids))))


def test_the_cli_takes_sglangs_eagle_algorithm():
    args = ServerArgs.from_cli(["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/h",
                                "--speculative-num-steps", "3", "--speculative-eagle-topk", "4",
                                "--speculative-num-draft-tokens", "16"])
    assert (args.speculative_algorithm, args.speculative_eagle_topk) == ("EAGLE", 4)
    args = ServerArgs.from_cli(["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "/h",
                                "--speculative-token-map", "/maps/freq_32768.pt"])
    assert args.speculative_token_map == "/maps/freq_32768.pt"
