"""Embeddings (--is-embedding, POST /v1/embeddings) on tiny Qwen3 embedding
models laid out as Qwen3-Embedding is, checked against sentence-transformers
(a dev dependency) on the same weights, float32: the engine's vectors in
batches and alone, over the prefix cache, and the route through the
official openai client. The tiny models are built here, so nothing is
downloaded."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from starlette.testclient import TestClient

from pyserve.api.app import App
from pyserve.asgi import create_app
from pyserve.api.generation.serving import ServingContext
from pyserve.engine.engine import Engine
from pyserve.engine.request import GenerateRequest, SamplingParams
from pyserve.server_args import ServerArgs
from tests.tiny_models import ST_POOLINGS, build_tiny_embedding_model

TOL = 1e-5
TEXTS = [
    "hello",
    "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun by the river.",
    "Embeddings map text to vectors.",
    " ".join(["a long sentence about nothing in particular"] * 6),
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, default_model_dir):
    """One tiny model per pooling; the last-token one (Qwen3-Embedding's) declares Matryoshka sizes."""
    out = {}
    for pooling in ST_POOLINGS:
        extra = {"matryoshka_dimensions": [16, 32]} if pooling == "lasttoken" else {}
        out[pooling] = build_tiny_embedding_model(tmp_path_factory.mktemp(f"tiny-embed-{pooling}"),
                                                  default_model_dir, pooling=pooling, **extra)
    return out


def by_hand(model_dir, texts: list[str], pooling: str) -> torch.Tensor:
    """transformers' last hidden state, one text at a time, pooled and L2
    normalised by hand: what each pooling's name promises."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    vectors = []
    with torch.inference_mode():
        for text in texts:
            hidden = model(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
            vectors.append({"lasttoken": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[pooling])
    return F.normalize(torch.stack(vectors), dim=-1)


def reference(model_dir, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' vectors, with the pooling the model's files declare."""
    return SentenceTransformer(str(model_dir), device="cpu", local_files_only=True).encode(
        texts, convert_to_tensor=True).float()


def make_engine(model_dir, **options) -> Engine:
    return Engine.from_args(ServerArgs(model_path=str(model_dir), is_embedding=True, max_total_tokens=4096, **options))


async def embed(engine: Engine, prompts: list[list[int]]) -> list[tuple[torch.Tensor, int]]:
    """(vector, cached tokens) per prompt, all submitted at once."""

    async def one(ids):
        async for out in engine.generate(GenerateRequest(ids, SamplingParams(max_new_tokens=None), embedding=True)):
            if out.finished:
                return out.embedding, out.cached_tokens

    return await asyncio.gather(*[one(p) for p in prompts])


def run_engine(model_dir, work, **options):
    """Start an engine on `model_dir`, await work(engine), check every KV page is accounted for."""

    async def main():
        engine = make_engine(model_dir, **options)
        await engine.start()
        try:
            return await work(engine)
        finally:
            assert engine.integrity_problem() is None
            await engine.shutdown()

    return asyncio.run(main())


@pytest.mark.parametrize("pooling", ST_POOLINGS)
def test_engine_matches_sentence_transformers(model_dirs, pooling):
    """Chunks of 16 tokens: the long texts are pooled over several steps."""
    model_dir = model_dirs[pooling]

    async def work(engine):
        return await embed(engine, [engine.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS])

    got = torch.stack([v for v, _ in run_engine(model_dir, work, chunked_prefill_size=16)])
    torch.testing.assert_close(got, reference(model_dir, TEXTS), atol=TOL, rtol=0)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=TOL)


def test_an_untied_model_saved_without_its_lm_head_loads(tmp_path, default_model_dir):
    """Qwen3-Embedding-4B/8B: untied embeddings, and no lm_head in the checkpoint."""
    model_dir = build_tiny_embedding_model(tmp_path / "untied", default_model_dir, tied=False)
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is False

    async def work(engine):
        return await embed(engine, [engine.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS])

    got = torch.stack([v for v, _ in run_engine(model_dir, work)])
    torch.testing.assert_close(got, reference(model_dir, TEXTS), atol=TOL, rtol=0)


