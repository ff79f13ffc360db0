"""SGLang's and vLLM's /start_profile and /stop_profile: a torch.profiler
trace of the forward thread's steps (the forward passes, sampling and
what they launch on the GPU), written as Chrome trace JSON that Perfetto
and chrome://tracing open. Started and stopped on the forward thread,
which alone runs steps; with `num_steps` it stops by itself after that
many steps."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger("pyserve.engine")

ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}


class StepProfiler:
    """Owned by the forward thread: every method runs there."""

    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None
        self._path: Path | None = None
        self._steps_left: int | None = None

    def start(self, output_dir: Path, profile_id: str, activities: list[str], num_steps: int | None,
              record_shapes: bool, with_stack: bool, profile_memory: bool) -> None:
        if self._profile is not None:
            raise ValueError("a profile is already running: stop it first (/stop_profile)")
        output_dir.mkdir(parents=True, exist_ok=True)
        self._profile = torch.profiler.profile(activities=[ACTIVITIES[a] for a in activities],
                                               record_shapes=record_shapes, with_stack=with_stack,
                                               profile_memory=profile_memory)
        self._profile.start()
        self._path = output_dir / f"{profile_id}-TP-0.trace.json"
        self._steps_left = num_steps
        logger.info("Profiling the forward thread's steps into %s", self._path)

    def on_step(self) -> None:
        """A step ran: count it against num_steps."""
        if self._steps_left is not None:
            self._steps_left -= 1
            if self._steps_left <= 0:
                self.stop()

    def stop(self) -> Path:
        if self._profile is None:
            raise ValueError("no profile is running: start one (/start_profile)")
        profile, path = self._profile, self._path
        self._profile = self._path = self._steps_left = None
        started = time.perf_counter()
        profile.stop()
        profile.export_chrome_trace(str(path))
        logger.info("Profile written to %s (%.1fs)", path, time.perf_counter() - started)
        return path
