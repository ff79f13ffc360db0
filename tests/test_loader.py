"""The safetensors loader and the config reader, on checkpoints transformers wrote."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pyserve.model.families import SERVED_ARCHITECTURES, parse_config, read_config
from pyserve.model.loader import load_model
from tests.tiny_models import build_tiny_model


def checkpoint_tensors(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def assert_loaded_exactly(model, tensors: dict[str, torch.Tensor]) -> None:
    """Every checkpoint tensor sits where the model reads it, fused or not."""
    cfg = model.config
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    params = dict(model.named_parameters())
    for hf_name, tensor in tensors.items():
        name = hf_name.removeprefix("model.")
        rows = None
        for proj, fused, start, n in [
            ("q_proj", "qkv_proj", 0, q), ("k_proj", "qkv_proj", q, kv), ("v_proj", "qkv_proj", q + kv, kv),
            ("gate_proj", "gate_up_proj", 0, cfg.intermediate_size),
            ("up_proj", "gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        ]:
            if f".{proj}." in name:
                name, rows = name.replace(proj, fused), (start, n)
        loaded = params[name]
        if rows is not None:
            loaded = loaded.narrow(0, *rows)
        assert torch.equal(loaded, tensor.to(loaded.dtype)), hf_name


@pytest.mark.parametrize("arch,kwargs", [
    ("llama", {}),
    ("llama", {"max_shard_size": "100KB"}),
    ("qwen2", {}),
    ("qwen3", {"max_shard_size": "50KB"}),
])
def test_every_tensor_lands_in_place(tmp_path, arch, kwargs):
    model_dir = build_tiny_model(tmp_path, arch, **kwargs)
    model, config = load_model(model_dir, torch.float32, "cpu")
    assert config.architecture.lower().startswith(arch)
    assert not model.training
    assert all(not p.requires_grad and p.device.type == "cpu" for p in model.parameters())
    assert_loaded_exactly(model, checkpoint_tensors(model_dir))


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    single = build_tiny_model(tmp_path / "single", "llama")
    sharded = build_tiny_model(tmp_path / "sharded", "llama", max_shard_size="100KB")
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, _ = load_model(single, torch.float32, "cpu")
    b, _ = load_model(sharded, torch.float32, "cpu")
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_tied_embeddings(tmp_path):
    model_dir = build_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in checkpoint_tensors(model_dir)
    model, config = load_model(model_dir, torch.float32, "cpu")
    assert config.tie_word_embeddings and model.lm_head is None


def test_tied_checkpoint_that_also_stores_lm_head(tmp_path):
    model_dir = build_tiny_model(tmp_path, "llama", tie_word_embeddings=True)
    tensors = checkpoint_tensors(model_dir)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, model_dir / "model.safetensors")
    model, _ = load_model(model_dir, torch.float32, "cpu")
    assert model.lm_head is None


def test_casts_to_the_requested_dtype(tmp_path):
    model_dir = build_tiny_model(tmp_path, "qwen2")
    model, _ = load_model(model_dir, torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert_loaded_exactly(model, checkpoint_tensors(model_dir))


def test_missing_tensor_is_named(tmp_path):
    model_dir = build_tiny_model(tmp_path, "llama")
    tensors = checkpoint_tensors(model_dir)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing.*layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(model_dir, torch.float32, "cpu")


def test_missing_lm_head_of_untied_model(tmp_path):
    model_dir = build_tiny_model(tmp_path, "llama")
    tensors = checkpoint_tensors(model_dir)
    del tensors["lm_head.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(model_dir, torch.float32, "cpu")


def test_unexpected_tensor_is_named(tmp_path):
    model_dir = build_tiny_model(tmp_path, "llama")
    tensors = checkpoint_tensors(model_dir)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected.*tensor model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_model(model_dir, torch.float32, "cpu")


def test_shape_mismatch_is_an_error(tmp_path):
    model_dir = build_tiny_model(tmp_path, "llama")
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has shape"):
        load_model(model_dir, torch.float32, "cpu")


def test_index_naming_an_absent_shard(tmp_path):
    model_dir = build_tiny_model(tmp_path, "llama", max_shard_size="100KB")
    next(model_dir.glob("model-*.safetensors")).unlink()
    with pytest.raises(ValueError, match="not there"):
        load_model(model_dir, torch.float32, "cpu")


def test_no_weights_is_an_error(tmp_path):
    model_dir = build_tiny_model(tmp_path, "llama")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(model_dir, torch.float32, "cpu")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture") as refused:
        load_model(tmp_path, torch.float32, "cpu")
    assert all(arch in str(refused.value) for arch in SERVED_ARCHITECTURES)


# The config, as the families read it

BASE = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 8, "max_position_embeddings": 1024,
}


def test_config_defaults_and_derived_fields():
    c = parse_config(BASE)
    assert c.num_key_value_heads == 8 and c.head_dim == 8
    assert c.rope_theta == 10000.0 and c.rope_scaling is None
    assert not (c.attention_bias or c.o_proj_bias or c.mlp_bias or c.qk_norm or c.tie_word_embeddings)
    assert c.eos_token_ids == [] and c.bos_token_id is None


def test_config_eos_is_the_union_of_both_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, "eos_token_id": 5, "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5, 9]}))
    c = read_config(tmp_path)
    assert c.eos_token_ids == [5, 7, 9] and c.bos_token_id == 1
    assert parse_config({**BASE, "eos_token_id": [3, 4]}).eos_token_ids == [3, 4]


def test_config_architecture_specifics():
    qwen2 = parse_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.qk_norm
    qwen3 = parse_config({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.attention_bias
    llama = parse_config({**BASE, "attention_bias": True, "mlp_bias": True})
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias
    assert parse_config({**BASE, "torch_dtype": "bfloat16"}).torch_dtype == "bfloat16"
    assert parse_config({**BASE, "dtype": "float16"}).torch_dtype == "float16"


def test_config_rope_spellings():
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    # transformers 4: rope_theta at top level, rope_scaling with rope_type or type
    old = parse_config({**BASE, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama3}})
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "llama3", **llama3}
    legacy = parse_config({**BASE, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert legacy.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # transformers 5: everything under rope_parameters
    new = parse_config({**BASE, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}})
    assert new.rope_theta == 5e5 and new.rope_scaling == old.rope_scaling
    plain = parse_config({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None
    yarn = parse_config({**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def test_config_rejects_what_it_cannot_run():
    with pytest.raises(ValueError, match="dynamic"):
        parse_config({**BASE, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="gelu"):
        parse_config({**BASE, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="no config.json"):
        read_config("/nonexistent")


def test_a_sliding_window_keeps_the_models_context():
    """The window is served by the attention of the sliding layers, so the
    context stays the checkpoint's."""
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "max_position_embeddings": 32768}
    windowed = parse_config({**mistral, "sliding_window": 4096})
    assert windowed.max_position_embeddings == 32768 and windowed.sliding_window == 4096
    assert parse_config({**mistral, "sliding_window": None}).sliding_window is None
    qwen2 = {**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 512, "max_window_layers": 0}
    assert parse_config({**qwen2, "use_sliding_window": False}).sliding_layers == set()
    on = parse_config({**qwen2, "use_sliding_window": True})
    assert on.max_position_embeddings == 1024 and on.sliding_window == 512 and on.sliding_layers
