"""What each CPU weight quantization costs in quality, against float32 on the same weights.

For every `--torchao-config` mode the model (the embedded one by default)
is loaded as the server loads it, and compared with its float32 self:

- perplexity on bench/data/quality_corpus.txt (about 1,000 words of
  prose, code, a letter and arithmetic written for this benchmark), in
  windows of --window tokens;
- greedy agreement over 50 prompts: float32 writes --new-tokens greedy
  tokens per prompt; each mode reads the same prompt + continuation and
  its argmax is compared with float32's token at every position. "same
  output" counts the prompts where all positions agree: there the mode's
  own greedy output is identical to float32's.

Every forward takes at most CHUNK tokens, one prompt at a time, so the
int4wo layers run the kernel that serving's decode steps run (from 512
rows, a long prompt's prefill, they multiply by a dense float32 copy
instead). 8da4w rounds its activations to 8 bits per block of 32 at
every row count, prefill and decode alike, and its Q4_1 products are
rust/kernels/block_gemm.rs's tiles in both.

Mixture-of-experts families: no MoE checkpoint of real weights is on this
machine, and random ones have no perplexity worth the name. With
--upcycled-moe E the model is first sparse-upcycled, as Mixtral was made:
a MixtralForCausalLM checkpoint whose every layer has E experts, each a
copy of that layer's MLP, top 2 under a random router. In float32 it is
the dense model exactly (the top 2 weights sum to 1); the quantized modes
then quantize E experts per layer from the checkpoint's bf16 weights. It
checks the experts' quantized path on real weights, not a trained
router's choices. The embedded model's weights are its GGUF's Q4_1 blocks
dequantized, so a copy requantizes to nearly those blocks; with
--permute-experts each expert's intermediate neurons come in another
order (the same function), which moves down's inputs into other blocks of
32: a second 4-bit rounding of weights already 4-bit.

With --kv-cache-dtypes, float32 weights are measured over a KV cache of
each dtype too (fp8_e4m3, fp8_e5m2: --kv-cache-dtype): the corpus's
windows are read CHUNK tokens at a time, each chunk attending over the
rounded keys and values of those before it.

Each mode's line ends with whether its perplexity is within 2% of
float32's (the bar the model families are held to).

    python bench/quality.py                       # none, int8wo, int4wo-32, 8da4w (the shipped groups), int4wo-64
    python bench/quality.py --model DIR --modes int8wo int4wo-128
    python bench/quality.py --modes --kv-cache-dtypes fp8_e4m3 fp8_e5m2   # float32 weights over an FP8 KV cache
    python bench/quality.py --upcycled-moe 4 --modes int8wo int4wo-32 8da4w [--permute-experts]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pyserve.model.attention.torch_backend import TorchAttention  # noqa: E402
from pyserve.model.forward_batch import ForwardBatch  # noqa: E402
from pyserve.model.kv_buffer import KV_CACHE_DTYPES, KVBuffer  # noqa: E402
from pyserve.model.loader import load_model  # noqa: E402
from pyserve.model.quant import parse_quant  # noqa: E402

CORPUS = Path(__file__).resolve().parent / "data" / "quality_corpus.txt"
CHUNK = 96  # tokens per forward: under Int4Linear.DENSE_FROM_ROWS (512 rows)
_SUBJECTS = ["the moon", "a rainforest", "the printing press", "volcanoes", "honey bees",
             "the Roman empire", "electric cars", "the human heart", "chess", "the ocean tides"]
_FRAMES = ["Write one sentence about {}.", "Here is a short fact about {}:", "Explain {} to a child.",
           "Three things to know about {}: 1.", "Q: Why is {} interesting?\nA:"]
PROMPTS = [frame.format(subject) for subject in _SUBJECTS for frame in _FRAMES]  # 50


class Sequences:
    """Sequences with their KV in one buffer; `logits` feeds each its next tokens."""

    def __init__(self, model, config, lengths: int, cache_dtype: torch.dtype | None = None):
        self.model = model
        kv = KVBuffer(config.num_hidden_layers, lengths + 1, config.num_key_value_heads, config.head_dim,
                      torch.float32, "cpu", cache_dtype=cache_dtype)
        self.attn = TorchAttention(kv)
        self.next_slot = 1  # slot 0 is the padding target
        self.slots: list[torch.Tensor] = []

    def logits(self, chunks: list[list[int]], every_position: bool = False) -> torch.Tensor:
        """Logits at each chunk's last token (or at all of them), in order."""
        if not self.slots:
            self.slots = [torch.empty(0, dtype=torch.long) for _ in chunks]
        ids, positions, fresh, wanted = [], [], [], []
        for i, tokens in enumerate(chunks):
            new = torch.arange(self.next_slot, self.next_slot + len(tokens))
            self.next_slot += len(tokens)
            positions += range(self.slots[i].numel(), self.slots[i].numel() + len(tokens))
            self.slots[i] = torch.cat([self.slots[i], new])
            fresh.append(new)
            first = len(ids)
            ids += tokens
            wanted += range(first, len(ids)) if every_position else [len(ids) - 1]
        batch = ForwardBatch.build(ids, positions, torch.cat(fresh), [len(t) for t in chunks], self.slots,
                                   wanted, all(len(t) == 1 for t in chunks), "cpu")
        with torch.inference_mode():
            return self.model(batch, self.attn)


def greedy(model, config, prompts: list[list[int]], n: int) -> list[list[int]]:
    seqs = Sequences(model, config, sum(map(len, prompts)) + n * len(prompts))
    outputs = [[t] for t in seqs.logits(prompts).argmax(-1).tolist()]
    for _ in range(n - 1):
        for out, t in zip(outputs, seqs.logits([[o[-1]] for o in outputs]).argmax(-1).tolist()):
            out.append(t)
    return outputs


