"""The loss watch of one process: losses in (from the ``.backward()`` hook, a Trainer's callback, ``guard.report``),
``step`` messages out. Stdlib only at import (torch is taken from ``sys.modules`` when a tensor is read).

One step is one optimizer step once the job has built a ``torch.optim`` optimizer: the ``.backward()`` calls of
its micro-batches (gradient accumulation) belong to the step they accumulate into, and the step's loss is what
that step minimises, combined from its micro-batches when the optimizer has stepped:

- the **sum** of the losses ``.backward()`` ran on, for a plain loop: their gradients add up in ``.grad``, so a
  loop that divides each micro-batch's loss by the accumulation steps (nanoGPT, most loops) gets the mean of its
  micro-batches' losses, the value it prints itself;
- the **mean** of the losses given to ``accelerator.backward(loss)`` or a DeepSpeed engine's ``backward(loss)``:
  those libraries divide by the accumulation steps themselves, after the agent took the loss.

A non-finite micro-batch is sent at once, with its step, whatever the accumulation.
"""

from __future__ import annotations

import math
import sys

TYPE_CHECKING = False  # typing's own flag, without importing typing in every job process (see protocol.py)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["UNSTEPPED_LIMIT", "LossWatch"]

#: ``.backward()`` calls after an optimizer was built with none of its steps seen, past which the watch stops
#: waiting for them and counts a step per ``.backward()`` again (an optimizer stepped without torch.optim's hooks).
UNSTEPPED_LIMIT = 1024


