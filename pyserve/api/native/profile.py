"""POST /start_profile and POST /stop_profile, as SGLang and vLLM serve
them (SGLang's bench_serving --profile calls both): a torch.profiler
trace of the forward thread's steps (engine/runner/profiler.py), written
to `output_dir` (default $SGLANG_TORCH_PROFILER_DIR, else
$VLLM_TORCH_PROFILER_DIR, else /tmp) as `<profile_id>-TP-0.trace.json`.
Both take an empty body, as vLLM's clients send it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from pyserve.api.generation.serving import ServingContext
from pyserve.http.errors import bad_request
from pyserve.http.io import Request, Response
from pyserve.http.strict import read_strict


class StartProfileRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's body; what pyserve cannot do (starting at a later step,
    profiling by stage, the CUDA profiler's own capture) is refused."""

    output_dir: str | None = None
    num_steps: int | None = None  # stop by itself after this many steps
    activities: list[str] | None = None  # CPU, GPU, MEM (default: CPU, and GPU on CUDA)
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None  # the trace file's name (default: the time)
    start_step: int | None = None
    profile_by_stage: bool = False


def _text(message: str) -> Response:
    return Response(200, message.encode(), "text/plain; charset=utf-8")


async def start_profile(ctx: ServingContext, request: Request) -> Response:
    req = await read_strict(request, StartProfileRequest, "/start_profile")
    if req.start_step is not None or req.profile_by_stage:
        raise bad_request("profiles start at once and cover whole steps: start_step and profile_by_stage are not "
                          "supported", "start_step" if req.start_step is not None else "profile_by_stage")
    if req.num_steps is not None and req.num_steps < 1:
        raise bad_request("num_steps must be at least 1", "num_steps")
    on_cuda = ctx.engine.runner.device.type == "cuda"
    activities = req.activities or (["CPU", "GPU"] if on_cuda else ["CPU"])
    unknown = [a for a in activities if a not in ("CPU", "GPU", "MEM") or (a == "GPU" and not on_cuda)]
    if unknown:
        raise bad_request(f"activities {unknown} cannot be profiled here: CPU, MEM" + (", GPU" if on_cuda else
                          " (GPU on a CUDA server)"), "activities")
    output_dir = req.output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or \
        os.environ.get("VLLM_TORCH_PROFILER_DIR") or "/tmp"
    try:
        await ctx.engine.runner.start_profile(
            output_dir=Path(output_dir), profile_id=req.profile_id or str(time.time()),
            activities=[a for a in activities if a != "MEM"], num_steps=req.num_steps,
            record_shapes=bool(req.record_shapes), with_stack=bool(req.with_stack), profile_memory="MEM" in activities)
    except (ValueError, OSError) as e:
        raise bad_request(str(e)) from None
    return _text("Start profiling.\n")


async def stop_profile(ctx: ServingContext, request: Request) -> Response:
    try:
        path = await ctx.engine.runner.stop_profile()
    except ValueError as e:
        raise bad_request(str(e)) from None
    return _text(f"Stop profiling. The trace is in {path}.\n")