def perplexity(model, config, tokens: list[int], window: int, cache_dtype: torch.dtype | None = None) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        piece = tokens[start : start + window + 1]
        seqs = Sequences(model, config, len(piece), cache_dtype)
        inputs = piece[:-1]
        logits = torch.cat([seqs.logits([inputs[i : i + CHUNK]], every_position=True)
                            for i in range(0, len(inputs), CHUNK)])
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(piece[1:]), reduction="sum").item()
        count += len(piece) - 1
    return math.exp(nll / count)


def agreement(model, config, prompts, continuations, cache_dtype=None) -> tuple[int, int, int]:
    """(positions whose argmax is float32's token, positions, prompts that agree everywhere)."""
    same = total = whole = 0
    for p, c in zip(prompts, continuations):
        logits = Sequences(model, config, len(p) + len(c), cache_dtype).logits(
            [p + c[:-1]], every_position=True)
        # The logits at the prompt's last token predict c[0], and so on.
        predicted = logits[len(p) - 1 : len(p) - 1 + len(c)].argmax(-1).tolist()
        hits = sum(a == b for a, b in zip(predicted, c))
        same, total, whole = same + hits, total + len(c), whole + (hits == len(c))
    return same, total, whole


def upcycle(model_dir: Path, out: Path, experts: int, permute: bool) -> Path:
    """The sparse-upcycled Mixtral checkpoint of a Llama-layout `model_dir` (see the docstring)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                  num_experts_per_tok=2, router_aux_loss_coef=0.0, sliding_window=None)
    g = torch.Generator().manual_seed(0)
    tensors, source = {}, load_file(model_dir / "model.safetensors")
    for name, t in source.items():
        found = name.split(".mlp.")
        if len(found) == 1:
            tensors[name] = t
            continue
        if not found[1].startswith("gate_proj"):
            continue
        layer = found[0]
        mlp = {k: source[f"{layer}.mlp.{k}_proj.weight"] for k in ("gate", "up", "down")}
        router = torch.randn(experts, t.shape[1], generator=g) * 0.02
        tensors[f"{layer}.block_sparse_moe.gate.weight"] = router.to(t.dtype)
        for e in range(experts):
            order = torch.randperm(t.shape[0], generator=g) if permute else torch.arange(t.shape[0])
            prefix = f"{layer}.block_sparse_moe.experts.{e}"
            tensors[f"{prefix}.w1.weight"] = mlp["gate"][order].contiguous()
            tensors[f"{prefix}.w3.weight"] = mlp["up"][order].contiguous()
            tensors[f"{prefix}.w2.weight"] = mlp["down"][:, order].contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    shutil.copy(model_dir / "tokenizer.json", out / "tokenizer.json")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--modes", nargs="*", default=["int8wo", "int4wo-32", "8da4w", "int4wo-64"])
    ap.add_argument("--kv-cache-dtypes", nargs="*", default=[], choices=sorted(KV_CACHE_DTYPES),
                    help="also float32 weights over a KV cache of each of these (--kv-cache-dtype)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--upcycled-moe", type=int, default=0, metavar="E",
                    help="measure the model sparse-upcycled into a Mixtral of E experts (see above)")
    ap.add_argument("--permute-experts", action="store_true", help="each upcycled expert's neurons in another order")
    args = ap.parse_args()
    if args.model is None:
        from pyserve.model.default_model import default_model_path

        args.model = str(default_model_path())
    if args.upcycled_moe:
        import tempfile

        source = Path(args.model)
        args.model = str(upcycle(source, Path(tempfile.mkdtemp()) / f"{source.name}-upcycled-{args.upcycled_moe}x",
                                 args.upcycled_moe, args.permute_experts))
    from pyserve._rust import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    corpus = tok.encode(CORPUS.read_text())
    prompts = [tok.encode(p) for p in PROMPTS]

    reference, config = load_model(args.model, torch.float32, "cpu")
    continuations = greedy(reference, config, prompts, args.new_tokens)
    rows = [("none (float32)", perplexity(reference, config, corpus, args.window), None)]
    del reference
    for mode in args.modes:
        start = time.perf_counter()
        model, config = load_model(args.model, torch.float32, "cpu", parse_quant(mode))
        rows.append((mode, perplexity(model, config, corpus, args.window),
                     agreement(model, config, prompts, continuations)))
        print(f"{mode}: measured in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    for name in args.kv_cache_dtypes:
        model, config = load_model(args.model, torch.float32, "cpu")
        cache = KV_CACHE_DTYPES[name]
        rows.append((f"KV {name}", perplexity(model, config, corpus, args.window, cache),
                     agreement(model, config, prompts, continuations, cache)))
    print(f"model {Path(args.model).name}; corpus {len(corpus)} tokens; {len(prompts)} prompts x "
          f"{args.new_tokens} greedy tokens of float32 as the reference; torch {torch.__version__}")
    print(f"{'mode':<18}{'perplexity':>11}{'vs float32':>12}{'greedy tokens agree':>21}{'same output':>13}"
          f"{'within 2%':>11}")
    base = rows[0][1]
    for mode, ppl, agree in rows:
        agree_text = "-" if agree is None else f"{100 * agree[0] / agree[1]:.1f}%"
        whole = "-" if agree is None else f"{agree[2]}/{len(prompts)}"
        within = "-" if agree is None else ("yes" if ppl <= 1.02 * base else "NO")
        print(f"{mode:<18}{ppl:>11.3f}{ppl / base:>11.3f}x{agree_text:>21}{whole:>13}{within:>11}")


if __name__ == "__main__":
    main()