def test_by_hand_reference_agrees_with_sentence_transformers(model_dirs):
    """sentence-transformers reads each tiny model's pooling config as the
    pooling it is named after (the engine reads the same files)."""
    for pooling in ST_POOLINGS:
        torch.testing.assert_close(reference(model_dirs[pooling], TEXTS),
                                   by_hand(model_dirs[pooling], TEXTS, pooling), atol=TOL, rtol=0)


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_a_batch_of_mixed_lengths_equals_each_alone(model_dirs, pooling):
    prompts = [[5, 6, 7], list(range(100, 190)), [42], list(range(300, 337)), [9] * 20]

    async def work(engine):
        together = await embed(engine, prompts)
        alone = []
        for p in prompts:
            assert engine.flush_cache()
            alone += await embed(engine, [p])
        return together, alone

    together, alone = run_engine(model_dirs[pooling], work, chunked_prefill_size=32)
    for (a, _), (b, _) in zip(together, alone):
        torch.testing.assert_close(a, b, atol=TOL, rtol=0)


def test_two_tensor_parallel_ranks_embed_what_one_does(model_dirs):
    """--tp-size 2 (gloo): rank 0 pools while rank 1 runs the same forward."""
    model_dir = model_dirs["mean"]

    async def work(engine):
        return await embed(engine, [engine.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS])

    one = torch.stack([v for v, _ in run_engine(model_dir, work, chunked_prefill_size=16)])
    two = torch.stack([v for v, _ in run_engine(model_dir, work, chunked_prefill_size=16, tp_size=2)])
    torch.testing.assert_close(two, one, atol=TOL, rtol=0)


