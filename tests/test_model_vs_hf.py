"""Greedy tokens from pyserve's model equal Hugging Face transformers'.

Both run the same weights in float32. pyserve's side goes through the real
loader, the KV slot pool and the torch attention backend, prefilling all
prompts in one batch and then decoding them together.
"""

from __future__ import annotations

import pytest
import torch

from pyserve.engine.attention.torch_backend import TorchAttention
from pyserve.engine.kv_pool import KVPool
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.loader import load_model
from tests.tiny_models import build_tiny_model

NEW_TOKENS = 12


def random_prompts(vocab: int, count: int = 10, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 5, 9, 17, 3, 31, 8, 12, 24][:count]
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def pyserve_greedy(model_dir, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    model, cfg = load_model(model_dir, torch.float32, "cpu")
    pool = KVPool(cfg.num_hidden_layers, 4096, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    attn = TorchAttention(pool)
    slots = [torch.empty(0, dtype=torch.long) for _ in prompts]
    seqs = [list(p) for p in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    pending = [list(p) for p in prompts]  # tokens whose KV is not cached yet
    with torch.inference_mode():
        for step in range(new_tokens):
            ids, pos, new_slots, kv, logit_idx = [], [], [], [], []
            for i, toks in enumerate(pending):
                start = slots[i].numel()
                fresh = pool.alloc(len(toks))
                slots[i] = torch.cat([slots[i], fresh])
                ids += toks
                pos += range(start, start + len(toks))
                new_slots.append(fresh)
                kv.append(slots[i])
                logit_idx.append(len(ids) - 1)
            batch = ForwardBatch(
                input_ids=torch.tensor(ids), positions=torch.tensor(pos),
                out_cache_loc=torch.cat(new_slots), extend_lens=[len(t) for t in pending],
                seq_lens=[s.numel() for s in slots], kv_indices=kv,
                logits_indices=torch.tensor(logit_idx), is_decode=step > 0,
            )
            next_ids = model(batch, attn).argmax(-1).tolist()
            for i, t in enumerate(next_ids):
                outputs[i].append(t)
                seqs[i].append(t)
            pending = [[t] for t in next_ids]
    return outputs


def hf_greedy(model_dir, prompts, new_tokens) -> list[list[int]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # generate exactly new_tokens, EOS included
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out


VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "llama-sharded": ("llama", {"max_shard_size": "100KB"}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_model_greedy_matches_transformers(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    model_dir = build_tiny_model(tmp_path, arch, **overrides)
    if variant == "llama-sharded":
        assert (model_dir / "model.safetensors.index.json").is_file()
    prompts = random_prompts(512)
    assert pyserve_greedy(model_dir, prompts, NEW_TOKENS) == hf_greedy(model_dir, prompts, NEW_TOKENS)


def test_embedded_model_greedy_matches_transformers(default_model_dir):
    from pyserve._rust import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    texts = [
        "The capital of France is", "def fibonacci(n):", "List 3 countries and their capitals.",
        "Once upon a time", "1, 2, 3, 4,", "Write a short story about a space explorer.",
        "你好，世界", "The quick brown fox", "import numpy as np\n", "Q: What is 2+2?\nA:",
    ]
    prompts = [tok.encode(t) for t in texts]
    assert pyserve_greedy(default_model_dir, prompts, 8) == hf_greedy(default_model_dir, prompts, 8)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        load_model(tmp_path, torch.float32, "cpu")
