"""SGLang's POST /release_memory_occupation and /resume_memory_occupation,
and vLLM's POST /sleep, POST /wake_up and GET /is_sleeping:
an RL trainer colocated with the server takes the memory of the KV cache,
the weights and the CUDA graphs (`tags`; none named: all three) between
rollouts, and gives it back (engine/runner/memory_occupation.py does it
on every rank). While any is released, requests wait at the admission
gate and /health_generate answers 503. A release waits for the requests
in the engine to finish, as a weight update does; the weights come back
as the served checkpoint on disk has them, before a trainer sends its own."""

from __future__ import annotations

import msgspec

from pyserve.api.generation.serving import ServingContext
from pyserve.api.native.pause import engine_emptied
from pyserve.api.native.weight_sync import on_every_rank
from pyserve.engine.runner.memory_occupation import TAGS, ReleaseMemory, ResumeMemory
from pyserve.http.errors import bad_request
from pyserve.http.io import Request


class MemoryOccupationRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tags: list[str] | None = None  # kv_cache, weights, cuda_graph; None: all


def _tags(given: list[str] | None) -> list[str]:
    tags = list(TAGS) if given is None else given
    unknown = [t for t in tags if t not in TAGS]
    if unknown or not tags:
        raise bad_request(f"tags {tags}: some of {', '.join(TAGS)} (null: all)", "tags")
    return tags


async def release_memory_occupation(ctx: ServingContext, req: MemoryOccupationRequest) -> None:
    await _release(ctx, _tags(req.tags))


async def _release(ctx: ServingContext, tags: list[str], host_copy: bool = False) -> None:
    engine = ctx.engine
    if engine.runner.draft is not None:
        raise bad_request("a server with a draft model (speculative decoding) keeps its memory: its draft's KV "
                          "cache and weights are not released", "tags")
    async with ctx.gate.updating():
        await engine_emptied(engine, stop=lambda: ctx.gate.pause_mode is not None)
        if engine.request_ids:
            raise bad_request("requests paused in place hold the memory: continue or abort them first", "tags")
        if "kv_cache" in tags:
            engine.flush_cache()  # the cached prefixes' KV goes with the memory
        try:
            await on_every_rank(ctx, ReleaseMemory(tags=tags, host_copy=host_copy), "tags")
        finally:
            ctx.gate.memory_released = bool(engine.runner.memory_released)


async def resume_memory_occupation(ctx: ServingContext, req: MemoryOccupationRequest) -> None:
    await _resume(ctx, _tags(req.tags))


async def _resume(ctx: ServingContext, tags: list[str]) -> None:
    runner = ctx.engine.runner
    async with ctx.gate.updating():
        try:
            await on_every_rank(ctx, ResumeMemory(tags=tags, checkpoint=str(runner.checkpoint_dir)), "tags")
        finally:
            ctx.gate.memory_released = bool(runner.memory_released)


async def vllm_sleep(ctx: ServingContext, request: Request) -> None:
    """vLLM's `?level=`: 1 (the default) keeps the weights in host memory
    to wake with, 2 lets them go (they wake as the checkpoint on disk has
    them); the KV cache goes at either. On a CPU server the weights are in
    host memory already: level 1 frees nothing of them."""
    level = request.query().get("level", "1")
    if level not in ("1", "2"):
        raise bad_request(f"level {level!r}: 1 (the weights kept in host memory) or 2 (let go)", "level")
    await _release(ctx, list(TAGS), host_copy=level == "1")


async def vllm_wake_up(ctx: ServingContext, request: Request) -> None:
    """vLLM's `?tags=weights&tags=kv_cache` (none: everything asleep)."""
    tags = request.query_values("tags") or list(TAGS)
    if "kv_cache" in tags:  # vLLM names no graphs: they come back with the KV cache
        tags.append("cuda_graph")
    await _resume(ctx, _tags(tags))


def vllm_is_sleeping(ctx: ServingContext) -> dict:
    return {"is_sleeping": bool(ctx.engine.runner.memory_released)}
