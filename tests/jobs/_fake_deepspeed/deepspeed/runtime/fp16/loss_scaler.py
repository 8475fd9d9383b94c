"""``deepspeed.runtime.fp16.loss_scaler``: the dynamic loss scaler (its ``loss_scale`` attribute, ``backward``
multiplying the loss by it, halving on overflow after ``hysteresis``, doubling after ``scale_window`` good steps)."""

from typing import Any


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0 ** 16, scale_factor: float = 2.0, scale_window: int = 1000,
                 min_scale: float = 1.0) -> None:
        self.cur_scale = init_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def backward(self, loss: Any, retain_graph: bool = False) -> None:
        scaled_loss = loss * self.loss_scale
        scaled_loss.backward(retain_graph=retain_graph)

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
