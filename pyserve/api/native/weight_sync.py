"""SGLang's routes that put a trainer's weights into the served model
while it serves, as RL frameworks (verl, OpenRLHF, slime) call them, and
the one that reads a weight back to check (engine/runner/weight_sync.py
does the work on every rank):

- POST /init_weights_update_group: the server's ranks join a process
  group with the trainer (its rank 0), gloo or NCCL;
- POST /update_weights_from_distributed: receive the tensors the trainer
  broadcasts over that group, by checkpoint name, dtype and shape;
- POST /destroy_weights_update_group: leave it;
- POST /update_weights_from_tensor: tensors a process on the same machine
  shares (CUDA IPC or shared memory), pickled by torch.multiprocessing;
- GET or POST /get_weights_by_name: a weight's first rows, as the
  checkpoint holds it (whole over the tensor-parallel ranks).

The updates replace weights as /update_weights_from_disk does (the gate,
the engine emptied or paused, the prefix cache flushed); one that does
not fit the served model (an unknown name, a shape, a layer held
quantized) is a 400 that leaves every weight as it was. Errors are
SGLang's `{"success": false, "message"}`."""

from __future__ import annotations

import msgspec
import torch

from pyserve.api.generation.serving import ServingContext
from pyserve.api.native.weights import weights_replaced
from pyserve.engine.runner.weight_sync import (
    BACKENDS, JoinGroup, LeaveGroup, Operation, ReadWeight, ReceiveWeights, SharedWeights, dtype_of,
)
from pyserve.http.errors import bad_request
from pyserve.http.io import Request
from pyserve.http.strict import read_strict
from pyserve.model.named_weights import assemble

_GROUP = "weight_update_group"


class InitWeightsUpdateGroupRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    master_address: str  # where the trainer's TCP store listens
    master_port: int
    rank_offset: int  # the group rank of this server's tensor-parallel rank 0
    world_size: int  # the trainer, this server's ranks, and any other server's
    group_name: str = _GROUP
    backend: str = "nccl"


class DestroyWeightsUpdateGroupRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    group_name: str = _GROUP


class UpdateWeightsFromDistributedRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    names: list[str]  # checkpoint names, in the order the trainer broadcasts them
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = _GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None  # null: one broadcast per tensor; flattened_bucket: one of all their bytes
    torch_empty_cache: bool = False


class UpdateWeightsFromTensorRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    serialized_named_tensors: list[str]  # one per tensor-parallel rank (or one for all)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None  # the draft model keeps its weights: true or unset
    torch_empty_cache: bool = False


class GetWeightsByNameRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str  # a checkpoint name, e.g. model.layers.0.mlp.down_proj.weight
    truncate_size: int = 100  # the rows (of a vector, the values) returned


async def on_every_rank(ctx: ServingContext, op: Operation, param: str | None = None) -> list:
    outcomes = await ctx.engine.runner.sync_weights(op)
    failed = next((o.error for o in outcomes if o.error is not None), None)
    if failed is not None:
        raise bad_request(failed, param)
    return outcomes


def _tp_size(ctx: ServingContext) -> int:
    return ctx.server_args.get("tp_size", 1)


async def init_weights_update_group(ctx: ServingContext, req: InitWeightsUpdateGroupRequest) -> dict:
    if req.backend not in BACKENDS:
        raise bad_request(f"backend {req.backend!r}: gloo or nccl", "backend")
    if req.backend == "nccl" and ctx.engine.runner.device.type != "cuda":
        raise bad_request("backend nccl joins GPUs; this server runs on the CPU: use gloo", "backend")
    if not 0 < req.master_port < 65536:
        raise bad_request(f"master_port {req.master_port} is not a TCP port", "master_port")
    tp = _tp_size(ctx)
    if req.rank_offset < 1 or req.rank_offset + tp > req.world_size:
        raise bad_request(f"rank_offset {req.rank_offset} and world_size {req.world_size}: the trainer is rank 0, "
                          f"and this server's {tp} rank(s) take rank_offset onwards, within world_size",
                          "rank_offset")
    await on_every_rank(ctx, JoinGroup(**msgspec.structs.asdict(req)))
    return {"success": True, "message": f"Joined update group {req.group_name!r}."}


