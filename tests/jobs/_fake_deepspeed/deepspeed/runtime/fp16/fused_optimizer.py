"""``deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer``: ``backward(loss)`` runs the loss scaler's backward
(``loss.float() * loss_scale``); ``step()`` unscales the gradients, skips the step on inf/NaN (``overflow``)."""

from typing import Any

import torch

from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler


class FP16_Optimizer:
    def __init__(self, init_optimizer: torch.optim.Optimizer, initial_dynamic_scale: float = 2.0 ** 16) -> None:
        self.optimizer = init_optimizer
        self.loss_scaler = DynamicLossScaler(init_scale=initial_dynamic_scale)
        self.overflow = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def backward(self, loss: Any, create_graph: bool = False, retain_graph: bool = False) -> None:
        self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)

    def step(self) -> None:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.overflow = any(not torch.isfinite(g).all() for g in grads)
        if not self.overflow:
            for g in grads:
                g.div_(self.cur_scale)  # unscale_and_clip_grads
            self.optimizer.step()
        self.loss_scaler.update_scale(self.overflow)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
