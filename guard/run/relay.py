"""A termination signal on one node of many, handled on every node through the job's own store.

A spot node reclaimed or one pod evicted signals one node's guard only. Forwarded there at once, the signal would
kill that node's ranks mid-step and leave every other node's ranks with a connection reset (a crash, in another
story). Instead, when this node's ranks share the job's store (``LoopLink.follows_node_0``) and answer checkpoint
requests, its guard asks them to save at one step ahead of every rank and stop, with ``origin`` and ``signal`` in
the request: they publish it in the store (``guard.inside.agent._dist``), every rank of the job adopts it, and the
other nodes' agents tell their guards (``relayed``), which handle the signal as if they had received it. Each node
stops its job at half the grace at the latest, so the VERDICT still comes within the grace.

With a shared output folder, node 0's guard secures the one checkpoint every node wrote into it: the other nodes'
guards take its word for it (``agree_with_node_0``), so that every node's VERDICT says the same ``secured=`` and
exit code (75 on all when it is secured).

With a folder per node, each node secures its own part, and a push of one node can end for want of another's part
at a different step than another node's push did. So the VERDICT's ``missing=`` is read from the destination at
the end (``agree_on_missing``): the nodes whose part of the run's newest step is not there, the same on every node.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from guard.contract import ExitCode, RunResult, signal_name
from guard.run.joblink import LoopLink
from guard.secure.outcome import missing_said
from guard.secure.sharing import SECURED_KEYS, await_secured, post_secured

__all__ = ["AGREE_BEFORE_END_S", "MISSING_WAIT_S", "agree_on_missing", "agree_with_node_0", "relay_signal",
           "relayed_signal", "wait_before_end_s"]

log = logging.getLogger("guard.relay")


def relay_signal(link: LoopLink, signum: int, now: float) -> bool:
    """Ask every rank of the job, through this node's ranks and the store, to save one step ahead and stop, for
    ``signum`` received here; the stop here comes at half the grace unless the job ends first. Returns False (and
    does nothing) on node 0 (it decides for every node anyway), without a store, or when the job does not answer
    checkpoint requests."""
    if not link.follows_node_0 or not link.state.facts.answers_checkpoints:
        return False
    ahead = (link.newest_rank_step() or 0) + 2 * link.check_every + 2
    request = {"t": "checkpoint", "stop": True, "at_step": ahead, "origin": link.node_rank,
               "signal": signal_name(signum)}
    if not link.broadcast(request):
        return False
    grace_s = link.settings.grace_s
    log.warning("%s received on node %s: every rank of the job saves at step %d and stops (through the job's "
                "store); stopping this node's job in %.0fs at the latest", signal_name(signum), link.node_rank, ahead,
                grace_s / 2)
    link.stop_job_at(now + grace_s / 2, grace_s / 2)
    return True


def relayed_signal(message: dict[str, object]) -> int | None:
    """The signal number of a ``relayed`` message, or None when it names none this machine knows."""
    name = str(message.get("signal") or "")
    try:
        return int(signal.Signals[name])
    except KeyError:
        return None


#: A node's wait for another's word ends this long before the platform's kill (seconds; at most a twentieth of
#: --grace): half the lead the guard's own VERDICT keeps (``guard.run.supervisor.VERDICT_BEFORE_END_S``), so that
#: node 0's word, posted before its VERDICT, comes within the wait.
AGREE_BEFORE_END_S = 0.5


def wait_before_end_s(end_s: float | None, grace_s: float, *, unknown_s: float) -> float:
    """How long a node's end may still wait (seconds, 0 or more): until shortly before ``end_s`` (wall-clock seconds,
    ``time.time``: the platform's kill, ``Supervisor.word_by_wall``), half a second or a twentieth of ``grace_s``
    before it, so that the VERDICT after the wait still comes before the kill; ``unknown_s`` when no kill is known.

    What bounds such a wait is the kill, not a fixed time: on a loaded machine node 0's guard said it had secured
    the checkpoint 8.7 s after node 1 had stopped waiting at half the grace (10 s) and said it had not."""
    if end_s is None:
        return max(0.0, unknown_s)
    return max(0.0, end_s - time.time() - min(AGREE_BEFORE_END_S, grace_s / 20))


def agree_with_node_0(result: RunResult, *, shared: bool | None, output_dir: str | None, run_id: str,
                      node_rank: int, end_s: float | None, grace_s: float) -> None:
    """A stopped run (``TIMEOUT``/``INTERRUPTED``) on a shared output folder (``guard.secure.sharing``): node 0 posts
    what it secured, when it did (nothing is left in the output folder otherwise); another node waits for it and,
    when node 0 secured the checkpoint with the same status, says so too (``secured=yes``, ``pushed=``, exit 75).
    Nothing happens on a folder per node (each secures its own part, or none does) nor on other outcomes.

    The wait ends when node 0's word comes, else (node 0 secured nothing, or is lost) shortly before ``end_s``
    (``wait_before_end_s``), the kill that node 0's guard secures and posts before too: the deadline for a ``TIMEOUT``
    (every node computes the same one), the end of the grace after the signal for an ``INTERRUPTED`` (a signal relayed
    from node 0 reaches this node after node 0 received it). Without a known kill, it waits ``grace_s``.

    Args:
        result: this node's result, changed in place.
        shared, output_dir, run_id: whether the output folder is shared by the nodes, the folder, the run's id.
        node_rank: this node's index.
        end_s: the platform's kill in wall-clock seconds (``Supervisor.word_by_wall``), or None when none is known.
        grace_s: ``--grace`` in seconds.
    """
    if shared is not True or not output_dir or result.status not in ("TIMEOUT", "INTERRUPTED"):
        return
    if node_rank == 0:
        if result.extra.get("secured") == "yes":  # else the others' own VERDICT (secured=no) already agrees
            post_secured(output_dir, run_id, result.status, result.exit_code, result.extra)
        return
    if result.extra.get("secured") == "yes":
        return
    wait_s = wait_before_end_s(end_s, grace_s, unknown_s=grace_s)
    found = await_secured(output_dir, run_id, wait_s=wait_s)
    if found is None:
        log.info("node 0's guard said nothing of what it secured within %.0fs: this node's VERDICT stands", wait_s)
        return
    if found.get("secured") != "yes" or found.get("status") != result.status:
        log.info("node 0's guard: %s secured=%s: this node's VERDICT stands", found.get("status"),
                 found.get("secured"))
        return
    result.exit_code = int(ExitCode.SECURED)
    result.extra.update({key: found[key] for key in SECURED_KEYS if key in found})
    result.hint = (f"node 0's guard secured the checkpoint of the shared output folder ({found.get('pushed')}): "
                   "the next run resumes from it (--resume)")
    log.info("node 0's guard secured %s: this node says the same", found.get("pushed"))


#: The longest a node's end waits for the destination's listing of the nodes' parts after a run that was not
#: stopped (seconds; a stopped one waits until shortly before the platform's kill, ``wait_before_end_s``).
MISSING_WAIT_S = 10.0


def agree_on_missing(result: RunResult, *, read: Callable[[float], dict[str, Any] | None], wait_s: float) -> None:
    """Many nodes, each securing its own part: set the VERDICT's ``missing=`` from what the destination holds of the
    run's newest step that any node put a part of, once this node's pushes are over, so that every node says the
    same, whatever its own last push saw (one node's push of step 620 ended for want of node 1's part while node
    1's push of step 640 ended for want of node 0's: both nodes now say ``missing=node0``, of step 640).

    Nothing is missing when that step is whole or not newer than ``secured_step``, unless this node holds its part
    of a newer step that node 0 never put (``details["missing"]`` seen ``held``, ``outcome.leader_missing``: a lost
    node 0), which stands. Only a result with checkpoint
    fields (``secured=``) is changed: ``missing=``, ``details["missing"]`` and the hint's clause on it. When the
    destination cannot be read within ``wait_s``, this node's own word stands (logged).

    Args:
        result: the run's result, changed in place.
        read: ``(deadline) -> dict | None``: ``Securer.newest_parts`` (the deadline in ``time.monotonic`` seconds),
            run on a thread of its own, waited for ``wait_s`` at most (a hung mount never holds the VERDICT back).
        wait_s: the longest to wait for it (seconds).
    """
    if "secured" not in result.extra or wait_s <= 0:
        return
    answer: list[dict[str, Any] | None] = []
    failed: list[BaseException] = []

    def work() -> None:
        try:
            answer.append(read(time.monotonic() + wait_s))
        except Exception as exc:  # noqa: BLE001 - any failure leaves this node's own word standing
            failed.append(exc)
    thread = threading.Thread(target=work, name="guard-missing", daemon=True)
    thread.start()
    thread.join(wait_s)
    if not answer:
        log.warning("the nodes' parts at the destination could not be read within %.1fs (%s): this node's missing= "
                    "stands", wait_s, failed[0] if failed else "no answer")
        return
    found = answer[0]
    step = found.get("step") if found is not None else None
    held = result.details.get("missing")
    if isinstance(held, dict) and held.get("seen") == "held" and isinstance(held.get("step"), int) \
            and not (isinstance(step, int) and step >= held["step"]):
        log.info("the destination's newest step with a node's part is %s: this node's part of step %d, newer, waits "
                 "for %s's: missing=%s stands", step, held["step"], held.get("what"), held.get("what"))
        return
    old = result.extra.pop("missing", None)
    old_details = result.details.pop("missing", None)
    if isinstance(old, str) and isinstance(old_details, dict) and result.hint:
        said = str(old_details.get("said") or missing_said(old_details.get("step"), old))
        result.hint = result.hint.replace(f"{said}; ", "").replace(said, "") or None
    secured_step = result.extra.get("secured_step")
    missing = str(found.get("missing") or "") if found is not None else ""
    if found is None or not isinstance(step, int) or found.get("complete") or not missing \
            or (isinstance(secured_step, int) and step <= secured_step):
        if old:
            log.info("the destination holds every node's part of the newest step: missing=%s is not said", old)
        return
    result.extra["missing"] = missing
    result.details["missing"] = {"step": step, "what": missing, "present": found.get("present"),
                                 "files": found.get("missing_files"), "seen": "destination"}
    said = missing_said(step, missing)
    result.hint = f"{said}; {result.hint}" if result.hint else said
    if missing != old:
        log.info("the destination holds nodes %s of step %d's parts: missing=%s (this node's own pushes said %s)",
                 found.get("present"), step, missing, old or "nothing")
