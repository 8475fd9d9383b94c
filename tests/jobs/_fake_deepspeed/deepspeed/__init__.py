"""A stand-in for DeepSpeed (not installed here) with the parts of its API a plain DeepSpeed loop uses, each
behaving as the real one does (microsoft/DeepSpeed ``deepspeed/__init__.py``, ``deepspeed/runtime/engine.py``,
``deepspeed/runtime/fp16/``): ``deepspeed.initialize(model=, model_parameters=, config=)`` returns
``(engine, optimizer, dataloader, lr_scheduler)``; ``engine.backward(loss)`` divides the loss by
``gradient_accumulation_steps`` and, with ``fp16`` on, multiplies it by the loss scaler's ``loss_scale`` before
running the backward; ``engine.step()`` unscales the gradients and steps only at accumulation boundaries. Used by
``tests/jobs/deepspeed_loop.py``: the guard's agent hooks ``deepspeed.runtime.engine.DeepSpeedEngine.backward``
exactly as it would the real one."""

from typing import Any

from deepspeed.runtime.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine", "initialize"]
__version__ = "0.0.0+fake"


def initialize(*, model: Any, model_parameters: Any, config: dict[str, Any]) -> tuple[Any, Any, None, None]:
    """``deepspeed.initialize``: the engine, its optimizer, no dataloader, no scheduler."""
    engine = DeepSpeedEngine(model, model_parameters, config)
    return engine, engine.optimizer, None, None
