"""The gate requests pass on their way to the engine. It is closed while
POST /update_weights_from_disk replaces the served weights, from POST
/pause_generation to POST /continue_generation, and while memory is
released (/release_memory_occupation to /resume_memory_occupation): a request that arrives
meanwhile waits, then starts (on the new weights), and neither an update
nor a pause waits on a stream of new arrivals."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager


class AdmissionGate:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._update = asyncio.Lock()  # one update at a time
        self._updating = False
        self._paused = False  # closed by /pause_generation
        self.pause_mode: str | None = None  # its mode, once the engine stopped
        # Closed too while /release_memory_occupation has memory released (api/native/memory.py).
        self.memory_released = False
        self.version = "default"  # the weights' version, as the last update named it

    @property
    def is_open(self) -> bool:
        """Whether a request passes now, or waits for an update or a pause to end."""
        return self._open.is_set()

    async def passed(self) -> None:
        await self._open.wait()

    @asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        async with self._update:
            self._updating = True
            self._open.clear()
            try:
                yield
            finally:
                self._updating = False
                self._reopen()

    async def pause(self, mode: str, stop: Awaitable[None]) -> None:
        """Close, then await `stop` (the engine stopping): paused from then on."""
        self._paused = True
        self._open.clear()
        await stop
        if self._paused:  # not resumed meanwhile
            self.pause_mode = mode

    def resume(self) -> None:
        self._paused = False
        self.pause_mode = None
        self._reopen()

    def _reopen(self) -> None:
        if not self._paused and not self._updating and not self.memory_released:
            self._open.set()
