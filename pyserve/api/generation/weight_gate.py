"""The gate requests pass on their way to the engine, closed while POST
/update_weights_from_disk replaces the served weights: a request that
arrives meanwhile waits, then starts on the new weights, and the update
does not wait on a stream of new arrivals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class WeightGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._update = asyncio.Lock()  # one update at a time
        self.version = "default"  # the weights' version, as the last update named it

    async def passed(self) -> None:
        await self._open.wait()

    @asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        async with self._update:
            self._open.clear()
            try:
                yield
            finally:
                self._open.set()
