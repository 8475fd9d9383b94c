"""A DataLoader whose worker grows (--mb MB, touched) and then waits to be killed; it writes its pid to --ready.
The main process then fails as torch makes it fail when a worker dies (``DataLoader worker (pid N) is killed by
signal``), with the socket or queue error the dead worker left behind."""

import argparse
import os
import time

import torch
from plain_sgd import PlainSGD
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--mb", type=int, default=400)
parser.add_argument("--ready", required=True)
args = parser.parse_args()


class Growing(Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 2:
            hoard = bytearray(args.mb << 20)
            for offset in range(0, len(hoard), 4096):
                hoard[offset] = 1
            with open(args.ready + ".tmp", "w") as handle:
                handle.write(str(os.getpid()))
            os.replace(args.ready + ".tmp", args.ready)
            time.sleep(600)
        return torch.randn(4)


model = torch.nn.Linear(4, 1)
opt = PlainSGD(model.parameters(), lr=0.1)
for batch in DataLoader(Growing(), batch_size=1, num_workers=1):
    loss = model(batch).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
