"""A 2-rank gloo loop for torchrun where --raise-rank R raises ValueError at --raise-at K; --record wraps main in
torch's ``@record`` (the rank's error then goes to its TORCHELASTIC_ERROR_FILE)."""

import argparse
import time

import torch
import torch.distributed as dist
from plain_sgd import PlainSGD
from torch.distributed.elastic.multiprocessing.errors import record

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--raise-rank", type=int, default=1)
parser.add_argument("--raise-at", type=int, default=4)
parser.add_argument("--record", action="store_true")
args = parser.parse_args()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(8, 1)
    opt = PlainSGD(model.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for step in range(1, args.steps + 1):
        if rank == args.raise_rank and step == args.raise_at:
            raise ValueError(f"rank {rank}: bad batch at step {step}")
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank != args.raise_rank:
            time.sleep(0.05)  # the other rank is slower: it is still training when the error happens
    dist.destroy_process_group()


if __name__ == "__main__":
    (record(main) if args.record else main)()
