"""The processes of the tensor-parallel ranks, started and watched.

On node 0 the pyserve server is rank 0; its ModelRunner owns a
`TensorParallelRanks`: the worker processes of the node's other ranks
(torch.multiprocessing, spawn), rank 0's membership of the group and the
step channel. A watcher thread waits on the workers' process handles: a
worker that exits while the server runs is a failure, logged once, that
stops the server the way SIGTERM does (the drain then finds every step
failing and ends at once); ModelRunner.shutdown raises it, so the server
exits with an error. A collective that fails on rank 0 (a rank on another
node died: its connections closed) is the same failure.

On a node with --node-rank > 0, `run_worker_node` runs that node's ranks
and nothing else: no HTTP, no tokenizer. It exits when they do: 0 when
rank 0 stopped them, 1 when one failed; SIGTERM or Ctrl-C stops them
(and with them the server, whose next step fails).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import torch.multiprocessing

from pyserve.engine.tp import group as tp_group
from pyserve.engine.tp.broadcast import StepChannel
from pyserve.engine.tp.worker import run_worker
from pyserve.options import ModelOptions

logger = logging.getLogger("pyserve.engine")

_STOP_GRACE_S = 30.0  # how long workers get to leave after rank 0's stop


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class WorkerProcesses:
    """Worker processes for some ranks of this node, and a thread watching them."""

    def __init__(self, layout: tp_group.RankLayout, options: ModelOptions, model_dir: Path, ranks: range,
                 on_exit: Callable[[str], None]):
        """Workers given the model's `options` and nothing else of the
        server's. `on_exit(what happened)` is called, on the watcher thread,
        for the first worker that exits before `stop`."""
        context = torch.multiprocessing.get_context("spawn")
        # Workers log as this process does (the `pyserve` command's --log-level).
        log_level = logging.getLogger().getEffectiveLevel()
        self.processes = {rank: context.Process(target=run_worker, args=(rank, layout, options, model_dir, log_level),
                                                name=f"pyserve-tp{rank}", daemon=True) for rank in ranks}
        self._stopping = threading.Event()
        self._on_exit = on_exit
        for process in self.processes.values():
            process.start()
        logger.info("Tensor-parallel ranks started: %s",
                    ", ".join(f"{rank} (pid {p.pid})" for rank, p in self.processes.items()))
        self._watcher = threading.Thread(target=self._watch, name="pyserve-tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: rank for rank, p in self.processes.items()}
        while by_sentinel and not self._stopping.is_set():
            for sentinel in multiprocessing.connection.wait(list(by_sentinel), timeout=0.5):
                rank = by_sentinel.pop(sentinel)
                process = self.processes[rank]
                process.join()
                # 0: rank 0 told it to stop. Anything else is a failure.
                if process.exitcode != 0 and not self._stopping.is_set():
                    self._on_exit(f"tensor-parallel rank {rank} (pid {process.pid}) {_exit_text(process.exitcode)}")
                    return

    def failed(self) -> bool:
        return any(p.exitcode for p in self.processes.values())

    def stop(self, grace: float = _STOP_GRACE_S) -> None:
        """Wait up to `grace` seconds for the workers to leave (rank 0 has
        told them to), then terminate, then kill, what is left."""
        self._stopping.set()
        for process in self.processes.values():
            process.join(grace)
            if process.is_alive():
                if grace:
                    logger.warning("tensor-parallel rank process %d did not stop: terminating it", process.pid)
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join()


class TensorParallelRanks:
    """Rank 0's side of the group: this node's other ranks as processes, the
    group joined, the step channel, and what happens when a rank fails."""

    def __init__(self, options: ModelOptions, model_dir: Path):
        """Start this node's other ranks and join them; `options` resolved."""
        self.layout = tp_group.RankLayout.from_options(options)
        self.layout.check_devices()
        self.failure: str | None = None
        self.serving = False  # once set, a failure stops the server
        self._lock = threading.Lock()
        local = self.layout.local_ranks
        self.workers = WorkerProcesses(self.layout, options, model_dir, range(local.start + 1, local.stop), self.fail)
        try:
            if self.layout.nnodes > 1:
                logger.info("Waiting for the %d tensor-parallel ranks of %d nodes at %s", self.layout.size,
                            self.layout.nnodes, self.layout.init_addr)
            self.member = self.watched(tp_group.join, self.layout, 0)
        except BaseException:
            self.abandon()
            raise
        self.channel = StepChannel(self.member)

    def watched(self, work: Callable, *args):
        """work(*args), given up (RuntimeError) if a rank fails meanwhile: for
        the start-up's waits on the others, which a dead rank never ends."""
        result, error = [], []
        done = threading.Event()

        def run() -> None:
            try:
                result.append(work(*args))
            except BaseException as e:
                error.append(e)
            done.set()

        threading.Thread(target=run, name="pyserve-tp-start", daemon=True).start()
        while not done.wait(0.2):
            if self.failure is not None:
                raise RuntimeError(self.failure)
        if error:
            raise error[0]
        return result[0]

    def check(self) -> None:
        """RuntimeError once a rank has failed: the group cannot run steps."""
        if self.failure is not None:
            raise RuntimeError(f"tensor parallelism is down: {self.failure}")

    def fail(self, what: str) -> None:
        """A rank died or a collective failed: the ranks can no longer run the
        same steps. Logged once; a serving server is stopped as by SIGTERM."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = what
        logger.error("%s: stopping pyserve", what)
        tp_group.abort()
        # The server's SIGTERM handler drains and stops it; a process that
        # handles no SIGTERM (an engine in a script) sees its steps fail.
        if self.serving and signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None):
            signal.raise_signal(signal.SIGTERM)

    def abandon(self) -> None:
        """Start-up failed: end this node's other ranks now and leave the group."""
        self.workers.stop(grace=0)
        tp_group.leave()

    def stop(self) -> None:
        """Tell the other ranks to stop, wait for this node's, leave the group."""
        if self.failure is None:
            try:
                self.channel.send_stop()
            except RuntimeError as e:  # a rank died just now
                self.fail(f"stopping the tensor-parallel ranks failed: {e}")
        self.workers.stop(grace=_STOP_GRACE_S if self.failure is None else 0)
        tp_group.leave()


def run_worker_node(options: ModelOptions) -> int:
    """`pyserve --node-rank K` (K > 0): run this node's ranks until they
    stop; the exit status. `options` resolved."""
    if options.model_path:
        model_dir = Path(options.model_path)
    else:
        from pyserve.model.default_model import default_model_path

        model_dir = default_model_path()
    layout = tp_group.RankLayout.from_options(options)
    layout.check_devices()
    failed = threading.Event()

    def on_exit(what: str) -> None:
        logger.error("%s: stopping this node's ranks", what)
        failed.set()

    logger.info("Node %d of %d: tensor-parallel ranks %s of %d, meeting at %s", options.node_rank, options.nnodes,
                list(layout.local_ranks), layout.size, layout.init_addr)
    workers = WorkerProcesses(layout, options, model_dir, layout.local_ranks, on_exit)
    stop_asked = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop_asked.set())
    while not (failed.is_set() or stop_asked.is_set() or all(not p.is_alive() for p in workers.processes.values())):
        stop_asked.wait(0.5)
    workers.stop(grace=0 if failed.is_set() or stop_asked.is_set() else _STOP_GRACE_S)
    return 1 if failed.is_set() or workers.failed() else 0
