"""The Batches API: create, retrieve, cancel, list."""

from __future__ import annotations

import msgspec

from pyserve.batches.runner import BatchManager
from pyserve.http.io import Request, page
from pyserve.batches.store import BatchRecord


class CreateBatchRequest(msgspec.Struct, kw_only=True):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


async def create(batches: BatchManager, req: CreateBatchRequest) -> BatchRecord:
    return await batches.create(req.input_file_id, req.endpoint, req.completion_window, req.metadata)


async def retrieve(batches: BatchManager, batch_id: str) -> BatchRecord:
    return batches.get(batch_id)


async def cancel(batches: BatchManager, batch_id: str) -> BatchRecord:
    return await batches.cancel(batch_id)


async def list_batches(batches: BatchManager, request: Request) -> dict:
    return page(batches.list(), request.query(), default_limit=20, max_limit=100)
