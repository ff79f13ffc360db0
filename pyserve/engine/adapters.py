"""The engine's LoRA adapters (--enable-lora): loading and unloading them
by name at run time and resolving a request's adapter name to its slot.

Runs on the event loop; the weights go into their slot on the forward
thread (ModelRunner.load_lora), between steps. An unloaded adapter's slot
is reused only once no request started under it is still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from pyserve.engine.request import GenerateRequest, RequestError
from pyserve.engine.runner.model_runner import ModelRunner
from pyserve.engine.sequence import Sequence
from pyserve.lora.adapter import read_adapter
from pyserve.lora.registry import LoraRef, LoraRegistry
from pyserve.model.hub import local_model_dir
from pyserve.options import ModelOptions


def parse_lora_paths(value: str | None) -> dict[str, str]:
    """--lora-paths: NAME=PATH items, comma-separated (a bare PATH is named by itself)."""
    out = {}
    for item in (value or "").split(","):
        item = item.strip()
        if item:
            name, _, path = item.partition("=") if "=" in item else (item, "", item)
            out[name.strip()] = path.strip()
    return out


class Adapters:
    def __init__(self, options: ModelOptions, runner: ModelRunner, running: Callable[[], Iterable[Sequence]]):
        """`running`: the engine's sequences now, whose adapters' slots are in use."""
        if options.max_loras_per_batch < 1 or options.max_lora_rank < 1:
            raise ValueError("--max-loras-per-batch and --max-lora-rank must be at least 1")
        self.runner, self.running = runner, running
        self.max_rank = options.max_lora_rank
        self.registry = LoraRegistry(options.max_loras_per_batch)
        self.lock = asyncio.Lock()
        self.download_dir = options.download_dir
        paths = parse_lora_paths(options.lora_paths)
        if len(paths) > self.registry.num_slots:
            raise ValueError(f"--lora-paths names {len(paths)} adapters, more than --max-loras-per-batch")
        # Each found (a Hub id in the cache) and checked now, so that a bad one stops the start:
        # name -> (the path given, its directory).
        self.initial = {name: (path, self.local_dir(path, "--lora-paths")) for name, path in paths.items()}
        for _, local in self.initial.values():
            read_adapter(local, self.max_rank)

    async def load_initial(self) -> None:
        for name, (path, local) in self.initial.items():
            await self.load(name, path, local)
        self.initial = {}

    def names(self) -> list[str]:
        return self.registry.names()

    def resolve(self, name: str) -> LoraRef:
        ref = self.registry.get(name)
        if ref is None:
            raise RequestError(f"The model `{name}` does not exist. {self.describe()}", "model",
                               "model_not_found")
        return ref

    def describe(self) -> str:
        names = self.names()
        return f"Loaded adapters: {', '.join(names)}." if names else "No LoRA adapters are loaded."

    async def load(self, name: str, path: str, local: str | None = None) -> LoraRef:
        """The adapter at `path`, a directory or Hub id (`local`: its
        directory, where already found). ValueError (AdapterError for the
        files) when it cannot be loaded."""
        if not name:
            raise ValueError("lora_name must be a non-empty string")
        local = local or await asyncio.to_thread(self.local_dir, path, "lora_path")
        adapter = await asyncio.to_thread(read_adapter, local, self.max_rank)
        async with self.lock:
            ref = self.registry.take_slot(name, _slots_in_use(self.running()))
            await self.runner.load_lora(ref.slot, adapter, path)  # other nodes find a Hub id in their own cache
            self.registry.add(ref, path)
        return ref

    def local_dir(self, path: str, flag: str) -> str:
        """The adapter's directory: `path`, or the snapshot of the Hub id
        `path` in the Hugging Face cache."""
        return local_model_dir(path, None, self.download_dir, flag)

    def unload(self, name: str) -> None:
        """KeyError for a name not loaded; its running requests finish under it."""
        self.registry.remove(name)


def adapter_of(req: GenerateRequest, adapters: Adapters | None) -> LoraRef | None:
    """The adapter `req` names; RequestError for an unknown one, or for any
    on a server without --enable-lora (as for an unknown field)."""
    if req.lora is None:
        return None
    if adapters is None:
        raise RequestError("Unrecognized request argument supplied: 'lora_path' (this server serves the base "
                           "model alone: start it with --enable-lora).", "lora", "unknown_parameter")
    return adapters.resolve(req.lora)


def _slots_in_use(running: Iterable[Sequence]) -> set[int]:
    return {seq.lora.slot for seq in running if seq.lora is not None}

