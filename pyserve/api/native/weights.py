"""SGLang's POST /update_weights_from_disk: serve another checkpoint of the
same model (a new fine-tune, a training step's weights) without a
restart.

The gate closes (new requests wait at it); the requests in the engine
finish, or stop at once with `abort_all_requests`, or, in an engine that
/pause_generation stopped, stay; the prefix cache is dropped (unless
`flush_cache` is false); then the forward thread reads the checkpoint as
the served model was read and copies it into the served model's tensors
(engine/runner/weight_swap.py), and the gate opens (unless paused). The
tokenizer and the options stay. What does not fit the served model
(another architecture, size or quantization) is a 400 that leaves the
weights as they were."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec

from pyserve.api.generation.serving import ServingContext
from pyserve.api.native.pause import engine_emptied
from pyserve.http.errors import bad_request
from pyserve.model.hub import local_model_dir


class UpdateWeightsRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model_path: str  # a model directory, or a Hub id
    load_format: str | None = None  # auto or safetensors: what --load-format reads
    abort_all_requests: bool = False  # stop the requests in the engine instead of letting them finish
    weight_version: str | None = None  # reported by /get_model_info from now on
    flush_cache: bool = True  # False keeps cached prefixes, whose KV the old weights computed


async def update_weights_from_disk(ctx: ServingContext, req: UpdateWeightsRequest) -> dict:
    if req.load_format not in (None, "auto", "safetensors"):
        raise bad_request(f"load_format {req.load_format!r}: weights are read from safetensors (auto)", "load_format")
    try:
        model_dir = Path(await asyncio.to_thread(local_model_dir, req.model_path, None,
                                                 ctx.server_args.get("download_dir"), "model_path"))
    except ValueError as e:
        raise bad_request(str(e), "model_path") from None
    if "weights" in ctx.engine.runner.memory_released:
        raise bad_request("the weights are released: /resume_memory_occupation with the tag weights first",
                          "model_path")
    async with weights_replaced(ctx, req.abort_all_requests, req.flush_cache, req.weight_version):
        try:
            await ctx.engine.runner.swap_weights(model_dir)
        except (ValueError, OSError) as e:
            raise bad_request(f"{model_dir}: {e}", "model_path") from None
    return {"success": True, "message": f"Succeeded to update model weights from {model_dir}."}


@asynccontextmanager
async def weights_replaced(ctx: ServingContext, abort_all_requests: bool, flush_cache: bool,
                           weight_version: str | None) -> AsyncIterator[None]:
    """The body replaces the served weights with the admission gate closed:
    the requests in the engine have finished first (or stopped, with
    `abort_all_requests`; a paused engine's stay, and resume on the new
    weights), and the prefix cache is dropped (`flush_cache`). Once the
    body returns, `weight_version` (if given) names the weights."""
    engine = ctx.engine
    async with ctx.gate.updating():
        if abort_all_requests:
            engine.abort_all()
        await engine_emptied(engine, stop=lambda: ctx.gate.pause_mode is not None)
        # Before the swap: no prefix of the old weights is matched after it.
        if flush_cache and not engine.flush_cache():
            raise bad_request("requests paused in place hold KV the served weights computed, which a flush cannot "
                              "drop: pause with mode retract or abort, or update with flush_cache false",
                              "flush_cache")
        yield
        ctx.gate.version = weight_version or ctx.gate.version


class UpdateWeightVersionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    new_version: str
    abort_all_requests: bool = False


def update_weight_version(ctx: ServingContext, req: UpdateWeightVersionRequest) -> dict:
    """SGLang's: name the served weights' version (weights a trainer wrote
    in place), reported by /get_model_info and /get_weight_version."""
    if req.abort_all_requests:
        ctx.engine.abort_all()
    ctx.gate.version = req.new_version
    return {"success": True, "message": f"Weight version updated to {req.new_version}."}


def weight_version(ctx: ServingContext) -> dict:
    return {"weight_version": ctx.gate.version}