def test_last_token_pooling_reuses_a_cached_prefix(model_dirs):
    prefix, tail = list(range(100, 160)), [7, 8, 9]

    async def work(engine):
        first = (await embed(engine, [prefix]))[0]
        again = (await embed(engine, [prefix]))[0]
        extended = (await embed(engine, [prefix + tail]))[0]
        assert engine.flush_cache()
        fresh = (await embed(engine, [prefix + tail]))[0]
        return first, again, extended, fresh

    first, again, extended, fresh = run_engine(model_dirs["lasttoken"], work)
    assert first[1] == 0 and again[1] == len(prefix) - 1 and extended[1] == len(prefix) and fresh[1] == 0
    torch.testing.assert_close(again[0], first[0], atol=TOL, rtol=0)
    torch.testing.assert_close(extended[0], fresh[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_pooling_from_the_first_token_computes_the_prompt_whole(model_dirs, pooling):
    prompt = list(range(100, 160))

    async def work(engine):
        return (await embed(engine, [prompt]))[0], (await embed(engine, [prompt]))[0]

    (first, hit1), (again, hit2) = run_engine(model_dirs[pooling], work)
    assert hit1 == hit2 == 0
    torch.testing.assert_close(again, first, atol=TOL, rtol=0)


def test_a_caller_that_leaves_frees_everything(model_dirs):
    """Cancelled in the middle of its chunked prompt, an embedding request
    gives back every KV page (run_engine checks) and leaves the engine."""

    async def work(engine):
        task = asyncio.create_task(embed(engine, [list(range(10, 1010))]))
        while engine.num_running == 0:
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return engine.scheduler.requests, (await embed(engine, [[5, 6, 7]]))[0][0]

    left, after = run_engine(model_dirs["mean"], work, chunked_prefill_size=16)
    assert left == {} and after.shape == (64,)


def test_unsupported_sentence_transformers_modules_are_refused_at_start(tmp_path, default_model_dir):
    model_dir = build_tiny_embedding_model(tmp_path, default_model_dir)
    modules = json.loads((model_dir / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        make_engine(model_dir)


def test_generation_options_are_refused_with_is_embedding(model_dirs):
    proc = subprocess.run([sys.executable, "-m", "pyserve", "--is-embedding", "--model",
                           str(model_dirs["lasttoken"]), "--reasoning-parser", "qwen3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--reasoning-parser" in proc.stderr and "--is-embedding" in proc.stderr


# -- the route, on a real server -----------------------------------------------


@pytest.fixture(scope="module")
def embed_server(model_dirs, tmp_path_factory):
    """The app in process, and an HTTP client of it: the routes' answers are checked, not the process."""
    app = create_app(is_embedding=True, model_path=str(model_dirs["lasttoken"]), served_model_name="tiny-embed",
                     file_storage_path=str(tmp_path_factory.mktemp("embed")))
    with TestClient(app) as http:
        yield http


@pytest.fixture(scope="module")
def embed_client(embed_server):
    return openai.OpenAI(api_key="EMPTY", base_url=f"{embed_server.base_url}/v1", http_client=embed_server)


def vectors(response) -> torch.Tensor:
    return torch.tensor([d.embedding for d in sorted(response.data, key=lambda d: d.index)])


def test_openai_client_float_and_base64(embed_client, model_dirs):
    floats = embed_client.embeddings.create(model="tiny-embed", input=TEXTS, encoding_format="float")
    base64 = embed_client.embeddings.create(model="tiny-embed", input=TEXTS)  # the client asks for base64
    assert [d.index for d in floats.data] == list(range(len(TEXTS))) and floats.model == "tiny-embed"
    torch.testing.assert_close(vectors(base64), vectors(floats), atol=TOL, rtol=0)
    torch.testing.assert_close(vectors(floats), reference(model_dirs["lasttoken"], TEXTS), atol=TOL, rtol=0)


def test_every_input_shape_and_usage(embed_client):
    one = embed_client.embeddings.create(model="m", input=TEXTS[2], encoding_format="float")
    many = embed_client.embeddings.create(model="m", input=TEXTS[1:3], encoding_format="float")
    tokens = embed_client.embeddings.create(model="m", input=[[5, 6, 7]], encoding_format="float")
    flat = embed_client.embeddings.create(model="m", input=[5, 6, 7], encoding_format="float")
    torch.testing.assert_close(vectors(many)[1], vectors(one)[0], atol=TOL, rtol=0)
    torch.testing.assert_close(vectors(flat), vectors(tokens), atol=TOL, rtol=0)
    assert flat.usage.prompt_tokens == flat.usage.total_tokens == 3
    assert many.usage.prompt_tokens == many.usage.total_tokens > one.usage.prompt_tokens > 0


def test_sglangs_encode_answers_the_same_vectors(embed_server, embed_client):
    """SGLang's native /encode: one object for a text, a list for a list."""
    openai_vectors = vectors(embed_client.embeddings.create(model="m", input=TEXTS[:2], encoding_format="float"))
    many = embed_server.post("/encode", json={"text": TEXTS[:2]}).json()
    one = embed_server.post("/encode", json={"input_ids": [5, 6, 7]}).json()
    torch.testing.assert_close(torch.tensor([m["embedding"] for m in many]), openai_vectors, atol=TOL, rtol=0)
    assert len(one["embedding"]) == openai_vectors.shape[1] and one["meta_info"]["prompt_tokens"] == 3
    r = embed_server.post("/classify", json={"text": "x"})
    assert r.status_code == 400 and "/encode" in r.json()["error"]["message"]  # no classifier head


def test_dimensions_cut_and_normalise_again(embed_client):
    full = vectors(embed_client.embeddings.create(model="m", input=TEXTS, encoding_format="float"))
    cut = vectors(embed_client.embeddings.create(model="m", input=TEXTS, dimensions=16))
    assert cut.shape == (len(TEXTS), 16)
    torch.testing.assert_close(cut, F.normalize(full[:, :16], dim=-1), atol=TOL, rtol=0)
    same = vectors(embed_client.embeddings.create(model="m", input=TEXTS, dimensions=full.shape[1]))
    torch.testing.assert_close(same, full, atol=TOL, rtol=0)
    with pytest.raises(openai.BadRequestError) as err:
        embed_client.embeddings.create(model="m", input="x", dimensions=20)  # not one of [16, 32]
    assert err.value.body["param"] == "dimensions" and "[16, 32]" in err.value.body["message"]


def test_bad_embedding_requests_are_400s(embed_server):
    url = "/v1/embeddings"
    for body, param in [({"input": []}, "input"), ({"input": [[5, 10**9]]}, "input"),
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "dimensions": 0}, "dimensions")]:
        r = embed_server.post(url, json={"model": "m", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert embed_server.get("/health_generate").status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"model": "m", "prompt": "hi"}),
    ("/generate", {"text": "hi"}),
])
def test_generation_routes_answer_400_on_an_embedding_server(embed_server, path, body):
    r = embed_server.post(path, json=body)
    assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"]


def test_embeddings_answer_400_on_a_generation_server(tiny_llama_dir):
    async def main():
        engine = Engine.from_args(ServerArgs(model_path=str(tiny_llama_dir), max_total_tokens=1024, grammar_backend="none"))
        await engine.start()
        try:
            app = App(ServingContext(engine, "m", None))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return await client.post("/v1/embeddings", json={"model": "m", "input": "hi"})
        finally:
            await engine.shutdown()

    r = asyncio.run(main())
    assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"]
