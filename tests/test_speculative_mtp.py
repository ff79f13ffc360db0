"""NEXTN speculative decoding: the checkpoint's own multi-token-prediction
layer (GLM-4.5's and DeepSeek V3's `num_nextn_predict_layers`) drafting,
as SGLang runs `--speculative-algorithm NEXTN` (or EAGLE with no draft
path). A tiny GLM-4.5 that transformers writes, with an MTP layer the
test writes in the checkpoint's layout from transformers' own MtpModel:
pyserve's layer gives transformers' MtpModel's logits, greedy output is
identical to decoding without speculation, a layer fitted to the target's
text gets its drafts kept, and what cannot run is refused at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pyserve.engine.speculative.options import drafter_of
from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.layers.causal_lm import AuxCapture
from pyserve.model.loader import load_model
from pyserve.model.mtp_head import MtpConfig, load_mtp_head
from pyserve.server_args import ServerArgs
from tests.eagle3_heads import PROMPTS, greedy_continuations, head_step
from tests.slow import slow, slow_test
from tests.test_speculative import repetitive, same, with_and_without
from tests.tiny_models import build_tiny_model

GREEDY = {"temperature": 0, "ignore_eos": True}
LAYERS = 3  # the tiny target's; its MTP layer is layer 3 in the checkpoint


def transformers_models(model_dir: Path):
    """transformers' target and its MtpModel, which reads the MTP layer
    from the checkpoint (its patterns name the real checkpoints' layer
    numbers; the tiny one's is LAYERS)."""
    import transformers
    from transformers.modeling_layers import MtpModel

    main = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    return main, MtpModel.from_pretrained(main).eval()


def checkpoint_tensors(mtp) -> dict[str, torch.Tensor]:
    """An MtpModel's layer 0 under the names GLM-4.5's checkpoints give
    their MTP layer: model.layers.L.{enorm,hnorm,eh_proj,shared_head.norm}
    and the decoder layer's, one tensor per expert projection."""
    out = {}
    layer = mtp.layers[0]
    prefix = f"model.layers.{LAYERS}."
    for name, t in layer.state_dict().items():
        if name.startswith("post_norm."):
            out[prefix + "shared_head.norm." + name.removeprefix("post_norm.")] = t
        elif name == "mtp_block.mlp.experts.gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name == "mtp_block.mlp.experts.down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = t[e]
        elif name.startswith("mtp_block."):
            out[prefix + name.removeprefix("mtp_block.")] = t
        else:
            out[prefix + name] = t
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def with_mtp_layer(target: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of `target` whose checkpoint carries the MTP layer `tensors`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(target, out)
    weights = load_file(out / "model.safetensors")
    weights.update(tensors)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return out


def random_mtp_layer(target: Path, seed: int) -> dict[str, torch.Tensor]:
    """An MTP layer of random weights of the target's scale, as checkpoint tensors."""
    import transformers
    from transformers.modeling_layers import MtpModel

    main = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    main.config.num_mtp_layers = 1
    torch.manual_seed(seed)
    mtp = MtpModel(main, 1)
    with torch.no_grad():
        for name, p in mtp.layers.named_parameters():
            p.copy_(torch.rand_like(p) + 0.5 if "norm" in name else torch.randn_like(p) * 0.2)
        for name, b in mtp.layers.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.2)
    return checkpoint_tensors(mtp)


def target_hidden(main, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden states of `ids` (after the final norm)."""
    with torch.no_grad():
        return main(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]


def first_drafts(main, mtp, ids: list[int], hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' MTP logits of pair i (token i + 1, the target's last
    hidden state at i), which predicts token i + 2, for every pair of `ids`
    (the last one's token is past `ids`); and the target's last hidden
    states (`hidden`, when already computed)."""
    hidden = target_hidden(main, ids) if hidden is None else hidden
    x = torch.tensor([ids])
    out = mtp.forward_layer(0, hidden[:, :-1], torch.arange(len(ids) - 1)[None], None, input_ids=x[:, 1:])
    return mtp._project_to_logits(out)[0], hidden[0]


@pytest.fixture(scope="module")
def glm(tmp_path_factory, default_model_dir) -> dict:
    """A tiny GLM-4.5 without MTP layers, and the same with a random one."""
    root = tmp_path_factory.mktemp("glm-mtp")
    target = build_tiny_model(root / "target", "glm4_moe", tokenizer_dir=default_model_dir, num_hidden_layers=LAYERS)
    return {"target": target, "random": with_mtp_layer(target, root / "random", random_mtp_layer(target, seed=1))}


@pytest.fixture(scope="module")
def glm_fitted(glm, tmp_path_factory) -> Path:
    """The tiny GLM-4.5 with an MTP layer fitted to the target's greedy
    continuations of PROMPTS (checked to draft them right > 90% of the
    time)."""
    target = glm["target"]
    texts = [p + out for p, out in zip(PROMPTS, greedy_continuations(target, PROMPTS, 40))]
    main, mtp = transformers_models(glm["random"])
    hidden = [target_hidden(main, ids) for ids in texts]  # the target's, once: only the layer learns
    main.requires_grad_(False)  # its embedding and vocabulary projection, which the layer shares, stay as they are
    mtp.train()
    opt = torch.optim.Adam(mtp.layers.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: a second thread only waits
    try:
        for _ in range(120):
            loss = sum(F.cross_entropy(first_drafts(main, mtp, ids, h)[0][:-1], torch.tensor(ids[2:]))
                       for ids, h in zip(texts, hidden))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        for ids, h in zip(texts, hidden):
            right = first_drafts(main, mtp, ids, h)[0][:-1].argmax(-1) == torch.tensor(ids[2:])
            assert float(right.float().mean()) > 0.9
    return with_mtp_layer(target, tmp_path_factory.mktemp("glm-mtp-fitted") / "fitted", checkpoint_tensors(mtp))


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory, default_model_dir) -> Path:
    """A tiny DeepSeek V3 (multi-head latent attention) with a random MTP layer."""
    from tests.test_deepseek import VARIANTS, build_tiny_deepseek

    root = tmp_path_factory.mktemp("v3-mtp")
    version, overrides = VARIANTS["v3-q-lora-interleaved-yarn"]
    target = build_tiny_deepseek(root / "target", version, default_model_dir, num_hidden_layers=LAYERS,
                                 **overrides)
    return with_mtp_layer(target, root / "random", random_mtp_layer(target, seed=1))


def nextn(**extra) -> dict:
    return {"speculative_algorithm": "NEXTN", "speculative_num_steps": 3, "speculative_num_draft_tokens": 4, **extra}


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_the_layer_computes_what_transformers_mtp_model_computes(glm, deepseek_v3, family):
    """pyserve's MTP layer over the target's kept stream (through its final
    norm: transformers' last hidden state) gives transformers' MtpModel's
    logits, a prompt's pairs in one extend, then one position at a time:
    GLM-4.5's layer, and DeepSeek V3's with its latent attention."""
    model_dir = glm["random"] if family == "glm4_moe" else deepseek_v3
    ids = repetitive(14)
    model, config = load_model(model_dir, torch.float32, "cpu")
    head_config = MtpConfig(model_dir)
    head = load_mtp_head(model_dir, head_config, model.embed_tokens.weight, model.lm_head.weight, model.norm,
                         torch.float32, torch.device("cpu"))
    capture = AuxCapture(head_config.aux_layers(config.num_hidden_layers))
    pool = KVBuffer(config.num_hidden_layers, 32, config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
    from pyserve.model.forward_batch import ForwardBatch

    batch = ForwardBatch.build(ids, list(range(len(ids))), torch.arange(1, len(ids) + 1), [len(ids)],
                               [torch.arange(1, len(ids) + 1)], [len(ids) - 1], False, "cpu")
    with torch.inference_mode():
        model(batch, TorchAttention(pool), capture=capture)
    main, mtp = transformers_models(model_dir)
    with torch.no_grad():
        expected, hidden = first_drafts(main, mtp, ids)
    assert torch.allclose(head.target_features(capture.states), hidden, atol=1e-4)
    c = head_config.model
    attn = TorchAttention(KVBuffer(1, 32, c.num_key_value_heads, c.head_dim, torch.float32, "cpu"))
    slots = torch.arange(1, len(ids) + 1)
    n = len(ids) - 1
    with torch.inference_mode():
        logits, _ = head_step(head, attn, slots, ids[1:9], 0, hidden[:8])
        rest = [head_step(head, attn, slots, [ids[i + 1]], i, hidden[i:i + 1])[0] for i in range(8, n)]
    assert torch.allclose(torch.cat([logits, *rest]), expected, atol=1e-4)


@pytest.mark.parametrize("which", ["random", pytest.param("fitted", marks=slow), pytest.param("deepseek_v3", marks=slow)])
def test_greedy_identical_and_a_fitted_layer_gets_its_drafts_kept(glm, request, which):
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 30}),
                (PROMPTS[1], {**GREEDY, "max_new_tokens": 20, "logprobs": True, "top_logprobs": 3}),
                ([5, 17, 99], {**GREEDY, "max_new_tokens": 13})]
    model_dir = {"random": lambda: glm["random"], "fitted": lambda: request.getfixturevalue("glm_fitted"),
                 "deepseek_v3": lambda: request.getfixturevalue("deepseek_v3")}[which]()
    plain, got, metrics = with_and_without(model_dir, requests, nextn(), {"torchao_config": "none"})
    same(plain, got)
    assert metrics.spec_verify_steps > 0
    if which == "fitted":
        # The first request's answer is the fitted text: a step keeps its first draft (the
        # chained ones, from the layer's own output, were not fitted), about half the tokens.
        assert metrics.accepted_drafts() >= 0.4 * 30


