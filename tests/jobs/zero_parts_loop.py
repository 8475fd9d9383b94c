"""A torchrun loop (gloo, CPU) that saves as DeepSpeed ZeRO does (``DeepSpeedEngine.save_checkpoint``), each rank
on its own node's disk: every --every steps ``OUT/global_stepN/`` gets each rank's
``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``; rank 0 also writes ``mp_rank_00_model_states.pt`` (with
``dp_world_size``, as DeepSpeed's does) and, after a barrier, ``OUT/latest`` naming the tag. On node 1 only its rank's
ZeRO file is there. On start it resumes from the tag ``latest`` names when there is one (``resumed from step N``).

--no-shard RANK: that rank never writes its ZeRO file (a node whose part is never saved)."""

import argparse
import os
import time

import torch
import torch.distributed as dist
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--every", type=int, default=20)
parser.add_argument("--steps", type=int, default=10**9)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--no-shard", type=int, default=-1)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 8), torch.randn(32, 1)
start = 0
latest = os.path.join(args.out, "latest")
if os.path.exists(latest):
    with open(latest) as file:
        tag = file.read().strip()
    states = torch.load(os.path.join(args.out, tag, "mp_rank_00_model_states.pt"), weights_only=True)
    model.load_state_dict(states["module"])
    mine = torch.load(os.path.join(args.out, tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"),
                      weights_only=True)
    start = int(states["global_steps"])
    assert float(mine["optimizer_state_dict"]["shard"][0]) == rank * 1000 + start, "this rank's own shard"
    print(f"rank {rank}: resumed from step {start}", flush=True)

for step in range(start + 1, args.steps + 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step % args.every == 0:
        tag = f"global_step{step}"
        folder = os.path.join(args.out, tag)
        os.makedirs(folder, exist_ok=True)
        if rank == 0:
            torch.save({"module": model.state_dict(), "global_steps": step, "dp_world_size": world,
                        "mp_world_size": 1}, os.path.join(folder, "mp_rank_00_model_states.pt"))
        if rank != args.no_shard:
            torch.save({"optimizer_state_dict": {"shard": torch.full((256,), float(rank * 1000 + step))},
                        "ds_config": {}}, os.path.join(folder, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        dist.barrier()
        if rank == 0:
            with open(latest, "w") as file:
                file.write(tag)
            print(f"saved step {step}", flush=True)
    time.sleep(args.step_s)
