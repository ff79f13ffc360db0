"""Embedding throughput: pyserve's /v1/embeddings against sentence-transformers'
`encode`, on the same encoder, in one process.

A random checkpoint of all-MiniLM-L6-v2's shape (BERT: hidden 384, 6
layers, 12 heads, intermediate 1536, 512 positions, mean pooling and
Normalize; --shape bge-base: hidden 768, 12 layers, intermediate 3072) is
written with transformers' own classes and sentence-transformers' layout
(tests/encoder_models.py). --texts texts of 8 to --max-words words are
embedded:

  st       SentenceTransformer.encode, --batch-size texts a batch
  pyserve  the ASGI app in process, the texts in requests of --batch-size
           inputs, all sent at once (the engine batches them as it
           schedules prompts)

Each side runs --rounds times, alternating; reported are the medians in
texts per second and the pyserve / st ratio, and the largest difference
between the two sides' vectors. Float32 on this machine's CPU, torch on
every core for both.

    python bench/embeddings.py
    python bench/embeddings.py --shape bge-base --texts 256 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.encoder_models import WORDS, build_tiny_encoder  # noqa: E402

SHAPES = {
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    "bge-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
}


def texts(count: int, max_words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, max_words))) for _ in range(count)]


def run_st(model, inputs: list[str], batch_size: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    vectors = model.encode(inputs, batch_size=batch_size, convert_to_tensor=True)
    return time.perf_counter() - start, vectors


async def run_pyserve(app, inputs: list[str], batch_size: int) -> tuple[float, torch.Tensor]:
    from tests.test_api_handlers import call

    start = time.perf_counter()
    answers = await asyncio.gather(*(call(app, "POST", "/v1/embeddings", {"input": inputs[i : i + batch_size]})
                                     for i in range(0, len(inputs), batch_size)))
    elapsed = time.perf_counter() - start
    vectors = [entry["embedding"] for _, _, body in answers for entry in json.loads(body)["data"]]
    return elapsed, torch.tensor(vectors)


async def main(args: argparse.Namespace) -> None:
    from sentence_transformers import SentenceTransformer

    from pyserve.asgi import create_app

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_encoder(Path(tmp) / "model", "bert", pooling="mean", initializer_range=0.02,
                                       max_position_embeddings=512, **SHAPES[args.shape])
        st = SentenceTransformer(str(model_dir), device="cpu")
        app = create_app(model_path=str(model_dir), file_storage_path=str(Path(tmp) / "files"), dtype="float32",
                         log_level="warning")
        await app.startup()
        try:
            inputs = texts(args.texts, args.max_words)
            run_st(st, inputs[: args.batch_size], args.batch_size)  # warm-up
            await run_pyserve(app, inputs[: args.batch_size], args.batch_size)
            times = {"st": [], "pyserve": []}
            for _ in range(args.rounds):
                elapsed, st_vectors = run_st(st, inputs, args.batch_size)
                times["st"].append(elapsed)
                elapsed, our_vectors = await run_pyserve(app, inputs, args.batch_size)
                times["pyserve"].append(elapsed)
        finally:
            await app.shutdown()
    rate = {side: args.texts / statistics.median(t) for side, t in times.items()}
    print(f"{args.shape}, {args.texts} texts of 8-{args.max_words} words, batches of {args.batch_size}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds (median)")
    for side, value in rate.items():
        print(f"  {side:8s} {value:8.1f} texts/s")
    print(f"  pyserve / st: {rate['pyserve'] / rate['st']:.2f}x; "
          f"largest vector difference {(our_vectors - st_vectors).abs().max().item():.1e}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="minilm")
    p.add_argument("--texts", type=int, default=512)
    p.add_argument("--max-words", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
