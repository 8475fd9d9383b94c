"""Plain PyTorch loops: the scalar loss a loop calls ``.backward()`` on.

``torch.Tensor.backward`` is wrapped once, when the job imports torch. The wrapper looks at tensors with one
element only (a loss; ``backward(gradient=...)`` on a vector is something else), and hands them to the agent's
``LossWatch``, which reads them from the device one by one during the sanity pass and then only every
``check_every`` steps (no host-device sync per step). It stays out of the way once a ``Trainer`` or
``guard.report()`` provides the losses. A step here is one ``.backward()`` call: with gradient accumulation
that is one micro-batch; call ``guard.report(step=..., loss=...)`` to count optimizer steps instead.

CUDA graphs: while a stream is being captured (``torch.cuda.is_current_stream_capturing()``), the wrapper does
nothing at all (a ``.item()`` there would break the capture); it asks only once CUDA is initialized, so a CPU job
never touches CUDA. A captured step is later run by ``CUDAGraph.replay()``, which calls no ``.backward()``: the
replay is wrapped too and, every ``check_every`` replays, tells the supervisor the job is making progress
(``{"t": "replay", "n": N}``), so a graph-replaying loop is not taken for a stall.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["patch"]


def _capture_probe(torch: Any) -> Callable[[], bool]:
    """A cheap ``() -> bool``: is the current CUDA stream being captured into a graph? False without CUDA."""
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    is_capturing = getattr(cuda, "is_current_stream_capturing", None)
    if is_initialized is None or is_capturing is None:
        return lambda: False

    def capturing() -> bool:
        if not is_initialized():  # no CUDA context yet: nothing can be capturing (and CUDA stays untouched)
            return False
        try:
            return bool(is_capturing())
        except Exception:  # noqa: BLE001 - a build without CUDA: never capturing
            return False

    return capturing


def patch(torch: Any) -> None:
    """Wrap ``torch.Tensor.backward`` and ``torch.cuda.CUDAGraph.replay`` (idempotent)."""
    from .. import agent as agent_module
    original = torch.Tensor.backward
    if getattr(original, "__guard_wrapped__", False):
        return
    capturing = _capture_probe(torch)

    @functools.wraps(original)
    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        agent = agent_module.get()
        if agent is not None and not capturing():
            agent.begun += 1
            if agent.backward_hook and self.numel() == 1:
                try:
                    agent.on_loss(self, None, "backward")
                except Exception as exc:  # noqa: BLE001 - never break the job
                    agent.backward_hook = False
                    agent_module._warn_once(f"loss hook disabled: {exc!r}")
        return original(self, *args, **kwargs)

    backward.__guard_wrapped__ = True  # type: ignore[attr-defined]
    torch.Tensor.backward = backward
    _patch_replay(torch, agent_module)


def _patch_replay(torch: Any, agent_module: Any) -> None:
    graph_class = getattr(getattr(torch, "cuda", None), "CUDAGraph", None)
    original = getattr(graph_class, "replay", None)
    if graph_class is None or original is None or getattr(original, "__guard_wrapped__", False):
        return
    count = [0]

    @functools.wraps(original)
    def replay(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        agent = agent_module.get()
        if agent is not None:
            agent.begun += 1
            count[0] += 1
            if count[0] >= agent.settings.check_every and agent.send({"t": "replay", "n": count[0]}):
                count[0] = 0
        return result

    replay.__guard_wrapped__ = True  # type: ignore[attr-defined]
    graph_class.replay = replay
