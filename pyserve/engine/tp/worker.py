"""A tensor-parallel rank other than 0: a process that loads its shard of
the model and runs every step rank 0 broadcasts, until rank 0 says stop.

It samples nothing and knows no requests: the batch it receives says
which KV slots to read and write, and its logits are dropped. Ctrl-C in a
terminal reaches the whole process group, so workers ignore SIGINT and
leave stopping to rank 0 (which stops them at once). A worker whose
parent process dies exits too.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
from pathlib import Path

import torch

from pyserve.engine.tp import group as tp_group
from pyserve.engine.runner.rank_model import RankModel
from pyserve.engine.runner.weight_swap import copy_weights, paired_tensors
from pyserve.engine.runner.weight_sync import WeightSync
from pyserve.engine.tp.broadcast import AdapterLoad, StepChannel, WeightSwap
from pyserve.lora.adapter import read_adapter
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.hub import local_model_dir
from pyserve.model.kv_buffer import SlotCopies
from pyserve.options import ModelOptions

logger = logging.getLogger("pyserve.engine")


def run_worker(rank: int, layout: tp_group.RankLayout, options: ModelOptions, model_dir: Path,
               log_level: int) -> None:
    """A worker process's main: the model's `options` resolved, as rank 0
    runs them, and the log level of the process that started it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"[%(asctime)s TP{rank}] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stdout, force=True)
    _exit_with_parent()
    try:
        member = tp_group.join(layout, rank)
        channel = StepChannel(member)
        model = RankModel(options, model_dir, member.device, member.tp, layout.ranks_per_node)
        model.allocate(channel.receive_value(), window_pool=True)
        channel.barrier()  # ready
        weight_sync = WeightSync(model)
        logger.info("tensor-parallel rank %d ready (pid %d)", rank, os.getpid())
        with torch.inference_mode():
            while (message := channel.receive()) is not None:
                if isinstance(message, AdapterLoad):
                    local = local_model_dir(message.path, None, options.download_dir, "lora_path")
                    model.lora.load(message.slot, read_adapter(local, options.max_lora_rank))
                elif isinstance(message, WeightSwap):
                    local = local_model_dir(message.path, None, options.download_dir, "model_path")
                    copy_weights(paired_tensors(model.model, model.read_checkpoint(Path(local))))
                elif isinstance(message, SlotCopies):
                    model.kv_buffer.copy_slots(message)
                elif isinstance(message, ForwardBatch):
                    model.forward(message)
                else:
                    channel.send_outcome(weight_sync.perform(message))
        tp_group.leave()
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)


def _exit_with_parent() -> None:
    """A rank whose parent died would otherwise wait in a collective."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(1)

    threading.Thread(target=watch, name="pyserve-parent-watch", daemon=True).start()
