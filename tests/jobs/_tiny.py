"""The tiny regression model and data the Trainer test jobs share (imported from the jobs' own folder)."""

import torch


class Tiny(torch.nn.Module):
    """One linear layer; the Trainer gets ``{"loss": ...}`` from ``forward``."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, 1)

    def forward(self, x, labels=None):
        return {"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), labels)}


class Data(torch.utils.data.Dataset):
    """``size`` deterministic samples: x ~ N(0, 1) of ``width`` values, labels = sum(x)."""

    def __init__(self, size: int, width: int = 16) -> None:
        self.size, self.width = size, width

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        x = torch.randn(self.width, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": x.sum()}
