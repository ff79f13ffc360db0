"""SGLang's weight sync for RL trainers. A trainer process joins a gloo
group with the server (/init_weights_update_group) and broadcasts another
checkpoint's tensors by name, tensor by tensor and as one flattened
bucket (/update_weights_from_distributed);
then the server answers as transformers does on that checkpoint (greedy
tokens in float32) and /get_weights_by_name reads the new values back,
q/k/v out of the fused projection. Tensors shared through
torch.multiprocessing (/update_weights_from_tensor) do the same, for a
dense and an MoE model. What does not fit (a name the model lacks, a
shape, a layer held quantized, a payload that is not tensors) is a 400
that changes no weight."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import pickle
import subprocess
import sys
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing
from safetensors.torch import load_file

from pyserve.asgi import create_app
from tests.conftest import ServerProcess, free_port
from tests.slow import slow_test
from tests.test_api_handlers import call
from tests.test_engine_vs_hf import hf_greedy
from tests.tiny_models import build_tiny_model

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 99, 300, 301]
GREEDY = {"model": "m", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}
FLOAT = {"dtype": "float32", "torchao_config": "none", "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def llamas(tmp_path_factory, default_model_dir):
    """Two checkpoints of one tiny Llama, other seeds."""
    root = tmp_path_factory.mktemp("sync")
    return tuple(build_tiny_model(root / f"seed{seed}", "llama", tokenizer_dir=default_model_dir, seed=seed)
                 for seed in (1, 2))


def reference_greedy(model_dir) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    return hf_greedy(model, PROMPT, 8)


def tensors_of(model_dir) -> dict[str, torch.Tensor]:
    return dict(sorted(load_file(model_dir / "model.safetensors").items()))


def start_trainer(tmp_path, port: int, world_size: int, checkpoint, tensors: list) -> subprocess.Popen:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"checkpoint": str(checkpoint), "tensors": tensors}))
    return subprocess.Popen([sys.executable, "-m", "tests.weight_trainer", str(port), str(world_size), str(plan)],
                            stdout=subprocess.PIPE, text=True)


def shared(named) -> str:
    """A trainer's payload: the (name, tensor) list (or a flattened bucket) pickled by torch.multiprocessing,
    in base64."""
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named)
    return base64.b64encode(buffer.getvalue()).decode()


@dataclass
class FlattenedTensorMetadata:
    """A trainer's copy of SGLang's bucket entry (weight_sync/tensor_bucket.py): where a tensor's bytes lie."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flattened_bucket(named: list[tuple[str, torch.Tensor]]) -> dict:
    """SGLang's flattened bucket of `named`: their bytes back to back, and where each lies."""
    parts, metadata, offset = [], [], 0
    for name, tensor in named:
        part = tensor.flatten().view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + part.numel(),
                                                part.numel()))
        parts.append(part)
        offset += part.numel()
    return {"flattened_tensor": torch.cat(parts), "metadata": metadata}


def _tokens(body: bytes) -> list[int]:
    return json.loads(body)["choices"][0]["token_ids"]


def _refusal(answer) -> str:
    status, _, raw = answer
    assert status == 400, raw
    body = json.loads(raw)
    assert body["success"] is False
    return body["message"]


