"""``PlainSGD``: the update ``torch.optim.SGD`` makes without momentum (``p -= lr * p.grad``), written out, for the
test jobs whose optimizer is not what a test is about.

Why not ``torch.optim.SGD`` itself: the first ``torch.optim`` optimizer a process builds imports ``torch._dynamo``
(``Optimizer.add_param_group`` runs under ``torch._disable_dynamo``, which imports it on its first call;
torch/_compile.py, torch 2.13), 1.4-2.1 s of CPU in every job process on a 2-core machine: as much as
``import torch`` itself. The jobs that test what the guard sees of an optimizer (an empty DataLoader, a GradScaler,
accelerate, nanoGPT's checkpoint with its optimizer state) keep ``torch.optim``.
"""

from collections.abc import Iterable
from typing import Any

import torch


class PlainSGD:
    """``PlainSGD(params, lr)``: ``param_groups`` (one group: ``params``, ``lr``, which a job may change),
    ``zero_grad()`` (sets each ``.grad`` to None) and ``step()`` (``p -= lr * p.grad`` under ``torch.no_grad``)."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float) -> None:
        self.param_groups: list[dict[str, Any]] = [{"params": list(params), "lr": lr}]

    def zero_grad(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])
