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
  did not ask for one, and to end the process when ``train()`` returns because the guard stopped it (deadline,
  signal), so that the script's code after ``train()`` (a "final" save, a ``push_to_hub``) does not run on a
  half-trained model (``Agent.end_process``; every rank of a torchrun job does this).

``TrainingArguments.__post_init__`` is wrapped too (``patch_arguments``, when the job imports
``transformers.training_args``): the arguments that matter are sent as ``training_args`` the moment they are
built (HfArgumentParser, TrlParser or a literal call), and the job waits, bounded, for the go-ahead. A scripted
job builds them before loading and preprocessing its data, so a missing tracker key or Hub token stops it
there, not after the data work.
"""

from __future__ import annotations

import functools
import os
import time

from ... import protocol

TYPE_CHECKING = False  # typing's own flag, without importing typing in every job process (see protocol.py)
if TYPE_CHECKING:
    from typing import Any

    Agent = Any  # guard.inside.agent.Agent: that package imports this module, so it is not imported here

__all__ = ["patch", "patch_arguments"]



def _checkpoint_bytes_estimate(model: Any) -> int | None:
    """A Trainer checkpoint's size before its first save: the weights as stored plus AdamW's two fp32 moments per
    parameter (``exp_avg``, ``exp_avg_sq``; ``torch.optim.AdamW`` state). Reads tensor metadata only (``numel``,
    ``element_size``): no device sync. None when the model has no ``parameters()``."""
    try:
        params = list(model.parameters())
    except Exception:
        return None
    return int(sum(p.numel() * p.element_size() + (8 * p.numel() if p.requires_grad else 0) for p in params))

def _arg(args: Any, name: str) -> Any:
    value: Any = getattr(args, name, None)
    if hasattr(value, "value"):  # enums such as IntervalStrategy
        value = value.value
    if isinstance(value, (list, tuple)):
        return [str(v.value if hasattr(v, "value") else v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def patch_arguments(args_module: Any) -> None:
    """Wrap ``TrainingArguments.__post_init__`` of ``transformers.training_args`` (idempotent).

    Subclasses (TRL's ``SFTConfig`` ...) call it through ``super().__post_init__()``. Each distinct set of
    reported values is sent once per process.
    """
    from . import _core as agent_module

    cls = args_module.TrainingArguments
    original = cls.__post_init__
    if getattr(original, "__guard_wrapped__", False):
        return
    sent: list[dict[str, Any]] = []

    @functools.wraps(original)
    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        agent = agent_module.get()
        if agent is None:
            return
        try:
            config = {name: _arg(self, name) for name in protocol.TRAINER_FIELDS if name != "max_steps"}
            if config in sent:
                return
            sent.append(config)
            agent.ask({"t": "training_args", "config": config})
        except Exception as exc:  # never break the job
            agent_module._warn_once(f"cannot report the TrainingArguments: {exc!r}")

    __post_init__.__guard_wrapped__ = True  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


def patch(trainer_module: Any) -> None:
    """Wrap ``Trainer.__init__`` of ``transformers.trainer`` (idempotent)."""
    from transformers.trainer_callback import TrainerCallback

    from . import _core as agent_module
    Trainer = trainer_module.Trainer
    if getattr(Trainer.__init__, "__guard_wrapped__", False):
        return

    class GuardCallback(TrainerCallback):
        """Reports losses, saves and arguments to the guard; obeys its checkpoint and stop requests."""

        def __init__(self, agent: Agent, trainer: Any) -> None:
            self.agent = agent
            self.trainer = trainer
            self.micro: list[Any] = []
            self.save_started_s: float | None = None
            self.requested = False
            self.stop_seen = False  # a callback (or the guard) asked training to stop: an early end is legitimate

        def _note_stop(self, control: Any) -> None:
            # This callback runs after the others (added last), so it sees their should_training_stop.
            if getattr(control, "should_training_stop", False):
                self.stop_seen = True

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._note_stop(control)

        def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._note_stop(control)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            config = {name: _arg(args, name) for name in protocol.TRAINER_FIELDS}
            config["has_eval_dataset"] = getattr(self.trainer, "eval_dataset", None) is not None
            config["max_steps"] = state.max_steps
            config["global_step"] = state.global_step
            config["world_process_zero"] = bool(state.is_world_process_zero)
            loss_fn = getattr(self.trainer, "compute_loss_func", None)
            config["loss_class"] = type(loss_fn).__name__ if loss_fn is not None else None
            config["checkpoint_bytes_estimate"] = _checkpoint_bytes_estimate(getattr(self.trainer, "model", None))
            self.agent.ask({"t": "trainer_config", "config": config})

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            losses, self.micro = self.micro, []
            if losses:
                # the step's loss as the Trainer logs it: the sum of its micro-batches' training_step returns
                # (each divided by the accumulation steps, or already a share of num_items_in_batch)
                loss = losses[0] if len(losses) == 1 else sum(losses)
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
            self._note_stop(control)

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
                self.agent.watch.flush("save")  # a save is a read point: a NaN in the window goes before the save
                self.agent.relay.learn_run_id()  # the save goes under the run id of node 0's guard
                self.agent.send({"t": "checkpoint_saved", "path": os.path.abspath(path), "zero": zero,
                                 "step": state.global_step, "save_s": save_s, "requested": False})

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.agent.watch.flush("trainer")
            self.agent.relay.learn_run_id()
            self.agent.send({"t": "train_end", "step": state.global_step, "max_steps": state.max_steps,
                             "stopped": self.stop_seen or self.agent.stop_requested})

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


def _instrument(trainer: Any, agent: Agent, callback: Any) -> None:
    from . import _core as agent_module

    agent.backward_hook = False  # the Trainer's training_step gives the losses; no double counting
    agent.trainer = True  # its saves come through on_save, not torch.save
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
        chosen = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if resume_path and isinstance(chosen, (str, os.PathLike)):
            try:
                agent.resume_seen(os.fspath(chosen))  # the Trainer loads it (its weights may be safetensors only)
            except Exception as exc:  # never break the job
                agent_module._warn_once(f"resume hook failed: {exc!r}")
        try:
            result = train_fn(*args, **kwargs)
        except Exception as exc:
            # Said before the script sees it: a script that swallows it and exits 0 did not finish its run.
            state = getattr(trainer, "state", None)
            agent.watch.flush("trainer")
            agent.send({"t": "train_error", "exc_type": type(exc).__name__, "message": str(exc)[:500],
                        "root": agent_module.root_cause(exc), "step": getattr(state, "global_step", None),
                        "max_steps": getattr(state, "max_steps", None)})
            raise
        if agent.stop_requested:  # the guard stopped training: the code after train() must not run as if finished
            agent.end_process()
        return result

    trainer.train = train
