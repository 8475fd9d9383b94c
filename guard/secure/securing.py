"""The supervisor's side of securing: feeds the plan its events and carries out the actions it returns.

The supervisor calls these hooks from its one loop (``tick``, ``on_signal``, ``on_checkpoint_saved``,
``on_decided``, ``on_job_exit`` ...); none blocks: pushes run in worker processes (``guard.secure.worker``) that
the plan polls and kills at ``secure_by``. ``finish`` fills the VERDICT's ``checkpoint=``, ``pushed=`` and
``secured=`` and the exit code of a deadline or signal (``CONTRACT.md``, "Secured checkpoints").
"""

from __future__ import annotations

import logging
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from guard.contract import (
    EXIT_PUSH_FAILED,
    EXIT_SECURED,
    EXIT_TIMEOUT_UNSECURED,
    RunResult,
    signal_name,
)
from guard.errors import GuardError
from guard.run.diagnose import incomplete_reason
from guard.run.state import Message, Outcome, RunState
from guard.secure import budget, checkpoints, layout, worker
from guard.secure.plan import Action, Decide, ForwardSignal, Plan, Pusher, RequestSave, State, StopJob

if TYPE_CHECKING:
    from guard.run.slurm import SlurmRefresher
    from guard.secure.hub import Securer

__all__ = ["FAILURE_REASONS", "JobLink", "Securing"]

log = logging.getLogger("guard.secure")

#: Outcomes after which the newest complete checkpoint saved before the failure is secured.
FAILURE_REASONS = ("non_finite_loss", "stalled", "crash", "oom", "killed", "incomplete")
SCAN_EVERY_S = 5.0  # how often the output folder is looked at for complete checkpoints
FILE_SETTLE_S = 1.0  # a torch.save'd file counts as a whole checkpoint after this long without another file


class JobLink(Protocol):
    """What securing needs from the supervisor's loop (``guard.run.supervisor.Supervisor`` offers it; tests offer
    a fake).

    Attributes:
        state: the run's state: ``progress.step``, ``facts`` (the Trainer, the saves), ``outcome``.
        check_every: ``--check-every``: the agents report a step at least this often (in steps).
        node_rank: this machine's node rank, or None when not known (yet).
        follows_node_0: node 0's guard decides checkpoints for this machine (through the job's store).
    """

    state: RunState
    check_every: int

    @property
    def node_rank(self) -> int | None: ...

    @property
    def follows_node_0(self) -> bool: ...

    def job_running(self) -> bool:
        """The job's main process started and has not exited."""

    def job_alive(self) -> bool:
        """A process of the job's tree still runs."""

    def job_exit_code(self) -> int | None:
        """The job's exit code once it exited (negative: the signal), else None."""

    def agents_connected(self) -> int:
        """How many agents are connected now."""

    def world_size(self) -> int:
        """The largest world size an agent reported (1 without one)."""

    def training_ranks(self) -> set[int]:
        """Ranks that reported training steps."""

    def newest_rank_step(self) -> int | None:
        """The highest step any rank reported, or None."""

    def broadcast(self, message: Message) -> int:
        """Send a command to every agent; returns how many got it."""

    def signal_job(self, signum: int) -> None:
        """Send ``signum`` to every process of the job."""

    def stop_job_at(self, at: float, grace_s: float | None) -> None:
        """Stop the job at ``at`` (monotonic seconds) with ``grace_s`` before SIGKILL, unless an earlier stop is
        set."""

    def decide(self, outcome: Outcome) -> None:
        """Record an outcome if none stands (the first one stands)."""

    def wake(self) -> None:
        """Run the timers (``tick``) on the loop's next turn."""


