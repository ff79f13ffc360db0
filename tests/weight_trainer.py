"""A trainer's side of SGLang's weight sync, as RL frameworks write it:
rank 0 of a gloo group that meets at its own TCP store, made with the
torch calls SGLang's init_custom_process_group makes, broadcasting tensors
in the order the server is told to receive them.

    python -m tests.weight_trainer PORT WORLD_SIZE PLAN.json

PLAN.json: {"checkpoint": dir, "tensors": [[name, shape or null], ...]}: a
null shape sends the checkpoint's tensor `name`, a shape sends zeros of it
(what a server must refuse); {"bucket": [names]} sends those tensors as
SGLang's flattened bucket, their bytes back to back in one uint8 tensor.
Prints "joined" once the group is made."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous


def trainer_group(port: int, world_size: int, name: str = "weight_update_group"):
    timeout = timedelta(minutes=2)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, world_size, timeout=timeout))
    group, _ = _new_process_group_helper(world_size, 0, [], "gloo", PrefixStore(name, store), group_name=name,
                                         timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def main() -> None:
    port, world_size, plan_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    plan = json.loads(open(plan_path).read())
    tensors = load_file(f"{plan['checkpoint']}/model.safetensors")
    group = trainer_group(port, world_size)
    print("joined", flush=True)
    for entry in plan["tensors"]:
        if isinstance(entry, dict):
            flat = torch.cat([tensors[name].flatten().view(torch.uint8) for name in entry["bucket"]])
            dist.broadcast(flat, src=0, group=group)
            continue
        name, shape = entry
        dist.broadcast(tensors[name] if shape is None else torch.zeros(shape), src=0, group=group)
    dist.destroy_process_group(group)
    print("sent", flush=True)


if __name__ == "__main__":
    main()
