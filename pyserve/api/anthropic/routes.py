"""Anthropic's Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A message is answered by the chat route: api/anthropic/input.py turns the
request into a chat request, api/anthropic/stream.py reads the chat
chunks into the Message and its stream events. Streamed or not, the answer
is read from the same chunks. Errors are written in Anthropic's shape (the
routes' Dialect, api/anthropic/errors.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from pyserve.api.anthropic.input import chat_request, messages_error
from pyserve.api.anthropic.stream import MessageBuilder
from pyserve.api.generation.serving import ServingContext, answering_model, new_id
from pyserve.api.openai import chat
from pyserve.api.protocol.anthropic import CountTokensRequest, Message, MessagesRequest, TokenCount, Usage
from pyserve.http.errors import APIError


async def create(ctx: ServingContext, req: MessagesRequest) -> Message | AsyncIterator:
    message_id = new_id("msg_")
    try:
        chunks = await chat.create(ctx, chat_request(req, message_id))
    except APIError as e:
        raise messages_error(e) from None
    omit = req.thinking is not None and req.thinking.display == "omitted"
    builder = MessageBuilder(Message(id=message_id, model=answering_model(ctx, req.model, None),
                                     usage=Usage(input_tokens=0, output_tokens=0)), omit)
    events = _events(builder, chunks)
    if req.stream:
        return events
    async for _ in events:
        pass
    return builder.message


async def _events(builder: MessageBuilder, chunks: AsyncIterator) -> AsyncIterator:
    """The chat chunks read into the Message, as events. Leaving early (the
    client went away) closes the chat stream, which aborts its engine request."""
    try:
        async for chunk in chunks:
            for event in builder.feed(chunk):
                yield event
        for event in builder.finish():
            yield event
    finally:
        await chunks.aclose()


def count_tokens(ctx: ServingContext, req: CountTokensRequest) -> TokenCount:
    """The prompt's tokens, as /v1/messages would render it: a message's
    usage.input_tokens plus its cache_read_input_tokens."""
    try:
        prompt_ids, _, _, _ = chat.prepare(ctx, chat_request(req))
    except APIError as e:
        raise messages_error(e) from None
    return TokenCount(input_tokens=len(prompt_ids))
