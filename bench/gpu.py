"""Decode speed on a GPU: Llama-shaped models with random bf16 weights.

For each model size: batch-1 decode ms/token with CUDA graphs on and off,
against the memory-bandwidth roofline (the bytes one decode step must read,
weights plus KV, over the HBM bandwidth measured here with a large
device-to-device copy); decode throughput at batch 64; and how far the
Triton backend's logits are from the torch backend's on the same batch.
The weights are random, built on the GPU from a ModelConfig: no checkpoint,
no download. With two GPUs or more, also decode tokens/s through the
engine at --tp-size 2 against 1 on each shape (bench/tensor_parallel.py,
from a random checkpoint written once: every rank loads its own slice).

    python bench/gpu.py                          # Llama 3.2 1B and Llama 3.1 8B shapes
    python bench/gpu.py --models 1b --json /tmp/gpu.json

A decode step is timed the way the engine runs one: build the ForwardBatch
from host lists, forward, greedy argmax, copy the tokens to the host.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pyserve.engine.runner.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from pyserve.model.attention.torch_backend import TorchAttention  # noqa: E402
from pyserve.model.attention.triton_backend import TritonAttention  # noqa: E402
from pyserve.model.config import ModelConfig  # noqa: E402
from pyserve.model.forward_batch import ForwardBatch  # noqa: E402
from pyserve.model.kv_buffer import KVBuffer  # noqa: E402
from pyserve.model.layers.causal_lm import CausalLM  # noqa: E402
from tests.test_attention_torch import reference_attention  # noqa: E402  the float64 reference the tests use

# Llama 3.2 1B and Llama 3.1 8B dimensions.
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
VOCAB = 128256
DTYPE = torch.bfloat16


def llama_config(name: str, context_len: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=VOCAB, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=None, max_position_embeddings=context_len, attention_bias=False, o_proj_bias=False,
        mlp_bias=False, qk_norm=None, torch_dtype="bfloat16", **SHAPES[name],
    )


def random_model(config: ModelConfig) -> CausalLM:
    """Built on the meta device, given GPU storage, filled in place."""
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(dtype=DTYPE).to_empty(device="cuda").requires_grad_(False).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    return model


def weight_bytes_per_step(model: CausalLM, config: ModelConfig) -> int:
    """Weight bytes a decode step reads: every parameter except the
    embedding table, of which it reads one row per token (unless the table
    is tied to the output projection, which reads it whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def hbm_bandwidth(nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Bytes/s of a large device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes * iters / seconds


class Decoder:
    """Sequences of random prompts in a KV pool, prefilled and decoded the
    way the engine drives the model. KV slots come from a counter."""

    def __init__(self, model, attention, graphs: CudaGraphRunner, vocab: int):
        self.model, self.attention, self.graphs, self.vocab = model, attention, graphs, vocab
        self.gen = torch.Generator().manual_seed(0)

    def start(self, batch_size: int, prompt_len: int, chunk_tokens: int = 8192) -> None:
        self.next_slot = 1
        self.lens = [prompt_len] * batch_size
        self.slots = [self._take(prompt_len) for _ in range(batch_size)]
        self.last = [0] * batch_size
        per_chunk = max(1, chunk_tokens // prompt_len)
        with torch.inference_mode():
            for first in range(0, batch_size, per_chunk):
                rows = list(range(first, min(first + per_chunk, batch_size)))
                ids = torch.randint(3, self.vocab, (len(rows) * prompt_len,), generator=self.gen).tolist()
                batch = ForwardBatch.build(
                    ids, list(range(prompt_len)) * len(rows), torch.cat([self.slots[r] for r in rows]),
                    [prompt_len] * len(rows), [self.slots[r] for r in rows],
                    [(i + 1) * prompt_len - 1 for i in range(len(rows))], is_decode=False, device="cuda",
                )
                for r, t in zip(rows, self.model(batch, self.attention).argmax(-1).tolist()):
                    self.last[r] = t

    def _take(self, n: int) -> torch.Tensor:
        self.next_slot += n
        return torch.arange(self.next_slot - n, self.next_slot)

    def decode_batch(self) -> ForwardBatch:
        """The next decode step of every sequence."""
        fresh = [self._take(1) for _ in self.lens]
        self.slots = [torch.cat([s, f]) for s, f in zip(self.slots, fresh)]
        positions = list(self.lens)
        self.lens = [n + 1 for n in self.lens]
        return ForwardBatch.build(
            self.last, positions, torch.cat(fresh), [1] * len(self.lens), self.slots,
            list(range(len(self.lens))), is_decode=True, device="cuda",
        )

    def step(self, use_graphs: bool) -> None:
        batch = self.decode_batch()
        with torch.inference_mode():
            if use_graphs:
                logits = self.graphs.replay(batch)
            else:
                logits = self.model(batch, self.attention)
            self.last = logits.argmax(-1).tolist()

    def replay_seconds(self, replays: int = 50) -> float:
        """GPU time of one graph replay, replays queued back to back with no
        host work between them: what a step costs once the scheduler's host
        work overlaps the GPU."""
        batch = self.decode_batch()
        with torch.inference_mode():
            self.graphs.replay(batch)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                self.graphs.replay(batch)  # rewrites the same KV slots each time
            end.record()
            end.synchronize()
        return start.elapsed_time(end) / 1e3 / replays

    def seconds_per_step(self, steps: int, use_graphs: bool, warmup: int = 3) -> float:
        for _ in range(warmup):
            self.step(use_graphs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            self.step(use_graphs)
        return (time.perf_counter() - start) / steps


def logits_agreement(decoder: Decoder, pool: KVBuffer, rows: int) -> dict:
    """One decode batch of `rows` sequences through the graph, eager Triton
    and eager torch attention; how far Triton's logits are from torch's."""
    decoder.lens, decoder.slots, decoder.last = decoder.lens[:rows], decoder.slots[:rows], decoder.last[:rows]
    batch = decoder.decode_batch()
    with torch.inference_mode():
        graph = decoder.graphs.replay(batch)
        eager = decoder.model(batch, decoder.attention)
        reference = decoder.model(batch, TorchAttention(pool))
    return {
        "rows": rows,
        "max_abs_diff_graph_vs_eager": (graph - eager).abs().max().item(),
        "max_abs_diff_triton_vs_torch": (eager - reference).abs().max().item(),
        "max_abs_logit": reference.abs().max().item(),
    }


def kernel_errors(config: ModelConfig, device: str = "cuda", seed: int = 0) -> dict:
    """Largest absolute error against float64 of one attention layer, Triton
    and torch backends, at the model's head shape in bfloat16: an extend over
    cached prefixes (one sequence has none), then a decode step."""
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    scale = dim**-0.5
    torch.manual_seed(seed)
    cached, added = [512, 0, 1500, 3], [64, 300, 200, 1]  # per sequence, before the decode token
    total = [c + a + 1 for c, a in zip(cached, added)]
    pool = KVBuffer(1, sum(total) + 1, kv_heads, dim, DTYPE, device)
    slots = (torch.randperm(sum(total)) + 1).split(total)  # scattered, as a busy pool hands them out
    keys = [torch.randn(n, kv_heads, dim).to(DTYPE) for n in total]
    values = [torch.randn(n, kv_heads, dim).to(DTYPE) for n in total]
    for s, k, v in zip(slots, keys, values):  # the cached prefixes (and the rest, rewritten by forward)
        pool.k_buffer[0][s.to(device)] = k.to(device)
        pool.v_buffer[0][s.to(device)] = v.to(device)
    backends = {"triton": TritonAttention(pool, heads, max(total)), "torch": TorchAttention(pool)}
    steps = {"extend": (cached, added), "decode": ([c + a for c, a in zip(cached, added)], [1] * len(total))}
    errors = {}
    for step, (first, lens) in steps.items():
        batch = ForwardBatch.build(
            [0] * sum(lens), torch.cat([torch.arange(f, f + n) for f, n in zip(first, lens)]),
            torch.cat([s[f : f + n] for s, f, n in zip(slots, first, lens)]), lens,
            [s[: f + n] for s, f, n in zip(slots, first, lens)], list(range(len(lens))),
            is_decode=step == "decode", device=device,
        )
        q = torch.randn(sum(lens), heads, dim).to(DTYPE)
        k = torch.cat([key[f : f + n] for key, f, n in zip(keys, first, lens)])
        v = torch.cat([val[f : f + n] for val, f, n in zip(values, first, lens)])
        qs = q.split(lens)
        expected = torch.cat([
            reference_attention(qs[i], keys[i][: f + n], values[i][: f + n], f, scale)
            for i, (f, n) in enumerate(zip(first, lens))
        ])
        for name, backend in backends.items():
            with torch.inference_mode():
                backend.prepare(batch)
                out = backend.forward(q.to(device), k.to(device), v.to(device), 0, batch, scale)
            errors[f"{step}_{name}"] = (out.cpu().double() - expected).abs().max().item()
    return errors


def bench_model(name: str, args, bandwidth: float) -> dict:
    config = llama_config(name, args.context_len)
    model = random_model(config)
    max_len = args.prompt_len + args.warmup + max(args.steps_bs1, args.steps_bs64) + 8
    pool = KVBuffer(config.num_hidden_layers, args.batch * max_len + 1, config.num_key_value_heads,
                  config.head_dim, DTYPE, "cuda")
    attention = TritonAttention(pool, config.num_attention_heads, args.context_len)
    start = time.perf_counter()
    graphs = CudaGraphRunner(model, attention, args.batch, args.context_len)
    capture_s = time.perf_counter() - start
    decoder = Decoder(model, attention, graphs, config.vocab_size)

    weight_bytes = weight_bytes_per_step(model, config)
    kv_bytes_per_token = KVBuffer.bytes_per_token(config.num_hidden_layers, config.num_key_value_heads,
                                               config.head_dim, DTYPE)
    # Mean context while timing: the prompt, the warm-up steps, half the timed steps.
    ctx_bs1 = args.prompt_len + args.warmup + args.steps_bs1 // 2
    ctx_batch = args.prompt_len + args.warmup + args.steps_bs64 // 2
    roofline_bs1 = (weight_bytes + ctx_bs1 * kv_bytes_per_token) / bandwidth
    roofline_batch = (weight_bytes + args.batch * ctx_batch * kv_bytes_per_token) / bandwidth

    result = {"model": name, "params": sum(p.numel() for p in model.parameters()),
              "weight_bytes_per_step": weight_bytes, "capture_s": capture_s,
              "graph_batch_sizes": graphs.batch_sizes}
    for use_graphs, key in ((True, "graph"), (False, "eager")):
        decoder.start(1, args.prompt_len)
        result[f"bs1_ms_{key}"] = decoder.seconds_per_step(args.steps_bs1, use_graphs, args.warmup) * 1e3
        if use_graphs:
            result["bs1_ms_replay"] = decoder.replay_seconds() * 1e3
        decoder.start(args.batch, args.prompt_len)
        step_s = decoder.seconds_per_step(args.steps_bs64, use_graphs, args.warmup)
        result[f"batch_tok_s_{key}"] = args.batch / step_s
        if use_graphs:
            result["batch_tok_s_replay"] = args.batch / decoder.replay_seconds()
    result["bs1_roofline_ms"] = roofline_bs1 * 1e3
    result["bs1_roofline_pct"] = 100 * result["bs1_roofline_ms"] / result["bs1_ms_graph"]
    result["batch_roofline_tok_s"] = args.batch / roofline_batch
    result["graph_speedup_bs1"] = result["bs1_ms_eager"] / result["bs1_ms_graph"]
    result["graph_speedup_batch"] = result["batch_tok_s_graph"] / result["batch_tok_s_eager"]
    result["logits"] = logits_agreement(decoder, pool, rows=8)
    result["kernel_errors"] = kernel_errors(config)
    del decoder, graphs, attention, pool, model
    torch.cuda.empty_cache()
    return result


ROWS = [
    ("parameters (B)", lambda r: f"{r['params'] / 1e9:.2f}"),
    ("weight GB read per step", lambda r: f"{r['weight_bytes_per_step'] / 1e9:.2f}"),
    ("bs=1 roofline ms/token", lambda r: f"{r['bs1_roofline_ms']:.2f}"),
    ("bs=1 ms/token, CUDA graph", lambda r: f"{r['bs1_ms_graph']:.2f}"),
    ("bs=1 ms/token, eager", lambda r: f"{r['bs1_ms_eager']:.2f}"),
    ("bs=1 ms/token, graph replays only", lambda r: f"{r['bs1_ms_replay']:.2f}"),
    ("bs=1 % of roofline (graph)", lambda r: f"{r['bs1_roofline_pct']:.0f}%"),
    ("bs=1 % of roofline (replays only)", lambda r: f"{100 * r['bs1_roofline_ms'] / r['bs1_ms_replay']:.0f}%"),
    ("bs=1 graph speed-up", lambda r: f"{r['graph_speedup_bs1']:.2f}x"),
    ("bs={batch} tok/s, CUDA graph", lambda r: f"{r['batch_tok_s_graph']:.0f}"),
    ("bs={batch} tok/s, eager", lambda r: f"{r['batch_tok_s_eager']:.0f}"),
    ("bs={batch} tok/s, graph replays only", lambda r: f"{r['batch_tok_s_replay']:.0f}"),
    ("bs={batch} roofline tok/s", lambda r: f"{r['batch_roofline_tok_s']:.0f}"),
    ("graph capture s", lambda r: f"{r['capture_s']:.1f}"),
    ("attn max err extend, triton", lambda r: f"{r['kernel_errors']['extend_triton']:.2g}"),
    ("attn max err extend, torch", lambda r: f"{r['kernel_errors']['extend_torch']:.2g}"),
    ("attn max err decode, triton", lambda r: f"{r['kernel_errors']['decode_triton']:.2g}"),
    ("attn max err decode, torch", lambda r: f"{r['kernel_errors']['decode_torch']:.2g}"),
    ("max |logit diff| graph vs eager", lambda r: f"{r['logits']['max_abs_diff_graph_vs_eager']:.2g}"),
    ("max |logit diff| triton vs torch", lambda r: f"{r['logits']['max_abs_diff_triton_vs_torch']:.2g}"),
    ("max |logit|", lambda r: f"{r['logits']['max_abs_logit']:.3g}"),
]


def format_table(report: dict) -> str:
    results = report["results"]
    lines = [
        f"{report['gpu']}, torch {report['torch']}, {report['date']}",
        f"HBM bandwidth (device-to-device copy): {report['hbm_bandwidth_gb_s']:.0f} GB/s; "
        f"prompt {report['prompt_len']} tokens, bfloat16, random weights",
    ]
    labels = [label.format(batch=report["batch"]) for label, _ in ROWS]
    width = max(map(len, labels)) + 2
    lines.append("".ljust(width) + "".join(f"{r['model']:>12}" for r in results))
    for label, (_, fmt) in zip(labels, ROWS):
        lines.append(label.ljust(width) + "".join(f"{fmt(r):>12}" for r in results))
    return "\n".join(lines)


def tensor_parallel_rows(models: list[str]) -> dict:
    """Decode tokens/s through the engine at --tp-size 2 vs 1 (bench/tensor_parallel.py),
    each shape written once as a random checkpoint; needs two GPUs."""
    if torch.cuda.device_count() < 2:
        print("tensor parallelism: skipped, it needs two GPUs (see bench/tensor_parallel.py for CPU figures)")
        return {}
    import tempfile

    from tensor_parallel import compare, format_rows, random_checkpoint

    rows = {}
    for name in models:
        with tempfile.TemporaryDirectory() as scratch:
            best = compare(str(random_checkpoint(SHAPES[name], Path(scratch))), "cuda", rounds=2)
        print(f"{name}: decode at --tp-size 2 vs 1 (engine, 32-token prompts, 64 output tokens)")
        print(format_rows(best))
        rows[name] = {f"tp{tp}": rates for tp, rates in best.items()}
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["1b", "8b"], choices=sorted(SHAPES))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=64, help="the throughput batch, also the largest CUDA graph")
    p.add_argument("--steps-bs1", type=int, default=100, help="timed batch-1 decode steps")
    p.add_argument("--steps-bs64", type=int, default=30, help="timed decode steps of the large batch")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--context-len", type=int, default=2048)
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    bandwidth = hbm_bandwidth()
    report = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": datetime.date.today().isoformat(), "hbm_bandwidth_gb_s": bandwidth / 1e9,
        "prompt_len": args.prompt_len, "batch": args.batch,
        "results": [bench_model(name, args, bandwidth) for name in args.models],
    }
    print(format_table(report))
    report["tensor_parallel"] = tensor_parallel_rows(args.models)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
