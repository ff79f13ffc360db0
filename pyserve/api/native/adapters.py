"""LoRA adapters at run time: SGLang's POST /load_lora_adapter and
/unload_lora_adapter, and vLLM's /v1/ forms of both (same bodies)."""

from __future__ import annotations

from pyserve.api.generation.serving import ServingContext
from pyserve.api.protocol.native import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from pyserve.http.errors import APIError, bad_request
from pyserve.http.io import Response


def _adapters(ctx: ServingContext):
    if ctx.engine.adapters is None:
        raise bad_request("this server serves the base model alone: start it with --enable-lora")
    return ctx.engine.adapters


async def load(ctx: ServingContext, req: LoadLoraAdapterRequest) -> Response:
    if req.lora_name in ctx.model_names:  # `model` must still reach the base model
        raise bad_request(f"lora_name {req.lora_name!r} is a name of the base model", "lora_name")
    try:
        await _adapters(ctx).load(req.lora_name, req.lora_path)
    except ValueError as e:
        raise bad_request(str(e), "lora_path") from None
    return Response(200, f"Success: LoRA adapter '{req.lora_name}' added successfully.\n".encode(),
                    "text/plain; charset=utf-8")


def unload(ctx: ServingContext, req: UnloadLoraAdapterRequest) -> Response:
    adapters = _adapters(ctx)
    try:
        adapters.unload(req.lora_name)
    except KeyError:
        raise APIError(f"The LoRA adapter '{req.lora_name}' cannot be found. {adapters.describe()}", 404,
                       param="lora_name", code="model_not_found") from None
    return Response(200, f"Success: LoRA adapter '{req.lora_name}' removed successfully.\n".encode(),
                    "text/plain; charset=utf-8")
