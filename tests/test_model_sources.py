"""Where the model's files come from: Hugging Face Hub ids, as SGLang and
vLLM users name models, tokenizers and adapters (`--model Qwen/Qwen3-8B`),
served from huggingface_hub's cache (laid out here as a download leaves
it, with HF_HUB_OFFLINE=1 so that no test reaches the network), a
tokenizer from elsewhere than the checkpoint (--tokenizer-path), and
config.json keys replaced on the command line (--json-model-override-args)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyserve.server_args import ServerArgs
from tests.conftest import app_of_cli
from tests.test_lora import make_adapter, reference_tokens

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

PROMPT = [5, 17, 99, 3, 42, 42]
MAIN, V2 = "a" * 40, "b" * 40  # commits


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def publish(cache: Path, repo_id: str, files: Path, commit: str, *refs: str, only=None, leave_out=()) -> Path:
    """Put `files` (`only` those named, without `leave_out`) in `cache` as
    huggingface_hub's snapshot of `repo_id` at `commit`, which the branches
    or tags `refs` point at."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in Path(files).iterdir():
        if (only is None or f.name in only) and f.name not in leave_out:
            shutil.copy(f, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_llama_dir) -> Path:
    from tests.tiny_models import build_tiny_model

    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    # A checkpoint without its tokenizer, which another repository holds.
    publish(cache, "tiny-org/tiny-llama", tiny_llama_dir, MAIN, "main", leave_out=TOKENIZER_FILES)
    publish(cache, "tiny-org/tokenizer", tiny_llama_dir, MAIN, "main", only=TOKENIZER_FILES)
    other = build_tiny_model(root / "other", "llama", tokenizer_dir=tiny_llama_dir, seed=1)
    publish(cache, "tiny-org/tiny-llama", other, V2, "v2")
    for name, seed in (("alpha", 1), ("beta", 2)):
        publish(cache, f"tiny-org/{name}-lora", make_adapter(tiny_llama_dir, root / name, seed), MAIN, "main")
    return cache


@pytest.fixture
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # for processes started here
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def snapshot(cache: Path, commit: str) -> str:
    return str(cache / "models--tiny-org--tiny-llama" / "snapshots" / commit)


def test_a_hub_id_serves_its_snapshot_under_its_own_name(hub_cache, tiny_llama_dir, offline):
    from transformers import AutoTokenizer

    # The app these arguments make, in process: where its files came from is checked, not the server process.
    with app_of_cli("--model", "tiny-org/tiny-llama", "--tokenizer-path", "tiny-org/tokenizer",
                    "--download-dir", str(hub_cache), "--enable-lora", "--lora-paths", "alpha=tiny-org/alpha-lora",
                    "--max-total-tokens", "2048") as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", http_client=srv)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"tiny-org/tiny-llama", "alpha"} and cards["alpha"].parent == "tiny-org/tiny-llama"
        assert cards["alpha"].root == "tiny-org/alpha-lora"  # the name it was loaded by
        info = srv.get("/get_model_info").json()
        assert info["model_path"] == snapshot(hub_cache, MAIN)
        assert info["tokenizer_path"] == str(hub_cache / "models--tiny-org--tokenizer" / "snapshots" / MAIN)
        # The chat template is the tokenizer repository's.
        messages = [{"role": "user", "content": "Name a colour."}]
        chat = client.chat.completions.create(model="tiny-org/tiny-llama", messages=messages, max_tokens=2)
        template = AutoTokenizer.from_pretrained(tiny_llama_dir).apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert chat.usage.prompt_tokens == len(template)

        def tokens(model):
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body={"return_token_ids": True, "ignore_eos": True})
            return out.choices[0].token_ids

        assert tokens("tiny-org/tiny-llama") == reference_tokens(tiny_llama_dir, None, PROMPT, 8)
        beta = hub_cache / "models--tiny-org--beta-lora" / "snapshots" / MAIN
        r = srv.post("/load_lora_adapter", json={"lora_name": "beta", "lora_path": "tiny-org/beta-lora"})
        assert r.status_code == 200, r.text
        assert tokens("beta") == reference_tokens(tiny_llama_dir, beta, PROMPT, 8)
        r = srv.post("/load_lora_adapter", json={"lora_name": "gamma", "lora_path": "tiny-org/gamma-lora"})
        assert r.status_code == 400 and "tiny-org/gamma-lora" in r.json()["error"]["message"]


def test_revisions_pick_a_branch_tag_or_commit(hub_cache, tiny_llama_dir, offline):
    def located(*argv):
        return ServerArgs.from_cli(["--model", "tiny-org/tiny-llama", "--download-dir", str(hub_cache), *argv]
                                   ).resolved()

    assert located().model_path == snapshot(hub_cache, MAIN)
    assert located().served_model_name == "tiny-org/tiny-llama"
    assert located("--revision", "v2").model_path == snapshot(hub_cache, V2)
    assert located("--revision", V2).model_path == snapshot(hub_cache, V2)
    assert located("--served-model-name", "mine").served_model_name == "mine"
    with pytest.raises(ValueError, match="tiny-org/tiny-llama.*revision v3"):
        located("--revision", "v3")
    # The draft model is found the same way, at its own revision.
    draft = ServerArgs.from_cli(["--model", str(tiny_llama_dir), "--download-dir", str(hub_cache),
                                 "--speculative-algorithm", "STANDALONE",
                                 "--speculative-draft-model-path", "tiny-org/tiny-llama",
                                 "--speculative-draft-model-revision", "v2"]).resolved()
    assert draft.speculative_draft_model_path == snapshot(hub_cache, V2)
    assert draft.model_path == str(tiny_llama_dir) and draft.served_model_name == str(tiny_llama_dir)


