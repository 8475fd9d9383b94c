"""A plain loop that trains --steps steps, then calls a torch.compile'd function whose backend never finishes
compiling (a stand-in for a compilation that takes longer than the stall timeout)."""

import argparse
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()


def endless_backend(graph_module, example_inputs):
    time.sleep(3600)
    return graph_module.forward


model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 4), torch.randn(8, 1)
for _step in range(args.steps):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
compiled = torch.compile(lambda t: t * 2 + 1, backend=endless_backend)
print("compiling", flush=True)
compiled(x)
