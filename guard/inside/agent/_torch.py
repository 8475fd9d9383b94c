"""Plain PyTorch loops: the scalar loss a loop calls ``.backward()`` on, as the user means it.

``torch.Tensor.backward`` is wrapped once, when the job imports torch. The wrapper looks at tensors with one
element only (a loss; ``backward(gradient=...)`` on a vector is something else), and hands them to the agent's
``LossWatch``, which reads them from the device one by one during the sanity pass and then only every
``check_every`` steps (no host-device sync per step). It stays out of the way once a ``Trainer`` or
``guard.report()`` provides the losses. A step is an optimizer step, as the Trainer, accelerate's ``step_N`` and
a loop's own ``iter_num`` count them: once the job has built a ``torch.optim.Optimizer``, a ``.backward()`` belongs
to the optimizer step it accumulates into (the first optimizer that steps is counted, through torch's global
``register_optimizer_step_post_hook``), so with gradient accumulation the micro-batches of one step share its
number; before any optimizer exists, a step is one ``.backward()`` call. An optimizer step a ``GradScaler`` skips
(inf/NaN gradients) counts all the same (``GradScaler.step`` is wrapped), as the Trainer's ``global_step`` does.

The loss the user means, not the tensor ``.backward()`` runs on:

- ``scaler.scale(loss).backward()`` (mixed precision, ``torch.amp.GradScaler``): ``GradScaler.scale`` is wrapped
  to remember which tensor it returned for which loss; the backward hook then watches the unscaled loss.
- ``accelerator.backward(loss)`` (``accelerate``): it divides the loss by the gradient accumulation steps before
  its backward (``Accelerator.backward``, accelerate 1.x); the wrapper remembers the loss it was given.
- ``engine.backward(loss)`` (DeepSpeed, ``deepspeed.runtime.engine.DeepSpeedEngine.backward``): it divides the loss
  by ``gradient_accumulation_steps()`` (``_scale_loss_by_gas``) and, with fp16, its optimizer multiplies it by the
  loss scale (``FP16_Optimizer.backward``: ``loss.float() * cur_scale``; the loss scaler's ``loss_scale``) before the
  backward (microsoft/DeepSpeed ``deepspeed/runtime/engine.py``, ``deepspeed/runtime/fp16/``); the wrapper remembers
  the loss it was given, as for accelerate. Nested (accelerate driving DeepSpeed), the outermost call's loss counts.
- ``GradScaler.update`` is wrapped to count, on the device, the consecutive optimizer steps skipped because the
  gradients held inf/NaN (its ``found_inf_per_device``, the same tensors ``update`` consumes); ``LossWatch`` reads
  the count along with the losses, and the supervisor fails the run when the loss scale keeps collapsing.

``torch.save`` is wrapped too: when it returns, a save to a named file (a path, or an open file object, mapped to
its path) is complete, and the agent reports the file with the step it has counted (``file_saved``). That is how
the guard sees the checkpoints of a loop that never calls the guard's API (nanoGPT's ``ckpt.pt``), with their step,
without reading them. ``torch.load`` is wrapped to see the job load the checkpoint the guard resumed it from
(``Agent.resume_seen``): only then does the step count go on from that checkpoint's step.

Whether the job trains at all: the first optimizer built (``torch.optim.Optimizer.__init__``, which every optimizer
calls) and the first optimizer step (torch's global ``register_optimizer_step_post_hook``) are told once each
(``{"t": "train_intent", "what": "optimizer"|"optimizer_step"}``), and so is a ``DataLoader`` iterated while it
has no batch at all (``len(loader) == 0``: an empty dataset, or fewer samples than ``batch_size`` with
``drop_last=True``; ``{"t": "empty_loader", ...}``). A job that built an optimizer and then exited 0 with no step
did not train (``FAIL incomplete``); one that never built one (an evaluation script) is not a training run.

CUDA graphs: while a stream is being captured (``torch.cuda.is_current_stream_capturing()``), the backward hook does
nothing at all (a ``.item()`` there would break the capture); it asks only once CUDA is initialized, so a CPU job
never touches CUDA. A captured step is later run by ``CUDAGraph.replay()``, which calls no ``.backward()``: the
replay is wrapped too and, every ``check_every`` replays, tells the supervisor the job is making progress
(``{"t": "replay", "n": N}``), so a graph-replaying loop is not taken for a stall.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable

from ...protocol import mask_allows_minus_inf

TYPE_CHECKING = False  # typing's own flag, without importing typing in every job process (see protocol.py)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["patch", "patch_accelerate", "patch_dataloader", "patch_dcp", "patch_deepspeed", "patch_optimizer"]


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
        except Exception:  # a build without CUDA: never capturing
            return False

    return capturing


def patch(torch: Any) -> None:
    """Wrap ``torch.Tensor.backward`` and ``torch.amp.GradScaler.scale``/``update`` (idempotent)."""
    from . import _core as agent_module
    original = torch.Tensor.backward
    if getattr(original, "__guard_wrapped__", False):
        return
    capturing = _capture_probe(torch)

    @functools.wraps(original)
    def backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        agent = agent_module.get()
        if agent is not None and capturing():  # recording a CUDA graph: no hook work at all
            return original(self, *args, **kwargs)
        if agent is not None:
            agent.begun += 1
        if agent is not None and agent.backward_hook and self.numel() == 1:
            try:
                loss, mean = self, False
                if agent.user_loss is not None:  # inside accelerator.backward(loss) / engine.backward(loss)
                    loss, mean = agent.user_loss, True  # the library divides it by the accumulation steps
                elif agent.scaled is not None and agent.scaled[0] is self:  # scaler.scale(loss).backward()
                    loss = agent.scaled[1]
                agent.scaled = None
                agent.on_loss(loss, None, "backward", mean=mean)
            except Exception as exc:  # never break the job
                agent.backward_hook = False
                agent_module._warn_once(f"loss hook disabled: {exc!r}")
        return original(self, *args, **kwargs)

    backward.__guard_wrapped__ = True  # type: ignore[attr-defined]
    torch.Tensor.backward = backward
    agent = agent_module.get()
    if agent is not None:  # from now on this agent sees the losses: printed numbers no longer decide
        agent.send({"t": "watching", "what": "torch"})
    try:
        _patch_scaler(torch, agent_module)
    except Exception as exc:  # an unknown torch version: the scaled loss is watched instead
        agent_module._warn_once(f"GradScaler hook failed: {exc!r}")
    _wrap_save(torch, agent_module)
    _wrap_clip(torch, agent_module)
    _patch_replay(torch, agent_module)


_told: set[str] = set()


def _tell(agent_module: Any, what: str, **extra: Any) -> None:
    agent = agent_module.get()
    if agent is not None and what not in _told and agent.send({"t": "train_intent", "what": what, **extra}):
        _told.add(what)


def patch_optimizer(optim: Any) -> None:
    """Wrap ``torch.optim.optimizer.Optimizer.__init__`` and add a global step post-hook, to tell the supervisor
    once each that an optimizer was built and that one stepped, and to count optimizer steps, the unit of the
    losses' and saves' steps once an optimizer exists (``LossWatch.observe``) (idempotent)."""
    from . import _core as agent_module

    told, tell = _told, functools.partial(_tell, agent_module)
    base = optim.Optimizer
    original_init = base.__init__
    if getattr(original_init, "__guard_wrapped__", False):
        return
    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        agent = agent_module.get()
        if agent is not None:
            agent.watch.optimizer_built()
        if "optimizer" not in told:
            tell("optimizer", type=type(self).__name__, state_bytes=_state_bytes(self))

    __init__.__guard_wrapped__ = True  # type: ignore[attr-defined]
    base.__init__ = __init__

    def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
        # every step: the count the losses and saves are labelled with (a Python call and an add per step)
        agent = agent_module.get()
        if agent is not None:
            agent.watch.optimizer_stepped(optimizer)
        if "optimizer_step" not in told:
            tell("optimizer_step")

    optim.register_optimizer_step_post_hook(stepped)


def _state_bytes(optimizer: Any) -> int | None:
    """About what a checkpoint of this optimizer's model holds, in bytes: its parameters' bytes, times 3 for the
    Adam family (two moment buffers of the parameters' size), else times 2 (one buffer: SGD's momentum). A Python
    walk over the parameter list (no device work); None when it cannot be told."""
    try:
        weights = sum(int(p.numel()) * int(p.element_size()) for group in optimizer.param_groups
                      for p in group["params"])
    except Exception:
        return None
    return weights * (3 if "adam" in type(optimizer).__name__.lower() else 2) if weights else None


def patch_dataloader(module: Any) -> None:
    """Wrap ``torch.utils.data.dataloader.DataLoader.__iter__`` to tell the supervisor (once) of a DataLoader
    iterated while it has no batch at all (idempotent)."""
    from . import _core as agent_module

    loader_class = module.DataLoader
    original_iter = loader_class.__iter__
    if getattr(original_iter, "__guard_wrapped__", False):
        return
    empty_told = [False]

    @functools.wraps(original_iter)
    def __iter__(self: Any) -> Any:
        if not empty_told[0]:
            try:
                batches = len(self)  # a sized dataset's batch count; an iterable dataset raises TypeError
            except Exception:
                batches = None
            if batches == 0:
                agent = agent_module.get()
                try:
                    samples: int | None = len(self.dataset)
                except Exception:
                    samples = None
                if agent is not None and agent.send({"t": "empty_loader", "samples": samples,
                                                     "batch_size": self.batch_size,
                                                     "drop_last": bool(self.drop_last)}):
                    empty_told[0] = True
        return original_iter(self)

    __iter__.__guard_wrapped__ = True  # type: ignore[attr-defined]
    loader_class.__iter__ = __iter__


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


def _patch_scaler(torch: Any, agent_module: Any) -> None:
    scaler_cls = torch.amp.grad_scaler.GradScaler
    original_scale, original_update = scaler_cls.scale, scaler_cls.update

    @functools.wraps(original_scale)
    def scale(self: Any, outputs: Any) -> Any:
        result = original_scale(self, outputs)
        agent = agent_module.get()
        if agent is not None and result is not outputs and isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            agent.scaled = (result, outputs)
        return result

    @functools.wraps(original_update)
    def update(self: Any, new_scale: Any = None) -> Any:
        agent = agent_module.get()
        if agent is not None and new_scale is None and getattr(self, "_enabled", False):
            try:
                found = [f for state in self._per_optimizer_states.values()
                         for f in state["found_inf_per_device"].values()]
                if found:
                    device = found[0].device
                    hit = torch.stack([f.to(device).float().reshape(()) for f in found]).sum().clamp(max=1.0)
                    prev = agent.watch.skipped
                    # consecutive skipped steps: +1 on a skip, back to 0 on a good step (device ops, no sync)
                    agent.watch.skipped = hit if prev is None else (prev.to(device) + 1.0) * hit
            except Exception as exc:  # never break the job
                agent_module._warn_once(f"skipped-step count disabled: {exc!r}")
        return original_update(self, new_scale)

    original_step = scaler_cls.step

    @functools.wraps(original_step)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        agent = agent_module.get()
        before = agent.watch.optimizer_steps if agent is not None else 0
        result = original_step(self, optimizer, *args, **kwargs)
        if agent is not None and agent.watch.optimizer_steps == before:
            agent.watch.optimizer_stepped(optimizer)  # skipped for inf/NaN gradients: a step all the same
        return result

    scaler_cls.scale, scaler_cls.update, scaler_cls.step = scale, update, step


def patch_accelerate(module: Any) -> None:
    """Wrap ``accelerate.accelerator.Accelerator.backward`` to remember the loss it was given (idempotent)."""
    _remember_loss(module.Accelerator)


def patch_deepspeed(module: Any) -> None:
    """Wrap ``deepspeed.runtime.engine.DeepSpeedEngine.backward`` to remember the loss it was given, before its
    division by the gradient accumulation steps and its fp16 loss scale (idempotent)."""
    _remember_loss(module.DeepSpeedEngine)


def patch_dcp(module: Any) -> None:
    """Wrap ``torch.distributed.checkpoint.save``: when it returns, a save to a named folder (``checkpoint_id`` a
    path) is reported (``Agent.dcp_saved``) (idempotent; a save through a ``storage_writer`` alone is left to the
    guard's scans)."""
    from . import _core as agent_module

    original = getattr(module, "save", None)
    if original is None or getattr(original, "__guard_wrapped__", False):
        return

    @functools.wraps(original)
    def save(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        result = original(*args, **kwargs)
        agent = agent_module.get()
        where = kwargs.get("checkpoint_id")
        if agent is not None and isinstance(where, (str, os.PathLike)):
            try:
                agent.dcp_saved(os.fspath(where), time.monotonic() - started)
            except Exception as exc:  # never break the job
                agent_module._warn_once(f"distributed checkpoint hook failed: {exc!r}")
        return result

    save.__guard_wrapped__ = True  # type: ignore[attr-defined]
    module.save = save


def _remember_loss(cls: Any) -> None:
    """Wrap ``cls.backward(self, loss, ...)``: while it runs, the ``.backward()`` hook reports ``loss`` (the user's),
    not the tensor the library runs its backward on. The outermost call wins when two nest."""
    from . import _core as agent_module

    original = cls.backward
    if getattr(original, "__guard_wrapped__", False):
        return

    @functools.wraps(original)
    def backward(self: Any, loss: Any, *args: Any, **kwargs: Any) -> Any:
        agent = agent_module.get()
        if agent is None or agent.user_loss is not None:
            return original(self, loss, *args, **kwargs)
        agent.user_loss = loss
        try:
            return original(self, loss, *args, **kwargs)
        finally:
            agent.user_loss = None

    backward.__guard_wrapped__ = True  # type: ignore[attr-defined]
    cls.backward = backward


#: The most tensors and containers ``first_non_finite`` looks at in one saved object.
WITNESS_LIMIT = 100_000


def _finite(torch: Any, tensor: Any, *, mask: bool = False) -> bool:
    """Whether every element of a floating ``tensor`` is finite: its minimum and maximum in one pass
    (``torch.aminmax``; a NaN anywhere makes both NaN, an infinity is one of them), no tensor of the same size
    allocated (``isfinite(t).all()`` allocates one: 26x slower on 50M float32 here). Complex: ``isfinite().all()``.
    ``mask``: -inf is allowed (``protocol.mask_allows_minus_inf``), so only the maximum is looked at: it is NaN
    when a NaN is anywhere, +inf when a +inf is, and -inf or finite otherwise."""
    if tensor.is_complex():
        return bool(torch.isfinite(tensor).all())
    low, high = torch.aminmax(tensor)
    if mask:
        return bool(torch.isfinite(high) | torch.isneginf(high))
    return bool(torch.isfinite(low) & torch.isfinite(high))


def first_non_finite(torch: Any, obj: Any) -> str | None:
    """The name of the first floating tensor in ``obj`` (a tensor, a ``state_dict``, nested dicts, lists and tuples,
    an ``nn.Module``) holding a NaN or an infinity (``a.b.0.weight``), or None when every one is finite. A -inf in a
    tensor named as a mask is not counted (``protocol.mask_allows_minus_inf``: an attention mask kept as a buffer).

    One reduction per tensor on its own device (``_finite``), then one read of its result (a device sync per tensor;
    no copy of the data to the host). Integer, boolean, empty, sparse and meta tensors are
    skipped; at most ``WITNESS_LIMIT`` items are visited."""
    stack: list[tuple[str, Any]] = [("", obj)]
    seen = 0
    while stack and seen < WITNESS_LIMIT:
        name, item = stack.pop()
        seen += 1
        if isinstance(item, torch.Tensor):
            try:
                if (item.is_floating_point() or item.is_complex()) and item.numel() and item.layout == torch.strided \
                        and item.device.type != "meta" \
                        and not _finite(torch, item.detach(), mask=mask_allows_minus_inf(name)):
                    return name or "tensor"
            except (RuntimeError, TypeError):
                continue
        elif isinstance(item, torch.nn.Module):
            stack.append((name, item.state_dict()))
        elif isinstance(item, dict):
            stack.extend((f"{name}.{key}" if name else str(key), value) for key, value in reversed(item.items()))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{name}.{i}" if name else str(i), value) for i, value in reversed(list(enumerate(item))))
    return None


def _wrap_clip(torch: Any, agent_module: Any) -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` (the name in ``torch.nn.utils`` and in ``torch.nn.utils.clip_grad``,
    where it is defined; accelerate's and the Trainer's clipping call it through the first): the total norm it
    returns goes to the agent's ``LossWatch.grad_norm``, a witness read with the losses. A non-finite norm means
    NaN/inf gradients; unless ``error_if_nonfinite=True`` the update then makes every clipped weight non-finite
    while the loss of that step was still finite (ModernBERT #233)."""
    utils = getattr(getattr(torch, "nn", None), "utils", None)
    original = getattr(utils, "clip_grad_norm_", None)
    if utils is None or original is None or getattr(original, "__guard_wrapped__", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        norm = original(*args, **kwargs)
        agent = agent_module.get()
        if agent is not None and agent.backward_hook:
            try:
                agent.watch.grad_norm(norm)
            except Exception as exc:  # never break the job
                agent_module._warn_once(f"gradient norm witness disabled: {exc!r}")
        return norm

    clip_grad_norm_.__guard_wrapped__ = True  # type: ignore[attr-defined]
    utils.clip_grad_norm_ = clip_grad_norm_
    clip_grad = getattr(utils, "clip_grad", None)
    if clip_grad is not None and getattr(clip_grad, "clip_grad_norm_", None) is original:
        clip_grad.clip_grad_norm_ = clip_grad_norm_


def _wrap_save(torch: Any, agent_module: Any) -> None:
    original = getattr(torch, "save", None)
    if original is None or getattr(original, "__guard_wrapped__", False):
        return

    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        result = original(obj, f, *args, **kwargs)
        agent = agent_module.get()
        path = _path_of(f, flush=True)
        if agent is not None and path is not None:
            try:
                save_s = time.monotonic() - started
                bad = first_non_finite(torch, obj) if agent.reports_saves() else None
                agent.file_saved(path, save_s, bad_tensor=bad)
            except Exception as exc:  # never break the job
                agent_module._warn_once(f"save hook failed: {exc!r}")
        return result

    save.__guard_wrapped__ = True  # type: ignore[attr-defined]
    torch.save = save
    _wrap_load(torch, agent_module)


def _path_of(f: Any, *, flush: bool = False) -> str | None:
    """The file a ``torch.save``/``torch.load`` argument names: a path, or an open file object's ``name`` (what
    ``open(path, "wb")`` gives: ``torch.save(model, f)`` as pytorch/examples' word_language_model does); None for
    an in-memory buffer. ``flush``: the file object's buffer is flushed first, so that the file on disk holds the
    whole save when the guard looks at it (the job closes it later)."""
    if isinstance(f, (str, os.PathLike)):
        return os.fspath(f)
    name = getattr(f, "name", None)
    if not isinstance(name, str) or not name or name.startswith("<"):
        return None  # BytesIO, a pipe, a file opened from a descriptor (its name is an int)
    if flush:
        try:
            f.flush()
        except Exception:  # a closed or read-only object: what is on disk is what there is
            pass
    return name


def _wrap_load(torch: Any, agent_module: Any) -> None:
    """``torch.load`` tells the agent what the job loads: the checkpoint the guard resumed it from, or not."""
    original = getattr(torch, "load", None)
    if original is None or getattr(original, "__guard_wrapped__", False):
        return

    @functools.wraps(original)
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(f, *args, **kwargs)
        agent = agent_module.get()
        if agent is not None and agent.settings.resume_path:
            try:
                path = _path_of(f)
                if path is not None:
                    agent.resume_seen(path)
            except Exception as exc:  # never break the job
                agent_module._warn_once(f"load hook failed: {exc!r}")
        return result

    load.__guard_wrapped__ = True  # type: ignore[attr-defined]
    torch.load = load