@pytest.mark.parametrize("argv, flag", [
    (["--revision", "v2"], "--revision"),  # no model to apply it to
    (["--model", "{local}", "--revision", "v2"], "--revision"),
    (["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "{local}",
      "--speculative-draft-model-revision", "v2"], "--speculative-draft-model-revision"),
])
def test_a_revision_without_a_hub_id_is_refused(argv, flag, tiny_llama_dir, capsys):
    with pytest.raises(SystemExit) as e:
        ServerArgs.from_cli([a.format(local=tiny_llama_dir) for a in argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_a_hub_id_not_in_the_cache_offline_fails_clearly(tmp_path, offline):
    out = subprocess.run([sys.executable, "-m", "pyserve", "--model", "tiny-org/absent", "--download-dir",
                          str(tmp_path), "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stdout + out.stderr
    assert "tiny-org/absent is neither a local directory nor in the Hugging Face cache" in out.stdout


def test_config_overrides_serve_the_model_transformers_runs_with_them(tmp_path, default_model_dir):
    """Qwen's recipe for a longer context: YaRN given on the command line
    (--json-model-override-args) over a checkpoint saved by transformers 5,
    whose rope_parameters hold a theta of their own."""
    import asyncio
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pyserve.engine.request import GenerateRequest, SamplingParams
    from tests.test_engine import started_engine
    from tests.tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path, "qwen2", tokenizer_dir=default_model_dir, rope_theta=1000.0,
                                 max_position_embeddings=64)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    prompt = [(7 * i) % 500 + 3 for i in range(100)]  # beyond the original context

    async def served(overrides: dict) -> tuple[list[int], int]:
        engine = await started_engine(model_dir, json_model_override_args=json.dumps(overrides))
        try:
            req = GenerateRequest(prompt, SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))
            return [t async for out in engine.generate(req) for t in out.token_ids], engine.context_len
        finally:
            await engine.shutdown()

    tokens, context = asyncio.run(served({"rope_scaling": yarn, "max_position_embeddings": 256}))
    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters = {**yarn, "rope_theta": 1000.0}
    config.max_position_embeddings = 256
    reference = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32).eval()
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert context == 256 and tokens == expected
    with pytest.raises(ValueError, match="context"):  # without them the prompt is past the model's context
        asyncio.run(served({}))


def _without_weights(model_dir: Path, out: Path) -> Path:
    """`out` with `model_dir`'s config and tokenizer files and no checkpoint."""
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, out / name)
    return out


def _greedy_tokens(model_dir: Path, n: int, **options) -> list[int]:
    """The engine's `n` greedy tokens after [5, 6, 7], started on `model_dir` with `options`."""
    import asyncio

    from tests.test_engine import collect, started_engine

    async def run():
        engine = await started_engine(model_dir, **options)
        try:
            return (await collect(engine, [5, 6, 7], max_new_tokens=n, temperature=0, ignore_eos=True))[1]
        finally:
            await engine.shutdown()

    return asyncio.run(run())


def test_dummy_weights_serve_a_config_without_its_checkpoint(tiny_llama_dir, tmp_path):
    """--load-format dummy (SGLang's): speed and memory measured from
    config.json and the tokenizer alone, the same weights on every run."""
    import json

    bare = _without_weights(tiny_llama_dir, tmp_path)
    first = _greedy_tokens(bare, 6, load_format="dummy")
    assert len(first) == 6 and _greedy_tokens(bare, 6, load_format="dummy") == first
    with pytest.raises(ValueError, match="model.safetensors"):
        _greedy_tokens(bare, 6)  # the checkpoint is not there to read
    config = json.loads((bare / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="--load-format dummy draws float weights"):
        _greedy_tokens(bare, 6, load_format="dummy")
    # What the refusal says to do: the float model of that config.
    float_model = {"load_format": "dummy", "json_model_override_args": '{"quantization_config": null}'}
    assert len(_greedy_tokens(bare, 6, **float_model)) == 6


def test_a_dummy_draft_model_beside_a_real_target(tiny_llama_dir, tmp_path):
    """--speculative-draft-load-format dummy: a STANDALONE draft drawn from
    its config alone; verification keeps the target's greedy tokens."""
    draft = {"speculative_algorithm": "STANDALONE",
             "speculative_draft_model_path": str(_without_weights(tiny_llama_dir, tmp_path)),
             "speculative_num_draft_tokens": 3}
    plain = _greedy_tokens(tiny_llama_dir, 8)
    assert _greedy_tokens(tiny_llama_dir, 8, **draft, speculative_draft_load_format="dummy") == plain
    with pytest.raises(ValueError, match="model.safetensors"):
        _greedy_tokens(tiny_llama_dir, 8, **draft)  # the target's format, whose checkpoint the draft's directory lacks


@pytest.mark.parametrize("algorithm, binaries", [("EAGLE3", True), ("STANDALONE", False)])
def test_eagle_heads_come_with_their_torch_binaries(tiny_llama_dir, monkeypatch, algorithm, binaries):
    """EAGLE heads are mostly published as pytorch_model.bin; a draft
    model's other weight formats, like a target's, are left on the Hub."""
    import huggingface_hub

    asked = {}

    def snapshot_download(repo_id, **options):
        asked[repo_id] = options["ignore_patterns"]
        return str(tiny_llama_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    ServerArgs(model_path=str(tiny_llama_dir), speculative_algorithm=algorithm,
               speculative_draft_model_path="org/draft").resolved()
    assert ("*.bin" not in asked["org/draft"]) == binaries and "*.gguf" in asked["org/draft"]
