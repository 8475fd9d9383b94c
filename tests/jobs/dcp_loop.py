"""A 2-rank loop for torchrun on the CPU (gloo) that saves with torch.distributed.checkpoint: every --every steps
``OUT/step_N/`` (one ``.distcp`` shard per rank, ``.metadata`` written last by the coordinator). On start it
resumes with ``dcp.load`` (``resumed from step N``) from the checkpoint the guard fetched (``guard.resume_path()``:
the secured one, whole on this node's disk), else from the newest ``OUT/step_N`` (a newer save there may be only
this node's part of it); --ready FILE is created once a save of at least --ready-step is done."""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _resume import resume_from
from plain_sgd import PlainSGD

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--steps", type=int, default=100000)
parser.add_argument("--every", type=int, default=10)
parser.add_argument("--step-s", type=float, default=0.05)
parser.add_argument("--ready")
parser.add_argument("--ready-step", type=int, default=0)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = PlainSGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 8), torch.randn(32, 1)


def state(step: int) -> dict:
    # the model is replicated (saved once); each rank's own tensor makes a shard of every rank
    return {"model": model.state_dict(), "step": torch.tensor(step),
            f"rank{rank}": torch.full((256,), float(rank * 1000 + step))}


start = 0
resume = resume_from(args.out)
if resume:
    loaded = state(0)
    dcp.load(loaded, checkpoint_id=resume)
    model.load_state_dict(loaded["model"])
    start = int(loaded["step"])
    assert float(loaded[f"rank{rank}"][0]) == rank * 1000 + start, "this rank's own shard"
    print(f"rank {rank}: resumed from step {start}", flush=True)

for step in range(start + 1, args.steps + 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step % args.every == 0:
        dcp.save(state(step), checkpoint_id=os.path.join(args.out, f"step_{step}"))
        if rank == 0:
            print(f"saved step {step}", flush=True)
            if args.ready and step >= args.ready_step:
                open(args.ready, "w").close()
    time.sleep(args.step_s)
dist.destroy_process_group()
