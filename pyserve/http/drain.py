"""The requests in flight, and the end of their time at shutdown."""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager

logger = logging.getLogger("pyserve.http")

# After the drain time, stopped requests need a moment to send their last
# bytes; one that still has not ended by then is not waited for.
STOPPED_REQUESTS_GRACE = 5.0


class Drain:
    """Counts the HTTP requests in flight; `begin(timeout)` starts the drain.

    Draining, the app answers new requests with a 503 and gives those in
    flight `timeout` seconds; then the futures of `stopped()` resolve, and
    each request still running is stopped: a stream ends with an error
    event, a whole response becomes a 503."""

    def __init__(self):
        self.draining = False
        self.expired = False
        self._stop_waiters: set[asyncio.Future] = set()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @contextmanager
    def track(self):
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    def stopped(self) -> asyncio.Future:
        """A future that resolves when the drain time ends (at once if it has)."""
        future = asyncio.get_running_loop().create_future()
        if self.expired:
            future.set_result(None)
        else:
            self._stop_waiters.add(future)
            future.add_done_callback(self._stop_waiters.discard)
        return future

    def begin(self, timeout: float) -> None:
        """Start draining (again: nothing changes); the drain time ends after `timeout` s."""
        if self.draining:
            return
        self.draining = True
        logger.info("Draining: %d requests in flight get %.0f s to finish", self._in_flight, timeout)
        asyncio.get_running_loop().call_later(timeout, self.expire)

    def expire(self) -> None:
        """End the drain time now (a second SIGTERM or Ctrl-C)."""
        self.draining = self.expired = True
        for future in list(self._stop_waiters):
            if not future.done():
                future.set_result(None)

    async def wait_idle(self) -> None:
        """Until no request is in flight: at most the drain time, and a short
        grace for the requests it stopped."""
        if self._idle.is_set():
            return
        idle = asyncio.ensure_future(self._idle.wait())
        expired = self.stopped()
        try:
            await asyncio.wait({idle, expired}, return_when=asyncio.FIRST_COMPLETED)
            if not idle.done():
                await asyncio.wait({idle}, timeout=STOPPED_REQUESTS_GRACE)
        finally:
            idle.cancel()
            expired.cancel()
        if self._in_flight:
            logger.warning("%d requests did not end after the drain time", self._in_flight)