def test_a_quantized_checkpoints_layer_is_read_as_its_dequantized_copy(glm, tmp_path):
    """A block-wise FP8 GLM-4.5, its (random) MTP layer's projections and
    experts quantized too: the layer gives the logits of the same layer
    read from the checkpoint's dequantized copy, and NEXTN's output is
    plain decoding's on the FP8 target."""
    from tests.test_quantized_checkpoints import FORMATS
    from tests.test_quantized_formats import dense_copy, write_quantized

    quantization, tensors_of, dequantize = FORMATS["fp8-block"]
    reference = write_quantized(glm["random"], tmp_path / "fp8", quantization, tensors_of, dequantize)
    dense_dir = dense_copy(glm["random"], tmp_path / "dense", reference)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert {f"model.layers.{LAYERS}.mlp.experts.3.down_proj.weight_scale_inv",
            f"model.layers.{LAYERS}.self_attn.q_proj.weight_scale_inv"} <= stored
    fp8, dense = layer_logits(dense_dir, [tmp_path / "fp8", dense_dir])
    torch.testing.assert_close(fp8, dense, atol=1e-5, rtol=0)
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 20})]
    plain, got, metrics = with_and_without(tmp_path / "fp8", requests, nextn(), {"torchao_config": "none"})
    same(plain, got)
    assert metrics.spec_verify_steps > 0