async def destroy_weights_update_group(ctx: ServingContext, request: Request) -> dict:
    req = await read_strict(request, DestroyWeightsUpdateGroupRequest, "/destroy_weights_update_group")
    await on_every_rank(ctx, LeaveGroup(group_name=req.group_name), "group_name")
    return {"success": True, "message": f"Left update group {req.group_name!r}."}


async def update_weights_from_distributed(ctx: ServingContext, req: UpdateWeightsFromDistributedRequest) -> dict:
    if req.load_format not in (None, "flattened_bucket"):
        raise bad_request(f"load_format {req.load_format!r}: null (a broadcast per tensor) or flattened_bucket",
                          "load_format")
    if not len(req.names) == len(req.dtypes) == len(req.shapes):
        raise bad_request(f"{len(req.names)} names, {len(req.dtypes)} dtypes and {len(req.shapes)} shapes: one of "
                          "each per tensor", "names")
    for dtype in req.dtypes:
        try:
            dtype_of(dtype)
        except ValueError as e:
            raise bad_request(str(e), "dtypes") from None
    if any(n < 0 for shape in req.shapes for n in shape):
        raise bad_request("a shape has a negative size", "shapes")
    op = ReceiveWeights(group_name=req.group_name, names=req.names, dtypes=req.dtypes, shapes=req.shapes,
                        flattened=req.load_format == "flattened_bucket")
    async with weights_replaced(ctx, req.abort_all_requests, req.flush_cache, req.weight_version):
        await on_every_rank(ctx, op, "names")
    _empty_cuda_cache(ctx, req.torch_empty_cache)
    return {"success": True, "message": f"Updated {len(req.names)} weights from group {req.group_name!r}."}


async def update_weights_from_tensor(ctx: ServingContext, req: UpdateWeightsFromTensorRequest) -> dict:
    if req.load_format not in (None, "direct", "flattened_bucket"):
        raise bad_request(f"load_format {req.load_format!r}: null (pickled (name, tensor) lists) or flattened_bucket",
                          "load_format")
    if req.disable_draft_model is False and ctx.engine.runner.draft is not None:
        raise bad_request("disable_draft_model false: the draft model's weights are not updated from tensors",
                          "disable_draft_model")
    tp = _tp_size(ctx)
    payloads = req.serialized_named_tensors
    if len(payloads) not in (1, tp):
        raise bad_request(f"{len(payloads)} payloads for {tp} tensor-parallel rank(s): one per rank",
                          "serialized_named_tensors")
    op = SharedWeights(payloads=payloads * tp if len(payloads) == 1 else payloads)
    async with weights_replaced(ctx, req.abort_all_requests, req.flush_cache, req.weight_version):
        await on_every_rank(ctx, op, "serialized_named_tensors")
    _empty_cuda_cache(ctx, req.torch_empty_cache)
    return {"success": True, "message": "Succeeded to update model weights."}


async def get_weights_by_name(ctx: ServingContext, request: Request) -> list:
    """The body's fields, or the query string's (a GET without a body)."""
    req = await read_strict(request, GetWeightsByNameRequest, "/get_weights_by_name", query=True)
    if req.truncate_size < 1:
        raise bad_request("truncate_size is at least 1", "truncate_size")
    outcomes = await on_every_rank(ctx, ReadWeight(name=req.name, rows=req.truncate_size), "name")
    try:
        weight = assemble([part for o in outcomes for part in o.parts], req.truncate_size)
    except ValueError as e:
        raise bad_request(f"{req.name}: {e}", "name") from None
    return weight[:req.truncate_size].tolist()


def _empty_cuda_cache(ctx: ServingContext, asked: bool) -> None:
    if asked and ctx.engine.runner.device.type == "cuda":
        torch.cuda.empty_cache()
