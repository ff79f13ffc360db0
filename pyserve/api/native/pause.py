"""SGLang's POST /pause_generation and POST /continue_generation, which
RL trainers call around a weight update.

A pause closes the admission gate (new requests wait at it), stops the
engine after the step in flight, and by its `mode`: "abort" (the
default) ends every request in the engine, their clients getting what
was generated so far; "retract" puts the running requests back in the
queue with their KV given to the prefix cache, so a flush may drop it
and they recompute it; "in_place" keeps everything. While paused,
/update_weights_from_disk does not wait for the requests in the engine.
/continue_generation opens the gate and the engine goes on.

vLLM's POST /pause (query `mode`: abort, wait for the requests in the
engine to finish, or keep them frozen; `clear_cache`, default true,
flushes the prefix cache unless keeping), POST /resume and GET /is_paused
are the same pause."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal

import msgspec
import torch

from pyserve.api.generation.serving import ServingContext
from pyserve.engine.engine import Engine
from pyserve.http.errors import bad_request
from pyserve.http.io import Request
from pyserve.http.strict import read_strict


class PauseGenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    torch_empty_cache: bool = True  # give the CUDA allocator's cached blocks back first


async def pause_generation(ctx: ServingContext, request: Request) -> dict:
    req = await read_strict(request, PauseGenerationRequest, "/pause_generation")
    engine = ctx.engine
    # Every mode stops the engine, so that a request already past the gate
    # waits in its queue too.
    await ctx.gate.pause(req.mode, engine.pause(retract=req.mode == "retract"))
    if req.mode == "abort":
        engine.abort_all()
    return {"status": "ok", "message": f"Generation paused ({req.mode})."}


async def continue_generation(ctx: ServingContext, request: Request) -> dict:
    req = await read_strict(request, ContinueGenerationRequest, "/continue_generation")
    if req.torch_empty_cache and ctx.engine.runner.device.type == "cuda":
        torch.cuda.empty_cache()
    _resume(ctx)
    return {"status": "ok", "message": "Generation continued."}


def _resume(ctx: ServingContext) -> None:
    """The engine steps again, then the gate lets the waiting requests in."""
    ctx.engine.resume()
    ctx.gate.resume()


_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def _query_flag(query: dict[str, str], name: str, default: bool) -> bool:
    if name not in query:
        return default
    if query[name].lower() not in _BOOLEANS:
        raise bad_request(f"{name} must be true or false, not {query[name]!r}", name)
    return _BOOLEANS[query[name].lower()]


async def engine_emptied(engine: Engine, stop: Callable[[], bool] = lambda: False) -> None:
    """Return once the engine holds no request, running or waiting (or once `stop()`)."""
    while (engine.num_running or engine.num_waiting) and not stop():
        await asyncio.sleep(0.02)


async def _drained_then_paused(engine: Engine) -> None:
    """vLLM's wait: the requests in the engine finish, then it stops."""
    await engine_emptied(engine)
    await engine.pause(retract=False)


async def vllm_pause(ctx: ServingContext, request: Request) -> dict:
    query = request.query()
    mode = "wait" if _query_flag(query, "wait_for_inflight_requests", False) else query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise bad_request(f"mode {mode!r}: expected abort, wait or keep", "mode")
    clear_cache = _query_flag(query, "clear_cache", True)
    engine = ctx.engine
    stop = _drained_then_paused(engine) if mode == "wait" else engine.pause(retract=False)
    await ctx.gate.pause({"keep": "in_place"}.get(mode, mode), stop)
    if mode == "abort":
        engine.abort_all()
    if clear_cache and mode != "keep":
        engine.flush_cache()
    return {"status": "paused"}


def vllm_resume(ctx: ServingContext) -> dict:
    _resume(ctx)
    return {"status": "resumed"}


def vllm_is_paused(ctx: ServingContext) -> dict:
    return {"is_paused": ctx.gate.pause_mode is not None}
