"""--watchdog-timeout (SGLang's): a forward step that runs longer means a
hung kernel, device or tensor-parallel rank. The process then ends, with
every thread's stack in the log, so that whatever supervises it starts a
new one, instead of holding its requests and taking new ones forever."""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import sys
from collections.abc import Awaitable
from typing import TypeVar

logger = logging.getLogger("pyserve.engine")

T = TypeVar("T")

# The exit status of a process the watchdog ended.
EXIT_STATUS = 3


async def within(step: Awaitable[T], timeout: float | None) -> T:
    """`step`'s result; past `timeout` seconds (None: never), the process ends."""
    if timeout is None:
        return await step
    try:
        return await asyncio.wait_for(asyncio.shield(step), timeout)
    except asyncio.TimeoutError:
        logger.critical("a forward step ran past --watchdog-timeout %g s: the process ends (every thread's "
                        "stack follows)", timeout)
        logging.shutdown()
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        sys.stdout.flush()
        os._exit(EXIT_STATUS)  # the hung thread cannot be stopped; no clean shutdown can finish
