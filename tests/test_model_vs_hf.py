"""pyserve's model gives transformers' logits and greedy tokens.

Both run the same weights in float32. pyserve's side goes the way the
engine drives it: the real loader, the KV slot pool, the torch attention
backend and ForwardBatches, with a chunked prefill (the second chunk attends
over a cached prefix) and a batched decode of sequences of different lengths.
"""

from __future__ import annotations

import pytest
import torch

from pyserve.model.attention.torch_backend import TorchAttention
from pyserve.engine.kv.page_allocator import PageAllocator
from pyserve.model.kv_buffer import KVBuffer
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.loader import load_model
from pyserve.model.step_plan import TORCH_STEP, StepPlan
from tests.tiny_models import build_tiny_model

NEW_TOKENS = 16
# Where an attention backend other than torch's is asked for: the Triton
# kernels run on CUDA, or in Triton's interpreter on the CPU.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT_LENGTHS = [1, 2, 5, 9, 17, 3, 31, 8, 12, 24]


class CachedSequences:
    """Sequences whose KV lives in a KVBuffer; `forward` runs one step,
    decode steps as `decode_plan` says."""

    def __init__(self, model, config, num_slots: int = 2048, decode_plan: StepPlan = TORCH_STEP,
                 attention=None):
        """`attention`: builds the attention backend as attention(pool,
        config); default, the torch backend."""
        self.model = model
        self.device = next(model.parameters()).device
        self.decode_plan = decode_plan
        self.pool = KVBuffer(
            config.num_hidden_layers, num_slots, config.num_key_value_heads, config.head_dim, torch.float32, self.device
        )
        self.pages = PageAllocator(num_slots)
        self.attn = TorchAttention(self.pool) if attention is None else attention(self.pool, config)
        self.slots: dict[int, torch.Tensor] = {}

    def forward(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Feed each sequence (by id) its next tokens; logits [B, vocab] at
        every sequence's last new token, in `chunks` order. A step where every
        sequence adds one token is a decode step."""
        ids, positions, new_slots, logits_indices = [], [], [], []
        for seq, tokens in chunks.items():
            cached = self.slots.get(seq, torch.empty(0, dtype=torch.long))
            fresh = self.pages.alloc(len(tokens))
            self.slots[seq] = torch.cat([cached, fresh])
            ids += tokens
            positions += range(cached.numel(), cached.numel() + len(tokens))
            new_slots.append(fresh)
            logits_indices.append(len(ids) - 1)
        batch = ForwardBatch.build(
            input_ids=ids,
            positions=positions,
            out_cache_loc=torch.cat(new_slots),
            extend_lens=[len(t) for t in chunks.values()],
            slots=[self.slots[s] for s in chunks],
            logits_indices=logits_indices,
            is_decode=all(len(t) == 1 for t in chunks.values()),
            device=self.device,
        )
        with torch.inference_mode():
            return self.model(batch, self.attn, self.decode_plan if batch.is_decode else TORCH_STEP).cpu()


def random_prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def pyserve_greedy(model_dir, prompts: list[list[int]], new_tokens: int,
                   attention=None) -> tuple[torch.Tensor, list[list[int]]]:
    """(first-step logits [B, vocab], greedy tokens per prompt), attending with `attention` (CachedSequences)."""
    model, config = load_model(model_dir, torch.float32, "cpu" if attention is None else KERNEL_DEVICE)
    seqs = CachedSequences(model, config, attention=attention)
    # Chunked prefill: the first halves together, then the rest over that
    # cached prefix (one-token prompts have no first half).
    firsts = {i: p[: len(p) // 2] for i, p in enumerate(prompts) if len(p) // 2}
    seqs.forward(firsts)
    logits = seqs.forward({i: p[len(p) // 2 :] for i, p in enumerate(prompts)})
    first_logits = logits
    outputs = [[t] for t in logits.argmax(-1).tolist()]
    for _ in range(new_tokens - 1):
        logits = seqs.forward({i: [out[-1]] for i, out in enumerate(outputs)})
        for out, t in zip(outputs, logits.argmax(-1).tolist()):
            out.append(t)
    return first_logits, outputs


def hf_greedy(model_dir, prompts, new_tokens) -> tuple[torch.Tensor, list[list[int]]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # exactly new_tokens, EOS or not
    first_logits, outputs = [], []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            first_logits.append(model(ids).logits[0, -1])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
            outputs.append(gen[0, len(p) :].tolist())
    return torch.stack(first_logits), outputs


VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-sharded": ("llama", {"max_shard_size": "100KB"}),
    "llama3-rope-tied": ("llama", {"tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-linear-rope": ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    "mistral": ("mistral", {}),
    # Windows shorter than the prompts: every layer (Mistral, Phi-3), the layers from max_window_layers on (Qwen2).
    "mistral-sliding-window": ("mistral", {"sliding_window": 8}),
    "qwen2-sliding-layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "phi3-sliding-window": ("phi3", {"sliding_window": 8}),
    "qwen2-bias": ("qwen2", {}),
    "qwen2-yarn-rope": ("qwen2", {"rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    "qwen3-qk-norm": ("qwen3", {}),
    "phi3-fused-checkpoint": ("phi3", {}),
    "phi3-partial-rotary-tied": ("phi3", {"partial_rotary_factor": 0.5, "tie_word_embeddings": True}),
    "granite-multipliers": ("granite", {}),
    "olmo2-post-norms-all-heads-qk-norm": ("olmo2", {}),
    "glm4-partial-interleaved-rotary": ("glm4", {}),
    "smollm3-nope-layers": ("smollm3", {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_model_matches_transformers(tmp_path, variant):
    arch, overrides = VARIANTS[variant]
    model_dir = build_tiny_model(tmp_path, arch, **overrides)
    if "max_shard_size" in overrides:
        assert (model_dir / "model.safetensors.index.json").is_file()
    else:
        assert (model_dir / "model.safetensors").is_file()
    prompts = random_prompts(512)
    ours_logits, ours = pyserve_greedy(model_dir, prompts, NEW_TOKENS)
    hf_logits, theirs = hf_greedy(model_dir, prompts, NEW_TOKENS)
    torch.testing.assert_close(ours_logits, hf_logits, atol=1e-4, rtol=1e-4)
    assert ours == theirs


def test_embedded_model_matches_transformers(default_model_dir):
    """The real (bf16-stored) default model, upcast to float32 on both sides."""
    from pyserve._rust import Tokenizer

    tok = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    texts = ["The capital of France is", "def fibonacci(n):", "你好，世界", "Q: What is 2+2?\nA:"]
    prompts = [tok.encode(t) for t in texts]
    ours_logits, ours = pyserve_greedy(default_model_dir, prompts, 8)
    hf_logits, theirs = hf_greedy(default_model_dir, prompts, 8)
    torch.testing.assert_close(ours_logits, hf_logits, atol=1e-3, rtol=1e-4)
    assert ours == theirs
