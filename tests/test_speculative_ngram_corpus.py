"""Operators' corpora for NGRAM draft trees (SGLang's external corpus):
--speculative-ngram-external-corpus-path at start, /add_external_corpus,
/remove_external_corpus and /list_external_corpora at run time. A request
whose answer is in a corpus drafts it from its first step; greedy output
stays what decoding without speculation gives; what cannot be loaded is
refused with SGLang's `{"success": false, "message"}` body."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pyserve._rust import Tokenizer
from pyserve.api.app import App
from pyserve.api.generation.serving import ServingContext
from pyserve.engine.speculative.corpora import DOCUMENT_SEPARATOR, ExternalCorpora
from pyserve.engine.speculative.options import drafter_of
from pyserve.server_args import ServerArgs
from tests.slow import slow, slow_test
from tests.test_speculative import collect, same, started
from tests.test_speculative_ngram_trees import GREEDY, TREES

QUESTIONS = ["Write three sentences about the sea.", "Explain how a bicycle works."]
OTHER_DOCUMENT = "Tides rise twice a day along the coast of the northern bay."


@pytest.fixture(scope="module")
def answers(default_model_dir):
    """Each question's prompt tokens and greedy answer (text, tokens,
    logprobs, last output), without speculation."""
    tokenizer = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))

    async def main():
        engine = await started(default_model_dir)
        try:
            return [(tokenizer.encode(q), await collect(engine, tokenizer.encode(q), **GREEDY, max_new_tokens=40,
                                                        logprobs=True)) for q in QUESTIONS]
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def _corpus_file(tmp_path, documents: list[str]):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in documents))
    return path


def _runs(model_dir, prompt, options: dict, engine_args=None):
    """The question's greedy answer on an engine with `options`, asked
    once, and the drafts it kept."""
    async def main():
        engine = await started(model_dir, **TREES, **options, **(engine_args or {}))
        try:
            got = await collect(engine, prompt, **GREEDY, max_new_tokens=40, logprobs=True)
            assert engine.kv_usage()["in_use"] == 0
            return got, engine.metrics.accepted_drafts()
        finally:
            await engine.shutdown()

    return asyncio.run(main())


# Pages of 4 under overlap by default; pages of 1 without it, slow.
@pytest.mark.parametrize("engine_args", [pytest.param({"page_size": 1}, id="page1", marks=slow),
                                         pytest.param({"page_size": 4, "disable_overlap_schedule": False},
                                                      id="page4-overlap")])
def test_a_request_whose_answer_is_in_the_corpus_drafts_it_from_the_start(default_model_dir, answers, tmp_path,
                                                                          engine_args):
    prompt, plain = answers[0]
    corpus = _corpus_file(tmp_path, [OTHER_DOCUMENT, plain[0]])
    spec, kept = _runs(default_model_dir, prompt, {
        "speculative_ngram_external_corpus_path": str(corpus), "speculative_ngram_external_sam_budget": 3},
        engine_args)
    same([plain], [spec])
    _, kept_without = _runs(default_model_dir, prompt, {}, engine_args)
    assert kept >= 0.6 * len(spec[1]) and kept > 2 * kept_without


def test_corpora_load_list_and_go_through_the_routes(default_model_dir, answers, tmp_path):
    """What an operator does with SGLang's routes, on a server drafting
    trees: the answers in a corpus loaded at run time are drafted, and
    once it is removed they are not."""
    (first, (answer, *_)), (second, (other_answer, *_)) = answers
    corpus = _corpus_file(tmp_path, [answer, other_answer])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n{"text": "not a string"}\n')
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'"caf\xe9"\n')

    async def main():
        engine = await started(default_model_dir, **TREES, speculative_ngram_external_corpus_max_tokens=400)
        app = App(ServingContext(engine, "m", None))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                async def kept_asking(prompt):
                    before = engine.metrics.accepted_drafts()
                    await collect(engine, prompt, **GREEDY, max_new_tokens=40)
                    return engine.metrics.accepted_drafts() - before

                replies = {}
                replies["add_file"] = await client.post("/add_external_corpus", json={
                    "corpus_id": "answers", "file_path": str(corpus)})
                replies["list"] = await client.get("/list_external_corpora")
                replies["add_documents"] = await client.post("/add_external_corpus", json={
                    "documents": [OTHER_DOCUMENT, "", "Another one."]})
                # SGLang's token_chunks: a token stream cut anywhere, documents separated.
                replies["add_chunks"] = await client.post("/add_external_corpus", json={
                    "corpus_id": "chunks", "token_chunks": [[5, 6], [7, DOCUMENT_SEPARATOR, 8], [9]]})
                for name, body in {
                        "again": {"corpus_id": "answers", "documents": ["x"]},
                        "neither": {"corpus_id": "x"},
                        "both": {"file_path": str(corpus), "documents": ["x"]},
                        "bad_token": {"token_chunks": [[5, -7]]},
                        "missing": {"file_path": str(tmp_path / "none.jsonl")},
                        "bad_line": {"file_path": str(bad)},
                        "not_utf8": {"file_path": str(binary)},
                        "directory": {"file_path": str(tmp_path)},
                        "too_big": {"documents": [answer * 20]},
                        "empty": {"documents": [""]},
                        "unknown_field": {"documents": ["x"], "text": "y"}}.items():
                    replies[name] = await client.post("/add_external_corpus", json=body)
                kept_with = await kept_asking(first)
                replies["remove"] = await client.post("/remove_external_corpus", json={"corpus_id": "answers"})
                replies["remove_again"] = await client.post("/remove_external_corpus", json={"corpus_id": "answers"})
                kept_without = await kept_asking(second)  # its answer was in the corpus removed
                replies["list_after"] = await client.get("/list_external_corpora")
                return replies, kept_with, kept_without
        finally:
            await engine.shutdown()

    replies, kept_with, kept_without = asyncio.run(main())
    add = replies["add_file"].json()
    assert replies["add_file"].status_code == 200 and add["success"] and add["corpus_id"] == "answers"
    assert add["loaded_token_count"] > 20
    assert replies["list"].json()["corpus_token_counts"] == {"answers": add["loaded_token_count"]}
    made_up = replies["add_documents"].json()
    assert replies["add_documents"].status_code == 200 and len(made_up["corpus_id"]) == 32
    assert replies["add_chunks"].json()["loaded_token_count"] == 5
    for name, words in {"again": "remove it first", "neither": "one of file_path, documents or token_chunks",
                        "both": "not file_path and documents", "bad_token": "-7 is neither a token id",
                        "missing": "no file at",
                        "bad_line": "line 2: a corpus line is a JSON string", "too_big": "more tokens than",
                        "not_utf8": "as UTF-8 text", "directory": "no file at",
                        "empty": "hold no tokens", "unknown_field": "'text'"}.items():
        r = replies[name]
        assert r.status_code == 400 and r.json()["success"] is False and words in r.json()["message"], (name, r.text)
    assert replies["remove"].status_code == 200 and replies["remove"].json()["success"]
    assert replies["remove_again"].status_code == 404 and replies["remove_again"].json()["success"] is False
    assert replies["list_after"].json()["corpus_ids"] == sorted([made_up["corpus_id"], "chunks"])
    assert kept_with >= 20 and kept_without < kept_with / 2


def test_a_server_without_ngram_trees_refuses_the_routes(tiny_llama_dir):
    async def main():
        engine = await started(tiny_llama_dir, speculative_algorithm="NGRAM")
        try:
            app = App(ServingContext(engine, "m", None))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                return await client.post("/add_external_corpus", json={"documents": ["x"]})
        finally:
            await engine.shutdown()

    r = asyncio.run(main())
    assert r.status_code == 400 and r.json() == {"success": False, "message": r.json()["message"]}
    assert "--speculative-ngram-max-bfs-breadth" in r.json()["message"]


def test_a_load_whose_client_leaves_holds_nothing(tiny_llama_dir):
    """The route's handler is cancelled when its client disconnects,
    wherever the load is: no corpus, and its tokens back in the budget."""
    corpora = ExternalCorpora(Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")), 0, 10**7)

    async def main():
        for wait in (0, 0.01, 0.05):
            task = asyncio.create_task(corpora.add_documents("big", ["the sea and the sky " * 500] * 100))
            await asyncio.sleep(wait)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert corpora.token_counts() == {} and corpora.tokens_left() == 10**7
        return await corpora.add_documents("big", ["the sea and the sky"])

    assert asyncio.run(main()) > 0 and list(corpora.token_counts()) == ["big"]


@pytest.mark.parametrize("options, message", [
    ({"speculative_ngram_external_corpus_path": "c.jsonl"},
     "--speculative-ngram-external-corpus-path is for NGRAM trees"),
    ({"speculative_ngram_external_sam_budget": 2}, "--speculative-ngram-external-sam-budget is for NGRAM trees"),
    ({**TREES, "speculative_ngram_external_sam_budget": -1}, "a count of draft nodes"),
    ({**TREES, "speculative_ngram_external_corpus_max_tokens": 0}, "must be at least 1"),
    ({**TREES, "speculative_ngram_external_corpus_path": "/nonexistent/c.jsonl"}, "no file at /nonexistent"),
])
def test_what_cannot_load_is_refused_at_start(tiny_llama_dir, options, message):
    args = ServerArgs(model_path=str(tiny_llama_dir), **{"speculative_algorithm": "NGRAM", **options}).resolved().split()
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    with pytest.raises(ValueError, match=message):
        drafter_of(args.engine, args.model, tiny_llama_dir, None, tokenizer)


def test_a_corpus_over_the_token_limit_is_refused_at_start(tiny_llama_dir, tmp_path):
    corpus = _corpus_file(tmp_path, ["one two three four five six seven"] * 3)
    args = ServerArgs(model_path=str(tiny_llama_dir), **TREES, speculative_ngram_external_corpus_path=str(corpus),
                      speculative_ngram_external_corpus_max_tokens=10).resolved().split()
    tokenizer = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    with pytest.raises(ValueError, match="more tokens than the corpora have room for"):
        drafter_of(args.engine, args.model, tiny_llama_dir, None, tokenizer)


def test_the_cli_takes_sglangs_corpus_flags():
    args = ServerArgs.from_cli(["--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "10",
                                "--speculative-ngram-external-corpus-path", "/data/c.jsonl",
                                "--speculative-ngram-external-sam-budget", "4",
                                "--speculative-ngram-external-corpus-max-tokens", "5000"])
    assert (args.speculative_ngram_external_corpus_path, args.speculative_ngram_external_sam_budget,
            args.speculative_ngram_external_corpus_max_tokens) == ("/data/c.jsonl", 4, 5000)


@slow_test
def test_a_real_server_started_with_a_corpus_drafts_from_it(answers, tmp_path):
    """`pyserve --speculative-algorithm NGRAM --speculative-ngram-max-bfs-breadth 4
    --speculative-ngram-external-corpus-path C --speculative-ngram-external-sam-budget 3`,
    asked through the openai client: the answer the corpus holds, with a
    mean accept length SGLang's /get_server_info reports above 2."""
    from tests.conftest import ServerProcess

    openai = pytest.importorskip("openai")
    answer = answers[0][1][0]
    corpus = _corpus_file(tmp_path, [answer])
    srv = ServerProcess("--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "4",
                        "--speculative-num-draft-tokens", "6", "--speculative-ngram-min-match-window-size", "1",
                        "--speculative-ngram-external-corpus-path", str(corpus),
                        "--speculative-ngram-external-sam-budget", "3")
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none")
        out = client.completions.create(model="default", prompt=QUESTIONS[0], max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == answer
        info = httpx.get(f"{srv.base_url}/get_server_info", timeout=30).json()
        assert info["internal_states"][0]["avg_spec_accept_length"] > 2
        listed = httpx.get(f"{srv.base_url}/list_external_corpora", timeout=30).json()
        assert list(listed["corpus_token_counts"]) == [str(corpus)]
    finally:
        srv.stop()
