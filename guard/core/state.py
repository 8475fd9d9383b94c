"""What the supervisor knows about the run, as plain typed data that the policies read.

The event loop (``guard.run.supervisor``) owns one :class:`RunState` and hands it to the policies: the watchdog
(``guard.run.watchdog``) writes ``progress`` and ``outcome``, the loop records the job's own facts (``facts``) from
the agent's messages and the job's output, securing (``guard.secure.securing``) and the verdict
(``guard.run.diagnose``) read it. No process, socket or clock lives here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from guard.contract import signal_name

__all__ = ["JobFacts", "Outcome", "Progress", "RunState", "died_after_training", "incomplete_reason"]

#: An agent message as decoded from the channel (``guard.protocol``): a JSON object with a string ``t``.
Message = dict[str, Any]


@dataclass
class Outcome:
    """What the guard decided (before the job's exit is known).

    Attributes:
        status: ``PASS``, ``FAIL``, ``TIMEOUT`` or ``INTERRUPTED`` (``guard.contract``).
        reason: the verdict's reason (``non_finite_loss``, ``stalled``, ``dry_run``, ``preflight``, ``signal`` ...).
        exit_code: the guard's exit code, or None when it comes later (securing fills it in).
        hint: one line saying what to do, or None.
        extra: ``key=value`` fields of the VERDICT line (``rank``, ``signal``, ``check`` ...).
    """

    status: str
    reason: str
    exit_code: int | None = None
    hint: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Progress:
    """The job's training progress, as the primary rank (or the job's output) reports it.

    Attributes:
        step: the newest training step, or None before the first.
        loss: the newest loss, or None (never a finite loss on a ``non_finite_loss`` verdict).
        sanity: the first ``--sanity-steps`` losses.
        sanity_done: the sanity pass is complete.
        loss_source: where losses come from: ``agent`` (inside the job) or ``output`` (parsed lines), or None.
        exploded: ``{"step", "loss", "early"}`` when a finite loss exploded against its early level, else None.
        rose: ``{"since", "step", "loss", "early", "factor", "checkpoint", "checkpoint_step"}`` when the loss stayed
            above k x its early level for the window (``--loss-rise-factor``, ``--loss-rise-steps``), else None.
        flat: ``{"since", "step", "loss"}`` when the loss stayed exactly the same for ``--loss-rise-steps`` steps
            (the weights are not updated), else None.
        witness: on a ``non_finite_loss`` decision, what was not finite at ``step``: ``loss``, ``grad_norm`` (the
            norm ``clip_grad_norm_`` returned; the loss was finite) or ``weights`` (a tensor the job saved).
    """

    step: int | None = None
    loss: float | None = None
    sanity: list[float] = field(default_factory=list)
    sanity_done: bool = False
    loss_source: str | None = None
    exploded: dict[str, Any] | None = None
    rose: dict[str, Any] | None = None
    flat: dict[str, Any] | None = None
    witness: str = "loss"


@dataclass
class JobFacts:
    """What the job said about itself (agent messages, its output).

    Attributes:
        trainer_config: the Trainer's arguments (``trainer_config`` message), or None without a Trainer.
        trainer_push: the Trainer's own background push result (``push_result``), or None.
        train_end: ``Trainer.train()`` returned: step, max_steps, stopped (rank 0's, else the first one's).
        train_error: ``Trainer.train()`` raised: exc_type, message, root, step, max_steps (the first one).
        last_exception: ``"Type: message"`` of the job's last uncaught exception, or None.
        root_exception: the innermost error behind it (chain, DataLoader worker), or None.
        cuda_oom: the job ran out of CUDA memory.
        api_used: the ``guard.<name>()`` calls the job made (``api`` messages).
        checkpoints: the ``checkpoint_saved`` messages, each with the sender's ``rank``.
        files_saved: the ``file_saved`` messages (``torch.save`` to a named file returned: path, step).
        agents_seen: agents that said ``hello``.
        agent_watching: an agent hooked torch (or a Trainer): printed losses stop deciding.
        hang_where: where the main thread waits, once the job looked hung.
        node_rank: the node rank an agent reported (torchrun's ``GROUP_RANK``), or None.
        job_verdict: the job's own last ``VERDICT:`` line (escaped in the output), or None.
        train_intent: signs that the job meant to train (``train_intent`` messages): ``optimizer`` (the first
            optimizer's class name) and ``optimizer_step`` (True once an optimizer stepped).
        empty_loader: a DataLoader with no batch was iterated (``empty_loader``: samples, batch_size, drop_last).
        rank_exceptions: each rank's own uncaught exception (``"Type: message"``, its root cause when it has one),
            the first per rank, in the order they came (the agents' ``exception`` messages, ``[rankN]:`` lines).
        last_stderr_line: the job's last non-empty stderr line (masked), or None.
        error_files: each rank's ``TORCHELASTIC_ERROR_FILE`` (torchrun's per-rank error file), from its ``hello``.
        worker_deaths: DataLoader workers torch said died (output lines, exception messages): pid -> the signal's
            description (``Killed``), or None (``exited unexpectedly``).
        rank_exits: the failed ranks of torchrun's failure summary: rank -> exit code (negative: a signal).
        ranks_seen: the global ranks whose agents said ``hello``.
    """

    trainer_config: dict[str, Any] | None = None
    trainer_push: Message | None = None
    train_end: Message | None = None
    train_error: Message | None = None
    last_exception: str | None = None
    root_exception: str | None = None
    cuda_oom: bool = False
    api_used: set[str] = field(default_factory=set)
    checkpoints: list[Message] = field(default_factory=list)
    files_saved: list[Message] = field(default_factory=list)
    agents_seen: int = 0
    agent_watching: bool = False
    hang_where: str | None = None
    node_rank: int | None = None
    job_verdict: str | None = None
    train_intent: dict[str, Any] = field(default_factory=dict)
    empty_loader: Message | None = None
    worker_deaths: dict[int, str | None] = field(default_factory=dict)
    rank_exceptions: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    last_stderr_line: str | None = None
    rank_exits: dict[int, int] = field(default_factory=dict)
    ranks_seen: set[int] = field(default_factory=set)

    @property
    def answers_checkpoints(self) -> bool:
        """The job can answer a checkpoint request: it runs a Trainer (the agent's callback saves on request), it
        reported a save, or its script called ``guard.should_checkpoint()``/``checkpoint_saved()``. A save the agent
        saw at ``torch.distributed.checkpoint.save`` (``hook``) is no answer: the loop never reads a request. False
        means asking only wastes time: forward signals at once and secure what it saved itself."""
        return (self.trainer_config is not None or any(m.get("hook") is None for m in self.checkpoints)
                or bool(self.api_used & {"should_checkpoint", "checkpoint_saved"}))

    @property
    def handles_sigterm(self) -> bool:
        """The job installed its own SIGTERM handler (seen by the agent at a ``torch.save``): it saves when told."""
        return "sigterm_handler" in self.api_used

    def on_exception(self, message: Message, rank: int | None = None) -> None:
        """An ``exception`` message: the job's uncaught exception (``sys.excepthook``), from ``rank`` (None: a
        process without a rank, such as the launcher)."""
        if rank is not None and rank not in self.rank_exceptions:
            self.rank_exceptions[rank] = str(message.get("root") or f"{message.get('exc_type')}: "
                                             f"{message.get('message')}")
        self.last_exception = f"{message.get('exc_type')}: {message.get('message')}"
        if message.get("root"):
            self.root_exception = str(message["root"])
        if "OutOfMemoryError" in str(message.get("exc_type")):
            self.cuda_oom = True

    def on_train_end(self, message: Message, rank: int | None) -> None:
        """A ``train_end`` message: rank 0's (or a rankless agent's) stands; another rank's only until then."""
        if self.train_end is None or rank in (None, 0):
            self.train_end = message

    def on_train_error(self, message: Message) -> bool:
        """A ``train_error`` message; True the first time (the one that stands)."""
        if self.train_error is not None:
            return False
        self.train_error = message
        return True


@dataclass
class RunState:
    """Everything the policies read: progress, the job's facts, the guard's decision.

    Attributes:
        progress: see :class:`Progress`.
        facts: see :class:`JobFacts`.
        outcome: the guard's first decision, or None (the job's exit decides); the first one stands.
    """

    progress: Progress = field(default_factory=Progress)
    facts: JobFacts = field(default_factory=JobFacts)
    outcome: Outcome | None = None


def _empty_loader_text(facts: JobFacts) -> str:
    empty = facts.empty_loader
    if empty is None:
        return ""
    samples, batch, drop = empty.get("samples"), empty.get("batch_size"), empty.get("drop_last")
    why = (f"{samples} sample(s) with batch_size={batch} and drop_last=True" if drop and samples
           else f"{samples if samples is not None else 'an unknown number of'} sample(s)")
    return f"; a DataLoader yielded no batch ({why})"


def incomplete_reason(facts: JobFacts, progress: Progress | None = None) -> str | None:
    """Why an exit 0 is not a finished run (the hint), or None: ``Trainer.train()`` raised and the script went on,
    training ended before ``max_steps`` with no stop asked for (a callback's ``should_training_stop``, the
    guard's own request), or the job entered training (built an optimizer) and completed no step at all (no loss,
    no optimizer step: an empty DataLoader).

    Args:
        facts: what the job said about itself.
        progress: the run's progress (the steps counted); None skips the zero-step check.
    """
    error, end = facts.train_error, facts.train_end
    if (progress is not None and progress.step is None and not progress.sanity and end is None and error is None
            and "optimizer" in facts.train_intent and "optimizer_step" not in facts.train_intent):
        optimizer = facts.train_intent["optimizer"]
        named = f" ({optimizer})" if isinstance(optimizer, str) else ""
        return (f"the job built an optimizer{named} but completed no training step (no .backward(), no optimizer "
                f"step){_empty_loader_text(facts)}, then exited 0: check the dataset's path, split and filters, and "
                "that it holds at least batch_size samples (drop_last=True drops a short last batch)")
    if error is not None:
        what = error.get("root") or f"{error.get('exc_type')}: {error.get('message')}"
        where = f" at step {error.get('step')} of {error.get('max_steps')}" if error.get("step") is not None else ""
        return (f"Trainer.train() raised {what}{where}, and the script caught it and exited 0: fix that error "
                "(or let it propagate, so that the run fails visibly)")
    if end is not None and not end.get("stopped"):
        step, max_steps = end.get("step"), end.get("max_steps")
        if isinstance(step, int) and isinstance(max_steps, int) and max_steps > 0 and step < max_steps:
            return (f"training ended at step {step} of {max_steps} with no stop asked for (no callback set "
                    "should_training_stop): check that the dataset yields enough batches for max_steps")
    return None


def died_after_training(facts: JobFacts, code: int | None,
                        final_model_saved: Callable[[], bool] | None = None) -> str | None:
    """The signal a job died of after its training had completed, or None: ``Trainer.train()`` returned at its
    last step (``max_steps``), a save of that last step was seen (a checkpoint reported at
    that step, or final model files in the output folder), and then the job was killed by a signal (a C++ watchdog's
    SIGABRT, a segfault in a library's teardown), or a shell reported one (exit 128 + n). Such a run is a ``PASS``
    with a ``warning=``, and gets its final push.

    Args:
        facts: what the job said about itself.
        code: the job's exit code (negative: the signal), or None.
        final_model_saved: tells whether the output folder holds final model files (asked only when no checkpoint
            of the last step was reported), or None.
    """
    if code is None or code == 0:
        return None
    signum = -code if code < 0 else code - 128 if 128 < code < 128 + 65 else None
    end = facts.train_end
    if signum is None or end is None:  # "stopped" is set at max_steps too (DefaultFlowCallback): not read here
        return None
    step, max_steps = end.get("step"), end.get("max_steps")
    if not (isinstance(step, int) and isinstance(max_steps, int) and 0 < max_steps <= step):
        return None
    saved = any(c.get("step") == step for c in facts.checkpoints)
    if not saved and final_model_saved is not None:
        saved = final_model_saved()
    return signal_name(signum) if saved else None
