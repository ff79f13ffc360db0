"""`pyserve`: load the model, then serve the HTTP API with Granian; or, on a
node other than 0 of a tensor-parallel group, run that node's ranks."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import resource
import signal
import socket
import sys
from typing import NoReturn

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
    """The app of pyserve.asgi.create_app under Granian's embedded server.

    The model loads before the port is bound, so a bad model fails before
    anything listens. SIGTERM or Ctrl-C stops accepting connections and
    drains the requests in flight (--drain-timeout); a second one ends
    them at once."""
    # Imported here so that `pyserve --help` answers without loading torch.
    from granian.constants import HTTPModes, Interfaces
    from granian.http import HTTP1Settings
    from granian.server.embed import Server

    from pyserve.asgi import create_app

    log = logging.getLogger("pyserve")
    check_port_free(args.host, args.port)  # before minutes of loading, not after
    raise_open_files_limit(args.max_connections)
    app = create_app(args)
    await app.startup()
    # The model, modules and engine made at start-up live as long as the
    # server: out of the collector's sight, a full collection no longer
    # walks them, which paused the event loop for half a second.
    gc.freeze()
    server = Server(
        app,
        address=args.host,
        port=args.port,
        interface=Interfaces.ASGINL,  # the lifespan is run here, around the server
        # HTTP/1.1 only: hyper's HTTP/2 detection holds a silent connection
        # with no timeout, and clients and proxies speak HTTP/1.1 to us.
        http=HTTPModes.http1,
        backlog=args.backlog,
        backpressure=args.max_connections,  # Granian's cap of open connections
        http1_settings=HTTP1Settings(header_read_timeout=int(args.header_read_timeout * 1000), keep_alive=True),
        log_enabled=False,
    )

    stopping = False

    def on_signal() -> None:
        nonlocal stopping
        if stopping:
            app.end_drain_now()
            return
        stopping = True
        app.begin_drain()
        server.stop()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    # Granian calls its startup hooks once the listening socket is bound.
    server.on_startup(lambda: log.info("pyserve is ready on http://%s:%d%s", args.host, args.port, args.root_path))
    try:
        await server.serve()  # returns once every connection has ended
    finally:
        await app.shutdown()


def raise_open_files_limit(max_connections: int) -> None:
    """Each connection is a file descriptor: raise the soft limit (often
    1,024) toward the hard one, so --max-connections can be reached."""
    want = max_connections + 1024  # model files, storage, the engine's own
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < want:
        logging.getLogger("pyserve").warning(
            "open files are limited to %d (ulimit -Hn): fewer than --max-connections %d plus files",
            target, max_connections)


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


def main(argv: list[str] | None = None) -> NoReturn:
    args = ServerArgs.from_cli(argv)
    setup_logging(args.log_level)
    try:
        if args.node_rank > 0:
            # Another node of a tensor-parallel group: its ranks only, no HTTP.
            from pyserve.engine.tp.workers import run_worker_node

            status = run_worker_node(args.resolved().split().model)
        else:
            asyncio.run(serve(args))
            status = 0
    except (ValueError, RuntimeError, OSError) as e:  # bad model, options or port, a failed rank: one clear line
        logging.getLogger("pyserve").error("%s", e)
        status = 1
    end_process(status)


def end_process(status: int) -> NoReturn:
    """Exit with `status` once everything pyserve wrote is flushed, without
    the interpreter's finalization: a thread still running Rust or C++ code
    (Granian's runtime, torch's) that reaches for the GIL while the
    interpreter finalizes is unwound through frames that cannot unwind,
    and a server that had stopped cleanly dies of SIGABRT ("panic in a
    function that cannot unwind", "terminate called without an active
    exception")."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
