"""EAGLE-3 draft heads for tiny targets, written in SGLang's checkpoint
format (config.json naming LlamaForCausalLMEagle3, safetensors with
`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`): a random one, and one
trained here on the target's own greedy text.

`reference_head` is the head's forward pass written from the format's
definition (SGLang's llama_eagle3.py), independent of pyserve's: pair i
reads the embedding of token i + 1 and the target's hidden states at
position i (those entering the chosen layers, through `fc`), attends
causally over pairs 0..i, and predicts token i + 2 (`first_drafts`); the
chained step after it reads token i + 2 and pair i's output hidden state
at position i + 1 and predicts token i + 3 (`second_drafts`).

`tiny_target_heads` makes the random and fitted heads of the four-layer
tiny target that the EAGLE3 tests share (conftest.py: once a session).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from tests.test_speculative import collect, repetitive, started

HEAD_INTERMEDIATE = 96
AUX_IDS = [0, 1, 2]  # the tiny target's: outputs of layers 0..2, entering layers 1..3
AUX_LAYERS = [1, 2, 3]
PROMPTS = [repetitive(), repetitive(33)]


def head_config(target_dir: Path, draft_vocab: int, aux_layer_ids: list[int] | None, **overrides) -> dict:
    target = json.loads((target_dir / "config.json").read_text())
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": target["hidden_size"], "intermediate_size": HEAD_INTERMEDIATE, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": target["rms_norm_eps"],
        "rope_theta": 10000.0, "rope_scaling": None, "max_position_embeddings": 2048,
        "vocab_size": target["vocab_size"], "draft_vocab_size": draft_vocab, "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    cfg.update(overrides)
    return cfg


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights of the checkpoint's names and shapes, as build_tiny_model draws them."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vd = cfg["hidden_size"], cfg["intermediate_size"], cfg["draft_vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {
        "fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q), "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
        "lm_head.weight": (vd, h),
    }
    w = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}
    for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.post_attention_layernorm.weight", "norm.weight"):
        w[name] = torch.rand(h, generator=g) + 0.5
    return w


def save_head(out: Path, cfg: dict, weights: dict[str, torch.Tensor], hot_ids: torch.Tensor,
              target_vocab: int) -> Path:
    """config.json and model.safetensors; d2t[i] = hot_ids[i] - i, t2d the mask of hot ids."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in weights.items()}
    tensors["d2t"] = hot_ids - torch.arange(len(hot_ids))
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[hot_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(x, positions, theta, head_dim):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions[:, None].float() * inv[None]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    half = head_dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def reference_head(w: dict, cfg: dict, embeds: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
                   sees: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft-vocabulary logits [n, draft vocab] and output hidden states
    (the residual stream before the final norm) of n pairs: `embeds`
    [n, hidden] of their tokens, `h` [n, hidden] their hidden states (the
    target's through `fc_of`, or the head's own output), at `positions`;
    pair r attends to the pairs where sees[r] is True."""
    eps = cfg["rms_norm_eps"]
    x = torch.cat([_rms(embeds, w["midlayer.input_layernorm.weight"], eps),
                   _rms(h, w["midlayer.hidden_norm.weight"], eps)], dim=-1)
    out = reference_layer(w, "midlayer.", cfg, x, h, positions, sees)
    return _rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T, out


def reference_layer(w: dict, prefix: str, cfg: dict, x: torch.Tensor, residual: torch.Tensor,
                    positions: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
    """A draft head's decoder layer (weights under `prefix`), from its
    definition: attention over `x` (its rows at `positions`, row r seeing
    the rows where sees[r] is True) added to `residual`, then the MLP of
    that stream, normed, added to it; the layer's output stream."""
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = x.shape[0]
    q = _rotate((x @ w[prefix + "self_attn.q_proj.weight"].T).view(n, nh, d), positions, cfg["rope_theta"], d)
    k = _rotate((x @ w[prefix + "self_attn.k_proj.weight"].T).view(n, nkv, d), positions, cfg["rope_theta"], d)
    v = (x @ w[prefix + "self_attn.v_proj.weight"].T).view(n, nkv, d)
    k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
    att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=sees)
    residual = residual + att.transpose(0, 1).reshape(n, nh * d) @ w[prefix + "self_attn.o_proj.weight"].T
    m = _rms(residual, w[prefix + "post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    m = (F.silu(m @ w[prefix + "mlp.gate_proj.weight"].T) * (m @ w[prefix + "mlp.up_proj.weight"].T)) \
        @ w[prefix + "mlp.down_proj.weight"].T
    return m + residual


def head_step(head, attn, slots: torch.Tensor, tokens: list[int], first: int, hidden: torch.Tensor):
    """pyserve's `head` over `tokens` at positions first.. (one sequence
    whose slots are `slots`), reading `hidden`: its logits and output
    hidden state at every one of them."""
    from pyserve.model.forward_batch import ForwardBatch

    m = len(tokens)
    batch = ForwardBatch.build(tokens, list(range(first, first + m)), slots[first: first + m], [m],
                               [slots[: first + m]], list(range(m)), m == 1, "cpu")
    return head(batch.input_ids, hidden, batch, attn)


def fc_of(w: dict, hidden: torch.Tensor) -> torch.Tensor:
    """The target's concatenated hidden states [n, 3 * hidden] as the head reads them."""
    return hidden @ w["fc.weight"].T


def first_drafts(w: dict, cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, output hidden states) of the pairs of a text: pair i at
    position i reads token i + 1 (`embeds`) and the target's hidden states
    at i (`hidden`), attends causally and predicts token i + 2."""
    n = embeds.shape[0]
    return reference_head(w, cfg, embeds, fc_of(w, hidden), torch.arange(n), torch.ones(n, n).tril().bool())


def second_drafts(w: dict, cfg: dict, embeds: torch.Tensor, hidden: torch.Tensor, outputs: torch.Tensor
                  ) -> torch.Tensor:
    """Logits of the chained step after each pair i but the last: at
    position i + 1, reading token i + 2 (`embeds`, one row ahead of the
    pairs') and pair i's output hidden state, attending to pairs 0..i and
    itself (as drafting does, before pair i + 1 exists)."""
    n = embeds.shape[0]
    m = n - 1
    sees = torch.zeros(n + m, n + m, dtype=torch.bool)
    sees[:n, :n] = torch.ones(n, n).tril().bool()
    sees[n:, :m] = torch.ones(m, m).tril().bool()
    sees[n + torch.arange(m), n + torch.arange(m)] = True
    h = torch.cat([fc_of(w, hidden), outputs[:m]])
    positions = torch.cat([torch.arange(n), torch.arange(1, n)])
    return reference_head(w, cfg, torch.cat([embeds, embeds[1:]]), h, positions, sees)[0][n:]


def target_features(target_dir: Path, ids: list[int], aux_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's (embeddings [n, hidden], hidden states entering
    `aux_layers` concatenated [n, 3 * hidden]) of the tokens `ids`, by transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        embeds = model.get_input_embeddings()(torch.tensor(ids))
    # hidden_states[i] enters layer i (0: the embeddings).
    return embeds, torch.cat([out.hidden_states[i][0] for i in aux_layers], dim=-1)


def trained_weights(target_dir: Path, cfg: dict, texts: list[list[int]], hot_ids: torch.Tensor,
                    aux_layers: list[int], steps: int = 120, seed: int = 0) -> dict[str, torch.Tensor]:
    """A head fitted to each of `texts`: pair i's first draft to token
    i + 2, the chained draft after it to token i + 3 (EAGLE-3's
    training-time test, two steps deep)."""
    to_draft = {int(t): i for i, t in enumerate(hot_ids)}
    data = []
    for ids in texts:
        embeds, hidden = target_features(target_dir, ids, aux_layers)
        labels = torch.tensor([to_draft[t] for t in ids[2:]])
        data.append((embeds[1:-1], hidden[:-2], labels))
    w = {k: v.clone().requires_grad_() for k, v in random_weights(cfg, seed).items()}
    opt = torch.optim.Adam(w.values(), lr=3e-3)
    # One thread: on these tiny tensors a second one only waits for the
    # first (on 2 busy cores 35-135 s against 1.3 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            loss = 0.0
            for e, h, y in data:
                logits, outputs = first_drafts(w, cfg, e, h)
                loss = loss + F.cross_entropy(logits, y) + F.cross_entropy(second_drafts(w, cfg, e, h, outputs), y[1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach() for k, v in w.items()}


def head_accuracy(target_dir: Path, cfg: dict, w: dict, ids: list[int], hot_ids: torch.Tensor,
                  aux_layers: list[int]) -> tuple[float, float]:
    """How often the head's first and chained drafts are right on `ids`, given right earlier drafts."""
    embeds, hidden = target_features(target_dir, ids, aux_layers)
    with torch.no_grad():
        logits, outputs = first_drafts(w, cfg, embeds[1:-1], hidden[:-2])
        second = second_drafts(w, cfg, embeds[1:-1], hidden[:-2], outputs)
    truth = torch.tensor(ids[2:])
    return (float((hot_ids[logits.argmax(-1)] == truth).float().mean()),
            float((hot_ids[second.argmax(-1)] == truth[1:]).float().mean()))


def vocab_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def hot_ids(model_dir: Path, must: list[int], size: int = 256) -> torch.Tensor:
    """A draft vocabulary of `size` target ids, sorted: `must` and random
    others (so d2t is no identity)."""
    g = torch.Generator().manual_seed(3)
    must = set(must)
    extra = [t for t in torch.randperm(vocab_size(model_dir), generator=g).tolist() if t not in must]
    return torch.tensor(sorted(must | set(extra[: size - len(must)])))


def greedy_continuations(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """The model's `n` greedy tokens after each prompt, by pyserve in float32."""
    async def main():
        engine = await started(model_dir, torchao_config="none")
        try:
            return [(await collect(engine, ids, temperature=0, ignore_eos=True, max_new_tokens=n))[1]
                    for ids in prompts]
        finally:
            await engine.shutdown()
    return asyncio.run(main())


def tiny_target_heads(target: Path, root: Path) -> dict:
    """A random head, and one fitted to the target's greedy continuations
    of PROMPTS (checked to draft them right > 90% of the time), each with a
    draft vocabulary of 256 tokens mapped through d2t; and those texts."""
    texts = [p + out for p, out in zip(PROMPTS, greedy_continuations(target, PROMPTS, 40))]
    hot = hot_ids(target, [t for text in texts for t in text])
    cfg = head_config(target, len(hot), AUX_IDS)
    random_dir = save_head(root / "random", cfg, random_weights(cfg, seed=1), hot, vocab_size(target))
    fitted = trained_weights(target, cfg, texts, hot, AUX_LAYERS)
    assert min(min(head_accuracy(target, cfg, fitted, t, hot, AUX_LAYERS)) for t in texts) > 0.9
    return {"random": random_dir, "fitted": save_head(root / "fitted", cfg, fitted, hot, vocab_size(target)),
            "texts": texts}
