"""``deepspeed.runtime.engine.DeepSpeedEngine``, the parts a plain loop uses: ``forward`` (``engine(x)``),
``backward(loss)`` (divided by ``gradient_accumulation_steps()``, ``_scale_loss_by_gas``; with fp16 through
``FP16_Optimizer.backward``, which multiplies by the loss scale), ``step()`` (the optimizer at accumulation
boundaries), ``is_gradient_accumulation_boundary()``, ``global_steps``, ``micro_steps``."""

from typing import Any

import torch

from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer


class DeepSpeedEngine(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, model_parameters: Any, config: dict[str, Any]) -> None:
        super().__init__()
        self.module = model
        self._config = config
        lr = float(config.get("optimizer", {}).get("params", {}).get("lr", 1e-3))
        basic = torch.optim.SGD(list(model_parameters), lr=lr)
        fp16 = config.get("fp16", {})
        self._fp16 = bool(fp16.get("enabled", False))
        self.optimizer: Any = (FP16_Optimizer(basic, initial_dynamic_scale=2.0 ** fp16.get("initial_scale_power", 16))
                               if self._fp16 else basic)
        self.micro_steps = 0
        self.global_steps = 0

    def gradient_accumulation_steps(self) -> int:
        return int(self._config.get("gradient_accumulation_steps", 1))

    def fp16_enabled(self) -> bool:
        return self._fp16

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    def _scale_loss_by_gas(self, prescaled_loss: Any) -> Any:
        return prescaled_loss / self.gradient_accumulation_steps()

    def backward(self, loss: Any, retain_graph: bool = False) -> Any:
        if self.gradient_accumulation_steps() > 1:
            loss = self._scale_loss_by_gas(loss.float())
        if self.fp16_enabled():
            self.optimizer.backward(loss, retain_graph=retain_graph)
        else:
            loss.backward(retain_graph=retain_graph)
        return loss

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.global_steps += 1
        self.micro_steps += 1