class _Slot:
    """A kept loss's place in ``LossWatch._buffer``."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Partial:
    """A step's losses read so far: their ``total`` and how many (``n``); ``combine``: ``"sum"`` or ``"mean"`` for
    the micro-batches of an optimizer step (the step's loss is their sum or their mean), None for a loss that is a
    step of its own."""

    __slots__ = ("combine", "n", "step", "total")

    def __init__(self, step: int, combine: str | None) -> None:
        self.step, self.combine, self.total, self.n = step, combine, 0.0, 0

    def add(self, value: float) -> None:
        self.total += value
        self.n += 1

    def value(self) -> float:
        return self.total / self.n if self.combine == "mean" and self.n else self.total


class LossWatch:
    """Turns losses into ``step`` messages: one by one in the sanity pass, then every ``check_every`` losses.

    After the sanity pass a device tensor's loss is copied into a small buffer on its device (no host-device sync;
    see ``_copy``) and every ``check_every`` losses the kept ones are read in one transfer; a CPU tensor's loss is
    read at once with ``item()`` (no transfer to save; cheaper than the copy) and kept in the same window. So the first
    non-finite step between two reads is known exactly: its message carries that step and its non-finite value
    (``n=1``), while a finite window's message carries the last whole step, its loss, and ``n`` (the steps it
    covers). Float losses (``guard.report(loss=2.3)``) cost nothing to check: a non-finite one is sent at once.

    The sanity pass is the first ``sanity_steps`` steps (optimizer steps once an optimizer is built: under gradient
    accumulation every micro-batch of them is read at once, and the step is sent when the optimizer has stepped).

    With a ``GradScaler``, ``skipped`` (consecutive optimizer steps skipped for inf/NaN gradients, counted on the
    device by ``_torch``) rides along on each message.

    Args:
        agent: the process's agent (``send(message) -> bool``, ``wait_stop()``).
        sanity_steps: steps read one by one first (``GUARD_AGENT_SANITY_STEPS``).
        check_every: after them, losses kept between two reads (``GUARD_AGENT_CHECK_EVERY``; at least 1).
    """

    def __init__(self, agent: Any, sanity_steps: int, check_every: int) -> None:
        self.agent = agent
        self.sanity_steps = sanity_steps
        self.check_every = max(1, check_every)
        self.count = 0  # losses observed (.backward() calls, reports)
        self.step = 0
        self.sanity_sent = 0  # finite steps sent one by one in the sanity pass
        self._after_sanity = 0  # losses observed since the sanity pass ended
        #: (step, detached tensor, slot or float, combine) since the last read; combine: None for a loss that is a
        #: step of its own, else "sum" or "mean" (a micro-batch of an optimizer step).
        self._kept: list[tuple[int, Any, str | None]] = []
        self._partial: _Partial | None = None  # the optimizer step whose micro-batches are not all read yet
        self._bad_float = False
        self._buffer: Any = None  # check_every float32 slots on the loss's device (see _copy)
        self._slots = 0  # slots of the buffer taken in this window
        self.skipped: Any = None  # consecutive skipped optimizer steps: a device tensor (set by _torch), or None
        #: The optimizer whose steps count (the first one that stepped: a GAN's second optimizer is not counted
        #: twice), its steps since the count's base, and that base: the step counted when the first optimizer was
        #: built (plus a resumed checkpoint's step). None: no optimizer built, a step is a ``.backward()`` call.
        self.optimizer_id: int | None = None
        self.optimizer_steps = 0
        self.step_base: int | None = None
        self._unstepped = 0  # .backward() calls since the optimizer was built, while none of its steps was seen
        #: Gradient norms ``clip_grad_norm_`` returned since the last read: ``(step, a copy on its device)``, read
        #: with the losses (a non-finite norm is a witness: the next update makes the weights non-finite).
        self._norms: list[tuple[int, Any]] = []

    @property
    def in_sanity(self) -> bool:
        """Whether the sanity pass is still on (fewer than ``sanity_steps`` finite steps sent)."""
        return self.sanity_sent < self.sanity_steps

    def grad_norm(self, norm: Any) -> None:
        """``torch.nn.utils.clip_grad_norm_`` returned ``norm`` (a 0-d tensor on the gradients' device) at this
        step: kept as a device-side copy (no sync), read with the next window (``flush``) or at once during the
        sanity pass; at most ``check_every`` are kept (the newest)."""
        try:
            kept = norm.detach().reshape(()).clone()
        except Exception:  # not a tensor (a float from a wrapper): read now, it costs nothing
            try:
                kept = float(norm)
            except (TypeError, ValueError):
                return
        self._norms.append((self.step, kept))
        if len(self._norms) > self.check_every:
            del self._norms[0]
        if self.in_sanity:
            self._read_norms("grad_norm")  # the sanity pass reads every step at once

    def _read_norms(self, source: str) -> int | None:
        """Read the kept gradient norms (one transfer): the step of the first non-finite one, else None. With
        ``source`` (not None) such a step is sent at once as its non-finite witness (source ``grad_norm``)."""
        if not self._norms:
            return None
        kept, self._norms = self._norms, []
        try:
            torch = sys.modules["torch"]
            values = [float(v) for v in torch.stack([torch.as_tensor(v, dtype=torch.float32)
                                                     if isinstance(v, float) else v.float()
                                                     for _, v in kept]).tolist()]
        except Exception:  # different devices: one by one
            try:
                values = [float(v) if isinstance(v, float) else float(v.item()) for _, v in kept]
            except Exception:
                return None
        bad = next((kept[i][0] for i, value in enumerate(values) if not math.isfinite(value)), None)
        if bad is not None and source:
            self._send(bad, math.nan, False, 1, "grad_norm")
        return bad

    def optimizer_built(self) -> None:
        """An optimizer was built (``torch.optim.Optimizer.__init__``): from now on a ``.backward()`` belongs to the
        optimizer step it accumulates into (``observe``), whatever the gradient accumulation."""
        if self.step_base is None:
            self.step_base = self.step

    def optimizer_stepped(self, optimizer: Any) -> None:
        """``optimizer.step()`` returned (torch's global ``register_optimizer_step_post_hook``): in the sanity pass
        the step's loss, whole now, is sent."""
        if self.optimizer_id is None:
            self.optimizer_id = id(optimizer)
        if id(optimizer) != self.optimizer_id:
            return
        self.optimizer_steps += 1
        if self.in_sanity and self._partial is not None and self._whole(self._partial.step):
            self._send_partial("backward")

    def resumed(self, step: int) -> None:
        """The job loaded a checkpoint of ``step``: the count goes on from it."""
        self.step += step
        if self.step_base is not None:
            self.step_base += step

    def _whole(self, step: int) -> bool:
        """Whether the optimizer has stepped past ``step`` (all of its micro-batches are in)."""
        return self.step_base is not None and step <= self.step_base + self.optimizer_steps

    def _accumulating(self) -> bool:
        """Set ``self.step`` for a ``.backward()`` with no step of its own; True when it is a micro-batch of an
        optimizer step (an optimizer is built and its steps are seen), False when it is a step of its own."""
        if self.step_base is not None and not self.optimizer_steps:
            self._unstepped += 1
            if self._unstepped > UNSTEPPED_LIMIT:  # its steps never reach torch.optim's hook: count .backward()s
                self.step, self.step_base, self._partial = self.step_base + self._unstepped, None, None
                return False
        if self.step_base is None:
            self.step += 1
            return False
        self.step = self.step_base + self.optimizer_steps + 1
        return True

    def observe(self, loss: Any, step: int | None, source: str, *, mean: bool = False) -> None:
        """One loss: ``step`` (None: the next one, or the optimizer step it accumulates into); ``mean``: the loss
        was given to a library that divides it by the accumulation steps itself (accelerate, DeepSpeed), so the
        step's loss is its micro-batches' mean, not their sum."""
        self.count += 1
        combine = None
        if step is not None:
            self.step = step
        elif self._accumulating():
            combine = "mean" if mean else "sum"
        is_float = isinstance(loss, (int, float))
        if self.in_sanity:
            value = float(loss) if is_float else float(loss.detach().float().item())
            if not math.isfinite(value):
                self._partial = None
                self._send(self.step, value, False, 1, source)
            elif combine is not None:  # sent once the optimizer has stepped (optimizer_stepped)
                self._add(self.step, value, combine)
            else:
                self.sanity_sent += 1
                self._send(self.step, value, True, 1, source)
            return
        self._after_sanity += 1
        if is_float:
            self._kept.append((self.step, float(loss), combine))
            if not math.isfinite(loss):
                self._bad_float = True
        elif getattr(loss, "is_cpu", False):
            # A CPU tensor: its value read now (no device, no sync: one ``item()``, ~10 us in a real loop's step,
            # where the buffer copy below costs ~45 us: four tensor ops with the step's caches cold), then kept in
            # the window like a device loss's copy, so that a NaN is read every ``check_every`` steps on every device.
            try:
                self._kept.append((self.step, float(loss.item()), combine))
            except (RuntimeError, TypeError, ValueError):  # an unusual tensor: copied as a device loss is
                self._kept.append((self.step, self._copy(loss), combine))
        else:
            self._kept.append((self.step, self._copy(loss), combine))
        # Windows end every ``check_every`` losses after the sanity pass, whatever read came between (a save reads
        # the pending losses early: the window after it still ends where it would have, so the steps a check names
        # do not shift with the saves).
        if self._bad_float or len(self._kept) >= self.check_every or self._after_sanity % self.check_every == 0:
            self.flush(source)

    def _add(self, step: int, value: float, combine: str) -> None:
        """A finite micro-batch loss of optimizer step ``step``, read: into the step's partial sum."""
        if self._partial is not None and self._partial.step != step:
            self._send_partial("backward")  # the step went on without its optimizer step seen: the old one is whole
        if self._partial is None:
            self._partial = _Partial(step, combine)
        self._partial.add(value)

    def _send_partial(self, source: str) -> None:
        partial, self._partial = self._partial, None
        if partial is not None and partial.n:
            if self.in_sanity:
                self.sanity_sent += 1
            self._send(partial.step, partial.value(), True, 1, source)

    def _copy(self, loss: Any) -> Any:
        """The step's scalar, copied now into a slot of a small buffer on its device (a device-side copy: no
        host-device sync). The loss tensor itself may not survive until the window is read: under CUDA-graph trees
        (``torch.compile(mode="reduce-overhead")``) the next replay overwrites it, and reading it then raises. A
        ``_Slot`` (its index in ``self._buffer``), or the detached tensor when the copy cannot be made."""
        slot = self._slots
        try:
            buffer = self._buffer
            if buffer is None or buffer.device != loss.device or buffer.numel() < self.check_every:
                torch = sys.modules["torch"]  # a plain tensor, whatever the loss's class
                buffer = self._buffer = torch.empty(self.check_every, dtype=torch.float32, device=loss.device)
            buffer[slot].copy_(loss.detach().reshape(()))
            self._slots += 1
            return _Slot(slot)
        except Exception:  # an unusual tensor (a subclass, a meta tensor): keep it and read it later
            return loss.detach()

    def _values(self) -> list[float]:
        items = [value for _, value, _ in self._kept]
        slots = [value.index for value in items if isinstance(value, _Slot)]
        read: list[float] = []
        if slots and self._buffer is not None:  # one transfer for the whole window
            read = [float(v) for v in self._buffer[: max(slots) + 1].tolist()]
        tensors = [value for value in items if not isinstance(value, (float, _Slot))]
        if not tensors:
            return [read[v.index] if isinstance(v, _Slot) else float(v) for v in items]
        torch = sys.modules.get("torch")
        if torch is not None and len(tensors) == len(items):
            try:  # one kernel and one transfer for the whole window
                return [float(v) for v in torch.stack([t.float().reshape(()) for t in tensors]).tolist()]
            except (RuntimeError, TypeError, ValueError):  # different devices or shapes: one by one
                pass
        return [read[v.index] if isinstance(v, _Slot) else v if isinstance(v, float) else float(v.float().item())
                for v in items]

    def flush(self, source: str) -> None:
        """Read the kept losses (one transfer) and send the window's message: its first non-finite loss, else its
        newest whole step with that step's loss; an optimizer step whose micro-batches are not all in waits for
        the next read."""
        if not self._kept:
            if self._partial is not None and self._whole(self._partial.step):
                self._send_partial(source)  # its optimizer step came after the last read
            self._read_norms(source)
            return
        values = self._values()
        kept, self._kept, self._bad_float, self._slots = self._kept, [], False, 0
        bad = next((i for i, value in enumerate(values) if not math.isfinite(value)), None)
        bad_norm = self._read_norms("")  # in the same read: the earlier witness of the two is sent
        if bad_norm is not None and (bad is None or bad_norm < kept[bad][0]):
            self._send(bad_norm, math.nan, False, 1, "grad_norm")  # a gradient norm went non-finite first
        elif bad is not None:  # the first non-finite step of the window, with its value
            self._partial = None
            self._send(kept[bad][0], values[bad], False, 1, source)
        else:
            self._send_whole(kept, values, source)

    def _send_whole(self, kept: list[tuple[int, Any, str | None]], values: list[float], source: str) -> None:
        """A finite window: its steps' losses (micro-batches of one optimizer step combined), the newest whole one
        sent with the number of steps the window covers."""
        steps: list[_Partial] = [self._partial] if self._partial is not None else []
        for (step, _, combine), value in zip(kept, values, strict=True):
            if combine is None or not steps or steps[-1].step != step or steps[-1].combine != combine:
                steps.append(_Partial(step, combine))
            steps[-1].add(value)
        self._partial = None
        if steps[-1].combine is not None and not self._whole(steps[-1].step):
            self._partial = steps.pop()  # its optimizer step is still accumulating: sent with a later read
        if steps:
            self._send(steps[-1].step, steps[-1].value(), True, len(steps), source)

    def non_finite_weights(self, tensor: str) -> None:
        """A save's tensor ``tensor`` is not finite: sent as this step's non-finite loss (source ``weights``)."""
        self._send(self.step, math.nan, False, 1, "weights")

    def _send(self, step: int, value: float, finite: bool, n: int, source: str) -> None:
        message = {"t": "step", "step": step, "loss": value, "finite": finite, "n": n, "source": source}
        if self.skipped is not None:
            try:
                message["skipped"] = int(self.skipped.item())  # read with the losses: no extra sync per step
            except (RuntimeError, TypeError, ValueError):
                self.skipped = None
        sent = self.agent.send(message)
        if sent and not finite:
            # The supervisor stops the job on a non-finite loss; wait for it here (bounded) so that the job does
            # not train on past the bad step while the message travels.
            self.agent.wait_stop()