class Securing:
    """Hooks for the supervisor's loop around one ``Plan``; each hook gets the loop as a :class:`JobLink`.

    Args:
        deadline: the job's deadline (``budget.resolve_deadline``); ``deadline_s`` None without a limit.
        estimator: the margin estimator (``--margin`` fixed, or measured).
        securer: a ``hub.Securer`` for the destination (its ``destination`` and ``token`` are what the workers
            use), or None (no destination yet: the Trainer's ``hub_model_id`` may provide one).
        securer_factory: builds a ``Securer`` from destination text (for the Trainer's ``hub_model_id``).
        output_dir: where the job writes checkpoints (``--output-dir``; else the Trainer's ``output_dir``).
        grace_s: ``--grace``. background: ``--background-push``. push_interval_s: ``--push-interval``.
        refresher: a ``slurm.SlurmRefresher`` or None.
        wall: epoch seconds; clock: monotonic seconds.
        pusher_factory: builds the plan's pusher from (destination text, token); default ``worker.Pusher``.
    """

    def __init__(self, *, deadline: budget.Deadline, estimator: budget.MarginEstimator, securer: Securer | None = None,
                 securer_factory: Callable[[str], Securer] | None = None, output_dir: str | None = None,
                 grace_s: float = 30.0, refresher: SlurmRefresher | None = None,
                 wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic, background: bool = True,
                 push_interval_s: float = 600.0,
                 pusher_factory: Callable[[str, str | None], Pusher] | None = None) -> None:
        self.deadline = deadline
        self.estimator = estimator
        self.securer = securer
        self.securer_factory = securer_factory
        self.output_dir = output_dir
        self.refresher = refresher
        self.wall, self.clock = wall, clock
        self._pusher_factory: Callable[[str, str | None], Pusher] = pusher_factory or (
            lambda dest, token: worker.Pusher(dest, token, clock=clock))
        self.plan = Plan(clock=clock, pusher=self._make_pusher(securer), estimator=estimator,
                         deadline_at=self._to_clock(deadline.deadline_s), grace_s=grace_s, background=background,
                         push_interval_s=push_interval_s, final_output_dir=output_dir)
        self.latest_reported: checkpoints.CheckpointInfo | None = None
        self.last_step_at: float | None = None
        self.saved_ranks: dict[int | None, set[int]] = {}  # step -> ranks whose part of that save is done
        self.reported_paths: set[str] = set()  # folders the job said it finished: no mtime rule for them
        self.saved_files = checkpoints.SavedFiles()  # torch.save calls the agent saw return
        self.trainer_seen = False
        self.pending_file: tuple[checkpoints.CheckpointInfo, float] | None = None  # a save that may still grow
        self.follower = False
        self.next_scan = -math.inf
        self._seen: set[tuple[str, str]] = set()
        self._node_checked = False
        self._save_logged = False
        self.started_s: float | None = None  # the job's start (epoch s): older checkpoints are an earlier run's
        self.resumed_paths: set[str] = set()
        if deadline.deadline_s is not None:
            log.info("deadline: %s (%s from now; %s)", time.strftime("%Y-%m-%d %H:%M:%S %Z",
                     time.localtime(deadline.deadline_s)),
                     budget.format_duration_s(round(deadline.deadline_s - wall())), deadline.source)
            estimator.margin_s()  # logs the starting margin
        if self.plan.pusher is not None:
            every = budget.format_duration_s(push_interval_s)
            log.info("background securing: %s", f"on, at most one push every {every}" if background
                     else "off (--background-push off)")

    # -- helpers ----------------------------------------------------------------------------------------------

    def _make_pusher(self, securer: Securer | None) -> Pusher | None:
        if securer is None:
            return None
        return self._pusher_factory(str(securer.destination), getattr(securer, "token", None))

    def _to_clock(self, epoch_s: float | None) -> float | None:
        return None if epoch_s is None else self.clock() + (epoch_s - self.wall())

    def busy(self) -> bool:
        """Securing has started and is not finished (the supervisor keeps running until it is)."""
        return self.plan.busy

    def due_at(self, now: float) -> float:
        """The next time ``tick`` has work (monotonic seconds)."""
        due = [self.plan.due_at(now)]
        if self.pending_file is not None:
            due.append(self.pending_file[1] + FILE_SETTLE_S)
        if self.refresher is not None and self.plan.state is State.WATCHING:
            due.append(now + 60.0)
        if self._scanning():
            due.append(self.next_scan)
        return min(due)

    def _scanning(self) -> bool:
        return bool(self.output_dir) and self.plan.state in (State.WATCHING, State.AWAITING_SAVE, State.SECURING)

    def before_start(self) -> None:
        """Before the job starts: a complete checkpoint already in the output folder gives the margin a size."""
        # this run's checkpoints: written from now on, or the one it resumed from (checkpoints.newest_complete)
        self.started_s = self.wall()
        self.resumed_paths = {str(self.latest_reported.path)} if self.latest_reported is not None else set()
        if not self.output_dir or self.latest_reported is not None:
            return
        try:
            found = checkpoints.newest_complete(self.output_dir, now_s=self.wall())
        except OSError:
            return
        if found is not None:
            self.estimator.observe_size(found.size_bytes)

    def _can_save(self, sup: JobLink) -> bool:
        """The job can answer a checkpoint request: a Trainer, or a script that reported a save itself or called
        ``guard.should_checkpoint()`` (``JobFacts.answers_checkpoints``)."""
        if not sup.job_running() or not sup.agents_connected():
            return False
        step = sup.state.progress.step
        # Too early to tell: a Trainer reports itself at on_train_begin, a loop calls should_checkpoint() after its
        # first step's backward (which the agent reports first). Ask; the wait is bounded.
        return step is None or step < 3 or sup.state.facts.answers_checkpoints

    def _check_node(self, sup: JobLink) -> None:
        if self._node_checked or self.plan.pusher is None:
            return
        node = sup.node_rank
        if node not in (None, 0):
            log.info("node %d: the guard of node 0 secures checkpoints; this one does not push", node)
            self.plan.pusher = None
            self._node_checked = True
        elif node == 0:
            self._node_checked = True
        # None: not known yet (the launcher's own agent says hello before the ranks do): asked again next time

    def _carry_out(self, sup: JobLink, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, Decide):
                extra = {"signal": signal_name(action.signum)} if action.signum is not None else {}
                sup.decide(Outcome(action.status, action.reason, extra=extra))
            elif isinstance(action, RequestSave):
                self._request_save(sup)
            elif isinstance(action, StopJob):
                sup.stop_job_at(max(now, action.at), action.grace_s)
            elif isinstance(action, ForwardSignal):
                sup.signal_job(action.signum)

    def _request_save(self, sup: JobLink) -> None:
        if sup.follows_node_0:
            self.follower = True
            log.info("node %s: node 0's guard asks for the checkpoint (through the job's store); waiting for the "
                     "job to save and end", sup.node_rank)
            return
        request: dict[str, Any] = {"t": "checkpoint", "stop": True}
        ranks = sup.training_ranks()
        world_size = sup.world_size()
        if len(ranks) > 1 or world_size > 1:
            # Collective saves (DDP, FSDP, DeepSpeed) deadlock unless every rank saves at the same step: name a step
            # ahead of every rank (the supervisor hears of steps every --check-every steps at most). Before the first
            # step no rank has reported one: count from 0.
            every = sup.check_every
            ahead = (sup.newest_rank_step() or 0) + 2 * every + 2
            request["at_step"] = ahead
            log.info("%d ranks: each saves at step %d", max(len(ranks), world_size), ahead)
        sup.broadcast(request)

    # -- hooks ------------------------------------------------------------------------------------------------

    def tick(self, sup: JobLink, now: float) -> None:
        self._check_node(sup)
        if self.refresher is not None and self.plan.state is State.WATCHING:
            end_s = self.refresher.maybe_refresh(self.wall())
            if end_s is not None:
                moved = self.deadline.refreshed(end_s, self.refresher.last_source or "scontrol EndTime")
                if moved.deadline_s != self.deadline.deadline_s:
                    log.info("deadline moved to %s (%s)", time.strftime("%H:%M:%S", time.localtime(moved.deadline_s)),
                             moved.source)
                    self.deadline = moved
                    self.plan.deadline_at = self._to_clock(moved.deadline_s)
        self._settle(sup, now)
        if self._scanning() and now >= self.next_scan:
            self.next_scan = now + SCAN_EVERY_S
            self._scan(sup)
        if sup.state.progress.step is not None:
            self.plan.training_started = True  # a step was seen: the deadline's request follows the margin
        actions: list[Action] = []
        if sup.job_running() and sup.state.outcome is None and self.plan.deadline_due(now):
            actions += self.plan.deadline_near(can_save=self._can_save(sup),
                                               handles_term=sup.state.facts.handles_sigterm)
        actions += self.plan.tick()
        self._carry_out(sup, actions, now)

    def _scan(self, sup: JobLink) -> None:
        """A complete checkpoint in the output folder the job did not report (``checkpoints.newest_complete``)."""
        try:
            found = checkpoints.newest_complete(self.output_dir or "", now_s=self.wall(), seen=self._seen,
                                                reported=self.reported_paths, loose=not self.trainer_seen,
                                                since_s=self.started_s, resumed=self.resumed_paths)
        except OSError:
            return
        if found is not None and (self.latest_reported is None or (found.step or -1) > (self.latest_reported.step
                                                                                      or -1)):
            self.estimator.observe_size(found.size_bytes)
            self._carry_out(sup, self.plan.checkpoint(found), self.clock())

    def on_signal(self, sup: JobLink, signum: int, now: float) -> bool:
        """Feed a termination signal to the plan; False lets the supervisor handle it (no destination, or done)."""
        if signum == signal.SIGHUP or self.plan.state is State.DONE:
            return False
        if self.plan.pusher is None and self.plan.state is State.WATCHING:
            return False
        if self.plan.state is State.WATCHING and sup.state.outcome is not None:
            return False
        self._carry_out(sup, self.plan.signal(signum, can_save=self._can_save(sup)), now)
        return True

    def on_trainer_config(self, config: dict[str, Any]) -> None:
        """The Trainer's arguments: its ``output_dir``, and its ``hub_model_id`` as the destination when
        ``push_to_hub`` is on and ``--push-to`` gave none."""
        self.trainer_seen = True
        estimate = config.get("checkpoint_bytes_estimate")
        if isinstance(estimate, int) and estimate > 0 and not self.estimator.size_hint_bytes:
            self.estimator.size_hint_bytes = float(estimate)  # until the first save measures the real size
            log.debug("checkpoint size before the first save: about %.1f MB (weights + AdamW state)", estimate / 1e6)
        if self.output_dir is None and config.get("output_dir"):
            self.output_dir = str(config["output_dir"])
            self.plan.final_output_dir = self.plan.final_output_dir or self.output_dir
        if self.securer is None and config.get("push_to_hub") and config.get("hub_model_id") and self.securer_factory:
            try:
                self.securer = self.securer_factory(str(config["hub_model_id"]))
                self.plan.pusher = self._make_pusher(self.securer)
                log.info("destination from the Trainer: %s (push_to_hub, hub_model_id)", self.securer.destination)
            except GuardError as exc:
                log.warning("cannot use the Trainer's hub_model_id as a destination: %s", exc.message)

    def on_step(self, sup: JobLink, now: float) -> None:
        """A training step of the primary rank (step times for the margin)."""
        self.plan.training_started = True
        if self.last_step_at is not None:
            self.estimator.observe_step(now - self.last_step_at)
        self.last_step_at = now

    def on_file_saved(self, sup: JobLink, message: Message) -> None:
        """The agent saw ``torch.save`` write a file (a loop that may never use the guard's API): complete (the call
        returned), with the agent's step at the save; the files of one save form one checkpoint."""
        path = message.get("path")
        if not path:
            return
        where = Path(str(path))
        if self.output_dir is None and layout.is_plausible_output_dir(layout.output_dir_for_save(where)):
            self.output_dir = str(layout.output_dir_for_save(where))
            self.plan.final_output_dir = self.plan.final_output_dir or self.output_dir
            log.info("output folder: %s (where the job saves with torch.save)", self.output_dir)
        if self.output_dir is None or not where.resolve().is_relative_to(Path(self.output_dir).resolve()):
            return
        info = self.saved_files.add(where, message.get("step"))
        if info is None:
            return
        if message.get("save_s"):
            self.estimator.observe_save(float(message["save_s"]), info.size_bytes)
        else:
            self.estimator.observe_size(info.size_bytes)
        if message.get("rank") not in (None, 0):
            return  # another rank's shard: rank 0's save names the checkpoint
        # A loop may save model.pt, then optim.pt: the set is taken once the job trains on (a later step) or a
        # moment passes without another file (see _settle).
        self.pending_file = (info, self.clock())
        sup.wake()

    def _settle(self, sup: JobLink, now: float, *, force: bool = False) -> None:
        if self.pending_file is None:
            return
        info, at = self.pending_file
        step = sup.state.progress.step
        stepped_on = step is not None and info.step is not None and step > info.step
        if not (force or now - at >= FILE_SETTLE_S or stepped_on):
            return
        self.pending_file = None
        self.latest_reported = info
        log.info("the job saved %s (step %s, %.1f MB)", info.path, info.step, info.size_bytes / 1e6)
        self._check_node(sup)
        self._carry_out(sup, self.plan.checkpoint(info), now)

    def on_checkpoint_saved(self, sup: JobLink, message: Message) -> None:
        """The job reported a finished save (``checkpoint_saved``, with the sender's ``rank``)."""
        try:
            path = str(layout.check_reported_path(message.get("path"), output_dir=self.output_dir))
        except GuardError as exc:
            log.warning("%s (hint: %s)", exc.message, exc.hint)
            return
        self.reported_paths.add(path)
        rank = message.get("rank")
        if rank is not None:
            self.saved_ranks.setdefault(message.get("step"), set()).add(int(rank))
        if message.get("zero", True):
            try:
                saved = checkpoints.describe(path, step=message.get("step"))
            except GuardError as exc:
                log.warning("%s", exc.message)
                return
            if message.get("save_s"):
                self.estimator.observe_save(float(message["save_s"]), saved.size_bytes)
            else:
                self.estimator.observe_size(saved.size_bytes)
            self.latest_reported = saved
            # The first save at INFO; later ones are counted in the heartbeat (``saves=``), their detail at DEBUG.
            first, self._save_logged = not self._save_logged, True
            log.log(logging.INFO if first else logging.DEBUG, "checkpoint saved by the job: %s (step %s, %.1f MB)%s",
                    saved.path, saved.step, saved.size_bytes / 1e6,
                    "; later saves are counted in the heartbeat" if first else "")
        latest = self.latest_reported
        if latest is None:
            return
        info = latest
        missing = sup.training_ranks() - self.saved_ranks.get(info.step, set())
        if missing and len(sup.training_ranks()) > 1:  # the push waits for every rank's part of the save
            log.info("checkpoint %s: waiting for rank(s) %s to finish their part", info.step,
                     ",".join(map(str, sorted(missing))))
            return
        self._check_node(sup)
        self._carry_out(sup, self.plan.checkpoint(info), self.clock())

    def push_running(self) -> bool:
        """A push that ends the run (securing a failure, a deadline, a signal) is under way."""
        return self.plan.state is State.SECURING and self.plan.push is not None

    def on_decided(self, sup: JobLink, outcome: Outcome) -> None:
        """The supervisor decided a failure (non-finite loss, stall): secure what was saved before it."""
        if outcome.reason not in FAILURE_REASONS:
            return
        self._settle(sup, self.clock(), force=True)
        bad = sup.state.progress.step if outcome.reason == "non_finite_loss" else None
        if self.output_dir:
            self._scan(sup)
        self._carry_out(sup, self.plan.failure(outcome.reason, bad_from_step=bad), self.clock())

    def on_job_exit(self, sup: JobLink, now: float) -> None:
        """The job's main process exited: a failure secures what it saved, a good end pushes the final model."""
        self._settle(sup, now, force=True)
        code = sup.job_exit_code()
        outcome = sup.state.outcome
        if self.output_dir and self.plan.state is not State.DONE:
            self._scan(sup)
        if self.plan.state is State.WATCHING and outcome is None and code is not None and code != 0:
            reason = "crash" if code > 0 else "killed"
            self._carry_out(sup, self.plan.failure(reason), now)
            return
        # an exit 0 that is not a finished run: a failure, not a final push
        if self.plan.state is State.WATCHING and outcome is None and code == 0 \
                and incomplete_reason(sup.state.facts) is not None:
            self._carry_out(sup, self.plan.failure("incomplete"), now)
            return
        ok = code == 0 and outcome is None
        self._check_node(sup)
        if ok and sup.node_rank not in (None, 0) and self.securer is not None:
            log.info("node %d: the guard of node 0 pushes the final model", sup.node_rank)
        has_final_model = True
        if ok and self.plan.final_output_dir:
            from guard.secure.hub import final_model_files

            folder = Path(self.plan.final_output_dir)
            has_final_model = folder.is_dir() and bool(final_model_files(folder))
        self._carry_out(sup, self.plan.job_exit(ok=ok, has_final_model=has_final_model), now)

    # -- the verdict ------------------------------------------------------------------------------------------

    def finish(self, result: RunResult, *, step: int | None) -> None:
        """Fill the result's checkpoint fields, and its exit code for TIMEOUT/INTERRUPTED (75 when secured).

        Args:
            result: the run's result, changed in place.
            step: the job's last training step (the steps lost after the secured checkpoint), or None.
        """
        plan = self.plan
        plan.stop()
        secured = plan.secured
        newest = plan.newest
        if secured is not None:
            result.extra["checkpoint"] = str(secured.info.path) if secured.info else None
            result.extra["pushed"] = secured.result.pushed
            result.details["push"] = {"files": len(secured.result.files), "size_bytes": secured.result.size_bytes,
                                      "elapsed_s": round(secured.result.elapsed_s, 3),
                                      "attempts": secured.result.attempts, "step": secured.info.step
                                      if secured.info else None}
        elif newest is not None:
            result.extra["checkpoint"] = str(newest.path)
        if plan.suspect is not None:
            result.details["suspect_checkpoint"] = str(plan.suspect.path)
        result.details["pushes"] = [{"kind": r.kind, "step": r.info.step if r.info else None,
                                     "ok": bool(r.result is not None and r.result.ok),
                                     "error": getattr(r.result, "error", None)} for r in plan.history]
        if plan.final is not None:
            self._finish_final(result)
            return
        if plan.trigger == "ended":  # ended well without final model files: its newest checkpoint was secured
            if secured is None and newest is not None and result.status == "PASS":
                failed = next((r.result for r in reversed(plan.history) if r.result is not None), None)
                result.status, result.reason, result.exit_code = "FAIL", "push_failed", EXIT_PUSH_FAILED
                result.extra["secured"] = "no"
                result.hint = (failed.hint if failed is not None and failed.hint else
                               "the job's newest checkpoint could not be secured; it is still in the output folder")
            return
        if plan.trigger is None or (plan.pusher is None and plan.trigger == "failure"):
            if plan.trigger == "failure" and result.extra.get("checkpoint"):
                result.extra["secured"] = "no"
            return
        is_secured = secured is not None
        result.extra["secured"] = "yes" if is_secured else "no"
        lost = ""
        steps_lost = 0
        if secured is not None and secured.info is not None and secured.info.step is not None and step is not None \
                and step > secured.info.step:
            steps_lost = step - secured.info.step
            lost = f"; the {steps_lost} steps after step {secured.info.step} are lost"
        if plan.trigger == "failure":
            if steps_lost:
                result.details["steps_lost"] = steps_lost
            if plan.suspect is not None:
                later = f" (step {plan.suspect.step})" if plan.suspect.step is not None else ""
                result.hint = (result.hint or "") + (f" (the save of {plan.suspect.path}{later} after the first "
                                                     "non-finite loss was not pushed)")
            if secured is not None:
                step_text = f"step {secured.info.step}" if secured.info and secured.info.step is not None else "it"
                result.hint = (result.hint or "") + (f"; secured before the failure: {step_text}, resume with "
                                                     f"--resume on --push-to {secured.result.destination}")
            return
        if plan.trigger == "deadline":
            result.exit_code = EXIT_SECURED if is_secured else EXIT_TIMEOUT_UNSECURED
            if not is_secured:
                result.hint = (layout.nothing_found_hint(output_dir=self.output_dir,
                                                         destination_given=self.securer is not None)
                               if plan.pusher is None or newest is None else
                               "the checkpoint was not secured before the deadline: raise --margin, or check the "
                               "destination's upload speed")
        else:
            signum = plan.signum or signal.SIGTERM
            result.exit_code = EXIT_SECURED if is_secured else 128 + signum
            if not is_secured:
                result.hint = (layout.nothing_found_hint(output_dir=self.output_dir, destination_given=True)
                               if newest is None and plan.pusher is not None else
                               "no checkpoint was secured within --grace: save more often or raise --grace")
        if secured is not None:
            result.hint = (f"the next run resumes from step {secured.info.step if secured.info else '?'}{lost}: "
                           f"python -m guard --resume on --push-to {secured.result.destination} ...")
        elif self.follower:
            result.hint = "the guard of node 0 secures the checkpoint of every rank: see its VERDICT"

    def _finish_final(self, result: RunResult) -> None:
        plan = self.plan
        final = plan.final
        assert final is not None
        done = final.result
        if done is not None and done.ok:
            result.extra["pushed"] = done.pushed
            result.details["final_push"] = {"files": len(done.files), "size_bytes": done.size_bytes,
                                            "elapsed_s": round(done.elapsed_s, 3)}
            return
        if result.status != "PASS":
            return
        if plan.signum is not None and (done is None or done.killed):
            result.status, result.reason, result.exit_code = "INTERRUPTED", "signal", 128 + plan.signum
            result.extra["signal"] = signal_name(plan.signum)
            result.extra["secured"] = "no"
            result.hint = "the job finished but a signal ended the final model's push within --grace: push it again"
            return
        result.status, result.reason, result.exit_code = "FAIL", "push_failed", EXIT_PUSH_FAILED
        result.extra["secured"] = "no"
        result.hint = (done.hint if done is not None and done.hint else
                       "the final model could not be secured; it is still in the output folder")

    @property
    def output_folder(self) -> Path | None:
        return Path(self.output_dir) if self.output_dir else None
