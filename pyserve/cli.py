"""`pyserve`: load the model, then serve the HTTP API with Granian."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
import time

from pyserve.server_args import ServerArgs


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="[%(asctime)s] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stdout,
        force=True,
    )


async def serve(args: ServerArgs) -> None:
    # Imported here so that `pyserve --help` answers without loading torch.
    from granian.constants import Interfaces
    from granian.server.embed import Server

    from pyserve.api.app import App
    from pyserve.api.batch_runner import BatchManager
    from pyserve.api.serving import ServingContext
    from pyserve.chat_template import ChatTemplate
    from pyserve.model.default_model import DEFAULT_MODEL_NAME
    from pyserve.engine.engine import Engine
    from pyserve.storage.batches import BatchStore
    from pyserve.storage.files import FileStore

    log = logging.getLogger("pyserve")
    started = time.perf_counter()
    args = args.resolved()
    log.info("server_args=%s", args)
    check_port_free(args.host, args.port)  # before minutes of loading, not after
    engine = Engine(args)
    template = ChatTemplate.for_model(engine.model_dir, args.chat_template)
    name = args.served_model_name or args.model_path or DEFAULT_MODEL_NAME
    ctx = ServingContext(engine, name, template, args.reasoning_parser, args.tool_call_parser)
    files = FileStore(args.file_storage_path, args.max_upload_size)
    batches = BatchManager(ctx, files, BatchStore(args.file_storage_path), args.batch_concurrency)
    await engine.start()
    batches.start()
    server = Server(
        App(ctx, args.api_key, files, batches),
        address=args.host,
        port=args.port,
        interface=Interfaces.ASGINL,
        log_enabled=False,
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    log.info("Serving %s as %r (%.1fs to start)", engine.model_dir, name, time.perf_counter() - started)
    # Granian calls its startup hooks once the listening socket is bound.
    server.on_startup(lambda: log.info("pyserve is ready on http://%s:%d", args.host, args.port))
    try:
        await server.serve()
    finally:
        await batches.shutdown()
        await engine.shutdown()
        log.info("pyserve stopped")


def check_port_free(host: str, port: int) -> None:
    """Granian binds with SO_REUSEPORT, so a second server on a taken port
    would silently share it; a bind without it tells us it is taken (while
    SO_REUSEADDR lets a restart reuse a port its predecessor left in TIME_WAIT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror}") from None


def main(argv: list[str] | None = None) -> None:
    args = ServerArgs.from_cli(argv)
    setup_logging(args.log_level)
    try:
        asyncio.run(serve(args))
    except (ValueError, RuntimeError, OSError) as e:  # bad model, options or port: one clear line
        logging.getLogger("pyserve").error("%s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
