"""Saves a model checkpoint with ``torch.save`` into FOLDER (a full disk in the test: a tiny tmpfs)."""

import os
import sys

import torch

folder = sys.argv[1]
state = {"weight": torch.randn(512, 512)}  # 1 MiB
torch.save(state, os.path.join(folder, "model.pt"))
print("saved", flush=True)
