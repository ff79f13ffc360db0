"""The Batches API: create, retrieve, cancel, list."""

from __future__ import annotations

import msgspec

from pyserve.api.files import page, query
from pyserve.api.http import Request
from pyserve.api.serving import ServingContext


class CreateBatchRequest(msgspec.Struct, kw_only=True):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


async def create(ctx: ServingContext, req: CreateBatchRequest) -> dict:
    return await ctx.batches.create(req.input_file_id, req.endpoint, req.completion_window, req.metadata)


async def retrieve(ctx: ServingContext, batch_id: str) -> dict:
    return ctx.batches.get(batch_id)


async def cancel(ctx: ServingContext, batch_id: str) -> dict:
    return await ctx.batches.cancel(batch_id)


async def list_batches(ctx: ServingContext, request: Request) -> dict:
    return page(ctx.batches.list(), query(request), default_limit=20, max_limit=100)
