"""Connection floods against a real `pyserve` (a tiny model, so that the
engine is not what is measured): 1,000 concurrent streams, and 200 streams
while 2,000 other connections are held open, all complete with no
connection dropped. Requests beyond what the engine runs at once wait in
its queue, not in the kernel. bench/load.py is the client."""

from __future__ import annotations

import asyncio
import re
import resource

import pytest

from bench.load import run_load
from tests.conftest import ServerProcess


@pytest.fixture(scope="module")
def flooded_server(tiny_llama_dir):
    # this process holds up to 2,200 sockets
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 4096:
        if hard != resource.RLIM_INFINITY and hard < 4096:
            pytest.skip(f"the open-files limit ({hard}) is below the 2,200 sockets this test opens")
        resource.setrlimit(resource.RLIMIT_NOFILE, (4096, hard))
    srv = ServerProcess("--model", str(tiny_llama_dir), "--max-total-tokens", "8192", "--header-read-timeout", "600")
    yield srv
    srv.stop()


def test_a_thousand_concurrent_streams_all_complete(flooded_server):
    report = asyncio.run(run_load(flooded_server.base_url, streams=1000, idle_sockets=0,
                                  server_pid=flooded_server.proc.pid))
    assert (report.completed, report.dropped, report.errors) == (1000, 0, 0), report.failures
    assert re.search(r"#queue-req: [1-9]", flooded_server.log())  # the excess waited in the engine's queue
    assert flooded_server.log().count('"POST /v1/chat/completions HTTP/1.1" 200') >= 1000


def test_two_hundred_streams_while_two_thousand_connections_are_held(flooded_server):
    report = asyncio.run(run_load(flooded_server.base_url, streams=200, idle_sockets=2000, idle_wait=0))
    assert (report.completed, report.dropped, report.errors) == (200, 0, 0), report.failures
    assert report.idle_closed == 0  # all 2,000 were still held by the server to the end
