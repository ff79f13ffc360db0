"""pyserve as an ASGI application, for any ASGI server or parent app.

    from pyserve import create_app
    app = create_app(model_path="/models/qwen2.5-0.5b-instruct", api_key="sekrit")

`create_app` takes the command line's options (a ServerArgs, or its field
names as keywords) and returns an ASGI 3 app. Its lifespan owns what the
app serves: on startup the model loads and the engine and the batch runner
start; on shutdown the requests in flight get --drain-timeout seconds, the
batches stop with their state saved, and the engine stops. A parent app
that does not pass the lifespan on to mounted apps (Starlette's `Mount`
does not) enters `app.lifespan()` in its own. `pyserve` the command runs
this same app under Granian.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import asynccontextmanager
from dataclasses import replace

from pyserve.option_fields import comma_list
from pyserve.server_args import ServerArgs

logger = logging.getLogger("pyserve")


def create_app(args: ServerArgs | None = None, **options) -> PyserveApp:
    """The ASGI app serving `args` (default: every option's default), with
    `options` (ServerArgs field names: model_path=..., api_key=...) applied
    over it. Nothing loads until the lifespan starts. TypeError for an
    unknown option, ValueError for an impossible value."""
    args = replace(args or ServerArgs(), **options)
    args.validate()
    if args.node_rank > 0:
        raise ValueError(f"--node-rank {args.node_rank} serves no API, only tensor-parallel ranks: "
                         "run the `pyserve` command on that node")
    return PyserveApp(args)


class PyserveApp:
    """The ASGI app: its lifespan builds and stops the engine, the stores
    and the HTTP app (pyserve.api.app.App), which serves every request."""

    def __init__(self, args: ServerArgs):
        self.args = args
        self.http = None  # the App, while started
        self._engine = None
        self._batches = None
        self._responses = None
        self._drain_deadline: float | None = None  # loop time at which the drain ends

    @property
    def started(self) -> bool:
        return self.http is not None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if self.args.root_path and not scope.get("root_path"):
            scope = {**scope, "root_path": self.args.root_path}
        if self.http is None:
            if scope["type"] == "http":
                await _not_started(send)
            return
        await self.http(scope, receive, send)

    # -- lifespan --------------------------------------------------------------

    async def startup(self) -> None:
        """Load the model and start the engine and the batch runner."""
        if self.started:
            return
        # Imported here so that `pyserve --help` answers without loading torch.
        from pyserve.api.app import App
        from pyserve.api.native.vertex import vertex_paths
        from pyserve.batches.runner import BatchManager
        from pyserve.http.proxy import CORS, TrustedProxies
        from pyserve.api.responses.routes import ResponseManager
        from pyserve.api.protocol.responses import StoredResponse
        from pyserve.api.generation.serving import ServingContext
        from pyserve.chat_template import ChatTemplate
        from pyserve.completion_template import completion_template
        from pyserve.engine.engine import Engine
        from pyserve.model.default_model import DEFAULT_MODEL_NAME
        from pyserve.batches.store import BatchStore
        from pyserve.files.store import FileStore
        from pyserve.api.responses.store import ResponseStore

        started = time.perf_counter()
        args = self.args.resolved()  # the one place "auto" is resolved
        logger.info("server_args=%s", args)
        server, engine_options, model_options = args.split()
        engine = Engine(engine_options, model_options)
        text = engine.tokenizer is not None  # not with --skip-tokenizer-init
        template = ChatTemplate.for_model(engine.tokenizer_dir, server.chat_template) if text else None
        names = comma_list(server.served_model_name) if server.served_model_name else [DEFAULT_MODEL_NAME]
        defaults = engine.model_config.sampling_defaults if server.sampling_defaults == "model" else {}
        if defaults:
            logger.info("Requests that leave them out sample with generation_config.json's %s "
                        "(--sampling-defaults openai: OpenAI's defaults)", defaults)
        defaults = {**defaults, **server.preferred_sampling()}
        ctx = ServingContext(engine, names[0], template, server.reasoning_parser, server.tool_call_parser,
                             max_sequences_per_request=server.max_sequences_per_request,
                             server_args=args.reported(), sampling_defaults=defaults,
                             completion_template=completion_template(engine.tokenizer, server.completion_template)
                             if text else None,
                             allow_auto_truncate=server.allow_auto_truncate, other_model_names=tuple(names[1:]))
        files = FileStore(server.file_storage_path, server.max_upload_size)
        batches = BatchManager(ctx, files, BatchStore(server.file_storage_path), server.batch_concurrency)
        responses = ResponseManager(ctx, ResponseStore(server.file_storage_path, StoredResponse))
        await engine.start()
        batches.start()
        self._engine, self._batches, self._responses = engine, batches, responses
        self.http = App(ctx, server.api_key, files, batches, responses=responses,
                        cors=CORS(comma_list(server.allowed_origins)),
                        proxies=TrustedProxies(comma_list(server.forwarded_allow_ips)),
                        max_body_bytes=server.max_payload_size, aliases=vertex_paths(os.environ))
        logger.info("Serving %s as %r (%.1fs to start)", engine.model_dir, names[0], time.perf_counter() - started)

    def begin_drain(self) -> None:
        """Stop taking work: new requests get a 503, batches take no new
        lines, and what is in flight has --drain-timeout seconds."""
        if self.http is None or self._drain_deadline is not None:
            return
        self._drain_deadline = asyncio.get_running_loop().time() + self.args.drain_timeout
        self.http.drain.begin(self.args.drain_timeout)
        self._batches.drain()

    def end_drain_now(self) -> None:
        """Stop what is still in flight now (a second SIGTERM or Ctrl-C)."""
        if self.http is not None:
            self.begin_drain()
            self._drain_deadline = asyncio.get_running_loop().time()
            self.http.drain.expire()

    async def shutdown(self) -> None:
        """Drain, then stop the batches (their state saved), the background
        responses (those unfinished saved as failed) and the engine."""
        if self.http is None:
            return
        self.begin_drain()
        await self.http.drain.wait_idle()
        left = max(0.0, self._drain_deadline - asyncio.get_running_loop().time())
        await self._batches.shutdown(left)
        await self._responses.shutdown(max(0.0, self._drain_deadline - asyncio.get_running_loop().time()))
        await self._engine.shutdown()
        self.http = self._engine = self._batches = self._responses = None
        self._drain_deadline = None
        logger.info("pyserve stopped")

    @asynccontextmanager
    async def lifespan(self):
        """Started inside, drained and stopped on the way out."""
        await self.startup()
        try:
            yield self
        finally:
            await self.shutdown()

    async def _lifespan(self, receive, send) -> None:
        """The ASGI lifespan protocol, over startup() and shutdown()."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:  # a bad model or option: the server reports it and exits
                    logger.error("pyserve failed to start: %s", e)
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    # Raised on, as starlette's apps do: a server that waits for the
                    # lifespan to end (starlette's TestClient) then fails at once.
                    raise
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _not_started(send) -> None:
    from pyserve.http.errors import APIError
    from pyserve.http.io import error_response

    await error_response(APIError(
        "pyserve has not started: serve it with an ASGI server that runs the lifespan, "
        "or enter `app.lifespan()` in the parent app's lifespan", 503, "server_error")).send(send)
