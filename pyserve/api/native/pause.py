"""SGLang's POST /pause_generation and POST /continue_generation, which
RL trainers call around a weight update.

A pause closes the admission gate (new requests wait at it), stops the
engine after the step in flight, and by its `mode`: "abort" (the
default) ends every request in the engine, their clients getting what
was generated so far; "retract" puts the running requests back in the
queue with their KV given to the prefix cache, so a flush may drop it
and they recompute it; "in_place" keeps everything. While
paused, /update_weights_from_disk does not wait for the requests in the
engine. /continue_generation opens the gate and the engine goes on."""

from __future__ import annotations

from typing import Literal

import msgspec
import torch

from pyserve.api.generation.serving import ServingContext
from pyserve.http.io import Request, decode_json
from pyserve.http.strict import convert_strict


class PauseGenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    torch_empty_cache: bool = True  # give the CUDA allocator's cached blocks back first


async def _body(request: Request, kind: type, route: str):
    """The body, which SGLang's clients may leave empty."""
    raw = await request.body()
    return convert_strict(decode_json(msgspec.json.Decoder(dict), raw) if raw.strip() else {}, kind, route)


async def pause_generation(ctx: ServingContext, request: Request) -> dict:
    req = await _body(request, PauseGenerationRequest, "/pause_generation")
    engine = ctx.engine
    # Every mode stops the engine, so that a request already past the gate
    # waits in its queue too.
    await ctx.gate.pause(req.mode, engine.pause(retract=req.mode == "retract"))
    if req.mode == "abort":
        engine.abort_all()
    return {"status": "ok", "message": f"Generation paused ({req.mode})."}


async def continue_generation(ctx: ServingContext, request: Request) -> dict:
    req = await _body(request, ContinueGenerationRequest, "/continue_generation")
    if req.torch_empty_cache and ctx.engine.runner.device.type == "cuda":
        torch.cuda.empty_cache()
    ctx.engine.resume()
    ctx.gate.resume()
    return {"status": "ok", "message": "Generation continued."}
