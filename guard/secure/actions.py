"""The securing plan's actions carried out: events go to ``Plan.on`` through :meth:`Actions.feed`, and what it
returns is done here.

Marker files and the release of kept folders go to the file system thread (``guard.secure.scans``), the run's
taint and the look for an older good save to the output folder (``guard.secure.folder``); the rest needs the loop
(a :class:`~guard.secure.link.JobLink`): an outcome decided, the request to save and stop (``asking.save_request``,
unless another node's guard asked every rank already), the job's stop, a signal forwarded. Pushes are started and
killed by the plan itself (``StartPush``/``KillPush`` are done when they come back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from guard.contract import signal_name
from guard.core.state import Outcome
from guard.secure import scans
from guard.secure.asking import save_request
from guard.secure.events import (
    Action,
    Decide,
    Event,
    ForwardSignal,
    LookOlder,
    MarkSuspect,
    RecordTaint,
    ReleaseKept,
    RequestSave,
    StopJob,
)
from guard.secure.folder import Folder
from guard.secure.link import JobLink
from guard.secure.peers import Peers
from guard.secure.plan import Plan

if TYPE_CHECKING:
    from guard.secure.securer import Securer

__all__ = ["Actions"]


class Actions:
    """Feeds one ``Plan`` and carries out its actions.

    Args:
        plan: the securing plan. port: the file system thread's port. folder: the run's output folder.
        peers: this node among the job's nodes (its run id names the markers; another node may have asked already).
        securer: ``() -> Securer | None``: securing's securer now. clock: monotonic seconds.

    Attributes:
        signalled: a signal was forwarded to the job: its end is no finished training (``asking.job_end``).
    """

    def __init__(self, plan: Plan, *, port: scans.Port, folder: Folder, peers: Peers,
                 securer: Callable[[], Securer | None], clock: Callable[[], float]) -> None:
        self.plan, self.port, self.folder, self.peers = plan, port, folder, peers
        self._securer, self._clock = securer, clock
        self.signalled = False

    def feed(self, sup: JobLink | None, event: Event, now: float | None = None) -> None:
        """One event to the plan; its actions carried out (``sup`` None: only actions that need no loop)."""
        actions = self.plan.on(event)
        if actions:
            self.carry_out(sup, actions, self._clock() if now is None else now)

    def carry_out(self, sup: JobLink | None, actions: list[Action], now: float) -> None:
        for action in actions:
            if isinstance(action, MarkSuspect):
                self.port.submit(scans.Disk.mark_suspect, action.path, action.step, action.first_bad_step,
                                 self.peers.run_id)
                continue
            if isinstance(action, ReleaseKept):
                securer = self._securer()
                if securer is not None:  # on the port: removing a folder is disk work
                    self.port.submit(securer.release_kept)
                continue
            if isinstance(action, RecordTaint):
                self.folder.tainted(action.first_bad_step)
                continue
            if isinstance(action, LookOlder):
                self.folder.look_older(action, now)
                continue
            if sup is None:
                continue
            if isinstance(action, Decide):
                extra = {"signal": signal_name(action.signum)} if action.signum is not None else {}
                sup.decide(Outcome(action.status, action.reason, extra=extra))
            elif isinstance(action, RequestSave):
                self._request_save(sup)
            elif isinstance(action, StopJob):
                sup.stop_job_at(max(now, action.at), action.grace_s)
            elif isinstance(action, ForwardSignal):
                self.signalled = True
                sup.signal_job(action.signum)

    def _request_save(self, sup: JobLink) -> None:
        if self.peers.asks_elsewhere(sup):  # many nodes: another node's guard asked every rank already
            return
        sup.broadcast(save_request(sup, self.plan.report()))