def layer_logits(target_dir: Path, layer_dirs: list[Path]) -> list[torch.Tensor]:
    """The logits of the MTP layer read from each of `layer_dirs` over
    `target_dir`'s embedding, vocabulary projection and final norm, on
    the same tokens and random hidden states."""
    model, config = load_model(target_dir, torch.float32, "cpu")
    hidden = torch.randn(6, config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = []
    for model_dir in layer_dirs:
        head_config = MtpConfig(model_dir)
        head = load_mtp_head(model_dir, head_config, model.embed_tokens.weight, model.lm_head.weight, model.norm,
                             torch.float32, torch.device("cpu"))
        c = head_config.model
        attn = TorchAttention(KVBuffer(1, 16, c.num_key_value_heads, c.head_dim, torch.float32, "cpu"))
        with torch.inference_mode():
            logits.append(head_step(head, attn, torch.arange(1, 8), repetitive(6), 0, hidden)[0])
    return logits


def test_a_directory_of_the_layer_alone_drafts_as_the_whole_checkpoint(glm, tmp_path):
    """SGLang's exported NextN checkpoints: --speculative-draft-model-path
    names a directory holding only the MTP layer (config.json and the
    layer's tensors) beside a target without one."""
    from safetensors.torch import load_file, save_file

    alone = tmp_path / "nextn"
    alone.mkdir()
    whole = load_file(glm["random"] / "model.safetensors")
    save_file({k: v for k, v in whole.items() if k.startswith(f"model.layers.{LAYERS}.")},
              str(alone / "model.safetensors"))
    shutil.copy(glm["random"] / "config.json", alone / "config.json")
    from_alone, from_whole = layer_logits(glm["target"], [alone, glm["random"]])
    assert torch.equal(from_alone, from_whole)
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 12})]
    plain, got, metrics = with_and_without(glm["target"], requests, nextn(speculative_draft_model_path=str(alone)),
                                           {"torchao_config": "none"})
    same(plain, got)
    assert metrics.spec_verify_steps > 0


