"""Vertex AI's prediction route, as SGLang serves it: POST
/vertex_generate, or the paths Vertex names in the container's
environment (AIP_PREDICT_ROUTE for predictions, AIP_HEALTH_ROUTE for its
health checks, which /health answers), with {"instances": [...],
"parameters": {...}}. The instances' prompts (each one `text`,
`input_ids` or `input_embeds`, all of one kind) go to /generate as one
batch with the parameters (/generate's other fields: `sampling_params`,
`return_logprob`, ...), and the answer is {"predictions": [each prompt's
/generate answer]}."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from pyserve.api.generation.serving import ServingContext
from pyserve.api.native.generate import generate
from pyserve.api.protocol.native import NativeGenerateRequest
from pyserve.http.errors import bad_request
from pyserve.http.strict import convert_strict

PREDICT_PATH = "/vertex_generate"
_PROMPT_KINDS = ("text", "input_ids", "input_embeds")


class VertexRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    instances: list[dict]
    parameters: dict | None = None


def vertex_paths(environ: Mapping[str, str]) -> dict[str, str]:
    """The paths Vertex sends to (from the container's environment), each
    to the route that answers it."""
    paths = {environ.get("AIP_PREDICT_ROUTE"): PREDICT_PATH, environ.get("AIP_HEALTH_ROUTE"): "/health"}
    return {path: route for path, route in paths.items() if path}


async def predict(ctx: ServingContext, req: VertexRequest) -> dict:
    if not req.instances:
        return {"predictions": []}
    kind = next(iter(req.instances[0]), None)
    if kind not in _PROMPT_KINDS or any(list(instance) != [kind] for instance in req.instances):
        raise bad_request("each instance is one prompt, {\"text\"}, {\"input_ids\"} or {\"input_embeds\"}, all of "
                          "the same kind", "instances")
    parameters = req.parameters or {}
    if kind in parameters or parameters.get("stream"):
        raise bad_request("parameters are /generate's other fields, answered whole: not the prompt, nor stream",
                          "parameters")
    body = convert_strict({kind: [instance[kind] for instance in req.instances], **parameters},
                          NativeGenerateRequest, PREDICT_PATH)
    answer = await generate(ctx, body)
    return {"predictions": answer if isinstance(answer, list) else [answer]}
