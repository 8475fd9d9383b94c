"""Securing checkpoints: the time budget's plan, carried out by the supervisor's event loop.

This is the part of the supervisor that knows about deadlines, checkpoints and destinations. The supervisor
calls its hooks (``tick``, ``on_signal``, ``on_checkpoint_saved``, ``on_job_exit`` ...) from its one loop; the
only blocking work, the push, runs on one worker thread whose future is polled, so output keeps flowing and
signals keep being handled while it runs. Every wait has a bound: the deadline, or the ``--grace`` after a
termination signal.

The flow (``CONTRACT.md``, "Secured checkpoints"):

1. At ``deadline - margin`` (``budget.checkpoint_due``), or on SIGTERM/SIGINT/SIGUSR1/SIGUSR2 when there is a
   destination, ask every agent for a checkpoint and then a stop (``{"t": "checkpoint", "stop": true}``).
2. Wait for the job's ``checkpoint_saved`` until only the time to push the fallback remains
   (``budget.save_wait_limit_s``), or until the job dies (a platform that signals the whole process group kills
   a job without handlers at once).
3. Push the fresh checkpoint, else the newest complete one on disk (``checkpoints.newest_complete``), and verify
   it (``hub.Securer``); then let the job end, SIGTERM/SIGKILL after what is left of the budget.
4. On a job that ends well, with a destination: push the final model files and verify them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guard.secure import budget

from guard.secure import checkpoints
from guard.errors import GuardError, PushFailedError
from guard.contract import EXIT_PUSH_FAILED, EXIT_SECURED, EXIT_TIMEOUT_UNSECURED, RunResult, signal_name

__all__ = ["Securing"]

log = logging.getLogger("guard.secure")

SAFETY_S = 1.0  # end securing this long before the kill
POLL_S = 0.2  # how often a running push is polled
STOP_BEFORE_S = 2.0  # after securing, SIGTERM the job this long before securing's end if it is still running


class Securing:
    """The deadline, the checkpoint request, the push; hooks for the supervisor's loop.

    Args:
        deadline: the job's deadline (``budget.resolve_deadline``); ``deadline_s`` None without a limit.
        estimator: the margin estimator (``--margin`` fixed, or measured).
        securer: a ``hub.Securer`` for the destination, or None (no destination yet: the Trainer's
            ``hub_model_id`` may provide one).
        securer_factory: builds a ``Securer`` from destination text (for the Trainer's ``hub_model_id``).
        output_dir: where the job writes checkpoints (``--output-dir``; else the Trainer's ``output_dir``).
        grace_s: ``--grace``.
        refresher: a ``slurm.SlurmRefresher`` or None.
        wall: epoch seconds; clock: monotonic seconds.
    """

    def __init__(self, *, deadline: budget.Deadline, estimator: budget.MarginEstimator, securer: Any = None,
                 securer_factory: Callable[[str], Any] | None = None, output_dir: str | None = None,
                 grace_s: float = 30.0, refresher: Any = None, wall: Callable[[], float] = time.time,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.deadline = deadline
        self.estimator = estimator
        self.securer = securer
        self.securer_factory = securer_factory
        self.output_dir = output_dir
        self.grace_s = grace_s
        self.refresher = refresher
        self.wall, self.clock = wall, clock
        self.trigger: str | None = None
        self.signum: int | None = None
        self.secure_by: float = math.inf
        self.wait_save_until: float | None = None
        self.requested = False
        self.done = False
        self.future: concurrent.futures.Future[Any] | None = None
        self.final = False
        self.result: Any = None
        self.error: GuardError | None = None
        self.secured_checkpoint: checkpoints.CheckpointInfo | None = None
        self.latest_reported: checkpoints.CheckpointInfo | None = None
        self.none_found = False
        self.last_step_at: float | None = None
        self.at_step: int | None = None
        self.follower = False  # a machine other than node 0 that waits for node 0's checkpoint
        self.saved_ranks: dict[Any, set[int]] = {}
        self._seen: set[tuple[str, str]] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="guard-push")
        if deadline.deadline_s is not None:
            log.info("deadline: %s (%s from now; %s)", time.strftime("%Y-%m-%d %H:%M:%S %Z",
                     time.localtime(deadline.deadline_s)),
                     budget.format_duration_s(round(deadline.deadline_s - wall())), deadline.source)
            estimator.margin_s()  # logs the starting margin

    # -- helpers ----------------------------------------------------------------------------------------------

    def _to_clock(self, epoch_s: float) -> float:
        return self.clock() + (epoch_s - self.wall())

    def busy(self) -> bool:
        """Securing has started and is not finished (the supervisor keeps running until it is)."""
        return (self.trigger is not None and not self.done) or self.future is not None

    def due_at(self, now: float) -> float:
        """The next time ``tick`` has work (monotonic seconds)."""
        due = [math.inf]
        if self.future is not None:
            due.append(now + POLL_S)
        if self.wait_save_until is not None:
            due.append(self.wait_save_until)
        if self.trigger is None and self.deadline.deadline_s is not None:
            due.append(self._to_clock(self.deadline.deadline_s - self.estimator.margin_s()))
        if self.refresher is not None and self.trigger is None:
            due.append(now + 60.0)
        return min(due)

    # -- hooks ------------------------------------------------------------------------------------------------

    def tick(self, sup: Any, now: float) -> None:
        if self.refresher is not None and self.trigger is None:
            end_s = self.refresher.maybe_refresh(self.wall())
            if end_s is not None:
                moved = self.deadline.refreshed(end_s, self.refresher.last_source or "scontrol EndTime")
                if moved.deadline_s != self.deadline.deadline_s:
                    log.info("deadline moved to %s (%s)", time.strftime("%H:%M:%S", time.localtime(moved.deadline_s)),
                             moved.source)
                    self.deadline = moved
        job_running = sup.job is not None and sup.job.returncode is None
        if (self.trigger is None and job_running and sup.outcome is None
                and budget.checkpoint_due(self.wall(), self.deadline, self.estimator.margin_s())):
            self._begin(sup, "deadline", None, now)
        if self.wait_save_until is not None and now >= self.wait_save_until and self.future is None:
            log.warning("the job did not save a checkpoint in time: securing the newest complete one on disk")
            self._fallback(sup, now)
        if self.future is not None and self.future.done():
            self._collect(sup, now)

    def on_signal(self, sup: Any, signum: int, now: float) -> bool:
        """Start securing on a termination signal; False lets the supervisor forward the signal instead."""
        if signum == signal.SIGHUP or (self.securer is None and self.trigger is None):
            return False
        if self.final:  # the job ended well and its final model is being pushed: finish that, bounded as it is
            log.warning("%s received during the final push: finishing it (it ends by %.0fs from now at most)",
                        signal_name(signum), max(0.0, self.secure_by - now))
            return True
        if self.trigger is None:
            if sup.outcome is not None:
                return False
            self._begin(sup, "signal", signum, now)
            return True
        log.warning("%s received while securing: ending within --grace", signal_name(signum))
        if self.signum is None:
            self.signum = signum
        self.secure_by = min(self.secure_by, now + self.grace_s - SAFETY_S)
        if self.wait_save_until is not None:
            self.wait_save_until = min(self.wait_save_until, self.secure_by)
        return True

    def on_trainer_config(self, sup: Any, config: dict[str, Any]) -> None:
        if self.output_dir is None and config.get("output_dir"):
            self.output_dir = str(config["output_dir"])
        if self.securer is None and config.get("push_to_hub") and config.get("hub_model_id") and self.securer_factory:
            try:
                self.securer = self.securer_factory(str(config["hub_model_id"]))
                log.info("destination from the Trainer: %s (push_to_hub, hub_model_id)", self.securer.destination)
            except GuardError as exc:
                log.warning("cannot use the Trainer's hub_model_id as a destination: %s", exc.message)

    def on_step(self, sup: Any, now: float) -> None:
        if self.last_step_at is not None:
            self.estimator.observe_step(now - self.last_step_at)
        self.last_step_at = now

    def on_checkpoint_saved(self, sup: Any, message: dict[str, Any]) -> None:
        path = message.get("path")
        if not path:
            return
        rank = message.get("rank")
        if rank is not None:
            self.saved_ranks.setdefault(message.get("step"), set()).add(int(rank))
        if not message.get("zero", True):  # another rank's part of the save: the push waits for every rank
            self._maybe_push_saved(sup)
            return
        try:
            info = checkpoints.describe(path, step=message.get("step"))
        except GuardError as exc:
            log.warning("%s", exc.message)
            return
        if message.get("save_s"):
            self.estimator.observe_save(float(message["save_s"]), info.size_bytes)
        else:
            self.estimator.observe_size(info.size_bytes)
        self.latest_reported = info
        log.info("checkpoint saved by the job: %s (step %s, %.1f MB)", info.path, info.step, info.size_bytes / 1e6)
        self._maybe_push_saved(sup)

    def _maybe_push_saved(self, sup: Any) -> None:
        """While securing: push the job's fresh checkpoint once every training rank has reported its save."""
        info = self.latest_reported
        if self.trigger is None or self.done or self.future is not None or info is None or not self.requested:
            return
        if self.at_step is not None and (info.step or 0) < self.at_step:
            return  # an older save; the requested one comes at at_step
        missing = sup.training_ranks() - self.saved_ranks.get(info.step, set())
        if missing and len(sup.training_ranks()) > 1:
            log.info("checkpoint %s: waiting for rank(s) %s to finish their part", info.step,
                     ",".join(map(str, sorted(missing))))
            return
        self.wait_save_until = None
        self._start_push(sup, info)

    def on_job_exit(self, sup: Any, now: float) -> None:
        if self.trigger is not None and not self.done and self.future is None:
            self.wait_save_until = None
            self._fallback(sup, now)
        elif (self.trigger is None and sup.outcome is None and sup.job.returncode == 0 and self.securer is not None
              and not self.final):
            self._push_final(sup, now)

    # -- the flow ---------------------------------------------------------------------------------------------

    def _begin(self, sup: Any, kind: str, signum: int | None, now: float) -> None:
        from guard.run.supervisor import Outcome

        self.trigger, self.signum = kind, signum
        sup.stall.pause()
        if kind == "deadline":
            self.secure_by = self._to_clock(self.deadline.deadline_s) - SAFETY_S  # type: ignore[arg-type]
            sup.outcome = Outcome("TIMEOUT", "deadline")
            log.warning("deadline in %.0fs: asking the job for a checkpoint (margin %.0fs)",
                        self.secure_by - now + SAFETY_S, self.estimator.margin_s())
        else:
            self.secure_by = now + self.grace_s - SAFETY_S
            sup.outcome = Outcome("INTERRUPTED", "signal", extra={"signal": signal_name(signum or 0)})
            log.warning("%s received: securing a checkpoint within --grace %.0fs", signal_name(signum or 0),
                        self.grace_s)
        job_alive = sup.job is not None and sup.job.returncode is None
        if job_alive and sup.follows_node_0:
            self.follower = True
            log.info("node %s: node 0's guard asks for the checkpoint (through the job's store); waiting for the "
                     "job to save and end", sup.node_rank)
            self._finish(sup, now)
            return
        if job_alive and sup.agents:
            request: dict[str, Any] = {"t": "checkpoint", "stop": True}
            ranks = sup.training_ranks()
            world_size = max((c.info.get("world_size") or 1 for c in sup.agents.values()), default=1)
            if len(ranks) > 1 or world_size > 1:
                # Collective saves (DDP, FSDP, DeepSpeed) deadlock unless every rank saves at the same step: name a
                # step ahead of every rank (the supervisor hears of steps every --check-every steps at most).
                # Ranks on other machines read node 0's request from the store every --check-every steps.
                every = sup.config.check_every
                ahead = max(step for step, _ in sup.rank_progress.values()) + 2 * every + 2
                request["at_step"] = self.at_step = ahead
                log.info("%d ranks: each saves at step %d", max(len(ranks), world_size), ahead)
            sent = sup.broadcast(request)
            self.requested = sent > 0
        if self.requested:
            fallback = self._newest_on_disk()
            left_s = self.secure_by - now
            # Keep enough time to push the fallback, but give the job's fresh save at least half of what is left.
            reserve_s = self.estimator.secure_estimate_s(fallback.size_bytes) if fallback else 0.0
            self.wait_save_until = now + max(0.5 * left_s, left_s - reserve_s, 0.0)
            log.info("waiting up to %.0fs for the job's checkpoint", self.wait_save_until - now)
        else:
            if kind == "signal" and job_alive and sup.job is not None:
                sup.job.signal_all(signum or signal.SIGTERM)  # no agent to ask: the job hears the signal itself
            self._fallback(sup, now)

    def _newest_on_disk(self) -> checkpoints.CheckpointInfo | None:
        found = None
        if self.output_dir:
            found = checkpoints.newest_complete(self.output_dir, now_s=self.wall(), seen=self._seen)
        reported = self.latest_reported
        if reported is not None and (found is None or (reported.step or -1) >= (found.step or -1)):
            if Path(reported.path).exists():
                found = reported
        return found

    def _fallback(self, sup: Any, now: float) -> None:
        self.wait_save_until = None
        info = self._newest_on_disk()
        if info is None:
            self.none_found = True
            log.error("no complete checkpoint to secure (output folder: %s)", self.output_dir or "unknown")
            self._finish(sup, now)
            return
        self._start_push(sup, info)

    def _start_push(self, sup: Any, info: checkpoints.CheckpointInfo) -> None:
        self.secured_checkpoint = info
        node = sup.node_rank
        if node not in (None, 0) and self.securer is not None:
            log.info("node %d: the guard of node 0 secures the checkpoint; this one does not push", node)
            self._finish(sup, self.clock())
            return
        if self.securer is None:
            log.info("no destination (--push-to): checkpoint %s stays on this machine only", info.path)
            self._finish(sup, self.clock())
            return
        remaining = self.secure_by - self.clock()
        log.info("securing %s (step %s) at %s, %.0fs left", info.path, info.step, self.securer.destination, remaining)
        self.future = self._pool.submit(self.securer.push_checkpoint, info.path, step=info.step or 0,
                                        deadline=self.secure_by)

    def _push_final(self, sup: Any, now: float) -> None:
        output_dir = self.output_dir
        if not output_dir:
            log.warning("the job ended; no output folder known (--output-dir), so the final model is not pushed")
            return
        if sup.node_rank not in (None, 0):
            log.info("node %d: the guard of node 0 pushes the final model", sup.node_rank)
            return
        self.final = True
        size = sum(f.stat().st_size for f in Path(output_dir).glob("*") if f.is_file())
        bound_s = self.estimator.secure_estimate_s(size) * 3 + 120
        if self.deadline.deadline_s is not None:
            bound_s = min(bound_s, self.deadline.deadline_s - self.wall() - SAFETY_S)
        self.secure_by = now + max(bound_s, 5.0)
        log.info("the job ended: securing the final model from %s at %s", output_dir, self.securer.destination)
        self.future = self._pool.submit(self.securer.push_final, output_dir, deadline=self.secure_by)

    def _collect(self, sup: Any, now: float) -> None:
        future, self.future = self.future, None
        assert future is not None
        try:
            self.result = future.result()
            if self.result.elapsed_s > 0:
                self.estimator.observe_push(self.result.size_bytes, self.result.elapsed_s)
            log.info("secured and verified: %s (%d files, %.1f MB in %.1fs)", self.result.pushed,
                     len(self.result.files), self.result.size_bytes / 1e6, self.result.elapsed_s)
        except GuardError as exc:
            self.error = exc
            log.error("%s", exc.message)
        except Exception as exc:  # a fault inside the push: reported, never a hang
            self.error = PushFailedError(f"push failed: {exc!r}", hint="set GUARD_DEBUG=1 and report it")
            log.error("push failed: %r", exc)
        if not self.final:
            self._finish(sup, now)

    def _finish(self, sup: Any, now: float) -> None:
        """Securing is over: the job was asked to stop; it may end on its own until shortly before the kill."""
        self.done = True
        if sup.job is not None and sup.job.alive():
            if not self.follower:  # a follower's ranks stop at node 0's checkpoint step, not before
                sup.broadcast({"t": "stop"})
            end = self.secure_by - STOP_BEFORE_S if math.isfinite(self.secure_by) else now + self.grace_s
            sup.stop_at = max(now, end)
            sup.stop_grace_s = 1.0
            if sup.stop_at > now:
                log.info("the job may end on its own for %.0fs; then SIGTERM", sup.stop_at - now)

    # -- the verdict ------------------------------------------------------------------------------------------

    def finish(self, sup: Any, result: RunResult) -> None:
        """Fill the result's checkpoint fields, and its exit code for TIMEOUT/INTERRUPTED (75 when secured)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        info = self.secured_checkpoint
        if info is not None:
            result.extra["checkpoint"] = str(info.path)
        if self.result is not None:
            result.extra["pushed"] = self.result.pushed
            result.details["push"] = {"files": len(self.result.files), "size_bytes": self.result.size_bytes,
                                      "elapsed_s": round(self.result.elapsed_s, 3), "attempts": self.result.attempts}
        if self.final:
            if self.error is not None and result.status == "PASS":
                result.status, result.reason, result.exit_code = "FAIL", "push_failed", EXIT_PUSH_FAILED
                result.hint = self.error.hint
            return
        if self.trigger is None:
            return
        secured = self.result is not None
        result.extra["secured"] = "yes" if secured else "no"
        if self.error is not None:
            result.status, result.reason, result.exit_code = "FAIL", "push_failed", EXIT_PUSH_FAILED
            result.hint = self.error.hint
            return
        if self.trigger == "deadline":
            result.exit_code = EXIT_SECURED if secured else EXIT_TIMEOUT_UNSECURED
            if not secured:
                if self.securer is None:
                    result.hint = ("no checkpoint could be secured before the deadline: pass --push-to, save more "
                                   "often, or give the job a longer --timeout")
                elif self.none_found:
                    result.hint = ("the job saved no complete checkpoint before the deadline: save checkpoint-N "
                                   "folders where --output-dir points (a custom loop: guard.should_checkpoint() and "
                                   "guard.checkpoint_saved(path)), save more often, or give a longer --timeout")
                else:
                    result.hint = "the checkpoint was not secured in time; raise --margin"
        else:
            signum = self.signum or signal.SIGTERM
            result.exit_code = EXIT_SECURED if secured else 128 + signum
            if not secured:
                result.hint = "no checkpoint was secured within --grace: save more often or raise --grace"
        if secured:
            result.hint = f"the next run resumes from it: python -m guard --resume on --push-to {self.result.destination} ..."
        elif self.follower:
            result.hint = "the guard of node 0 secures the checkpoint of every rank: see its VERDICT"
