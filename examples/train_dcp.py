"""A tiny data-parallel loop for torchrun that saves with torch.distributed.checkpoint: every 50 steps
``out/step_N/`` (each rank writes its own shard, rank 0 also ``.metadata``). On the CPU (gloo), about 20 ms a step.
docs/many-nodes.md runs it as two nodes on one machine, each in its own folder, under one guard each."""

import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 100_000):
    x = torch.randn(16, 8)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():  # average the gradients over the ranks (what DDP does)
        assert p.grad is not None
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()
    if step % 50 == 0:
        dcp.save({"model": model.state_dict(), "step": step}, checkpoint_id=f"out/step_{step}")
    time.sleep(0.02)