@slow_test
def test_trees_of_the_layers_drafts(glm_fitted):
    """--speculative-eagle-topk above 1: the fitted layer's trees keep at
    least what its chains keep, and greedy output is plain decoding's."""
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 30}),
                ([5, 17, 99], {**GREEDY, "max_new_tokens": 13})]
    tree = nextn(speculative_eagle_topk=2, speculative_num_steps=3, speculative_num_draft_tokens=6)
    plain, got, metrics = with_and_without(glm_fitted, requests, tree, {"torchao_config": "none"})
    same(plain, got)
    assert metrics.accepted_drafts() >= 0.4 * 30


@slow_test
def test_eagle_without_a_draft_path_drafts_with_the_models_own_layer(glm_fitted):
    """SGLang's GLM-4.5 launch line: EAGLE, no --speculative-draft-model-path."""
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 30})]
    plain, got, metrics = with_and_without(glm_fitted, requests, nextn(speculative_algorithm="EAGLE"),
                                           {"torchao_config": "none"})
    same(plain, got)
    assert metrics.accepted_drafts() >= 0.4 * 30


def test_what_cannot_run_is_refused_at_start(glm, tmp_path):
    def refused(model_dir: Path, message: str, **options):
        args = ServerArgs(model_path=str(model_dir), torchao_config="none", **options).resolved().split()
        with pytest.raises(ValueError, match=message):
            drafter_of(args.engine, args.model, model_dir, None, None)

    refused(glm["target"], "needs --speculative-draft-model-path \\(or a model whose checkpoint carries", **nextn())
    refused(glm["target"], "has no multi-token-prediction layers", **nextn(speculative_draft_model_path=str(
        glm["target"])))
    torch.save([1, 2], tmp_path / "map.pt")
    from pyserve.engine.engine import Engine

    with pytest.raises(ValueError, match="the multi-token-prediction layer in .* projects onto the whole vocabulary"):
        Engine.from_args(ServerArgs(model_path=str(glm["random"]), torchao_config="none",
                                    **nextn(speculative_token_map=str(tmp_path / "map.pt"))))


def test_the_cli_takes_sglangs_nextn_line():
    args = ServerArgs.from_cli(["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
                                "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"])
    assert (args.speculative_algorithm, args.speculative_num_steps) == ("NEXTN", 3)


def test_the_layer_runs_with_the_targets_config_overrides(glm):
    """--json-model-override-args change the model and its MTP layer alike
    (the layer is the target's own), and greedy output stays plain decoding's."""
    import json

    overrides = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    config = MtpConfig(glm["random"], overrides)
    assert config.model.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.layer == MtpConfig(glm["random"], {"num_hidden_layers": 1}).layer  # the checkpoint's index
    requests = [(PROMPTS[0], {**GREEDY, "max_new_tokens": 16})]
    plain, got, _ = with_and_without(glm["random"], requests, nextn(),
                                     {"torchao_config": "none", "json_model_override_args": json.dumps(overrides)})
    same(plain, got)
