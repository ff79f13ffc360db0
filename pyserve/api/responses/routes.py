"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id},
POST /v1/responses/{id}/cancel and GET /v1/responses/{id}/input_items.

A response is answered by the chat route (api/responses/input.py turns the
request into a chat request; api/responses/stream.py reads the chat
chunks into the Response and its stream events), in the request, streamed
or not, or in the background as an asyncio task. With `store` (the
default, as in OpenAI's API) the Response and the conversation it answered
are kept on disk (api/responses/store.py), so `previous_response_id`, GET,
DELETE and input_items work across restarts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pyserve.api.openai import chat
from pyserve.http.errors import APIError, bad_request
from pyserve.http.io import Request, page
from pyserve.api.responses.input import (
    chat_request, check_call_outputs, check_supported, read_input, responses_error, unsupported,
)
from pyserve.api.protocol.responses import (
    ACTIVE, ReasoningConfig, Response, ResponseError, ResponsesRequest, StoredResponse, TextConfig,
)
from pyserve.api.responses.stream import Event, ResponseBuilder, snapshot
from pyserve.api.generation.serving import ServingContext, answering_model, now
from pyserve.http.strict import convert_strict
from pyserve.api.responses.store import ResponseNotFound, ResponseStore, RunLock, new_response_id

logger = logging.getLogger("pyserve.responses")


@dataclass
class BackgroundRun:
    record: StoredResponse
    builder: ResponseBuilder
    task: asyncio.Task | None = None
    started: bool = False  # its task took its first step
    stop: str | None = None  # why it was told to stop: "cancel" (the client) or "shutdown"


class ResponseManager:
    """Answers, keeps, shows, cancels and deletes responses. The store owns
    what is on disk; `running` owns the background responses this process
    runs, whose in-memory Response is the current one."""

    def __init__(self, ctx: ServingContext, store: ResponseStore[StoredResponse]):
        self.ctx = ctx
        self.store = store
        self.running: dict[str, BackgroundRun] = {}

    # -- creating ----------------------------------------------------------------

    async def create(self, req: ResponsesRequest) -> Response | AsyncIterator[Event]:
        check_supported(req)
        items = read_input(req.input)
        first_new = 0
        if req.previous_response_id is not None:
            previous = await self._previous(req.previous_response_id)
            earlier = previous.input + previous.response.output
            items, first_new = earlier + items, len(earlier)
        check_call_outputs(items, first_new)
        response_id = new_response_id()
        try:
            chunks = await chat.create(self.ctx, chat_request(req, items, response_id))
        except APIError as e:
            raise responses_error(e) from None
        record = StoredResponse(response=self._new_response(req, response_id), input=items)
        builder = ResponseBuilder(record.response, self._count_tokens)
        if req.background:
            return await self._start_background(record, builder, chunks)
        if req.stream:
            return self._stream(record, builder, chunks)
        async for _ in self._run(builder, chunks):
            pass
        await self._keep(record)
        if record.response.status == "failed":
            raise APIError(record.response.error.message, 500, "server_error", code=record.response.error.code)
        return record.response

    def _new_response(self, req: ResponsesRequest, response_id: str) -> Response:
        return Response(
            id=response_id, created_at=now(), status="queued" if req.background else "in_progress",
            background=bool(req.background), instructions=req.instructions,
            max_output_tokens=req.max_output_tokens, max_tool_calls=req.max_tool_calls,
            # The adapter a request picked by `model` is the model that answers.
            model=answering_model(self.ctx, req.model, None),
            parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
            prompt_cache_key=req.prompt_cache_key, reasoning=req.reasoning or ReasoningConfig(),
            safety_identifier=req.safety_identifier, store=req.store is not False, temperature=req.temperature,
            text=req.text or TextConfig(), tool_choice=req.tool_choice or "auto", tools=req.tools or [],
            top_p=req.top_p, user=req.user, metadata=req.metadata or {},
        )

    def _count_tokens(self, text: str) -> int:
        return len(self.ctx.engine.tokenizer.encode(text)) if text else 0

    async def _previous(self, response_id: str) -> StoredResponse:
        try:
            previous = await self.get(response_id)
        except APIError:
            raise bad_request(f"Previous response with id {response_id!r} not found.", "previous_response_id",
                              "previous_response_not_found") from None
        if previous.response.status not in ("completed", "incomplete"):
            raise bad_request(f"the previous response is {previous.response.status}: only a completed or "
                              "incomplete response can be continued", "previous_response_id")
        return previous

    async def _run(self, builder: ResponseBuilder, chunks: AsyncIterator) -> AsyncIterator[Event]:
        """The chat chunks read into the Response, as events. A failure of
        the generation ends the response as failed; leaving early (the
        client went away, a cancel) closes the chat stream, which aborts
        its engine request."""
        try:
            for event in builder.start():
                yield event
            try:
                async for chunk in chunks:
                    for event in builder.feed(chunk):
                        yield event
            except APIError as e:
                for event in builder.fail(e):
                    yield event
                return
            for event in builder.finish():
                yield event
        finally:
            await chunks.aclose()

    async def _stream(self, record: StoredResponse, builder: ResponseBuilder,
                      chunks: AsyncIterator) -> AsyncIterator[Event]:
        async for event in self._run(builder, chunks):
            yield event
        await self._keep(record)

    async def _keep(self, record: StoredResponse) -> None:
        if record.response.store:
            await self.store.save(record.id, record)

    # -- background ----------------------------------------------------------------

    async def _start_background(self, record: StoredResponse, builder: ResponseBuilder,
                                chunks: AsyncIterator) -> Response:
        lock = self.store.try_lock(record.id)  # a new id: nobody else holds it
        await self.store.save(record.id, record)
        run = BackgroundRun(record, builder)
        self.running[record.id] = run
        run.task = asyncio.create_task(self._run_background(run, chunks, lock), name=f"response-{record.id}")
        return snapshot(record.response)

    async def _run_background(self, run: BackgroundRun, chunks: AsyncIterator, lock: RunLock) -> None:
        run.started = True
        try:
            if run.stop is not None:
                raise asyncio.CancelledError  # told to stop before it began
            saved_running = False
            async for _ in self._run(run.builder, chunks):
                if not saved_running:  # in_progress now, no longer queued
                    saved_running = True
                    await self.store.save(run.record.id, run.record)
        except asyncio.CancelledError:
            if run.stop == "cancel":
                run.builder.cancel()
            else:
                run.builder.fail(APIError("the server shut down before the response finished", 503,
                                          "server_error"))
        except Exception as e:  # saved as failed, not lost in a task nobody awaits
            logger.exception("background response %s failed", run.record.id)
            run.builder.fail(APIError(f"internal error: {e}", 500, "server_error"))
        finally:
            try:
                await self.store.save(run.record.id, run.record)
            finally:
                del self.running[run.record.id]
                lock.release()

    async def cancel(self, response_id: str) -> Response:
        """OpenAI's cancel: a background response still running ends
        `cancelled`; cancelling it again returns it as it is."""
        run = self.running.get(response_id)
        if run is not None:
            await self._stop(run, "cancel")
            return run.record.response
        record = await self.get(response_id)
        response = record.response
        if not response.background:
            raise bad_request("only responses created with background=true can be cancelled", "response_id")
        if response.status in ACTIVE:
            raise APIError("this response runs in another server process sharing the storage path; cancel it "
                           "there", 409, code="invalid_state")
        if response.status != "cancelled":
            raise bad_request(f"cannot cancel a response that is {response.status}", "response_id")
        return response

    async def _stop(self, run: BackgroundRun, reason: str) -> None:
        """Stop a background run and wait until it has saved its end. A
        task cancelled before its first step would never run its handlers,
        so one not started yet is told, and stops when it starts."""
        run.stop = reason
        if run.started:
            run.task.cancel()
        await asyncio.gather(run.task, return_exceptions=True)

    async def shutdown(self, timeout: float = 0.0) -> None:
        """Give the background responses still running up to `timeout`
        seconds, then stop them: those unfinished are saved as failed."""
        runs = list(self.running.values())
        if runs and timeout > 0:
            await asyncio.wait([run.task for run in runs], timeout=timeout)
        await asyncio.gather(*(self._stop(run, "shutdown") for run in runs if not run.task.done()))

    # -- reading and deleting --------------------------------------------------------

    async def get(self, response_id: str) -> StoredResponse:
        run = self.running.get(response_id)
        if run is not None:
            return snapshot(run.record)
        try:
            record = await self.store.load(response_id)
        except ResponseNotFound:
            raise APIError(f"Response with id {response_id!r} not found.", 404, param="response_id",
                           code="response_not_found") from None
        if record.response.status in ACTIVE:
            record = await self._settle_orphan(record)
        return record

    async def _settle_orphan(self, record: StoredResponse) -> StoredResponse:
        """A record still marked running that no process runs (its lock is
        free: the process stopped) is saved as failed."""
        lock = self.store.try_lock(record.id)
        if lock is None:
            return record  # another process runs it
        try:
            record = await self.store.load(record.id)  # as its runner left it
            if record.response.status in ACTIVE:
                record.response.status = "failed"
                record.response.error = ResponseError(
                    code="server_error", message="the server that ran this response stopped before it finished")
                await self.store.save(record.id, record)
        finally:
            lock.release()
        return record

    async def delete(self, response_id: str) -> dict:
        run = self.running.get(response_id)
        if run is not None:
            await self._stop(run, "cancel")
        try:
            await self.store.delete(response_id)
        except ResponseNotFound:
            raise APIError(f"Response with id {response_id!r} not found.", 404, param="response_id",
                           code="response_not_found") from None
        return {"id": response_id, "object": "response", "deleted": True}


# -- routes --------------------------------------------------------------------------


async def create(responses: ResponseManager, body: dict):
    return await responses.create(convert_strict(body, ResponsesRequest, "pyserve's Responses API"))


def _refuse_query(request: Request, names: tuple[str, ...]) -> dict[str, str]:
    query = request.query()
    for name in query:
        if name.startswith(names):
            raise unsupported(name, f"the query parameter {name!r}")
    return query


async def retrieve(responses: ResponseManager, request: Request, response_id: str) -> Response:
    _refuse_query(request, ("stream", "starting_after", "include"))
    return (await responses.get(response_id)).response


async def delete(responses: ResponseManager, response_id: str) -> dict:
    return await responses.delete(response_id)


async def cancel(responses: ResponseManager, response_id: str) -> Response:
    return await responses.cancel(response_id)


async def input_items(responses: ResponseManager, request: Request, response_id: str) -> dict:
    """The conversation items the response answered (the previous
    responses' included), newest first unless `order=asc`."""
    query = _refuse_query(request, ("include",))
    items = list((await responses.get(response_id)).input)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", "order")
    return page(items[::-1] if order == "desc" else items, query, default_limit=20, max_limit=100)
