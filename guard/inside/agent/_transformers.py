"""``transformers.Trainer`` and every trainer built on it (TRL's SFTTrainer, ...).

``Trainer.__init__`` is wrapped once, when the job imports ``transformers.trainer``. Each new instance gets:

- its bound ``training_step`` wrapped, to see the raw loss tensor of each micro-batch. The Trainer's own logs
  cannot be trusted for this: with the default ``logging_nan_inf_filter=True`` a NaN loss is replaced by the
  running average in what is logged (``Trainer._inner_training_loop``, transformers 5.24), while the optimizer
  still steps on it.
- a ``GuardCallback``: reports the step's loss at ``on_step_end`` (``state.global_step``), the arguments that
  matter at ``on_train_begin`` (then waits, bounded, for the supervisor's go-ahead, so a preflight failure found
  here stops the job before its first step), every finished save at ``on_save``, and obeys checkpoint and stop
  requests by setting ``control.should_save`` / ``control.should_training_stop`` (``TrainerControl``).
- ``_push_from_checkpoint`` / ``_finish_current_push`` wrapped, to report the result of the Trainer's background
  pushes (``upload_folder(run_as_future=True)``), whose failures the Trainer never raises.
- ``train`` wrapped to pass ``resume_from_checkpoint`` when the supervisor fetched a checkpoint and the script
  did not ask for one.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

from ... import protocol

__all__ = ["patch"]


def _arg(args: Any, name: str) -> Any:
    value = getattr(args, name, None)
    if hasattr(value, "value"):  # enums such as IntervalStrategy
        value = value.value
    if isinstance(value, (list, tuple)):
        return [str(v.value if hasattr(v, "value") else v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def patch(trainer_module: Any) -> None:
    """Wrap ``Trainer.__init__`` of ``transformers.trainer`` (idempotent)."""
    from transformers.trainer_callback import TrainerCallback

    from .. import agent as agent_module
    Trainer = trainer_module.Trainer
    if getattr(Trainer.__init__, "__guard_wrapped__", False):
        return

    class GuardCallback(TrainerCallback):  # type: ignore[misc]
        """Reports losses, saves and arguments to the guard; obeys its checkpoint and stop requests."""

        def __init__(self, agent: Any, trainer: Any) -> None:
            self.agent = agent
            self.trainer = trainer
            self.micro: list[Any] = []
            self.save_started_s: float | None = None
            self.requested = False

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            config = {name: _arg(args, name) for name in protocol.TRAINER_FIELDS}
            config["has_eval_dataset"] = getattr(self.trainer, "eval_dataset", None) is not None
            config["max_steps"] = state.max_steps
            config["global_step"] = state.global_step
            config["world_process_zero"] = bool(state.is_world_process_zero)
            loss_fn = getattr(self.trainer, "compute_loss_func", None)
            config["loss_class"] = type(loss_fn).__name__ if loss_fn is not None else None
            if self.agent.send({"t": "trainer_config", "config": config}):
                self.agent.wait_ack()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            losses, self.micro = self.micro, []
            if losses:
                loss = losses[0] if len(losses) == 1 else sum(losses) / len(losses)
                self.agent.on_loss(loss, state.global_step, "trainer")
            if self.agent.checkpoint_due() and not self.requested:
                self.requested = True
                control.should_save = True
                if (self.agent.checkpoint_request or {}).get("stop"):
                    control.should_training_stop = True
            if self.agent.stop_requested:
                control.should_training_stop = True
            if control.should_save:
                self.save_started_s = time.monotonic()

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            save_s = time.monotonic() - self.save_started_s if self.save_started_s is not None else None
            self.save_started_s = None
            # Every rank reports its part of the save (DDP/FSDP/DeepSpeed write per-rank files); the supervisor
            # pushes once every training rank has reported, taking the path from the world's process zero.
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            zero = bool(state.is_world_process_zero)
            if self.requested:
                self.requested = False
                self.agent.checkpoint_done(path, state.global_step, save_s=save_s, zero=zero)
            else:
                self.agent.send({"t": "checkpoint_saved", "path": os.path.abspath(path), "zero": zero,
                                 "step": state.global_step, "save_s": save_s, "requested": False})

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.agent.watch.flush("trainer")
            self.agent.send({"t": "train_end", "step": state.global_step})

    original_init = Trainer.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        agent = agent_module.get()
        if agent is None or getattr(self, "_guard_callback", None) is not None:
            return
        try:
            _instrument(self, agent, GuardCallback(agent, self))
        except Exception as exc:  # never break the job
            agent_module._warn_once(f"cannot watch this Trainer: {exc!r}")

    __init__.__guard_wrapped__ = True  # type: ignore[attr-defined]
    Trainer.__init__ = __init__


def _instrument(trainer: Any, agent: Any, callback: Any) -> None:
    agent.backward_hook = False  # the Trainer's training_step gives the losses; no double counting
    trainer._guard_callback = callback
    trainer.add_callback(callback)

    step_fn = trainer.training_step

    @functools.wraps(step_fn)
    def training_step(*args: Any, **kwargs: Any) -> Any:
        agent.begun += 1
        loss = step_fn(*args, **kwargs)
        if hasattr(loss, "detach"):
            callback.micro.append(loss.detach())
        return loss

    trainer.training_step = training_step

    pushes: list[Any] = []
    if hasattr(trainer, "_push_from_checkpoint"):
        push_fn = trainer._push_from_checkpoint

        @functools.wraps(push_fn)
        def _push_from_checkpoint(*args: Any, **kwargs: Any) -> Any:
            result = push_fn(*args, **kwargs)
            progress = getattr(trainer, "push_in_progress", None)
            for job in getattr(progress, "jobs", None) or []:
                if job not in pushes:
                    pushes.append(job)
            return result

        trainer._push_from_checkpoint = _push_from_checkpoint

    if hasattr(trainer, "_finish_current_push"):
        finish_fn = trainer._finish_current_push

        @functools.wraps(finish_fn)
        def _finish_current_push(*args: Any, **kwargs: Any) -> Any:
            result = finish_fn(*args, **kwargs)
            errors = [repr(job.exception()) for job in pushes if job.done() and job.exception() is not None]
            if pushes:
                agent.send({"t": "push_result", "ok": not errors, "error": "; ".join(errors)[:500] or None,
                            "count": len(pushes)})
            return result

        trainer._finish_current_push = _finish_current_push

    train_fn = trainer.train
    resume_path = agent.settings.resume_path

    @functools.wraps(train_fn)
    def train(*args: Any, **kwargs: Any) -> Any:
        if resume_path and not args and kwargs.get("resume_from_checkpoint") in (None, False):
            kwargs["resume_from_checkpoint"] = resume_path
        return train_fn(*args, **kwargs)

    trainer.train = train
