"""A torchrun loop (gloo, CPU) that saves as Megatron-LM's dist-checkpointing does with its ``torch_dist`` backend,
each rank on its own node's disk. Every --every steps ``OUT/iter_<7 digits>/`` gets, as ``megatron/core/
dist_checkpointing/serialization.py::save`` writes it: rank 0's common state ``common.pt`` (``torch.save``) first,
then every rank's shards through ``torch.distributed.checkpoint`` with two files per rank (``__<r>_0.distcp``,
``__<r>_1.distcp``: ``TorchDistSaveShardedStrategy``'s ``thread_count=2``) and the coordinator's ``.metadata``,
then rank 0's ``metadata.json`` naming the backends (``save_config``); after a barrier rank 0 writes
``OUT/latest_checkpointed_iteration.txt`` holding the iteration (``megatron/training/checkpointing.py``). On node 1
only its rank's two shard files are there.

On start it loads as Megatron's ``load_checkpoint`` does, from ``OUT`` only (Megatron knows nothing of the guard):
the tracker file names the iteration (without it: "could not find the metadata file", training starts from
scratch), ``metadata.json`` must name the ``torch_dist`` backend, every rank reads ``common.pt`` and its shards
(``resumed from step N``)."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--every", type=int, default=20)
parser.add_argument("--steps", type=int, default=10**9)
parser.add_argument("--step-s", type=float, default=0.05)
args = parser.parse_args()

TRACKER = os.path.join(args.out, "latest_checkpointed_iteration.txt")
BACKENDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 8), torch.randn(32, 1)


def sharded(step: int) -> dict:
    # the model is replicated (saved once); each rank's own two tensors make two files of every rank
    return {"model": model.state_dict(), f"rank{rank}.a": torch.full((256,), float(rank * 1000 + step)),
            f"rank{rank}.b": torch.full((64,), float(step))}


def save(step: int) -> None:
    folder = os.path.join(args.out, f"iter_{step:07d}")
    os.makedirs(folder, exist_ok=True)
    if rank == 0:
        torch.save({"iteration": step, "checkpoint_version": 3.0, "args": {"save": args.out}},
                   os.path.join(folder, "common.pt"))
    dcp.save(sharded(step), storage_writer=dcp.FileSystemWriter(folder, thread_count=2))
    if rank == 0:
        with open(os.path.join(folder, "metadata.json"), "w") as file:
            json.dump(BACKENDS, file)
    dist.barrier()
    if rank == 0:
        with open(TRACKER, "w") as file:
            file.write(str(step))


def load() -> int:
    if not os.path.isfile(TRACKER):
        print(f"rank {rank}: WARNING: could not find the metadata file {TRACKER}; will not load any checkpoints "
              "and will start from random", flush=True)
        return 0
    with open(TRACKER) as file:
        step = int(file.read().strip())
    folder = os.path.join(args.out, f"iter_{step:07d}")
    with open(os.path.join(folder, "metadata.json")) as file:
        assert json.load(file)["sharded_backend"] == "torch_dist"
    common = torch.load(os.path.join(folder, "common.pt"), weights_only=False)
    assert common["iteration"] == step
    loaded = sharded(0)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(folder))
    model.load_state_dict(loaded["model"])
    assert float(loaded[f"rank{rank}.a"][0]) == rank * 1000 + step, "this rank's own shard"
    print(f"rank {rank}: resumed from step {step}", flush=True)
    return step


start = load()
for step in range(start + 1, args.steps + 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step % args.every == 0:
        save(step)
        if rank == 0:
            print(f"saved step {step}", flush=True)
    time.sleep(args.step_s)
dist.destroy_process_group()
