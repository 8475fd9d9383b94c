"""Plain PyTorch loops: the scalar loss a loop calls ``.backward()`` on.

``torch.Tensor.backward`` is wrapped once, when the job imports torch. The wrapper looks at tensors with one
element only (a loss; ``backward(gradient=...)`` on a vector is something else), and hands them to the agent's
``LossWatch``, which reads them from the device one by one during the sanity pass and then only every
``check_every`` steps (no host-device sync per step). It stays out of the way once a ``Trainer`` or
``guard.report()`` provides the losses. A step here is one ``.backward()`` call: with gradient accumulation
that is one micro-batch; call ``guard.report(step=..., loss=...)`` to count optimizer steps instead.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["patch"]


def patch(torch: Any) -> None:
    """Wrap ``torch.Tensor.backward`` (idempotent)."""
    from .. import agent as agent_module
    original = torch.Tensor.backward
    if getattr(original, "__guard_wrapped__", False):
        return

    @functools.wraps(original)
    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        agent = agent_module.get()
        if agent is not None:
            agent.begun += 1
        if agent is not None and agent.backward_hook and self.numel() == 1:
            try:
                agent.on_loss(self, None, "backward")
            except Exception as exc:  # never break the job
                agent.backward_hook = False
                agent_module._warn_once(f"loss hook disabled: {exc!r}")
        return original(self, *args, **kwargs)

    backward.__guard_wrapped__ = True  # type: ignore[attr-defined]
    torch.Tensor.backward = backward
