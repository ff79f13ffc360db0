"""The tensor-parallel group: which process is which rank, where the ranks
meet, and how they join (torch.distributed).

`--tp-size N` ranks are spread over `--nnodes` machines, N / nnodes on
each; node k runs ranks k * N / nnodes onwards, and rank 0 (on node 0) is
the pyserve server. On CUDA a node's ranks use its GPUs 0, 1, ... in
order. The ranks meet at `--dist-init-addr` (rank 0's node; on one
machine a free local port) through torch's TCP rendezvous.

Two process groups: the default one carries the model's collectives
(NCCL on CUDA, gloo on CPU); a gloo group on the CPU carries rank 0's
step headers, which the other ranks wait on for as long as the server is
idle, so it has no practical timeout. A rank that dies closes its
connections, and the others' next collective fails at once.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pyserve.model.parallel import TensorParallel
from pyserve.options import ModelOptions

# Ranks wait on rank 0's next step header for as long as the server idles.
_IDLE_TIMEOUT = timedelta(days=3650)


@dataclass(frozen=True)
class RankLayout:
    size: int  # --tp-size
    nnodes: int
    node_rank: int
    init_addr: str  # host:port where the ranks meet
    device_type: str  # "cuda" or "cpu"

    @classmethod
    def from_options(cls, options: ModelOptions) -> RankLayout:
        """From resolved options; one machine without --dist-init-addr meets on a free local port."""
        addr = options.dist_init_addr or f"127.0.0.1:{_free_port()}"
        return cls(options.tp_size, options.nnodes, options.node_rank, addr, options.device)

    @property
    def ranks_per_node(self) -> int:
        return self.size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The ranks this node runs."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    @property
    def backend(self) -> str:
        return "nccl" if self.device_type == "cuda" else "gloo"

    def device(self, rank: int) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", rank % self.ranks_per_node)
        return torch.device("cpu")

    def check_devices(self) -> None:
        """ValueError when this node has fewer GPUs than it runs ranks."""
        if self.device_type == "cuda" and torch.cuda.device_count() < self.ranks_per_node:
            raise ValueError(f"--tp-size {self.size} over {self.nnodes} node(s) runs {self.ranks_per_node} ranks "
                             f"on this node, one per GPU, but it has {torch.cuda.device_count()} GPU(s)")


@dataclass(frozen=True)
class Membership:
    """A joined rank: its TensorParallel (the model's group) and the CPU group for step headers."""

    tp: TensorParallel
    control: object  # the gloo process group of step headers
    device: torch.device


def join(layout: RankLayout, rank: int) -> Membership:
    """Join the group as `rank`; returns once every rank has joined."""
    device = layout.device(rank)
    options = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        options["device_id"] = device  # NCCL's communicator is made now, before any graph capture
    dist.init_process_group(layout.backend, init_method=f"tcp://{layout.init_addr}", rank=rank,
                            world_size=layout.size, **options)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return Membership(TensorParallel(rank, layout.size, dist.group.WORLD), control, device)


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def abort() -> None:
    """Make collectives that wait on a dead rank fail instead of hanging
    (gloo fails by itself when the peer's connection closes; NCCL needs this)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        dist.distributed_c10d._abort_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