def test_a_trainer_broadcasts_a_checkpoint_into_the_server(llamas, tmp_path):
    first, second = llamas
    new = tensors_of(second)
    names = list(new)
    half = len(names) // 2
    port = free_port()
    down = "model.layers.0.mlp.down_proj.weight"
    trainer = start_trainer(tmp_path, port, 2, second,
                            [[down, [3, 5]], ["model.layers.0.mlp.nonsense.weight", [4]]]
                            + [[n, None] for n in names[:half]] + [{"bucket": names[half:]}])

    async def go():
        app = create_app(model_path=str(first), file_storage_path=str(tmp_path), **FLOAT)
        await app.startup()
        try:
            before = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            nccl = await call(app, "POST", "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2})
            joined = await call(app, "POST", "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "backend": "gloo"})
            misshapen = await call(app, "POST", "/update_weights_from_distributed",
                                   {"names": [down], "dtypes": ["float32"], "shapes": [[3, 5]]})
            unknown = await call(app, "POST", "/update_weights_from_distributed", {
                "names": ["model.layers.0.mlp.nonsense.weight"], "dtypes": ["float32"], "shapes": [[4]]})
            still = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            buckets = []
            for bucket, dtype, load_format in ((names[:half], "float32", None),
                                               (names[half:], "torch.float32", "flattened_bucket")):
                buckets.append(await call(app, "POST", "/update_weights_from_distributed", {
                    "names": bucket, "dtypes": [dtype] * len(bucket), "load_format": load_format,
                    "shapes": [list(new[n].shape) for n in bucket], "weight_version": "step-1"}))
            after = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            k_rows = await call(app, "GET", "/get_weights_by_name?name=model.layers.1.self_attn.k_proj.weight"
                                             "&truncate_size=3")
            norm = await call(app, "POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 5})
            no_group = await call(app, "POST", "/update_weights_from_distributed",
                                  {"names": [], "dtypes": [], "shapes": [], "group_name": "other"})
            left = await call(app, "POST", "/destroy_weights_update_group", {})
            info = json.loads((await call(app, "GET", "/get_model_info"))[2])
            return before, nccl, joined, misshapen, unknown, still, buckets, after, k_rows, norm, no_group, left, info
        finally:
            await app.shutdown()

    try:
        before, nccl, joined, misshapen, unknown, still, buckets, after, k_rows, norm, no_group, left, info = \
            asyncio.run(go())
        assert trainer.wait(timeout=60) == 0
    finally:
        trainer.kill()
    assert "use gloo" in _refusal(nccl)
    assert joined[0] == 200 and json.loads(joined[2])["success"] is True
    assert "has shape (3, 5)" in _refusal(misshapen)
    assert "not a weight of this LlamaForCausalLM model" in _refusal(unknown)
    assert before == still == reference_greedy(first)  # the refused updates wrote nothing
    assert [status for status, _, _ in buckets] == [200, 200], buckets
    assert after == reference_greedy(second) != before
    assert json.loads(k_rows[2]) == new["model.layers.1.self_attn.k_proj.weight"][:3].tolist()
    assert json.loads(norm[2]) == new["model.norm.weight"][:5].tolist()
    assert "no update group 'other'" in _refusal(no_group)
    assert left[0] == 200
    assert info["weight_version"] == "step-1"


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_tensors_shared_by_a_trainer_process_replace_the_weights(arch, tmp_path, default_model_dir):
    first, second = (build_tiny_model(tmp_path / f"seed{seed}", arch, tokenizer_dir=default_model_dir, seed=seed)
                     for seed in (1, 2))
    new = list(tensors_of(second).items())

    async def go():
        app = create_app(model_path=str(first), file_storage_path=str(tmp_path), **FLOAT)
        await app.startup()
        try:
            # Not torch.multiprocessing's pickle: a call of a function, and a tensor as plain pickle writes it
            # (its storage unpickled by torch.load).
            strangers = [await call(app, "POST", "/update_weights_from_tensor",
                                    {"serialized_named_tensors": [base64.b64encode(pickle.dumps(obj)).decode()]})
                         for obj in (os.getcwd, [("model.norm.weight", torch.ones(64))])]
            half = len(new) // 2
            updated = [await call(app, "POST", "/update_weights_from_tensor", body) for body in (
                {"serialized_named_tensors": [shared(new[:half])]},
                {"serialized_named_tensors": [shared(flattened_bucket(new[half:]))],
                 "load_format": "flattened_bucket"})]
            after = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            expert = await call(app, "POST", "/get_weights_by_name",
                                {"name": "model.layers.0.mlp.experts.0.gate_proj.weight"})
            return strangers, updated, after, expert
        finally:
            await app.shutdown()

    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")  # how a trainer shares CPU tensors with a server
    try:
        strangers, updated, after, expert = asyncio.run(go())
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    assert "may hold only tensors; it names posix.getcwd" in _refusal(strangers[0])
    assert "may hold only tensors; it names torch." in _refusal(strangers[1])
    assert [status for status, _, _ in updated] == [200, 200], updated
    assert after == reference_greedy(second)
    if arch == "mixtral":
        assert "not read back by name" in _refusal(expert)


def test_a_layer_held_quantized_is_not_written_by_name(llamas, tmp_path):
    first, second = llamas
    q = "model.layers.0.self_attn.q_proj.weight"

    async def go():
        app = create_app(model_path=str(first), file_storage_path=str(tmp_path), max_total_tokens=4096,
                         torchao_config="int8wo")
        await app.startup()
        try:
            before = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            refused = await call(app, "POST", "/update_weights_from_tensor",
                                 {"serialized_named_tensors": [shared([(q, tensors_of(second)[q])])]})
            after = _tokens((await call(app, "POST", "/v1/completions", GREEDY))[2])
            return before, refused, after
        finally:
            await app.shutdown()

    before, refused, after = asyncio.run(go())
    assert "holds it quantized" in _refusal(refused)
    assert before == after


@slow_test
def test_every_tensor_parallel_rank_joins_the_group_and_takes_its_shard(llamas, tmp_path):
    import httpx

    first, second = llamas
    new = tensors_of(second)
    port = free_port()
    trainer = start_trainer(tmp_path, port, 3, second, [[n, None] for n in new])
    server = ServerProcess("--model", str(first), "--tp-size", "2", "--dtype", "float32", "--torchao-config", "none",
                           "--max-total-tokens", "4096")
    try:
        url = server.base_url
        joined = httpx.post(f"{url}/init_weights_update_group", timeout=120, json={
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3, "backend": "gloo"})
        assert joined.status_code == 200, joined.text
        updated = httpx.post(f"{url}/update_weights_from_distributed", timeout=120, json={
            "names": list(new), "dtypes": ["float32"] * len(new), "shapes": [list(t.shape) for t in new.values()]})
        assert updated.status_code == 200, updated.text
        assert trainer.wait(timeout=60) == 0
        tokens = httpx.post(f"{url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["token_ids"]
        # Split over the ranks: o_proj by its inputs, gate_up by its rows.
        for name in ("model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight"):
            read = httpx.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": 4}, timeout=60)
            assert read.json() == new[name][:4].tolist()
    finally:
        trainer.kill()
        server.stop()
    assert tokens == reference_greedy(second)


def test_a_tied_matrix_whose_output_projection_is_a_quantized_copy_is_refused(tmp_path):
    from pyserve.model.loader import load_model
    from pyserve.model.named_weights import NamedWeights
    from pyserve.model.quant import resolve_quant

    model_dir = build_tiny_model(tmp_path / "tied", "llama", seed=1, tie_word_embeddings=True)
    quant = resolve_quant("int8wo", model_dir, torch.device("cpu"), 1, "auto", None)
    model, config = load_model(model_dir, torch.float32, "cpu", quant)
    before = model.embed_tokens.weight.clone()
    with pytest.raises(ValueError, match="quantized copy of this tied matrix"):
        NamedWeights(model, config).write([("model.embed_tokens.weight", torch.zeros_like(before))])
    assert torch.equal(model.embed_tokens.weight, before)
