"""The watchdog policy: what the job's steps, losses and silences mean.

A plain object, fed events by the supervisor's loop with the loop's clock (``now``, monotonic seconds), that
never touches a process, a socket or the clock itself. It writes the run's progress (``RunState.progress``) and
returns what the guard decided as :class:`Decision` values; the loop carries them out (record the outcome, stop
the job, ask for stacks). It decides:

- the sanity pass: the first ``--sanity-steps`` losses are finite; with ``--dry-run`` the job is then stopped
  (``PASS dry_run``);
- a non-finite loss (``FAIL non_finite_loss``): with several ranks, the earliest step and its rank, once every rank
  has reported that far (at most ``NAN_SETTLE_S``), since a NaN on one rank reaches the others through the
  gradient all-reduce a step later;
- optimizer steps skipped by a GradScaler past ``--max-skipped-steps`` (``FAIL non_finite_loss``, no loss);
- a stall (``FAIL stalled``): one rank silent for ``--stall-timeout`` while others go on (``ranks.RankWatch``), or
  no step (before the first: no output) for that long (``timers.StallWatch``);
- a loss that exploded while staying finite (named in the hint, no verdict of its own);
- a sustained loss rise: the loss above ``--loss-rise-factor`` times its early level for ``--loss-rise-steps``
  steps in a row (named once in the log with the last checkpoint saved before the rise began; a ``warning=`` on a
  PASS, no verdict of its own).
- a loss that never changes: exactly the same value for ``--loss-rise-steps`` steps in a row (the weights are not
  updated: an optimizer holding other tensors than the model's, a learning rate of 0); named once in the log, a
  ``warning=`` on a PASS.

Only the primary rank's steps (the lowest rank seen) stand for the job's ``step`` and ``loss``; every rank is
checked for non-finite losses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from guard.contract import EXIT_NON_FINITE, EXIT_PREFLIGHT, EXIT_STALLED
from guard.core.state import Outcome, RunState
from guard.run.config import WatchSettings
from guard.run.ranks import RankWatch
from guard.run.timers import StallWatch

if TYPE_CHECKING:
    from guard.preflight._models import CheckResult

__all__ = ["EARLY_STEPS", "EXPLODE_FACTOR", "NAN_SETTLE_S", "Decision", "SettingsCheck", "StepResult", "Watchdog",
           "flat_loss_text"]

log = logging.getLogger("guard.supervisor")

EXPLODE_FACTOR = 100.0  # a finite loss this many times its early level (Watchdog._early_level) exploded
EARLY_STEPS = 5  # steps whose median is the loss's early level
NAN_SETTLE_S = 2.0  # with several ranks, how long to wait for the others' reports before naming the first NaN
#: Frames of torch.compile's machinery (a stall there is compilation, not a collective or I/O).
_COMPILE_FRAMES = ("torch/_dynamo/", "torch/_inductor/", "_dynamo/", "_inductor/", "torch/_functorch/")
STACKS_WAIT_S = 1.0  # after a stall: how long the agents have to print their stacks before the SIGTERM


def flat_loss_text(flat: Mapping[str, Any]) -> str:
    """The warning for a loss that never changes (``Progress.flat``), with its likely causes."""
    if flat["loss"] == 0.0:
        return (f"the loss stayed exactly 0 from step {flat['since']} to step {flat['step']} after non-zero "
                "losses: a masked or \"NaN-safe\" loss with nothing left to predict (an empty mask, every label "
                "-100), or nan_to_num hiding NaN; the weights may be non-finite (every save is checked): look at "
                "the batches and the masking")
    return (f"the loss stayed exactly {flat['loss']:.6g} from step {flat['since']} to step {flat['step']}: the "
            "weights are not being updated (the optimizer was built over other tensors than the model trains, e.g. "
            "before the model was moved or rebuilt; a learning rate of 0; requires_grad off; optimizer.step() "
            "never called)")


@dataclass(frozen=True)
class Decision:
    """An outcome the watchdog decided, and what the loop does about it.

    Attributes:
        outcome: the verdict's status, reason, exit code, hint, extra fields.
        stop: stop the job now (``stop`` to the agents, SIGTERM, SIGKILL after ``--grace``).
        dump_stacks: ask every agent where it waits (``dump``) and log the job's Python stacks (py-spy).
        stop_in_s: stop the job this many seconds from now (the stacks come first), or None.
    """

    outcome: Outcome
    stop: bool = True
    dump_stacks: bool = False
    stop_in_s: float | None = None


@dataclass
class StepResult:
    """What one step report led to.

    Attributes:
        counted: the step stands for the job's (the primary rank's, with a finite loss): securing's step times
            and the heartbeat hear of it.
        decisions: outcomes decided on this step (non-finite loss, dry run done).
    """

    counted: bool = False
    decisions: list[Decision] = field(default_factory=list)


class Watchdog:
    """The policy that decides sanity pass, non-finite loss, skipped steps, stalls and dry run.

    Args:
        state: the run's state; the watchdog writes ``state.progress`` and reads ``state.outcome`` and
            ``state.facts.train_end``.
        now: the clock at the job's start (monotonic seconds).
        sanity_steps: ``--sanity-steps`` (losses checked one by one before the pass).
        stall_timeout_s: ``--stall-timeout`` in seconds; 0 turns the stall watch off.
        dry_run: ``--dry-run``: stop the job once the sanity pass is done.
        max_skipped_steps: ``--max-skipped-steps``; 0 turns that check off.
        loss_rise_factor: ``--loss-rise-factor`` (k); 0 turns the sustained-rise check off.
        loss_rise_steps: ``--loss-rise-steps`` (the window, in training steps; at least 1).
        expected_primary: the rank whose steps stand for the job's, from the launcher's command, or None.
    """

    @classmethod
    def from_settings(cls, state: RunState, now: float, settings: WatchSettings, *,
                      expected_primary: int | None = None) -> Watchdog:
        """A watchdog on the loop's part of the settings (``RunSettings.watch``); ``now``: monotonic seconds."""
        return cls(state, now, sanity_steps=settings.sanity_steps, stall_timeout_s=settings.stall_timeout_s,
                   dry_run=settings.dry_run, max_skipped_steps=settings.max_skipped_steps,
                   loss_rise_factor=settings.loss_rise_factor, loss_rise_steps=settings.loss_rise_steps,
                   expected_primary=expected_primary)

    def __init__(self, state: RunState, now: float, *, sanity_steps: int, stall_timeout_s: float,
                 dry_run: bool = False, max_skipped_steps: int = 0, loss_rise_factor: float = 0.0,
                 loss_rise_steps: int = 20, expected_primary: int | None = None) -> None:
        self.state = state
        self.loss_rise_factor = loss_rise_factor
        self.loss_rise_steps = max(1, loss_rise_steps)
        self.rise_since: tuple[int, float] | None = None  # (step, loss) where the loss first stood above k x early
        self.flat_since: tuple[int, float] | None = None  # (step, loss) where the current run of equal losses began
        self.sanity_steps = sanity_steps
        self.stall_timeout_s = stall_timeout_s
        self.dry_run = dry_run
        self.max_skipped_steps = max_skipped_steps
        self.stall = StallWatch(stall_timeout_s, now)
        self.ranks = RankWatch(stall_timeout_s, expected_primary)  # the primary rank, every rank's last step time
        self.primary_agent: int | None = None  # agents without a rank: the first one's steps stand
        self.early_losses: list[float] = []  # the first EARLY_STEPS finite losses (the explosion check's level)
        self.nan_reports: list[tuple[int, int, float, int]] = []  # (step, rank or -1, loss, n), non-finite
        self.witnesses: dict[int | None, str] = {}  # step -> what was non-finite there when not the loss
        self.nonzero_seen = False  # a loss other than exactly 0.0 was reported (_check_flat)
        self.nan_decide_at: float | None = None
        self.rank_begun: dict[int, int] = {}  # rank -> steps begun, from the answers to a stack dump
        self.output_seen = False  # the job wrote at least one byte

    # -- events -------------------------------------------------------------------------------------------------

    def on_output(self, now: float) -> None:
        """The job printed something (progress only before its first step)."""
        self.output_seen = True
        self.stall.output(now)

    def on_step(self, now: float, step: int | None, value: float, *, finite: bool = True, n: int = 1,
                source: str = "agent", rank: int | None = None, agent: int | None = None,
                live_ranks: frozenset[int] = frozenset(), witness: str = "loss") -> StepResult:
        """A step report.

        Args:
            now: monotonic seconds.
            step: the step number, or None (one more than the last, ``n`` more for a batch).
            value: the loss (NaN when the report had none).
            finite: the sender's finiteness check (the agent checks on the device).
            n: steps covered by this report (>= 1).
            source: ``agent`` (inside the job) or ``output`` (a parsed line). Once an agent reports, parsed
                losses stop counting and the sanity pass restarts with the agent's losses.
            rank: the sender's rank, or None (output, or an agent without a rank).
            agent: the sender's connection, for agents without a rank (the first one's steps stand).
            live_ranks: the ranks of the agents connected now (a non-finite loss waits for them).
            witness: what was found non-finite (``loss``; the agent's ``grad_norm``: the norm
                ``clip_grad_norm_`` returned; ``weights``: a tensor the job saved): the hint says which.
        """
        progress = self.state.progress
        if source == "agent" and progress.loss_source != "agent":
            if progress.loss_source == "output":
                log.info("losses now come from the agent inside the job (output parsing off)")
                progress.sanity, progress.sanity_done = [], False
            progress.loss_source = "agent"
        elif progress.loss_source is None:
            progress.loss_source = source
            log.info("reading losses from the job's output (no agent step seen)")
        result = StepResult()
        outcome = self.state.outcome
        if outcome is not None and outcome.reason == "non_finite_loss":
            return result  # step= and loss= stay the first bad step's (a later report in the same read: its echo)
        if not finite or not math.isfinite(value):
            if math.isfinite(value):
                value = math.nan  # never a finite loss on a non_finite_loss verdict
            if witness != "loss":
                self.witnesses.setdefault(step, witness)
            result.decisions += self._non_finite(now, step, value, n, rank, live_ranks)
            return result
        if rank is not None:  # step and loss come from the lowest rank; the others were checked for NaN above
            if not self.ranks.on_step(rank, step, now):
                return result
        else:  # agents without a rank (several plain processes): the first one's
            if self.primary_agent is None and agent is not None:
                self.primary_agent = agent
            if agent is not None and agent != self.primary_agent:
                return result
        progress.step = step if step is not None else (progress.step or 0) + n
        progress.loss = value
        self._check_explosion(value)
        self._check_rise(value)
        self._check_flat(value)
        self.stall.step(now)
        result.counted = True
        if not progress.sanity_done:
            progress.sanity.append(value)
            if len(progress.sanity) >= self.sanity_steps:
                result.decisions += self._sanity_passed()
        return result

    def on_replay(self, now: float, rank: int | None) -> None:
        """CUDA-graph replays: steps without a loss (no ``.backward()``), progress all the same, never a stall."""
        self.stall.step(now)
        if rank is not None:
            self.ranks.alive(rank, now)

    def on_train_end(self, rank: int | None) -> None:
        """``Trainer.train()`` returned on ``rank``: it is silent on purpose from now on."""
        if rank is not None:
            self.ranks.finished(rank)

    def on_skipped(self, skipped: int, step: int | None, rank: int | None) -> list[Decision]:
        """A GradScaler skipped ``skipped`` optimizer steps in a row (inf/NaN gradients): past
        ``--max-skipped-steps`` the fp16 loss scale is collapsing and nothing is learned."""
        limit = self.max_skipped_steps
        if self.state.outcome is not None or not limit or skipped < limit:
            return []
        log.error("the GradScaler skipped the last %d optimizer steps (inf/NaN gradients; --max-skipped-steps %d)%s",
                  skipped, limit, f" on rank {rank}" if rank is not None else "")
        if step is not None:
            self.state.progress.step = step
        self.state.progress.loss = None  # the loss itself is finite: no loss= on a non_finite_loss verdict
        extra = {"rank": rank} if rank is not None else {}
        return [Decision(Outcome("FAIL", "non_finite_loss", EXIT_NON_FINITE, extra=extra, hint=(
            f"fp16 overflow: the loss scale kept collapsing and the last {skipped} optimizer steps were all skipped "
            "(gradients inf/NaN), so nothing was learned: prefer bf16 over fp16, lower the learning rate or add "
            "warmup, clip gradients, and look for a layer whose activations overflow fp16")))]

    def on_count(self, rank: int | None, step: int | None) -> None:
        """A rank's own step count (``count``, or a stack answer's ``step``): the primary rank's moves ``step`` on
        (the steps since its last report were checked on the device but not sent yet); after a non-finite loss
        ``step`` stays the first bad step."""
        progress = self.state.progress
        primary = self.ranks.primary
        outcome = self.state.outcome
        bad_step = outcome is not None and outcome.reason == "non_finite_loss"
        if (step is not None and progress.step is not None and step > progress.step and not bad_step
                and (rank is None or primary is None or rank == primary)):
            progress.step = step

    def on_stack_answer(self, rank: int | None, begun: int | None, where: str | None,
                        step: int | None = None) -> None:
        """A rank's answer to a stack dump or a stop (``progress``): how many steps it has begun, the last step it
        counted, and where its main thread waits. The primary rank's count moves ``step`` on (the steps since its
        last report were checked on the device but not sent yet); names the rank that holds up the rest, and where
        the job hangs, on a ``stalled`` outcome."""
        self.on_count(rank, step)
        outcome = self.state.outcome
        stalled = outcome is not None and outcome.reason == "stalled"
        named = outcome.extra.get("rank") if outcome is not None else None
        # the stalled rank's own stack (rank 0's, or a rankless process's, when no rank is named)
        if where and stalled and self.state.facts.hang_where is None and (
                rank == named if named is not None else rank in (None, 0)):
            self._name_hang(where)
        if rank is None or begun is None:
            return
        self.rank_begun[rank] = begun
        if outcome is None or not stalled or len(self.rank_begun) < 2:
            return
        fewest = min(self.rank_begun.values())
        behind = [r for r, count in self.rank_begun.items() if count == fewest]
        if len(behind) == 1 and outcome.extra.get("rank") != behind[0]:
            outcome.extra["rank"] = behind[0]
            log.error("rank %d has begun fewer steps (%d) than the others: it is the one stuck; the others wait "
                      "for it in a collective", behind[0], fewest)

    def pause(self) -> None:
        """Stop watching for stalls (the guard decided; it is stopping the job or securing a checkpoint)."""
        self.stall.pause()
        self.ranks.pause()

    # -- timers -------------------------------------------------------------------------------------------------

    def due_at(self) -> float:
        """When ``tick`` next has work (monotonic seconds; ``inf`` when nothing is pending)."""
        return min(self.stall.due_at(), self.ranks.due_at(),
                   self.nan_decide_at if self.nan_decide_at is not None else math.inf)

    def tick(self, now: float, live_ranks: frozenset[int] = frozenset()) -> list[Decision]:
        """The timed decisions: a settled non-finite loss, a stalled rank, a stalled job."""
        if self.state.outcome is not None:
            return []
        if self._non_finite_settled(now, live_ranks):
            return [self._decide_non_finite()]
        stalled_rank = self.ranks.stalled_rank(now) if not self.stall.paused else None
        if stalled_rank is not None:
            silent = self.ranks.silent_for_s(stalled_rank, now)
            log.error("rank %d: no training step for %.0fs (--stall-timeout %.0fs) while the other ranks go on",
                      stalled_rank, silent, self.stall_timeout_s)
            return [Decision(Outcome("FAIL", "stalled", EXIT_STALLED, extra={"rank": stalled_rank}, hint=(
                f"rank {stalled_rank} made no training step for {silent:.0f}s while the others went on: look at "
                "its stack above (stopped, I/O, a DataLoader worker); raise --stall-timeout if a step can take "
                "that long")), stop=False, dump_stacks=True, stop_in_s=STACKS_WAIT_S)]
        if self.stall.expired(now):
            return [self._stalled(now)]
        return []

    def _stalled(self, now: float) -> Decision:
        silent = self.stall.silent_for_s(now)
        what = "no training step" if self.stall.first_step_seen else "no output and no training step"
        train_end = self.state.facts.train_end
        if train_end is not None:
            what = f"no progress since training ended at step {train_end.get('step')}"
        log.error("%s for %.0fs (--stall-timeout %.0fs): the job looks hung", what, silent, self.stall_timeout_s)
        stuck = self.stuck_rank()
        extra = {"rank": stuck} if stuck is not None else {}
        if stuck is not None:
            log.error("rank %d reported the fewest steps (%d); asking every rank how far it got",
                      stuck, self.ranks.last_step[stuck][0])
        hint = (f"{what} for {silent:.0f}s: look at the stacks above for where it waits (a collective, a "
                "DataLoader worker, I/O); raise --stall-timeout if a step or the first output can take that long")
        if not self.output_seen and not self.stall.first_step_seen and not self.state.facts.agents_seen:
            hint = (f"{what} for {silent:.0f}s, and no agent inside the job (a program the guard cannot enter, or "
                    "python -I/-S): a Python program writing to a pipe block-buffers its output, so it may be "
                    "working and saying nothing: run it with python -u (or PYTHONUNBUFFERED=1, or print(..., "
                    "flush=True)); raise --stall-timeout if its first output can take that long")
        return Decision(Outcome("FAIL", "stalled", EXIT_STALLED, extra=extra, hint=hint),
                        stop=False, dump_stacks=True, stop_in_s=STACKS_WAIT_S)

    # -- ranks --------------------------------------------------------------------------------------------------

    def stuck_rank(self) -> int | None:
        """With several ranks: the one that fell behind (lowest step, then the oldest report); else None."""
        last = self.ranks.last_step
        if len(last) < 2:
            return None
        steps = {rank: step for rank, (step, _) in last.items()}
        if len(set(steps.values())) == 1:
            return min(last, key=lambda r: last[r][1])
        return min(steps, key=lambda r: (steps[r], r))

    def training_ranks(self) -> set[int]:
        """Ranks that reported training steps."""
        return set(self.ranks.last_step)

    def newest_rank_step(self) -> int | None:
        """The highest step any rank reported, or None before the first."""
        return max((step for step, _ in self.ranks.last_step.values()), default=None)

    def rank_steps(self) -> dict[int, int]:
        """Each training rank's last reported step."""
        return {rank: step for rank, (step, _) in self.ranks.last_step.items()}

    # -- the decisions ------------------------------------------------------------------------------------------

    def _check_explosion(self, value: float) -> None:
        """Name, once, a finite loss that exploded against its early level (in the spirit of Lightning's loss
        spike detection): ``EXPLODE_FACTOR`` times the early level (``_early_level``), checked from the second
        loss on: a learning rate far too high explodes the loss at the first update (TRL's sft.py, lr 50: 3.13,
        then 2.0e4), inside the steps whose median would otherwise be its level."""
        if len(self.early_losses) < EARLY_STEPS:
            self.early_losses.append(value)
        progress = self.state.progress
        if progress.exploded is not None or len(self.early_losses) < 2:
            return
        early = self._early_level()
        if abs(value) > EXPLODE_FACTOR * max(abs(early), 1e-6):
            progress.exploded = {"step": progress.step, "loss": value, "early": early}
            log.warning("the loss exploded: %.6g at step %s, %.0fx its early level %.4g (the lower of the first "
                        "loss and the median of the first %d steps): the run is diverging; lower the learning rate, "
                        "add warmup or clip gradients",
                        value, progress.step, abs(value) / max(abs(early), 1e-6), early, EARLY_STEPS)

    def _early_level(self) -> float:
        """The loss's early level: the lower of the first loss (taken before any update, the model's own starting
        point) and the median of the first ``EARLY_STEPS`` losses, so that losses that already exploded inside
        those steps do not become the level they are measured against."""
        median = sorted(self.early_losses)[len(self.early_losses) // 2]
        first = self.early_losses[0]
        return min(first, median) if first > 0 and median > 0 else median

    def _check_rise(self, value: float) -> None:
        """Name, once, a loss that stays above ``loss_rise_factor`` times its early level (the median of the first
        ``EARLY_STEPS`` losses) for ``loss_rise_steps`` steps: a run that diverged and did not come back, though no
        single value exploded. The last checkpoint saved before the rise began is the one to go back to."""
        progress = self.state.progress
        k = self.loss_rise_factor
        if not k or progress.rose is not None or len(self.early_losses) < EARLY_STEPS or progress.step is None:
            return
        early = self._early_level()
        if early <= 0 or value <= k * early:
            self.rise_since = None
            return
        if self.rise_since is None:
            self.rise_since = (progress.step, value)
            return
        began, first = self.rise_since
        if progress.step - began + 1 < self.loss_rise_steps:
            return
        before = [c for c in self.state.facts.checkpoints + self.state.facts.files_saved
                  if isinstance(c.get("step"), int) and c["step"] < began and c.get("path")]
        last = max(before, key=lambda c: int(c["step"]), default=None)
        progress.rose = {"since": began, "step": progress.step, "loss": value, "early": early, "factor": k,
                         "checkpoint": last.get("path") if last else None,
                         "checkpoint_step": last.get("step") if last else None}
        where = (f"the last checkpoint before it: {last['path']} (step {last['step']})" if last
                 else "no checkpoint was saved before it")
        log.warning("the loss rose and stayed up: above %gx its early level %.4g (the lower of the first loss "
                    "and the median of the first %d steps) "
                    "since step %d (%.6g), now %.6g at step %d (--loss-rise-factor %g, --loss-rise-steps %d); %s",
                    k, early, EARLY_STEPS, began, first, value, progress.step, k, self.loss_rise_steps, where)

    def _check_flat(self, value: float) -> None:
        """Name, once, a loss that stays exactly the same for ``loss_rise_steps`` steps. Losses of different batches
        differ when the weights move; the same value step after step means they do not. Exactly 0.0 counts only
        after a non-zero loss (a loss at 0 from the start is a job's choice; one that drops to exactly 0 and stays
        is a masked loss with nothing to predict, or ``nan_to_num`` hiding NaN: ModernBERT #233)."""
        progress = self.state.progress
        if value != 0.0:
            self.nonzero_seen = True
        if progress.flat is not None or progress.step is None or self.loss_rise_steps < 2 or \
                (value == 0.0 and not self.nonzero_seen):
            return
        if self.flat_since is None or self.flat_since[1] != value:
            self.flat_since = (progress.step, value)
            return
        began = self.flat_since[0]
        if progress.step - began + 1 < self.loss_rise_steps:
            return
        progress.flat = {"since": began, "step": progress.step, "loss": value}
        log.warning("%s", flat_loss_text(progress.flat))

    def _sanity_passed(self) -> list[Decision]:
        progress = self.state.progress
        progress.sanity_done = True
        text = " ".join(f"{v:.4g}" for v in progress.sanity)
        log.info("sanity pass: the first %d losses are finite: %s", len(progress.sanity), text or "(0 steps asked)")
        if self.dry_run and self.state.outcome is None:
            log.info("--dry-run: stopping the job after the sanity pass")
            return [Decision(Outcome("PASS", "dry_run", 0))]
        return []

    def _non_finite(self, now: float, step: int | None, value: float, n: int, rank: int | None,
                    live_ranks: frozenset[int]) -> list[Decision]:
        """A non-finite loss. With several ranks, the first one to report is not always the one where it
        happened first (a NaN on rank 1 reaches rank 0 through the gradient all-reduce one step later, and rank 0's
        message may arrive first): wait until every rank has reported that far (at most ``NAN_SETTLE_S``), then
        name the earliest step and its rank."""
        if self.state.outcome is not None:
            return []
        at = step if step is not None else (self.state.progress.step or 0) + n
        self.nan_reports.append((at, rank if rank is not None else -1, value, n))
        if len(live_ranks) < 2:
            return [self._decide_non_finite()]
        if self.nan_decide_at is None:
            self.nan_decide_at = now + NAN_SETTLE_S
        return []

    def _non_finite_settled(self, now: float, live_ranks: frozenset[int]) -> bool:
        if self.nan_decide_at is None:
            return False
        if now >= self.nan_decide_at:
            return True
        first = min(at for at, _, _, _ in self.nan_reports)
        bad = {r for _, r, _, _ in self.nan_reports}
        last = self.ranks.last_step
        return all(r in bad or last.get(r, (-1, 0.0))[0] >= first for r in live_ranks)

    def _decide_non_finite(self) -> Decision:
        at, rank_or_none, value, n = min(self.nan_reports, key=lambda r: (r[0], r[1]))
        rank = None if rank_or_none < 0 else rank_or_none
        self.nan_decide_at = None
        progress = self.state.progress
        progress.step, progress.loss = at, value
        where = f"step {at}" if n == 1 else f"steps {at - n + 1}..{at}"
        phase = "sanity pass" if not progress.sanity_done else "training"
        on_rank = f" on rank {rank}" if rank is not None else ""
        extra = {"rank": rank} if rank is not None else {}
        batches = f"the batch of step {at}" if n == 1 else f"the batches of {where}"
        hint = ("lower the learning rate or add warmup, clip gradients (max_grad_norm), prefer bf16 over fp16, "
                f"and check {batches} for empty or corrupt inputs")
        witness = self.witnesses.get(at)
        progress.witness = witness or "loss"
        # After a finite loss exploded, non-finite gradients or weights are that divergence overflowing, not a
        # loss that hides NaN: the explosion's hint (diagnose) comes first and says what to do.
        exploded = progress.exploded is not None and int(progress.exploded.get("step") or 0) <= at
        if witness == "grad_norm":
            log.error("the gradient norm clip_grad_norm_ returned at %s is not finite, its loss was finite (%s)%s",
                      where, phase, on_rank)
            hint = (f"the gradients of step {at} were not finite while its loss was (clip_grad_norm_ returned nan or "
                    "inf): the update made the weights non-finite. ")
            hint += ("They overflowed as the loss diverged" if exploded else
                     "Look for a NaN-safe loss that is not (torch.where or a masked mean over an empty mask: its "
                     "backward is 0 * (0/0)), a log or sqrt of 0, or a division by a count that can be 0 in "
                     f"{batches}; pass error_if_nonfinite=True to stop there")
        elif witness == "weights":
            log.error("a tensor the job saved at %s is not finite, its losses looked finite (%s)%s", where, phase,
                      on_rank)
            hint = f"the job saved non-finite weights at step {at} while its losses looked finite"
            hint += (": the weights overflowed as the loss diverged" if exploded else
                     " (a NaN-safe loss, nan_to_num or a masked mean can hide NaN gradients): resume from the "
                     "secured checkpoint and look for a division by a count that can be 0, a log or sqrt of 0 in "
                     f"{batches}. A -inf is allowed only in a tensor whose name ends in 'mask' (an attention mask "
                     "kept as a buffer)")
        else:
            log.error("non-finite loss %s at %s (%s)%s", value, where, phase, on_rank)
        return Decision(Outcome("FAIL", "non_finite_loss", EXIT_NON_FINITE, extra=extra, hint=hint))

    def _name_hang(self, where: str) -> None:
        """The stalled verdict's hint names where the main thread waits (from the agent's stack answer); after
        ``Trainer.train()`` returned, the hang is not in training: say so."""
        outcome = self.state.outcome
        assert outcome is not None
        facts = self.state.facts
        facts.hang_where = where
        if facts.train_end is not None:
            log.error("training ended at step %s; since then the job waits in %s", facts.train_end.get("step"), where)
            outcome.hint = (f"training ended at step {facts.train_end.get('step')} (Trainer.train() returned), "
                            f"then the job hung in {where}: that call never returned (a push, an upload, a "
                            "collective or a thread join after training); see the stacks above")
        elif any(marker in where for marker in _COMPILE_FRAMES):
            log.error("the job's main thread is inside torch.compile: %s", where)
            outcome.hint = (f"the main thread is inside torch.compile ({where}): compiling a large model, or "
                            "recompiling for every new input shape, can take longer than --stall-timeout; raise it "
                            "for the first steps, mark the changing dimensions dynamic (torch.compile(dynamic=True) "
                            "or torch._dynamo.mark_dynamic), and see why it recompiles with TORCH_LOGS=recompiles")
        else:
            log.error("the job's main thread waits in %s", where)
            outcome.hint = f"the main thread waits in {where}; {outcome.hint}"


class SettingsCheck:
    """The Trainer-settings check, when the agent reports the arguments (``training_args``, ``trainer_config``).

    Args:
        check: returns preflight rows for the reported arguments (``guard.preflight.trainer.check_job_settings``),
            or None: no check.
    """

    def __init__(self, check: Callable[[Mapping[str, Any]], list[CheckResult]] | None) -> None:
        self.check = check
        self._logged: set[tuple[str, str]] = set()  # rows already logged (the same arguments come twice)

    def on_arguments(self, config: Mapping[str, Any]) -> Decision | None:
        """Log each ``warn``/``fail`` row once; a ``fail`` stops the job (``FAIL preflight``), else None (the
        agent gets its ``ack``)."""
        rows = self.check(config) if self.check is not None else []
        for row in rows:
            if row.status in ("fail", "warn") and (row.status, row.seen) not in self._logged:
                self._logged.add((row.status, row.seen))
                log.log(logging.ERROR if row.status == "fail" else logging.WARNING, "preflight %s %s: %s%s",
                        row.name, row.status, row.seen, f" (hint: {row.hint})" if row.hint else "")
        failed = next((row for row in rows if row.status == "fail"), None)
        if failed is None:
            return None
        return Decision(Outcome("FAIL", "preflight", EXIT_PREFLIGHT, hint=failed.hint, extra={"check": failed.name}))
